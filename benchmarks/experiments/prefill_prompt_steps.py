"""Whole prompts of workload (a)'s prompt steps (GPU): 14 prompts of 100..1024 tokens through
``flash_attn_varlen_func`` (planned, the Hopper kernel forced, the Triton kernel forced)
against cuDNN SDPA called once per prompt, in TFLOP/s (causal; 16 and 32 query heads, 8 KV
heads, head_size 128, bf16). cuDNN has no varlen entry in torch: its column is the sum of
its per-prompt GPU times.

    python -m benchmarks.experiments.prefill_prompt_steps [--out DIR]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from torch.nn.attention import SDPBackend

from benchmarks import bench_prefill
from benchmarks.bench_prefill import Case, contiguous_fn, paged_batch, sdpa_tflops
from benchmarks.common import environment, start_gpu_run, time_us
from benchmarks.experiments.prefill_hopper_threshold import ALWAYS, NEVER, timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench_out"))
    start_gpu_run(parser.parse_args().out, "benchmarks.experiments.prefill_prompt_steps")
    print(f"{environment()['device']}; TFLOP/s (us)")
    print(f"{'case':16} {'planned':>14} {'hopper':>14} {'triton':>14} {'cudnn per prompt':>18}")
    heads = bench_prefill.HQ
    try:
        for hq in (16, 32):
            bench_prefill.HQ = hq      # read by Case.flops and paged_batch at call time
            for seed in range(3):
                rnd = random.Random(seed)
                case = Case(f"{hq} q heads, s{seed}",
                            tuple(rnd.randint(100, 1024) for _ in range(14)), (0,) * 14)
                times = [time_us(contiguous_fn(paged_batch(case))),
                         timed(case, ALWAYS, True), timed(case, NEVER, True)]
                cudnn = 0.0
                for length in case.q_lens:
                    one = Case("one", (length,), (0,))
                    cudnn += one.flops / (sdpa_tflops(one, SDPBackend.CUDNN_ATTENTION) * 1e6)
                times.append(cudnn)
                print(f"{case.name:16} " + " ".join(
                    f"{case.flops / us / 1e6:7.0f} ({us:4.0f})" for us in times), flush=True)
    finally:
        bench_prefill.HQ = heads


if __name__ == "__main__":
    main()
