"""A/B of the prefill kernel (GPU): another version of ``ops/prefill_kernel.py`` against the
library's, alternated in one process, on paged and contiguous K/V.

``--baseline FILE`` is a copy of ``prefill_kernel.py`` (for example ``git show
REV:mini_paged_attn/ops/prefill_kernel.py > /tmp/old.py``); it is loaded as a module of
``mini_paged_attn.ops`` and its ``_prefill_kernel`` launched through the library's own launcher,
so both run the same tiles and arguments. Each round times, per case, the baseline and the
current kernel on paged K/V (``paged_prefill``'s launch) and on contiguous K/V
(``flash_attn_varlen_func``'s launch, tensor descriptors on Hopper), then cuDNN and flash SDPA;
the table gives the median of the rounds and each kernel's largest difference from the other.

    python -m benchmarks.experiments.prefill_ab --baseline /tmp/old.py [--rounds 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.bench_prefill import CASES, D, contiguous_kv, paged_batch, sdpa_tflops
from benchmarks.common import environment, start_gpu_run, time_us
from mini_paged_attn.ops import prefill as prefill_module
from mini_paged_attn.ops.checks import check_paged_prefill_args


def load_kernel(path: Path):
    """``_prefill_kernel`` of a copy of ``prefill_kernel.py`` (relative imports resolve
    against ``mini_paged_attn.ops``)."""
    spec = importlib.util.spec_from_file_location("mini_paged_attn.ops._prefill_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._prefill_kernel


def prepared(kernel, batch, contiguous, paged: bool):
    """A repeatable launch of ``kernel`` through the library's launcher, and its output."""
    saved = prefill_module._prefill_kernel
    prefill_module._prefill_kernel = kernel
    try:
        q, kc, vc, tables, cu, ctx = batch
        out = torch.empty_like(q)
        if paged:
            shapes = check_paged_prefill_args(q, kc, vc, tables, cu, ctx, None, out)
            launch = prefill_module.triton_paged_prefill(q, kc, vc, tables, cu, ctx, shapes,
                                                         causal=True, out=out, lse=None)
            args = (q, kc, vc, kc, kc, out, out, tables, cu, ctx, q)
        else:
            k, v, cu_k = contiguous
            launch = prefill_module.triton_varlen_contiguous(q, k, v, cu, cu_k, 0, 0, causal=True,
                                                             scale=D ** -0.5, out=out)
            args = (q, k, v, k, k, out, out, cu_k, cu, cu_k, q)
    finally:
        prefill_module._prefill_kernel = saved
    return (lambda: launch(args)), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, required=True,
                        help="a copy of prefill_kernel.py to compare against")
    parser.add_argument("--rounds", type=int, default=3, help="alternations per case")
    parser.add_argument("--cases", default=",".join(c.name for c in CASES),
                        help="comma-separated case names of bench_prefill")
    parser.add_argument("--out", type=Path, default=Path("bench_out"),
                        help="directory for prefill_ab.json")
    args = parser.parse_args()
    from torch.nn.attention import SDPBackend
    kernels = {"baseline": load_kernel(args.baseline), "current": prefill_module._prefill_kernel}
    ceilings = start_gpu_run(args.out, "benchmarks.experiments.prefill_ab")
    env = environment()
    rows = []
    for case in [c for c in CASES if c.name in args.cases.split(",")]:
        batch = paged_batch(case)
        contiguous = contiguous_kv(batch)
        fns, outs = {}, {}
        for paged in (True, False):
            for name, kernel in kernels.items():
                key = f"{name} {'paged' if paged else 'contiguous'}"
                fns[key], outs[key] = prepared(kernel, batch, contiguous, paged)
                fns[key]()
        times = {key: [] for key in [*fns, "cudnn", "flash"]}
        for _ in range(args.rounds):
            for key, fn in fns.items():
                times[key].append(case.flops / time_us(fn) / 1e6)
            times["cudnn"].append(sdpa_tflops(case, SDPBackend.CUDNN_ATTENTION) or float("nan"))
            times["flash"].append(sdpa_tflops(case, SDPBackend.FLASH_ATTENTION) or float("nan"))
        torch.cuda.synchronize()
        diff = {layout: float((outs[f"current {layout}"].float()
                               - outs[f"baseline {layout}"].float()).abs().max())
                for layout in ("paged", "contiguous")}
        row = {"case": case.name, "tflops": times,
               "median": {k: statistics.median(v) for k, v in times.items()}, "max_diff": diff}
        rows.append(row)
        print(json.dumps(row), flush=True)
    (args.out / "prefill_ab.json").write_text(json.dumps(
        {"env": env, "ceilings": asdict(ceilings), "baseline": str(args.baseline),
         "rows": rows}, indent=1))
    print(f"\n{env['device']} torch {env['torch']} triton {env['triton']}; "
          f"matmul {ceilings.matmul_tflops:.0f} TFLOP/s; median of {args.rounds} rounds, TFLOP/s")
    keys = ["baseline paged", "current paged", "baseline contiguous", "current contiguous",
            "cudnn", "flash"]
    print(f"{'case':20}" + "".join(f"{k:>21}" for k in keys) + f"{'cur contig/cuDNN':>18}")
    for r in rows:
        m = r["median"]
        print(f"{r['case']:20}" + "".join(f"{m[k]:21.0f}" for k in keys)
              + f"{m['current contiguous'] / m['cudnn']:18.2f}")
    print("max |current - baseline|:", {r["case"]: r["max_diff"] for r in rows})


if __name__ == "__main__":
    main()
