"""A fresh engine's first run of workload (a) against its later runs, and the host's speed
(GPU).

One engine runs (a) ``--runs`` times, each with new prompts of the same lengths (token ids
shifted, so the prefix cache finds nothing). For each run: the rate; the wall time of the
``step()`` calls launching prompt tokens and of the decode-only ones; from the run's start to
its last prompt step (in (a) every prompt is admitted before any step is decode-only), the
main thread's CPU time (equal to the wall time: the thread never sleeps, so a slower
run is a slower host, not a wait), its page faults and involuntary context switches; and a
fixed pure-Python loop timed before the checkpoint is written, after the engine's start and
after each run (~1 ms on a fast host). The prompt steps of (a) (8192 tokens, 28 eager layers)
take about as long to launch as to run, so the host's speed shows in the rate.

    python -m benchmarks.experiments.first_run_host [--runs 3] [--kv-cache-dtype auto|fp8]
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_engine import engine_llm, engine_options, random_model_dir, workload_a_requests
from benchmarks.experiments.lm_head_rows import python_loop_ms


def run_once(engine, prompts, params) -> dict:
    for prompt, p in zip(prompts, params):
        engine.add_request(prompt, p)
    torch.cuda.synchronize()
    prompt_s = decode_s = 0.0
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    cpu = time.thread_time()
    prompt_cpu, prompt_usage = 0.0, usage
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        at = time.perf_counter()
        engine.step()
        took = time.perf_counter() - at
        if engine.last_schedule is not None and engine.last_schedule.num_prefill_tokens:
            prompt_s += took
            prompt_cpu = time.thread_time() - cpu
            prompt_usage = resource.getrusage(resource.RUSAGE_THREAD)
        else:
            decode_s += took
    torch.cuda.synchronize()
    return {"seconds": time.perf_counter() - start, "prompt_s": prompt_s, "decode_s": decode_s,
            "prompt_cpu_s": prompt_cpu,
            "faults": prompt_usage.ru_minflt - usage.ru_minflt,
            "switches": prompt_usage.ru_nivcsw - usage.ru_nivcsw}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("first_run_host needs a CUDA GPU")
    from mini_paged_attn.engine import SamplingParams
    print(f"Python loop before the checkpoint: {python_loop_ms():.2f} ms", flush=True)
    base, limits, params = workload_a_requests()
    with tempfile.TemporaryDirectory() as root:
        llm = engine_llm(random_model_dir("qwen3-0.6b", Path(root)),
                         engine_options(kv_cache_dtype=args.kv_cache_dtype))
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)     # warm-up
        print(f"Python loop after the engine's start: {python_loop_ms():.2f} ms", flush=True)
        for k in range(args.runs):
            prompts = [[(t + 7 * (k + 1)) % 10000 for t in p] for p in base]
            r = run_once(llm.engine, prompts, params)
            print(f"run {k}: {sum(limits) / r['seconds']:7.0f} tok/s; prompt steps "
                  f"{r['prompt_s'] * 1e3:4.0f} ms (main thread CPU {r['prompt_cpu_s'] * 1e3:4.0f} ms, "
                  f"{r['faults']} page faults, {r['switches']} involuntary switches), decode "
                  f"steps {r['decode_s'] * 1e3:5.0f} ms; Python loop after: "
                  f"{python_loop_ms():.2f} ms", flush=True)


if __name__ == "__main__":
    main()
