"""The LM head at new row counts, and the host's speed during workload (a) (GPU).

cuBLAS picks a GEMM kernel by the row count, and the first launch of a kernel CUDA has not
loaded yet waits for the device to drain. An engine stepping ahead of the device then loses
the overlap at each new count of sample rows (a batch size it has not seen). The engine pads
the LM head's rows to its batch buckets, all loaded at warm-up
(``InputBuilder.logit_buckets``).

- ``--gemm``: the LM head of Qwen3-0.6B (``[151936, 1024]``, bf16) with the buckets warmed;
  host time of ``F.linear`` at row counts outside them with ~20 ms of GPU work queued
  ahead, first call and second call (a first call near 20 ms waited for the queue to drain).
- ``--sweep``: the layers' projections of Qwen3-0.6B (qkv, o, gate_up, down), powers of two
  of rows from 16 to 8192 warmed (as the engine's warm-up prompts do), then every row count
  1..8192 in turn: the counts whose first call took over 2 ms of host time (a kernel load).
  ``--blas cublaslt`` picks torch's other cuBLAS backend.
- ``--engine``: workload (a) of ``bench_engine`` (a fresh engine's first run, each in a
  process of its own), the LM head on bucketed rows ("padded") and on the sample rows as they
  are ("exact"), alternated; LM-head calls that took over 2 ms of host time; and a fixed
  pure-Python loop timed before the checkpoint is written and after the engine is built (the
  engine's eager prompt steps are host-bound, so the host's own speed moves the rate).

    python -m benchmarks.experiments.lm_head_rows [--gemm] [--sweep [--blas cublaslt]]
        [--engine] [--rounds 2]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

OFF_BUCKET_ROWS = (3, 15, 32, 47, 62, 75, 91, 104, 130, 200, 255)
QUEUED_CYCLES = 40_000_000     # ~20 ms of torch.cuda._sleep at 2 GHz


def gemm() -> None:
    from mini_paged_attn.engine.worker.input_batch import batch_buckets
    weight = torch.randn(151936, 1024, device="cuda", dtype=torch.bfloat16)
    hidden = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    buckets = batch_buckets(256)
    for rows in buckets:
        F.linear(hidden[:rows], weight)
    torch.cuda.synchronize()

    def host_ms(rows: int) -> float:
        torch.cuda._sleep(QUEUED_CYCLES)
        start = time.perf_counter()
        F.linear(hidden[:rows], weight)
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize()
        return elapsed * 1e3

    print(f"LM head [151936 x 1024] bf16, buckets {buckets} warmed; host ms of F.linear with "
          "~20 ms of GPU work queued ahead (first call, second call):")
    for rows in OFF_BUCKET_ROWS:
        print(f"  {rows:4} rows  {host_ms(rows):6.2f}  {host_ms(rows):6.2f}", flush=True)


def sweep() -> None:
    shapes = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024),
              "down": (1024, 3072)}
    weights = {k: torch.randn(shape, device="cuda", dtype=torch.bfloat16)
               for k, shape in shapes.items()}
    hidden = torch.randn(8192, 3072, device="cuda", dtype=torch.bfloat16)
    for rows in (2 ** i for i in range(4, 14)):
        for w in weights.values():
            F.linear(hidden[:rows, :w.shape[1]], w)
    torch.cuda.synchronize()
    loads = {k: [] for k in weights}
    for rows in range(1, 8193):
        for k, w in weights.items():
            start = time.perf_counter()
            F.linear(hidden[:rows, :w.shape[1]], w)
            if time.perf_counter() - start > 2e-3:
                loads[k].append(rows)
        if rows % 64 == 0:
            torch.cuda.synchronize()
    print(f"{torch.backends.cuda.preferred_blas_library()}, powers of two 16..8192 warmed; "
          "row counts whose first call took over 2 ms:")
    for k, rows in loads.items():
        print(f"  {k:8} {len(rows):3}: {rows[:24]}{' ...' if len(rows) > 24 else ''}")


def python_loop_ms() -> float:
    """A fixed pure-Python loop (~1 ms on a fast host): the host's own speed."""
    start = time.perf_counter()
    acc = 0
    for x in range(20000):
        acc += (x * 7) % 13
    return (time.perf_counter() - start) * 1e3


def engine_once(variant: str) -> None:
    from benchmarks.bench_engine import (engine_llm, engine_options, random_model_dir,
                                          timed_generate, workload_a_requests)
    from mini_paged_attn.engine import SamplingParams
    before = python_loop_ms()
    prompts, limits, params = workload_a_requests()
    with tempfile.TemporaryDirectory() as root:
        llm = engine_llm(random_model_dir("qwen3-0.6b", Path(root)), engine_options())
        if variant == "exact":
            llm.engine.runner.inputs.logit_buckets = None
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)     # warm-up
        after = python_loop_ms()
        model = llm.engine.runner.model
        compute_logits, slow, calls = model.compute_logits, [], [0]

        def timed(hidden, **kwargs):
            start = time.perf_counter()
            logits = compute_logits(hidden, **kwargs)
            elapsed = time.perf_counter() - start
            calls[0] += 1
            if elapsed > 2e-3:
                slow.append((hidden.shape[0], round(elapsed * 1e3, 1)))
            return logits
        model.compute_logits = timed
        seconds, _ = timed_generate(llm, prompts, params)
    print(f"{variant:6} {sum(limits) / seconds:7.0f} tok/s; LM-head calls {calls[0]}, "
          f"{len(slow)} over 2 ms ({sum(ms for _, ms in slow):.0f} ms in all; rows, ms: "
          f"{slow[:8]}); Python loop {before:.2f} ms before the checkpoint, {after:.2f} ms "
          "after the engine's start", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gemm", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--blas", choices=("cublas", "cublaslt"), default=None)
    parser.add_argument("--engine", action="store_true")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--one", choices=("padded", "exact"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("lm_head_rows needs a CUDA GPU")
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    if args.one:
        engine_once(args.one)
        return
    chosen = args.gemm or args.sweep or args.engine
    if args.gemm or not chosen:
        gemm()
    if args.sweep:
        sweep()
    if args.engine or not chosen:
        for _ in range(args.rounds):
            for variant in ("padded", "exact"):
                subprocess.run([sys.executable, "-m", "benchmarks.experiments.lm_head_rows",
                                "--one", variant], check=True)


if __name__ == "__main__":
    main()
