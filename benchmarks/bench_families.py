"""Every model family on the GPU (bf16, CUDA graphs): greedy parity with transformers, and speed.

For each family, a small model with random bf16 weights (transformers' own init, std 0.02;
1024 hidden, 6 layers, 16 query / 4 KV heads; windowed layers see 256 keys, so most prompts
outrun the window; MoE layers 8 experts, top 2) is saved like a checkpoint and loaded by the
engine (decode under CUDA graphs) and by transformers (its default attention). Both decode
``--requests`` prompts of 16..600 tokens greedily for ``--steps`` tokens:

- identical: requests whose tokens are all the same;
- agreeing prefix: the mean share of tokens before the first difference;
- worst gap: at each first difference, transformers' logit of its own token minus its logit of
  ours, in units of bf16's spacing at the top logit (a few steps: a near tie rounded apart);
- the engine's output tokens/s on the same batch (warm).

(``--dtype float32`` runs the same in float32, where the tokens should agree exactly; in bf16 a
rounding difference can flip a near tie, and in a mixture-of-experts layer a router's choice.)

    python -m benchmarks.bench_families --out /tmp/bench_families
    python -m benchmarks.bench_families --families mistral gemma2 --requests 8
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.cli import add_log_level, add_output_arguments, parse_and_log, replot_if_asked

logger = logging.getLogger("benchmarks.bench_families")

WINDOW = 256
COMMON = dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=6,
              num_attention_heads=16, num_key_value_heads=4, vocab_size=32064,
              max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
              pad_token_id=2, tie_word_embeddings=False)
MOE = dict(num_experts_per_tok=2)
# family -> (transformers config class, fields beyond COMMON)
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", dict(head_dim=64)),
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW)),
    "phi3": ("Phi3Config", {}),
    "gemma2": ("Gemma2Config", dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=WINDOW)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=64, query_pre_attn_scalar=64,
                                        sliding_window=WINDOW)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=64, num_experts=8, moe_intermediate_size=512,
                                         **MOE)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, sliding_window=WINDOW, **MOE)),
    "gpt_oss": ("GptOssConfig", dict(head_dim=64, num_local_experts=8, sliding_window=128,
                                     **MOE)),
}


def model_dir(family: str, root: Path, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Path:
    import transformers

    from benchmarks.bench_engine import save_random_model
    cls, fields = FAMILIES[family]
    config = getattr(transformers, cls)(**{**COMMON, **fields})
    return save_random_model(config, root / f"{family}-{str(dtype).replace('torch.', '')}",
                             seed=seed, dtype=dtype)


def family_row(family: str, root: Path, args: argparse.Namespace) -> dict:
    from benchmarks.bench_engine import greedy_parity, hf_generate
    from mini_paged_attn.engine import LLM, SamplingParams

    dtype = getattr(torch, args.dtype)
    path = model_dir(family, root, dtype=dtype)
    rng = random.Random(2)
    prompts = [[rng.randint(3, 30000) for _ in range(rng.randint(16, 600))]
               for _ in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.steps, ignore_eos=True)
    llm = LLM(str(path), dtype=args.dtype, max_model_len=1024, max_num_seqs=args.requests)
    graphs = llm.engine.runner.graphs is not None
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)     # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del llm
    torch.cuda.empty_cache()
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    hf = hf.to("cuda").eval()
    _, theirs, logits = hf_generate(hf, prompts, [args.steps] * len(prompts),
                                    batch=len(prompts), temperature=0.0, scores=True)
    del hf
    torch.cuda.empty_cache()
    parity = greedy_parity(ours, theirs, logits)
    worst = max((abs(g["gap_in_bf16_steps"]) for g in parity["differing"]), default=0.0)
    return {"family": family, "cuda_graphs": graphs, "requests": len(prompts),
            "identical": parity["identical"], "agreeing_prefix": parity["agreeing_prefix_share"],
            "worst_gap_bf16_steps": worst,
            "tok_per_s": len(prompts) * args.steps / seconds}


def plot(path: Path, rows: list[dict]) -> None:
    """Bars: per family, the share of requests identical to transformers and the mean share
    of tokens before the first difference."""
    from benchmarks.plots import plot_bars
    rows = [r for r in rows if "error" not in r]
    plot_bars(path, [r["family"] for r in rows],
              {"identical requests": [r["identical"] / r["requests"] for r in rows],
               "tokens before the first difference": [r["agreeing_prefix"] for r in rows]},
              title="greedy agreement with transformers, bf16, CUDA graphs", ylabel="share")


def run(args: argparse.Namespace) -> int:
    from benchmarks.common import environment, print_table
    if replot_if_asked(args, plot, lambda data: data.get("rows") or data["bf16"]):
        return 0
    if not torch.cuda.is_available():
        logger.error("bench_families needs a CUDA device")
        return 2
    env = environment()
    root = Path(tempfile.mkdtemp())
    rows = []
    for family in args.families:
        try:
            rows.append(family_row(family, root, args))
        except Exception as exc:  # noqa: BLE001 - one family's failure is a row, not the end
            logger.exception("family %s failed", family)
            rows.append({"family": family, "error": f"{type(exc).__name__}: {exc}"[:200]})
        logger.info("%s", rows[-1])
    import transformers
    env["transformers"] = transformers.__version__
    print(f"device: {env['device']}  torch {env['torch']}  transformers "
          f"{env['transformers']}  date {env['date']}")
    print_table(rows, ["family", "cuda_graphs", "requests", "identical", "agreeing_prefix",
                       "worst_gap_bf16_steps", "tok_per_s", "error"])
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
        plot(out / "families.png", rows)
    return 0 if all("error" not in r for r in rows) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES),
                        help="the model families to run (default: all of them)")
    parser.add_argument("--requests", type=int, default=16,
                        help="requests per family, all in one batch (default 16)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="weights and activations (float32: parity should be exact)")
    parser.add_argument("--steps", type=int, default=32, help="greedy tokens per request")
    add_output_arguments(parser, "directory for results.json")
    add_log_level(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(parse_and_log(build_parser(), argv))


if __name__ == "__main__":
    sys.exit(main())
