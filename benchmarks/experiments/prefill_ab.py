"""Is one source tree's prefill faster than another's? (GPU)

``paged_prefill`` (paged K/V, blocks in random order) and ``flash_attn_varlen_func``
(contiguous K/V) of two checkouts, each imported under a name of its own in this process, on
``bench_prefill``'s cases (32 query / 8 KV heads, head_size 128, bf16, causal), alternated
round by round, with cuDNN and flash SDPA in the same rounds for scale. Each tree plans and
launches its own calls as a user's repeated call does, so whatever the trees differ in (the
kernel, its tiles, the plan, the page copy) shows. The table gives each column's median of the
rounds in TFLOP/s of the attention's FLOPs, and per case the largest difference between the
two trees' outputs.

    git worktree add /tmp/base main
    python -m benchmarks.experiments.prefill_ab --baseline /tmp/base [--current .]
        [--rounds 3] [--cases "causal 4x4k,chunk 512 on 8k x8"] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.bench_prefill import CASES, contiguous_kv, paged_batch, sdpa_tflops
from benchmarks.common import environment, start_gpu_run, time_us
from benchmarks.experiments import import_tree

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = ("paged", "contiguous")


def tree_calls(ops, batch, contiguous) -> dict:
    """``{layout: (call, result)}``: the public prefill calls of one tree's ``ops`` package
    over ``batch`` (``bench_prefill.paged_batch``) and its ``contiguous`` K/V; ``result()``
    is the last call's output, ``[total_q, num_q_heads, head_size]`` in the query's dtype."""
    q, kc, vc, tables, cu, ctx = batch
    k, v, cu_k = contiguous
    max_q, max_k = int((cu[1:] - cu[:-1]).max()), int(ctx.max())
    paged_out = torch.empty_like(q)
    varlen_out = [None]     # the call allocates its output, as a user's does

    def paged():
        ops.paged_prefill(q, kc, vc, tables, cu, ctx, causal=True, out=paged_out,
                          max_seqlen_q=max_q)

    def varlen():
        varlen_out[0] = ops.flash_attn_varlen_func(q, k, v, cu, cu_k, max_q, max_k, causal=True)
    return {"paged": (paged, lambda: paged_out), "contiguous": (varlen, lambda: varlen_out[0])}

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", required=True, help="the checkout to compare against")
    parser.add_argument("--current", default=str(ROOT),
                        help="the checkout under test (default: this one)")
    parser.add_argument("--rounds", type=int, default=3, help="alternations per case")
    parser.add_argument("--cases", default=",".join(c.name for c in CASES),
                        help="comma-separated case names of bench_prefill")
    parser.add_argument("--out", type=Path, default=Path("bench_out"),
                        help="directory for prefill_ab.json")
    args = parser.parse_args()
    names = [c.name for c in CASES]
    unknown = [n for n in args.cases.split(",") if n not in names]
    if unknown:
        parser.error(f"--cases: expected names among {names}, got {unknown}")
    if args.rounds < 1:
        parser.error(f"--rounds: expected at least 1, got {args.rounds}")
    trees = {}
    for name in ("baseline", "current"):
        try:
            trees[name] = import_tree(getattr(args, name), f"mini_paged_attn_{name}").ops
        except ValueError as exc:
            parser.error(f"--{name}: {exc}")
    from torch.nn.attention import SDPBackend
    ceilings = start_gpu_run(args.out, "benchmarks.experiments.prefill_ab")
    env = environment()
    rows = []
    for case in [c for c in CASES if c.name in args.cases.split(",")]:
        batch = paged_batch(case)
        contiguous = contiguous_kv(batch)
        calls = {f"{tree} {layout}": fn_out
                 for tree, ops in trees.items()
                 for layout, fn_out in tree_calls(ops, batch, contiguous).items()}
        for fn, _ in calls.values():    # compiled and prepared before any timing
            fn()
        times = {key: [] for key in [*calls, "cudnn", "flash"]}
        for _ in range(args.rounds):
            for key, (fn, _) in calls.items():
                times[key].append(case.flops / time_us(fn) / 1e6)
            times["cudnn"].append(sdpa_tflops(case, SDPBackend.CUDNN_ATTENTION) or float("nan"))
            times["flash"].append(sdpa_tflops(case, SDPBackend.FLASH_ATTENTION) or float("nan"))
        torch.cuda.synchronize()
        diff = {layout: float((calls[f"current {layout}"][1]().float()
                               - calls[f"baseline {layout}"][1]().float()).abs().max())
                for layout in LAYOUTS}
        row = {"case": case.name, "tflops": times,
               "median": {k: statistics.median(v) for k, v in times.items()}, "max_diff": diff}
        rows.append(row)
        print(json.dumps(row), flush=True)
    (args.out / "prefill_ab.json").write_text(json.dumps(
        {"env": env, "ceilings": asdict(ceilings),
         "trees": {name: str(Path(getattr(args, name)).resolve()) for name in trees},
         "rows": rows}, indent=1))
    print(f"\n{env['device']} torch {env['torch']} triton {env['triton']}; "
          f"matmul {ceilings.matmul_tflops:.0f} TFLOP/s; median of {args.rounds} rounds, TFLOP/s")
    keys = [f"{tree} {layout}" for layout in LAYOUTS for tree in ("baseline", "current")]
    keys += ["cudnn", "flash"]
    print(f"{'case':20}" + "".join(f"{k:>21}" for k in keys) + f"{'cur contig/cuDNN':>18}")
    for r in rows:
        m = r["median"]
        print(f"{r['case']:20}" + "".join(f"{m[k]:21.0f}" for k in keys)
              + f"{m['current contiguous'] / m['cudnn']:18.2f}")
    print("max |current - baseline|:", {r["case"]: r["max_diff"] for r in rows})


if __name__ == "__main__":
    main()
