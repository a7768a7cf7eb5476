"""Structured-output overhead (GPU): output tokens/s of a batch with a JSON schema against the
same batch unconstrained.

``--batch`` requests (default 64) of ``--prompt-len`` random prompt tokens each generate up to
``--max-tokens`` tokens at temperature 0.6, once unconstrained (ignore_eos) and once with a
JSON schema whose strings never have to end (so the constrained samples run about as long).
Reported per run: output tokens, seconds, tokens/s, engine steps, and for the constrained run
the host time spent filling the grammar bitmasks per step. The model: ``--model DIR`` (a real
tokenizer makes the grammar work realistic), else random weights of ``--shape`` (default
Qwen2.5-0.5B) with a byte tokenizer, or ``--tokenizer DIR``'s tokenizer and vocabulary size.

Random weights end JSON strings at random, so constrained samples finish early and the batch
thins out: besides tokens/s, each run reports the milliseconds of a step while all of its
requests still run (``full_batch_ms_per_step``), which compares the same work.

    python -m benchmarks.bench_structured --out /tmp/bench_structured.json
    python -m benchmarks.bench_structured --model /models/Qwen2.5-0.5B-Instruct --batch 64
    python -m benchmarks.bench_structured --tokenizer /models/SmolLM2-135M-Instruct
    python -m benchmarks.bench_structured --shape qwen2.5-7b
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.cli import add_output_arguments, replot_if_asked

# Strings without a length bound: noise keeps writing them until max_tokens.
SCHEMA = {"type": "object",
          "properties": {"title": {"type": "string"},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "score": {"type": "number"}},
          "required": ["title", "tags", "score"]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="model directory (default: random Qwen2.5-0.5B shapes)")
    from .bench_engine import SHAPES
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=tuple(SHAPES),
                        help="the random model's shapes (default qwen2.5-0.5b)")
    parser.add_argument("--tokenizer", default=None,
                        help="with random weights: this tokenizer directory's tokenizer and "
                             "vocabulary size instead of a byte tokenizer")
    parser.add_argument("--batch", type=int, default=64, help="requests in the batch (default 64)")
    parser.add_argument("--prompt-len", type=int, default=128,
                        help="random prompt tokens per request (default 128)")
    parser.add_argument("--max-tokens", type=int, default=256,
                        help="most tokens generated per request (default 256)")
    parser.add_argument("--enforce-eager", action="store_true", help="engine without CUDA graphs")
    from .bench_engine import add_async_argument
    add_async_argument(parser)
    add_output_arguments(parser, "write the results as JSON here")


def _run(llm, prompts, params) -> dict:
    engine = llm.engine
    mask_s = 0.0
    fill = engine.structured._fill

    def timed_fill(matchers, bitmask):
        # On the mask worker thread: the time the fill takes, overlapped or not.
        nonlocal mask_s
        start = time.perf_counter()
        try:
            return fill(matchers, bitmask)
        finally:
            mask_s += time.perf_counter() - start

    engine.structured._fill = timed_fill
    step = engine.step
    full = []     # seconds of the decode steps that ran the whole batch

    def timed_step(*args, **kwargs):
        began = time.perf_counter()
        outputs = step(*args, **kwargs)
        out = engine.last_schedule
        if out is not None and out.decode_only and out.num_seqs == len(prompts):
            full.append(time.perf_counter() - began)
        return outputs

    engine.step = timed_step
    steps = engine.counters.num_steps
    try:
        torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    finally:
        del engine.structured._fill
        del engine.step
    steps = engine.counters.num_steps - steps
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"output_tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1), "steps": steps,
            "full_batch_steps": len(full),
            "full_batch_ms_per_step": round(1e3 * statistics.median(full), 3) if full else None,
            "mask_ms_per_step": round(1e3 * mask_s / max(steps, 1), 3),
            "finish_reasons": sorted({c.finish_reason for o in outputs for c in o.outputs})}


def plot(path: Path, results: dict) -> None:
    """Bars: output tokens/s of the batch unconstrained and with the JSON schema."""
    from benchmarks.plots import plot_bars
    runs = ("unconstrained", "json_schema")
    plot_bars(path, [f"batch {results['batch']}"],
              {name: [results[name]["tokens_per_s"]] for name in runs},
              title="structured outputs: output tokens/s", ylabel="tokens/s", annotate=True)


def run(args: argparse.Namespace) -> int:
    from mini_paged_attn.engine import LLM, SamplingParams
    from mini_paged_attn.engine.structured import StructuredOutputsParams

    from .bench_engine import ASYNC_CHOICES
    if replot_if_asked(args, plot):
        return 0
    if not torch.cuda.is_available():
        print("bench_structured needs a CUDA GPU", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            from .bench_engine import random_model_dir
            path = random_model_dir(args.shape, Path(tmp), tokenizer=args.tokenizer)
        llm = LLM(str(path), dtype="bfloat16", max_model_len=args.prompt_len + args.max_tokens,
                  max_num_seqs=max(args.batch, 1), enforce_eager=args.enforce_eager,
                  async_scheduling=ASYNC_CHOICES[args.async_scheduling])
        rng = random.Random(0)
        vocab = min(llm.engine.tokenizer.vocab_size, llm.engine.model_config.vocab_size)
        prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)]
                   for _ in range(args.batch)]
        plain = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=args.max_tokens)
        constrained = SamplingParams(temperature=0.6, max_tokens=args.max_tokens,
                                     structured_outputs=StructuredOutputsParams(json=SCHEMA))
        # Warm-up: kernels, the grammar's compile and the token trie.
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, structured_outputs=(
            constrained.structured_outputs)), use_tqdm=False)
        results = {"batch": args.batch, "prompt_len": args.prompt_len,
                   "max_tokens": args.max_tokens,
                   "model": str(args.model or f"random {args.shape}"),
                   "tokenizer": args.tokenizer,
                   "device": torch.cuda.get_device_name(),
                   "async_scheduling": args.async_scheduling,
                   "unconstrained": _run(llm, prompts, plain),
                   "json_schema": _run(llm, prompts, constrained)}
        llm.engine.shutdown()
    base, cons = results["unconstrained"], results["json_schema"]
    results["overhead_per_token_pct"] = round(
        100 * (base["tokens_per_s"] / cons["tokens_per_s"] - 1), 1)
    if base["full_batch_ms_per_step"] and cons["full_batch_ms_per_step"]:
        results["full_batch_overhead_pct"] = round(
            100 * (cons["full_batch_ms_per_step"] / base["full_batch_ms_per_step"] - 1), 1)
    print(json.dumps(results, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
        plot(Path(args.out).with_suffix(".png"), results)
    return 0


def main(argv: list[str] | None = None) -> int:
    from .bench_engine import engine_tool_main
    return engine_tool_main(__doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
