"""How much faster is temperature sampling's one-pass Triton kernel than the eager
exponential race (the torch reference, seven passes over float32 logits)? (GPU) Qwen3's
151,936-token vocabulary, ``sample_tokens`` with ``backend="torch"`` and ``"triton"``.

GPU time (CUDA events, L2 flushed) and eager back-to-back time per call, by row count.

    python -m benchmarks.experiments.sample_ab [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.common import environment, start_gpu_run, time_us
from mini_paged_attn.ops import sample_tokens

VOCAB = 151_936


def eager_us(fn, calls: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    args = parser.parse_args()
    ceilings = start_gpu_run(args.out, "benchmarks.experiments.sample_ab")
    env = environment()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for n in (1, 16, 64, 256):
        logits = torch.randn(n, VOCAB, device="cuda", generator=gen) * 3
        temps = torch.full((n,), 0.6, device="cuda")
        row = {"rows": n, "logits_mb": logits.numel() * 4 / 1e6}
        for backend in ("torch", "triton"):
            def fn(b=backend):
                return sample_tokens(logits, temps, generator=gen, backend=b)
            row[f"{backend}_gpu_us"] = time_us(fn)
            row[f"{backend}_eager_us"] = eager_us(fn)
        row["read_once_us"] = logits.numel() * 4 / (ceilings.copy_gbps * 1e3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    (args.out / "sample_ab.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    print(f"\n{env['device']}; copy {ceilings.copy_gbps:.0f} GB/s; float32 logits, T 0.6")
    print(f"{'rows':>5} {'torch GPU us':>13} {'triton GPU us':>14} {'read once us':>13} "
          f"{'torch eager us':>15} {'triton eager us':>16}")
    for r in rows:
        print(f"{r['rows']:5d} {r['torch_gpu_us']:13.1f} {r['triton_gpu_us']:14.1f} "
              f"{r['read_once_us']:13.1f} {r['torch_eager_us']:15.1f} {r['triton_eager_us']:16.1f}")


if __name__ == "__main__":
    main()
