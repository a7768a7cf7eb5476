"""The engine's workload (a) with the one-pass Triton sampler against the eager one, alternated
on one engine in one process (GPU).

Workload (a) of ``bench_engine`` (256 requests, prompts and outputs uniform in 100..1024,
temperature 0.6, Qwen3-0.6B shapes with random bf16 weights). Temperature-only rows sample
through :func:`~mini_paged_attn.ops.sample.sample_tokens`; the eager rounds force its torch
reference there (the seven passes the engine ran before).

    python -m benchmarks.experiments.engine_sampler_ab [--rounds 2] [--kv-cache-dtype fp8]
"""

from __future__ import annotations

import argparse
import functools
import random
import tempfile
from pathlib import Path

from benchmarks.bench_engine import engine_llm, engine_options, random_model_dir, timed_generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    args = parser.parse_args()
    from mini_paged_attn.engine import SamplingParams
    import mini_paged_attn.engine.sampler as sampler_module
    from mini_paged_attn.ops.sample import sample_tokens
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))]
               for _ in range(256)]
    limits = [random.randint(100, 1024) for _ in range(256)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in limits]
    variants = {"eager": functools.partial(sample_tokens, backend="torch"),
                "triton": sample_tokens}
    results = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as root:
        path = random_model_dir("qwen3-0.6b", Path(root))
        # No prefix caching: every round prefills its prompts as the first did.
        llm = engine_llm(path, engine_options(kv_cache_dtype=args.kv_cache_dtype),
                         enable_prefix_caching=False)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        for _ in range(args.rounds):
            for name, fn in variants.items():
                sampler_module.sample_tokens = fn
                seconds, _ = timed_generate(llm, prompts, params)
                results[name].append(sum(limits) / seconds)
                print(f"{name:7} {sum(limits) / seconds:8.0f} tok/s", flush=True)
    sampler_module.sample_tokens = sample_tokens
    print(f"kv cache {args.kv_cache_dtype}: " + ", ".join(
        f"{name} {' / '.join(f'{v:.0f}' for v in vals)} tok/s" for name, vals in results.items()))


if __name__ == "__main__":
    main()
