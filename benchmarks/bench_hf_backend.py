"""transformers with ``attn_implementation="mini_paged_attn"`` vs its own attention (GPU).

(generate) ``model.generate()`` greedy on a random-weight model of ``bench_engine``'s shapes
    (bf16), left-padded batches of random prompts: output tokens/s with ``mini_paged_attn``,
    ``sdpa`` (and ``flash_attention_2`` where installed), and the share of rows whose tokens
    equal sdpa's.
(batch) ``model.generate_batch()`` (transformers' continuous batching, paged cache) with
    ``paged|mini_paged_attn`` and ``paged|sdpa``, where the installed transformers calls custom
    paged functions (up to 5.22); otherwise the row says why it was skipped.

    python -m benchmarks.bench_hf_backend --out /tmp/bench_hf_backend
    python -m benchmarks.bench_hf_backend --shape qwen2.5-0.5b --batch 1 32 --output-len 128
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from pathlib import Path

import torch

logger = logging.getLogger("benchmarks.bench_hf_backend")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _model(shape: str):
    import transformers
    from benchmarks.bench_engine import SHAPES

    spec = dict(SHAPES[shape])
    config = getattr(transformers, f"{spec.pop('arch')}Config")(**spec, bos_token_id=0,
                                                                 eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                              attn_implementation="sdpa")
    return model.eval()


def _prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _generate(model, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    """Seconds for one left-padded greedy ``generate`` of ``prompts``, and each row's tokens."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device="cuda")
    mask = (torch.arange(width, device="cuda")[None, :]
            >= torch.tensor([width - len(p) for p in prompts], device="cuda")[:, None]).long()
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                  pad_token_id=0)
    model.generate(input_ids=ids[:, :8], attention_mask=mask[:, :8], max_new_tokens=2,
                   do_sample=False, pad_token_id=0)                      # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out[:, width:].tolist()


def _generate_batch(model, prompts: list[list[int]], output_len: int) -> tuple[float, list]:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=-1,
                              pad_token_id=0)
    model.generate_batch(prompts[:2], generation_config=config)          # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=config)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, [out[k].generated_tokens for k in sorted(out)]


def _compare(model, part: str, impls: list[str], batch: int, args) -> list[dict]:
    """One row per implementation (the last is the reference): time, tokens/s, same tokens."""
    prompts = _prompts(batch, *args.prompt_len, model.config.vocab_size, seed=batch)
    run = _generate if part == "generate" else _generate_batch
    results = {}
    for impl in impls:
        model.set_attn_implementation(impl)
        results[impl] = run(model, prompts, args.output_len)
    reference = results[impls[-1]][1]
    rows = []
    for impl, (secs, tokens) in results.items():
        rows.append(dict(part=part, impl=impl, batch=batch, seconds=round(secs, 3),
                         tokens_per_s=round(batch * args.output_len / secs, 1),
                         same_as=impls[-1],
                         same_share=sum(a == b for a, b in zip(tokens, reference)) / batch))
        logger.info("%s", rows[-1])
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3-0.6b", choices=("qwen3-0.6b", "qwen2.5-0.5b"),
                        help="the random-weight model's shapes (default qwen3-0.6b)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32],
                        help="batch sizes to time generate at (default 1 8 32)")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[64, 512], metavar=("LO", "HI"),
                        help="prompt lengths drawn uniformly from [LO, HI] (default 64 512)")
    parser.add_argument("--output-len", type=int, default=128,
                        help="tokens generated per prompt (default 128)")
    parser.add_argument("--parts", default="generate,batch", help="subset of generate,batch")
    parser.add_argument("--out", default=None, help="directory for results.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    if not torch.cuda.is_available():
        raise SystemExit("bench_hf_backend needs a CUDA GPU")
    import transformers
    from transformers import AttentionInterface

    from mini_paged_attn.integrations.transformers import register

    name = register()
    model = _model(args.shape)
    impls = [name]
    try:
        import flash_attn  # noqa: F401
        impls.append("flash_attention_2")
    except ImportError:
        pass
    impls.append("sdpa")                                   # last: the tokens' reference
    rows = []
    for batch in args.batch if "generate" in args.parts else []:
        rows += _compare(model, "generate", impls, batch, args)
    if "batch" in args.parts:
        if "paged|sdpa" not in AttentionInterface._global_mapping:
            rows.append(dict(part="batch", skipped=f"transformers {transformers.__version__}: "
                             "continuous batching takes only its own implementations"))
            logger.info("%s", rows[-1])
        else:
            rows += _compare(model, "batch", [f"paged|{name}", "paged|sdpa"], max(args.batch),
                             args)
    print(json.dumps(rows, indent=1))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        report = dict(transformers=transformers.__version__, torch=torch.__version__,
                      device=torch.cuda.get_device_name(), args=vars(args), rows=rows)
        (Path(args.out) / "results.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
