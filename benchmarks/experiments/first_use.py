"""What do an engine's first requests pay once? (GPU) Triton compiles and kernel loads,
modules imported, and the longest host operations, during ``bench_engine``'s timed requests.

After the engine's start-up and ``bench_engine``'s own warm-up request, each workload runs as
``bench_engine`` times it, with Triton's JIT hooks recording every kernel specialisation
compiled (or read from the disk cache) and every kernel module loaded meanwhile, the
modules imported, the segments the caching allocator asked CUDA for and Python's garbage
collections:

- (b): ``--prompts`` fresh 512-token prompts of 256 greedy tokens (Qwen2.5-0.5B shapes), their
  TTFT, the GPU's clock before each and the host time of their first engine steps; with
  ``--profile-first`` the first one under the torch profiler, its longest host operations;
  ``--spin-ms`` keeps the GPU busy before the first; ``--gc-freeze`` freezes Python's
  garbage collector's view of the engine after the warm-up;
- (a): the 256 requests of workload (a) (Qwen3-0.6B shapes), its rate, then a second run.

``CUDA_MODULE_LOADING=EAGER`` in the environment loads every CUDA kernel at start-up (cuBLAS's
included): TTFT then shows what lazy loading costs.

    python -m benchmarks.experiments.first_use [--workloads b a] [--profile-first]
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_engine import (engine_llm, engine_options, random_model_dir, timed_generate,
                                      workload_a_requests)


class FirstUse:
    """Records Triton compiles (in-memory cache misses), kernel loads, new modules, device
    memory the caching allocator had to ask CUDA for, and Python's garbage collections while
    active."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self._started: dict[str, float] = {}

    def _gc(self, phase, info):
        if phase == "start":
            self._started["gc"] = time.perf_counter()
        else:
            ms = 1e3 * (time.perf_counter() - self._started.pop("gc", time.perf_counter()))
            self.events.append(f"gc      {ms:7.1f} ms  generation {info['generation']}, "
                               f"{info['collected']} collected")

    def _compile_start(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):
        self._started[repr] = time.perf_counter()
        return None

    def _compile_end(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):
        ms = 1e3 * (time.perf_counter() - self._started.pop(repr, time.perf_counter()))
        self.events.append(f"compile {ms:7.1f} ms  {repr[:220]}")
        return None

    def _load_start(self, module, function, name, metadata_group, hash):
        self._started["load " + name] = time.perf_counter()

    def _load_end(self, module, function, name, metadata_group, hash):
        ms = 1e3 * (time.perf_counter() - self._started.pop("load " + name, time.perf_counter()))
        self.events.append(f"load    {ms:7.1f} ms  {name}")

    def __enter__(self) -> "FirstUse":
        from triton import knobs
        self._modules = set(sys.modules)
        self._segments = torch.cuda.memory_stats().get("segment.all.allocated", 0)
        gc.callbacks.append(self._gc)
        knobs.runtime.jit_cache_hook = self._compile_start
        knobs.runtime.jit_post_compile_hook = self._compile_end
        knobs.runtime.kernel_load_start_hook.add(self._load_start)
        knobs.runtime.kernel_load_end_hook.add(self._load_end)
        return self

    def __exit__(self, *exc) -> None:
        from triton import knobs
        knobs.runtime.jit_cache_hook = None
        knobs.runtime.jit_post_compile_hook = None
        knobs.runtime.kernel_load_start_hook.remove(self._load_start)
        knobs.runtime.kernel_load_end_hook.remove(self._load_end)
        gc.callbacks.remove(self._gc)
        for name in sorted(set(sys.modules) - self._modules):
            self.events.append(f"import  {name}")
        segments = torch.cuda.memory_stats().get("segment.all.allocated", 0) - self._segments
        if segments:
            self.events.append(f"cudaMalloc: {segments} new segments")

    def report(self, label: str) -> None:
        print(f"  {label}: {len(self.events)} first uses", flush=True)
        for line in self.events:
            print(f"    {line}", flush=True)


def longest_host_ops(prof, count: int = 20) -> None:
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    events.sort(key=lambda e: -e.cpu_time_total)
    for e in events[:count]:
        print(f"    {e.cpu_time_total / 1e3:7.2f} ms  {e.name[:100]}", flush=True)


def clock_mhz() -> str:
    """The GPU's SM clock now (NVML, when installed)."""
    try:
        return f"{torch.cuda.clock_rate()} MHz"
    except Exception:  # noqa: BLE001 - no NVML bindings
        return "clock unknown"


def spin(ms: float) -> None:
    """Keep the GPU busy with matmuls for about ``ms`` milliseconds (its clocks ramp up)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    start = time.perf_counter()
    while time.perf_counter() - start < ms / 1e3:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def workload_b(root: Path, args) -> None:
    from mini_paged_attn.engine import SamplingParams
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 10000, (512,), generator=gen).tolist()
               for _ in range(args.prompts)]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=256)
    llm = engine_llm(random_model_dir("qwen2.5-0.5b", root), engine_options(), max_num_seqs=8)
    warm_up = torch.randint(0, 10000, (50,), generator=gen).tolist()     # shares no block
    llm.generate([warm_up], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    steps: list[float] = []
    step = llm.engine.step

    def timed_step(*a, **k):
        start = time.perf_counter()
        try:
            return step(*a, **k)
        finally:
            steps.append(1e3 * (time.perf_counter() - start))
    llm.engine.step = timed_step
    print("(b) batch 1, 512-token prompts", flush=True)
    if args.spin_ms:
        spin(args.spin_ms)
    ttfts = []
    for i, prompt in enumerate(prompts):
        clock = clock_mhz()
        steps.clear()
        with FirstUse() as seen:
            if args.profile_first and i == 0:
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    seconds, (out,) = timed_generate(llm, [prompt], params)
            else:
                seconds, (out,) = timed_generate(llm, [prompt], params)
        ttfts.append(1e3 * out.metrics.time_to_first_token)
        print(f"  prompt {i}: TTFT {ttfts[-1]:.1f} ms, {256 / seconds:.0f} tok/s ({clock} "
              f"before); first steps {', '.join(f'{ms:.1f}' for ms in steps[:4])} ms, "
              f"slowest {max(steps):.1f} ms", flush=True)
        seen.report(f"prompt {i}")
        if args.profile_first and i == 0:
            print("  longest host operations of prompt 0:", flush=True)
            longest_host_ops(prof)
    ordered = sorted(ttfts)
    print(f"  TTFT over {len(ttfts)} prompts: first {ttfts[0]:.1f}, median "
          f"{ordered[len(ordered) // 2]:.1f}, max {ordered[-1]:.1f} ms", flush=True)
    del llm
    torch.cuda.empty_cache()


def workload_a(root: Path) -> None:
    from mini_paged_attn.engine import SamplingParams
    rng = random.Random(0)
    prompts, limits, params = workload_a_requests(rng=rng)
    others = [[rng.randint(0, 10000) for _ in p] for p in prompts]
    llm = engine_llm(random_model_dir("qwen3-0.6b", root), engine_options())
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
    print("(a) 256 requests", flush=True)
    for label, batch in (("first run", prompts), ("second run", others)):
        with FirstUse() as seen:
            seconds, _ = timed_generate(llm, batch, params)
        print(f"  {label}: {sum(limits) / seconds:.0f} tok/s", flush=True)
        seen.report(label)
    del llm
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="+", default=["b", "a"], choices=("a", "b"))
    parser.add_argument("--profile-first", action="store_true",
                        help="(b): the first prompt under the torch profiler (host only)")
    parser.add_argument("--spin-ms", type=float, default=0.0,
                        help="(b): keep the GPU busy this long before the first prompt")
    parser.add_argument("--prompts", type=int, default=4, help="(b): fresh prompts to time")
    parser.add_argument("--gc-freeze", action="store_true",
                        help="(b): gc.freeze() after the warm-up (the engine's objects then "
                             "never pass through a collection)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks.experiments.first_use needs a CUDA GPU")
    with tempfile.TemporaryDirectory() as root:
        for name in args.workloads:
            if name == "b":
                workload_b(Path(root), args)
            else:
                workload_a(Path(root))


if __name__ == "__main__":
    main()
