"""Where does workload (a)'s wall time go, over the whole run? GPU time by kernel kind, the
time the GPU is idle, and the run's steps by phase (GPU).

Workload (a) of ``bench_engine`` (256 requests, prompts and outputs uniform in 100..1024,
temperature 0.6, Qwen3-0.6B shapes with random bf16 weights) runs once untimed (warm), once
timed (the untimed run's rate is reported too: an engine's first run pays first-use costs),
then once under the torch profiler (each run with prompts of its own, so a prefix
cache finds none; prefix caching is off unless asked) (CUDA kernels only; graph replays included). The
kernels are grouped by name; "idle" is the run's wall time not covered by any kernel.
Alongside, every ``step()`` call's host wall time is summed by the phase of the batch it
launched (a batch with prompt tokens, or decode only).

    python -m benchmarks.experiments.engine_timeline [--kv-cache-dtype auto fp8]
        [--prefix-caching off on] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_engine import (engine_llm, engine_options, random_model_dir, timed_generate,
                                      workload_a_requests)
from benchmarks.common import start_gpu_run

# (kind, substrings of the kernel name); the first match wins.
KINDS = (
    ("decode attention", ("_paged_decode_kernel", "_merge_splits_kernel")),
    ("prefill attention", ("_prefill_kernel",)),
    ("store_kv", ("_store_kv_kernel",)),
    ("rotary", ("_rotary_kernel",)),
    ("rms_norm", ("_rms_norm_kernel",)),
    ("silu_and_mul", ("_silu_and_mul_kernel",)),
    ("sampling", ("_sample_slices_kernel", "argmax", "Philox", "exponential", "distribution")),
    ("gemm", ("gemm", "nvjet", "sm90_xmma", "cutlass", "cublas", "splitK", "Kernel2")),
    ("copies", ("copy", "Memcpy", "Memset", "fill", "elementwise")),
)


def kind_of(name: str) -> str:
    for kind, keys in KINDS:
        if any(k in name for k in keys):
            return kind
    return "other"


def union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def idle_gaps(spans: list[tuple[float, float, str]]) -> dict:
    """The GPU's idle time between kernels (``spans`` sorted by start), by size and by the
    kernels on either side of the gap."""
    sizes = {"<5us": 0.0, "5-50us": 0.0, "50-500us": 0.0, ">=500us": 0.0}
    pairs: dict[str, list[float]] = {}
    end, before = None, ""
    for start, stop, name in spans:
        if end is not None and start > end:
            gap = start - end
            key = ("<5us" if gap < 5 else "5-50us" if gap < 50 else "50-500us" if gap < 500
                   else ">=500us")
            sizes[key] += gap / 1e3
            if gap >= 5:
                pair = f"{kind_of(before)}/{before[:40]} -> {name[:50]}"
                pairs.setdefault(pair, [0, 0.0])
                pairs[pair][0] += 1
                pairs[pair][1] += gap / 1e3
        if end is None or stop > end:
            end, before = stop, name
    top = sorted(pairs.items(), key=lambda kv: -kv[1][1])[:15]
    return {"ms_by_size": sizes, "top_pairs": [(p, n, ms) for p, (n, ms) in top]}


def profile_run(llm, prompts, params) -> dict:
    from torch.profiler import ProfilerActivity, profile
    engine = llm.engine
    steps: list[tuple[float, int, int, bool]] = []
    plain_step = engine.step

    def step(*args, **kwargs):
        start = time.perf_counter()
        result = plain_step(*args, **kwargs)
        out = engine.last_schedule
        steps.append((time.perf_counter() - start, out.num_prefill_tokens if out else 0,
                      out.num_seqs if out else 0, bool(out and out.decode_only)))
        return result

    from mini_paged_attn.engine import SamplingParams
    with profile(activities=[ProfilerActivity.CUDA]):    # the profiler's own start-up, untimed
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
    engine.step = step
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            seconds, _ = timed_generate(llm, prompts, params)
    finally:
        del engine.step
    events = [e for e in prof.events()
              if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    by_kind: dict[str, list[float]] = {}
    intervals = []
    names: dict[str, float] = {}
    for e in events:
        start, dur = e.time_range.start, e.time_range.end - e.time_range.start
        intervals.append((start, start + dur))
        by_kind.setdefault(kind_of(e.name), []).append(dur)
        names[e.name[:70]] = names.get(e.name[:70], 0.0) + dur
    busy = union_us(intervals) / 1e3
    gaps = idle_gaps(sorted((e.time_range.start, e.time_range.end, e.name) for e in events))
    phases = {"prompt tokens": [0, 0.0, 0], "decode only": [0, 0.0, 0]}
    for wall, prefill_tokens, num_seqs, decode_only in steps:
        row = phases["decode only" if decode_only else "prompt tokens"]
        row[0] += 1
        row[1] += wall * 1e3
        row[2] += num_seqs
    return {"seconds_profiled": seconds, "gpu_busy_ms": busy,
            "kinds": {k: {"ms": sum(v) / 1e3, "kernels": len(v)} for k, v in by_kind.items()},
            "phases": {k: {"steps": n, "host_wall_ms": ms, "mean_seqs": s / max(n, 1)}
                       for k, (n, ms, s) in phases.items()},
            "gaps": gaps,
            "top_other": sorted(((n, ms / 1e3) for n, ms in names.items()
                                 if kind_of(n) in ("other", "copies")),
                                key=lambda x: -x[1])[:12]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["auto", "fp8"])
    parser.add_argument("--prefix-caching", nargs="+", default=["off"], choices=("off", "on"))
    parser.add_argument("--out", default="engine_timeline_out")
    args = parser.parse_args()
    start_gpu_run(args.out, "engine_timeline")
    from mini_paged_attn.engine import SamplingParams
    rng = random.Random(0)
    prompts, limits, params = workload_a_requests(rng=rng)
    # The same lengths with other tokens, for the runs a prefix cache must not serve.
    others = [[[rng.randint(0, 10000) for _ in p] for p in prompts] for _ in range(2)]
    results = {}
    with tempfile.TemporaryDirectory() as root:
        path = random_model_dir("qwen3-0.6b", Path(root))
        for dtype, caching in itertools.product(args.kv_cache_dtype, args.prefix_caching):
            llm = engine_llm(path, engine_options(kv_cache_dtype=dtype),
                             enable_prefix_caching=caching == "on")
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
            first, _ = timed_generate(llm, others[0], params)
            seconds, _ = timed_generate(llm, prompts, params)
            row = {"seconds": seconds, "tok_per_s": sum(limits) / seconds,
                   "first_run_tok_per_s": sum(limits) / first,
                   **profile_run(llm, others[1], params)}
            results[dtype + (", prefix caching" if caching == "on" else "")] = row
            del llm
            torch.cuda.empty_cache()
    Path(args.out, "engine_timeline.json").write_text(json.dumps(results, indent=1))
    for dtype, row in results.items():
        wall = row["seconds_profiled"] * 1e3
        print(f"\nkv cache {dtype}: {row['tok_per_s']:.0f} tok/s unprofiled ({row['seconds']:.2f} s; "
              f"the engine's first run {row['first_run_tok_per_s']:.0f} tok/s); "
              f"profiled {wall:.0f} ms, GPU busy {row['gpu_busy_ms']:.0f} ms, "
              f"idle {wall - row['gpu_busy_ms']:.0f} ms")
        for kind, v in sorted(row["kinds"].items(), key=lambda kv: -kv[1]["ms"]):
            print(f"  {kind:18} {v['ms']:8.1f} ms  {v['kernels']:8d} kernels")
        for phase, v in row["phases"].items():
            print(f"  steps, {phase:14} {v['steps']:5d} steps  {v['host_wall_ms']:8.1f} ms wall  "
                  f"mean {v['mean_seqs']:.0f} seqs")
        print("  idle gaps, ms by size: " + ", ".join(
            f"{k} {v:.0f}" for k, v in row["gaps"]["ms_by_size"].items()))
        for pair, n, ms in row["gaps"]["top_pairs"]:
            print(f"    gap {ms:7.1f} ms {n:6d}x  {pair}")
        for name, ms in row["top_other"]:
            print(f"    other: {ms:7.1f} ms  {name}")


if __name__ == "__main__":
    main()
