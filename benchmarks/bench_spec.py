"""Speculative decoding benchmark: the engine with and without speculation in the same process,
on the same requests (output tokens/s, their ratio, the acceptance measured).

(summary) the real packaged smollm2-135m, batch 1, greedy: a passage and a request to
    summarise it quoting its sentences; n-gram proposals (runs on the CPU too).
(repeat) Qwen2.5-0.5B shapes with random bf16 weights, batch 1, greedy, 512-token prompt:
    a random model's greedy output falls into loops, which prompt lookup then proposes.
(norepeat) the same model sampled at temperature 1.0: the output repeats nothing, so the
    proposals are almost never kept; what they cost shows.
(draft) the same model as its own draft, k = 4: every proposal is kept; the ceiling of the
    machinery, since the draft costs what the target does.
(pair) Qwen2.5-7B shapes as the target, the 0.5B shapes as the draft (random weights of
    both, so the acceptance is near 0: what a small draft costs a large target).
(batch64) 64 requests at once with n-gram on: past ``disable_by_batch_size`` (32) running
    sequences no step speculates, so the speed is the plain engine's.

    python -m benchmarks.bench_spec --out /tmp/bench_spec
    python -m benchmarks.bench_spec --workloads summary --device cpu
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

PASSAGE = (
    "The key-value cache of a language model grows with every token it reads or writes. "
    "Stored as one contiguous buffer per request, it must be reserved for the longest output "
    "the request may produce, and most of that reservation is never used. Paged attention "
    "stores the cache in fixed-size blocks instead, and a block table maps each request's "
    "logical positions to physical blocks. Blocks are allocated only when tokens arrive, so "
    "memory follows the actual length of each request. Requests that share a prompt can "
    "share its blocks, and a block is copied only when one of them writes to it. The same "
    "tables let a scheduler preempt a request by giving its blocks back, and resume it later "
    "by computing them again.")
SUMMARY_PROMPT = (f"{PASSAGE}\n\nSummarise the passage above in three sentences, quoting "
                  f"its own words.\nSummary: \"")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from benchmarks.cli import add_output_arguments
    parser.add_argument("--workloads", default="summary,repeat,norepeat,draft,pair,batch64",
                        help="comma-separated subset of summary,repeat,norepeat,draft,pair,"
                             "batch64 (default: all)")
    parser.add_argument("--device", default=None,
                        help="cuda or cpu (default: cuda when there is one); only the "
                             "summary workload runs on the CPU")
    parser.add_argument("--max-tokens", type=int, default=256,
                        help="output tokens per request (default 256)")
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=4,
                        help="proposals per step (default 4)")
    add_output_arguments(parser, "directory for results.json")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _generate(llm, prompts, params, device: str) -> tuple[float, list]:
    _sync(device)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    _sync(device)
    return time.perf_counter() - start, outputs


def compare(model, prompts, params, device: str, spec: dict, *, warm_up: list[int],
            **options) -> dict:
    """Tokens/s of ``model`` on ``prompts`` without and with ``spec`` (each engine warmed up on
    ``warm_up``, a prompt that shares no block with the timed ones), the ratio, the acceptance
    and whether greedy outputs matched."""
    from mini_paged_attn.engine import LLM, SamplingParams
    row: dict = {}
    outputs = {}
    for name, config in (("base", None), ("spec", spec)):
        llm = LLM(str(model), device=device, speculative_config=config, **options)
        llm.generate([warm_up], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        seconds, out = _generate(llm, prompts, params, device)
        tokens = sum(len(c.token_ids) for o in out for c in o.outputs)
        row[f"{name}_tok_per_s"] = tokens / seconds
        outputs[name] = [c.token_ids for o in out for c in o.outputs]
        if config is not None:
            stats = llm.stats()
            row.update(acceptance=stats.spec_acceptance_rate,
                       mean_accepted=stats.spec_mean_accepted_length,
                       spec_steps=stats.spec_steps)
        llm.shutdown()
        del llm
        gc.collect()
    row["speedup"] = row["spec_tok_per_s"] / row["base_tok_per_s"]
    if all(p.temperature == 0 for p in (params if isinstance(params, list) else [params])):
        row["same_outputs"] = outputs["base"] == outputs["spec"]
    return row


def _random_prompt(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(2, 10000, (n,), generator=gen).tolist()


def run(args: argparse.Namespace) -> int:
    from benchmarks.bench_engine import SHAPES, random_model_dir
    from mini_paged_attn.engine import SamplingParams
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    k = args.num_speculative_tokens
    ngram = dict(NGRAM, num_speculative_tokens=k)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.max_tokens)
    results: dict = {"env": {"device": (torch.cuda.get_device_name() if device == "cuda"
                                        else "cpu"), "torch": torch.__version__,
                             "date": time.strftime("%Y-%m-%d"), "k": k}, "rows": []}
    gpu_options = dict(dtype="bfloat16", max_model_len=4096)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)

        def model_dir(shape: str, **overrides) -> Path:
            if overrides:
                SHAPES[f"{shape}+"] = dict(SHAPES[shape], **overrides)
                shape = f"{shape}+"
            path = root / shape
            return path if path.exists() else random_model_dir(shape, root)

        for name in args.workloads.split(","):
            start = time.perf_counter()
            if name == "summary":
                params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
                row = compare("smollm2-135m", [SUMMARY_PROMPT], params, device, ngram,
                              warm_up=_random_prompt(40, 9),
                              **({"dtype": "bfloat16"} if device == "cuda" else {}))
            elif device != "cuda":
                print(f"[{name}] skipped: needs a CUDA GPU", flush=True)
                continue
            elif name in ("repeat", "norepeat"):
                params = (greedy if name == "repeat" else
                          SamplingParams(temperature=1.0, ignore_eos=True,
                                         max_tokens=args.max_tokens))
                row = compare(model_dir("qwen2.5-0.5b"), [_random_prompt(512, 1)], params,
                              device, ngram, warm_up=_random_prompt(50, 2), **gpu_options)
            elif name == "draft":
                target = model_dir("qwen2.5-0.5b")
                row = compare(target, [_random_prompt(512, 1)], greedy, device,
                              {"method": "draft_model", "model": str(target),
                               "num_speculative_tokens": k},
                              warm_up=_random_prompt(50, 2), **gpu_options)
            elif name == "pair":
                target = model_dir("qwen2.5-7b", vocab_size=SHAPES["qwen2.5-0.5b"]["vocab_size"])
                row = compare(target, [_random_prompt(512, 1)], greedy, device,
                              {"method": "draft_model", "model": str(model_dir("qwen2.5-0.5b")),
                               "num_speculative_tokens": k},
                              warm_up=_random_prompt(50, 2), **gpu_options)
            elif name == "batch64":
                prompts = [_random_prompt(256, 100 + i) for i in range(64)]
                row = compare(model_dir("qwen2.5-0.5b"), prompts, greedy, device, ngram,
                              warm_up=_random_prompt(50, 2), max_num_seqs=64, **gpu_options)
            else:
                raise SystemExit(f"error: --workloads: unknown workload {name!r}")
            row = {"workload": name, **row}
            results["rows"].append(row)
            print(f"[{name}] done in {time.perf_counter() - start:.0f} s: {row}", flush=True)
            if args.out:
                Path(args.out).mkdir(parents=True, exist_ok=True)
                (Path(args.out) / "results.json").write_text(json.dumps(results, indent=2))
    from benchmarks.common import print_table
    print_table(results["rows"], ["workload", "base_tok_per_s", "spec_tok_per_s", "speedup",
                                  "acceptance", "mean_accepted", "same_outputs"])
    return 0


def main(argv: list[str] | None = None) -> int:
    from benchmarks.bench_engine import engine_tool_main
    return engine_tool_main(__doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
