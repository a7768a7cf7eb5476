"""FP8 (e4m3) KV cache benchmark (GPU): decode speed over an fp8 cache vs bf16, and accuracy.

(decode) ``paged_decode`` at large shapes (32 query / 8 KV heads, head size 128, block 16,
    blocks in random physical order), bf16 queries, over a bf16 cache and over the same values
    in an fp8 cache (no scales, and per-KV-head scales): microseconds (L2 flushed before each
    call), the bytes actually read (K/V in the cache's dtype, query, block table, output) as a
    percentage of this run's copy bandwidth, the speedup over bf16, and the largest
    ``|out_fp8 - out_bf16|`` (the rounding of K/V to e4m3). Each cache runs its own planned
    tiles (``bf16_block_n``, ``fp8_block_n``).
(accuracy) the engine's bench models (random Qwen3-0.6B / Qwen2.5-0.5B shapes in bf16, as
    ``bench_engine`` builds them) with ``kv_cache_dtype="auto"`` (bf16) and ``"fp8"`` on the
    same prompts, greedy: the share of requests with identical tokens, the mean share of
    tokens before the first difference, and the first step's log-probabilities (its top 20,
    on the tokens both runs list): max and mean ``|logprob_fp8 - logprob_bf16|``. Where the
    tokens first differ, the bf16 run's log-probability gap between its token and the fp8
    run's (small: a near tie that rounding flipped).

    python -m benchmarks.bench_fp8 --out /tmp/bench_fp8
    python -m benchmarks.bench_fp8 --parts decode --out /tmp/bench_fp8
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.cli import add_log_level, add_output_arguments, parse_and_log, replot_if_asked

logger = logging.getLogger("benchmarks.bench_fp8")

DECODE_SHAPES = ((64, 4096), (256, 4096), (128, 16384), (32, 65536))
MODELS = ("qwen3-0.6b", "qwen2.5-0.5b")
TOP_LOGPROBS = 20


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _decode_row(batch: int, context: int, copy_gbps: float, seed: int) -> dict:
    """Time bf16 and fp8 decode at one ``(batch, context)`` (its tensors die on return)."""
    from benchmarks.bench_attention import DecodeCase, make_inputs
    from benchmarks.common import time_us
    from mini_paged_attn.ops import paged_decode
    from mini_paged_attn.ops.attention.decode_plan import num_sms_of, plan_decode
    from mini_paged_attn.ops.kv_quant import FP8_DTYPE

    case = DecodeCase(batch, context)
    x = make_inputs(case, seed)
    # The same values in an fp8 pool (N(0, 1) fits e4m3 at scale 1), same block tables.
    pool8 = torch.stack([x.key_cache, x.value_cache], dim=2).to(FP8_DTYPE)
    ones = torch.ones(case.num_kv_heads, dtype=torch.float32, device="cuda")
    variants = {
        "bf16": (x.key_cache, x.value_cache, {}),
        "fp8": (pool8[:, :, 0], pool8[:, :, 1], {}),
        "fp8_scaled": (pool8[:, :, 0], pool8[:, :, 1], {"k_scale": ones, "v_scale": ones}),
    }
    sizes = (batch, case.num_q_heads, case.num_kv_heads, case.head_size, context,
             case.block_size, case.dtype, num_sms_of(x.query.device))
    plan, plan8 = plan_decode(*sizes), plan_decode(*sizes, kv_dtype=FP8_DTYPE)
    # Bytes a call reads or writes besides K/V: query, block table, output.
    other = 2 * x.query.numel() * x.query.element_size() + x.block_tables.numel() * 4
    row: dict = {"shape": f"{batch}x{context}", "splits": plan8.num_splits,
                 "bf16_block_n": plan.tiles.block_n, "fp8_block_n": plan8.tiles.block_n}
    outs = {}
    for name, (kc, vc, scales) in variants.items():
        out = torch.empty_like(x.query)

        def call(kc=kc, vc=vc, scales=scales, out=out):
            paged_decode(x.query, kc, vc, x.block_tables, x.context_lens, out=out,
                         workspace=x.workspace, **scales)

        call()
        outs[name] = out.float()
        us = time_us(call)
        kv = case.kv_bytes // case.dtype.itemsize * kc.element_size()
        row[f"{name}_us"] = us
        row[f"{name}_pct_copy"] = 100 * (kv + other) / (us * 1e-6) / 1e9 / copy_gbps
    row["fp8_speedup"] = row["bf16_us"] / row["fp8_us"]
    row["max_abs_err"] = float((outs["fp8"] - outs["bf16"]).abs().max())
    # Scales of 1.0 multiply exactly: the scaled path must give the same bits.
    row["scaled_equal"] = bool(torch.equal(outs["fp8"], outs["fp8_scaled"]))
    return row


def decode_rows(shapes, copy_gbps: float, seed: int = 0) -> list[dict]:
    """One row per ``(batch, context)``: bf16 and fp8 decode times and the fp8 error."""
    rows = []
    for batch, context in shapes:
        rows.append(_decode_row(batch, context, copy_gbps, seed))
        _free()
        logger.info("decode %s", rows[-1])
    return rows


def _prompts(num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(0, 100000) for _ in range(rng.randint(16, 400))] for _ in range(num)]


def accuracy_row(shape: str, root: Path, num_requests: int, steps: int) -> dict:
    """bf16 vs fp8 KV cache on one bench model: agreement and first-step log-prob error."""
    from benchmarks.bench_engine import engine_llm, engine_options, random_model_dir
    from mini_paged_attn.engine import SamplingParams

    path = random_model_dir(shape, root, seed=1)
    prompts = _prompts(num_requests, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True,
                            logprobs=TOP_LOGPROBS)
    engine_args = engine_options(enforce_eager=True, max_num_seqs=num_requests)
    runs = {}
    for kv_dtype in ("auto", "fp8"):
        llm = engine_llm(path, engine_args, kv_cache_dtype=kv_dtype, max_model_len=1024)
        runs[kv_dtype] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
        _free()
    identical, prefix_shares, first_errors, flip_gaps = 0, [], [], []
    for ref, fp8 in zip(runs["auto"], runs["fp8"]):
        a, b = list(ref.token_ids), list(fp8.token_ids)
        differ = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        identical += differ is None
        prefix_shares.append(1.0 if differ is None else differ / len(a))
        first_ref, first_fp8 = ref.logprobs[0], fp8.logprobs[0]
        first_errors += [abs(first_ref[t] - first_fp8[t]) for t in first_ref.keys() & first_fp8]
        if differ is not None and {a[differ], b[differ]} <= ref.logprobs[differ].keys():
            step = ref.logprobs[differ]
            flip_gaps.append(step[a[differ]] - step[b[differ]])
    return {
        "model": shape, "requests": num_requests, "steps": steps,
        "identical_share": identical / num_requests,
        "mean_agreeing_prefix_share": sum(prefix_shares) / len(prefix_shares),
        "first_step_logprob_max_err": max(first_errors),
        "first_step_logprob_mean_err": sum(first_errors) / len(first_errors),
        "differing": num_requests - identical,
        "max_flip_gap": max(flip_gaps) if flip_gaps else None,
        "mean_flip_gap": sum(flip_gaps) / len(flip_gaps) if flip_gaps else None,
    }


DECODE_COLUMNS = ("shape", "splits", "bf16_block_n", "fp8_block_n", "bf16_us", "bf16_pct_copy",
                  "fp8_us", "fp8_pct_copy", "fp8_scaled_us", "fp8_scaled_pct_copy",
                  "fp8_speedup", "max_abs_err", "scaled_equal")
ACCURACY_COLUMNS = ("model", "requests", "steps", "identical_share",
                    "mean_agreeing_prefix_share", "first_step_logprob_max_err",
                    "first_step_logprob_mean_err", "differing", "max_flip_gap",
                    "mean_flip_gap")


def _display(rows: list[dict]) -> list[dict]:
    """Rows with floats at 4 significant digits (the tables' default keeps 1 decimal)."""
    return [{k: f"{v:.4g}" if isinstance(v, float) else v for k, v in r.items()} for r in rows]


def plot(path: Path, results: dict) -> None:
    """Bars: decode microseconds per shape over a bf16 and an fp8 cache."""
    from benchmarks.plots import plot_bars
    rows = results["decode"]
    plot_bars(path, [r["shape"] for r in rows],
              {"bf16 cache": [r["bf16_us"] for r in rows],
               "fp8 cache": [r["fp8_us"] for r in rows]},
              title="paged_decode, bf16 queries, 32 q / 8 kv heads, d 128: us per call",
              ylabel="us (GPU)", annotate=True)


def run(args: argparse.Namespace) -> int:
    from benchmarks.common import environment, markdown_table, print_table, start_gpu_run

    if replot_if_asked(args, plot):
        return 0
    if args.out is None:
        print("--out: required (a directory for results.json, report.md)", file=sys.stderr)
        return 2
    out = Path(args.out)
    ceilings = start_gpu_run(out, "benchmarks.bench_fp8")
    env = environment()
    results: dict = {"env": env, "copy_gbps": ceilings.copy_gbps}
    parts = args.parts.split(",")
    unknown = set(parts) - {"decode", "accuracy"}
    if unknown:
        print(f"--parts: unknown {sorted(unknown)}; expected decode and/or accuracy",
              file=sys.stderr)
        return 2
    header = (f"device: {env['device']}  torch {env['torch']}  triton {env['triton']}  "
              f"date {env['date']}  copy bandwidth {ceilings.copy_gbps:.0f} GB/s")
    lines = [header, ""]
    if "decode" in parts:
        start = time.perf_counter()
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        results["decode"] = decode_rows(shapes, ceilings.copy_gbps)
        print_table(_display(results["decode"]), DECODE_COLUMNS)
        lines += ["decode (us, % of copy bandwidth counting the bytes read):",
                  markdown_table(_display(results["decode"]), DECODE_COLUMNS), ""]
        logger.info("decode part: %.0f s", time.perf_counter() - start)
    if "accuracy" in parts:
        start = time.perf_counter()
        results["accuracy"] = []
        with tempfile.TemporaryDirectory() as tmp:
            for shape in args.models.split(","):
                results["accuracy"].append(accuracy_row(shape, Path(tmp), args.requests,
                                                        args.steps))
                (out / "results.json").write_text(json.dumps(results, indent=2))
        print_table(_display(results["accuracy"]), ACCURACY_COLUMNS)
        lines += ["accuracy (fp8 vs bf16 KV cache, greedy):",
                  markdown_table(_display(results["accuracy"]), ACCURACY_COLUMNS), ""]
        logger.info("accuracy part: %.0f s", time.perf_counter() - start)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "report.md").write_text("\n".join(lines))
    if "decode" in results:
        plot(out / "fp8.png", results)
    print("\n".join(lines))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_arguments(parser, "directory for results.json, report.md (required)")
    parser.add_argument("--parts", default="decode,accuracy",
                        help="comma-separated subset of decode,accuracy (default: both)")
    parser.add_argument("--shapes", default=",".join(f"{b}x{c}" for b, c in DECODE_SHAPES),
                        help="decode shapes BATCHxCONTEXT, comma-separated")
    parser.add_argument("--models", default=",".join(MODELS),
                        help="bench models for the accuracy part (bench_engine's shapes)")
    parser.add_argument("--requests", type=int, default=32, help="accuracy: prompts per model")
    parser.add_argument("--steps", type=int, default=32, help="accuracy: greedy tokens each")
    add_log_level(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(parse_and_log(build_parser(), argv))


if __name__ == "__main__":
    sys.exit(main())
