"""Mixture-of-experts benchmark (GPU): the Triton grouped-GEMM ``fused_moe`` vs a per-expert
torch loop, on one Qwen3-30B-A3B-shaped layer.

The layer: hidden 2048, expert intermediate 768, 128 experts, top-8, bf16, SwiGLU; router
weights from a softmax over random logits (about uniform load). For each token count the table
gives the GPU time per call (median, L2 flushed before each call) of

- ``triton``: ``fused_moe(..., backend="triton")`` (routing plan, two grouped GEMMs, the
  top-k sum);
- ``torch``: the reference, one ``F.linear`` pair per expert that got a token (what
  transformers' eager expert loop does; it reads the routed experts back to the host, so its
  time includes the GPU idling while the host launches each expert's kernels);

the routing plan's share of the Triton time (``plan_us``, the torch ops that sort the pairs by
expert), the experts hit, the useful TFLOP/s of each (``6 * T * k * H * I`` flops: gate/up
and down), the
Triton path's expert-weight bytes read per second as a share of this run's copy bandwidth
(what bounds small batches), and the largest ``|triton - torch|``.

    python -m benchmarks.bench_moe --out /tmp/bench_moe.json
    python -m benchmarks.bench_moe --tokens 1,128 --experts 64 --out /tmp/moe_small.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

from benchmarks.cli import add_log_level, add_output_arguments, parse_and_log, replot_if_asked

logger = logging.getLogger("benchmarks.bench_moe")

TOKENS = (1, 16, 128, 1024, 4096)
COLUMNS = ("tokens", "experts_hit", "triton_us", "plan_us", "torch_us", "speedup",
           "triton_tflops", "torch_tflops", "weights_pct_copy_bw", "max_abs_diff")


def make_layer(hidden: int, inter: int, experts: int, seed: int = 0) -> dict:
    """Expert weights ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` in bf16 on the GPU, scaled so the
    activations stay O(1)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen, device="cuda") * hidden ** -0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen, device="cuda") * inter ** -0.5
    return {"w13": w13.to(torch.bfloat16), "w2": w2.to(torch.bfloat16)}


def make_tokens(num_tokens: int, hidden: int, experts: int, top_k: int, seed: int) -> dict:
    """Hidden states and their routing (softmax top-k of random logits, renormalised)."""
    from mini_paged_attn.models.moe import softmax_topk

    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    logits = torch.randn(num_tokens, experts, generator=gen, device="cuda")
    weights, ids = softmax_topk(logits, top_k, renormalize=True)
    return {"hidden": x, "topk_weights": weights, "topk_ids": ids}


def bench_row(layer: dict, num_tokens: int, top_k: int, copy_gbps: float) -> dict:
    from benchmarks.common import time_us
    from mini_paged_attn.ops.moe import fused_moe
    from mini_paged_attn.ops.moe_triton import moe_routing_plan, moe_tiles

    experts, two_inter, hidden = layer["w13"].shape
    inter = two_inter // 2
    args = dict(**layer, **make_tokens(num_tokens, hidden, experts, top_k, seed=num_tokens))
    triton_out = fused_moe(**args, backend="triton")
    torch_out = fused_moe(**args, backend="torch")
    diff = (triton_out.float() - torch_out.float()).abs().max().item()
    hit = int(torch.unique(args["topk_ids"]).numel())
    triton_us = time_us(lambda: fused_moe(**args, backend="triton"))
    torch_us = time_us(lambda: fused_moe(**args, backend="torch"))
    block_m = moe_tiles(num_tokens * top_k, experts, hidden, inter).block_m
    plan_us = time_us(lambda: moe_routing_plan(args["topk_ids"], experts, block_m))
    flops = 6 * num_tokens * top_k * hidden * inter
    weight_bytes = hit * 3 * hidden * inter * layer["w13"].element_size()
    return {"tokens": num_tokens, "experts_hit": hit, "triton_us": triton_us,
            "plan_us": plan_us, "torch_us": torch_us, "speedup": torch_us / triton_us,
            "triton_tflops": flops / (triton_us * 1e-6) / 1e12,
            "torch_tflops": flops / (torch_us * 1e-6) / 1e12,
            "weights_pct_copy_bw": 100 * weight_bytes / (triton_us * 1e-6) / 1e9 / copy_gbps,
            "max_abs_diff": diff}


def plot(path: Path, results: dict) -> None:
    """Bars: microseconds per call by token count, the Triton kernel against the torch loop."""
    from benchmarks.plots import plot_bars
    rows = results["rows"]
    plot_bars(path, [f"T={r['tokens']}" for r in rows],
              {"Triton grouped GEMM": [r["triton_us"] for r in rows],
               "torch loop over experts": [r["torch_us"] for r in rows]},
              title="MoE layer (hidden 2048, 128 experts x 768, top 8), bf16: us per call",
              ylabel="us (GPU)", log=True, annotate=True)


def run(args: argparse.Namespace) -> int:
    from benchmarks.common import environment, measure_ceilings, print_table

    if replot_if_asked(args, plot):
        return 0
    if args.out is None:
        print("--out: required (the JSON results file)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        sys.exit("benchmarks.bench_moe needs a CUDA GPU")
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        print(f"--tokens: expected comma-separated integers, got {args.tokens!r}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    ceilings = measure_ceilings()
    env = environment()
    shape = {"hidden": args.hidden, "moe_intermediate": args.intermediate,
             "experts": args.experts, "top_k": args.top_k, "dtype": "bfloat16"}
    results: dict = {"env": env, "shape": shape, "copy_gbps": ceilings.copy_gbps,
                     "matmul_tflops": ceilings.matmul_tflops, "rows": []}
    layer = make_layer(args.hidden, args.intermediate, args.experts)
    for num_tokens in tokens:
        row = bench_row(layer, num_tokens, args.top_k, ceilings.copy_gbps)
        logger.info("T=%d: triton %.1f us, torch %.1f us", num_tokens, row["triton_us"],
                    row["torch_us"])
        results["rows"].append(row)
        out.write_text(json.dumps(results, indent=2))
    print(f"device: {env['device']}  torch {env['torch']}  triton {env['triton']}  "
          f"copy {ceilings.copy_gbps:.0f} GB/s  bf16 matmul {ceilings.matmul_tflops:.0f} TFLOP/s")
    print(f"layer: {shape}")
    display = [{k: f"{v:.4g}" if isinstance(v, float) else v for k, v in r.items()}
               for r in results["rows"]]
    print_table(display, COLUMNS)
    plot(out.with_suffix(".png"), results)
    print(f"results: {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_arguments(parser, "path of the JSON results file (required)")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)),
                        help="token counts, comma-separated (default: 1,16,128,1024,4096)")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size (default 2048)")
    parser.add_argument("--intermediate", type=int, default=768,
                        help="expert intermediate size (default 768)")
    parser.add_argument("--experts", type=int, default=128, help="experts (default 128)")
    parser.add_argument("--top-k", type=int, default=8, help="experts per token (default 8)")
    add_log_level(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(parse_and_log(build_parser(), argv))


if __name__ == "__main__":
    sys.exit(main())
