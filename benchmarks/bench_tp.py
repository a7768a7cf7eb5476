"""Tensor-parallel benchmark (2 GPUs): Qwen2.5-7B shapes at TP=1 and TP=2, same run, same cards.

(b) batch 1: a 512-token prompt, 256 greedy output tokens: time per output token (CUDA
    graphs, the all-reduces captured in them).
(a) nano-vllm's workload: 256 requests, prompt and output lengths uniform in 100..1024
    (random.seed(0)), temperature 0.6, ignore_eos: output tokens/s.
(parity) greedy outputs of 32 prompts (64 tokens each) at TP=2 against TP=1: the share of
    identical requests (bf16 all-reduces sum in another order, so late divergence is possible)
    and the first differing position of the others.

Random bf16 weights (transformers' init) are saved once to a temporary directory that every
rank loads its shard of. Each engine is shut down before the next starts.

    python -m benchmarks.bench_tp --out /tmp/bench_tp
    python -m benchmarks.bench_tp --workloads b,parity --sizes 1,2
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_engine import (engine_tool_main, random_model_dir, timed_generate,
                                      workload_a_requests)

SHAPE = "qwen2.5-7b"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workloads", default="parity,b,a",
                        help="comma-separated subset of parity,a,b (default: all)")
    parser.add_argument("--sizes", default="1,2", help="tensor-parallel sizes (default 1,2)")
    parser.add_argument("--model", default=None,
                        help=f"a model directory (default: random {SHAPE} weights)")
    parser.add_argument("--num-requests", type=int, default=256, help="workload (a) requests")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--out", default=None, help="directory for results.json")


def workload_b(llm) -> dict:
    from mini_paged_attn.engine import SamplingParams
    prompt = torch.randint(0, 10000, (512,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=256)
    seconds, (out,) = timed_generate(llm, [prompt], params)
    m = out.metrics
    return {"seconds": seconds, "tpot_ms": 1e3 * (m.last_token_time - m.first_token_time) / 255,
            "ttft_ms": 1e3 * m.time_to_first_token}


def workload_a(llm, num_requests: int) -> dict:
    prompts, limits, params = workload_a_requests(num_requests)
    seconds, _ = timed_generate(llm, prompts, params)
    return {"seconds": seconds, "tok_per_s": sum(limits) / seconds,
            "preemptions": llm.stats().num_preemptions}


def parity_outputs(llm) -> list[list[int]]:
    from mini_paged_attn.engine import SamplingParams
    rng = random.Random(3)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(16, 256))] for _ in range(32)]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=64)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def compare(reference: list[list[int]], other: list[list[int]]) -> dict:
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
             for x, y in zip(reference, other)]
    return {"identical": sum(f is None for f in first) / len(first),
            "first_difference": [f for f in first if f is not None]}


def run(args: argparse.Namespace) -> int:
    from mini_paged_attn.engine import LLM, SamplingParams
    sizes = [int(s) for s in args.sizes.split(",")]
    if not torch.cuda.is_available() or torch.cuda.device_count() < max(sizes):
        print(f"benchmarks.bench_tp needs {max(sizes)} CUDA GPUs", file=sys.stderr)
        return 2
    workloads = args.workloads.split(",")
    results: dict = {"env": {"device": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(),
                             "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.model) if args.model else random_model_dir(SHAPE, Path(tmp))
        parity = {}
        for n in sizes:
            llm = LLM(str(path), dtype="bfloat16", max_model_len=4096, tensor_parallel_size=n,
                      enforce_eager=args.enforce_eager)
            try:
                llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
                row = results.setdefault(f"tp{n}", {})
                if "parity" in workloads:
                    parity[n] = parity_outputs(llm)
                if "b" in workloads:
                    row["b"] = workload_b(llm)
                if "a" in workloads:
                    row["a"] = workload_a(llm, args.num_requests)
            finally:
                llm.shutdown()
                del llm
                torch.cuda.empty_cache()
            print(f"TP={n}: {json.dumps(results[f'tp{n}'])}", flush=True)
        base = sizes[0]
        for n in sizes[1:]:
            if parity:
                results[f"tp{n}"]["parity_vs_tp{base}"] = compare(parity[base], parity[n])
    print(json.dumps(results, indent=2))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "results.json").write_text(json.dumps(results, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    return engine_tool_main(__doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
