"""Sliding-window attention benchmark (GPU): what a window saves at long context.

(ops) ``paged_decode`` over 32k-token contexts (32 query / 8 KV heads, head size 128, bf16,
    blocks of 16 in random order) with ``window_size=(W - 1, 0)`` against full attention:
    GPU microseconds per call (L2 flushed) and the speedup. A windowed decode reads only the
    blocks its window reaches, so it should cost about ``W / context`` of the full one.
(engine) a Mistral-shaped model with random bf16 weights (Qwen3-0.6B-sized layers, every
    layer windowed) against the same weights with full attention: ``--batch`` requests of
    ``--context`` prompt tokens, steady decode steps: wall and GPU milliseconds per step, and
    the KV blocks the requests hold (the windowed run gives blocks left of the window back to
    the pool).

    python -m benchmarks.bench_window --out /tmp/bench_window
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.cli import add_log_level, add_output_arguments, parse_and_log, replot_if_asked

logger = logging.getLogger("benchmarks.bench_window")

MISTRAL_SHAPE = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                     num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                     vocab_size=32000, rms_norm_eps=1e-5, rope_theta=1000000.0)


def ops_rows(context: int, windows: list[int], batches: list[int]) -> list[dict]:
    """``paged_decode`` GPU time with each window against full attention."""
    from benchmarks.bench_attention import DecodeCase, make_inputs
    from benchmarks.common import time_us
    from mini_paged_attn.ops import paged_decode

    rows = []
    for batch in batches:
        case = DecodeCase(batch, context)
        x = make_inputs(case, 0)

        def call(window: int | None):
            size = (-1, -1) if window is None else (window - 1, 0)
            return paged_decode(*x.args, out=x.out, workspace=x.workspace, window_size=size)

        full_us = time_us(lambda: call(None))
        for window in windows:
            us = time_us(lambda: call(window))
            rows.append({"batch": batch, "context": context, "window": window, "full_us": full_us,
                         "window_us": us, "speedup": full_us / us,
                         "ideal_speedup": context / window})
            logger.info("ops %s", rows[-1])
    return rows


def _model_dir(root: Path, window: int | None) -> Path:
    import transformers

    from benchmarks.bench_engine import save_random_model
    config = transformers.MistralConfig(**MISTRAL_SHAPE, sliding_window=window,
                                        max_position_embeddings=131072, bos_token_id=0,
                                        eos_token_id=1)
    # Seed 0 for both runs: the same weights, windowed or not.
    return save_random_model(config, root / f"mistral-window-{window}", seed=0)


def engine_rows(context: int, window: int, batch: int, steps: int) -> list[dict]:
    """Steady decode of ``batch`` long requests, windowed model against full attention."""
    from benchmarks.bench_engine import profile_decode
    from mini_paged_attn.engine import LLM

    rows = []
    root = Path(tempfile.mkdtemp())
    prompts = [[(7 * i + 13 * j) % 30000 + 2 for j in range(context)] for i in range(batch)]
    for name, w in (("full", None), ("window", window)):
        llm = LLM(str(_model_dir(root, w)), dtype="bfloat16", max_model_len=context + 2 * steps + 64,
                  max_num_seqs=batch)
        prof = profile_decode(llm, prompts, 2 * steps + 32, steps=steps)
        total = llm.stats().kv_blocks_total
        rows.append({"attention": name, "window": w, "batch": batch, "context": context,
                     "wall_ms_per_step": prof["wall_ms_per_step"],
                     "gpu_ms_per_step": prof["gpu_ms_per_step"],
                     "kv_blocks_held": total - prof["kv_blocks_free"],
                     "kv_blocks_total": total})
        logger.info("engine %s", rows[-1])
        del llm
        torch.cuda.empty_cache()
    return rows


def plot(path: Path, results: dict) -> None:
    """Bars: GPU time of a decode call, full attention against each window (log scale)."""
    from benchmarks.plots import plot_bars
    rows = results.get("ops", [])
    cases = [f"{r['batch']} x {r['context'] // 1024}k, W {r['window']}" for r in rows]
    plot_bars(path, cases, {"full attention": [r["full_us"] for r in rows],
                            "sliding window": [r["window_us"] for r in rows]},
              title="paged_decode, bf16, 32 q / 8 kv heads, d 128: us per call",
              ylabel="us (GPU)", log=True, annotate=True)


def run(args: argparse.Namespace) -> int:
    from benchmarks.common import environment, print_table
    if replot_if_asked(args, plot):
        return 0
    if not torch.cuda.is_available():
        logger.error("bench_window needs a CUDA device")
        return 2
    env = environment()
    results = {"env": env}
    if "ops" in args.parts:
        results["ops"] = ops_rows(args.context, args.windows, args.batches)
    if "engine" in args.parts:
        results["engine"] = engine_rows(args.context, args.windows[0], args.engine_batch,
                                        args.steps)
    print(f"device: {env['device']}  torch {env['torch']}  date {env['date']}")
    if "ops" in results:
        print_table(results["ops"], ["batch", "context", "window", "full_us", "window_us",
                                     "speedup", "ideal_speedup"])
    if "engine" in results:
        print_table(results["engine"], ["attention", "window", "batch", "context",
                                        "wall_ms_per_step", "gpu_ms_per_step",
                                        "kv_blocks_held"])
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        if "ops" in results:
            plot(out / "window.png", results)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="ops,engine", help="comma-separated: ops, engine")
    parser.add_argument("--context", type=int, default=32768, help="tokens per sequence")
    parser.add_argument("--windows", type=int, nargs="+", default=[4096],
                        help="window sizes (Hugging Face's sliding_window); the engine part "
                             "uses the first")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64],
                        help="(ops) sequences per decode call")
    parser.add_argument("--engine-batch", type=int, default=8, help="(engine) requests")
    parser.add_argument("--steps", type=int, default=10, help="(engine) profiled steps")
    add_output_arguments(parser, "directory for results.json")
    add_log_level(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parse_and_log(build_parser(), argv)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
