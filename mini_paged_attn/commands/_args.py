"""Argument helpers shared by the CLI's sub-commands."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value}")
    return value


def context_budget(text: str) -> int | str | None:
    """``--max-num-batched-context-tokens``: a positive int, ``auto`` or ``none``."""
    if text in ("auto", "none"):
        return None if text == "none" else text
    return positive_int(text)


def port_number(text: str) -> int:
    """argparse type: a TCP port, 1..65535."""
    value = int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 1..65535, got {value}")
    return value


def device_name(text: str) -> str:
    """argparse type: a torch device string (cpu, cuda, cuda:1, ...) this torch can use."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(
            f"expected a torch device such as cpu, cuda or cuda:1, got {text!r}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(
                f"expected a device this torch can use, got {text!r}: no CUDA GPU is available "
                f"(torch {torch.__version__}, CUDA {torch.version.cuda or 'not built in'}); "
                "use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"expected one of cuda:0..cuda:{torch.cuda.device_count() - 1}, got {text!r}")
    return text


DTYPES = ("auto", "float16", "bfloat16", "float32")
# vLLM's spellings of the same dtypes.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def dtype_name(text: str) -> str:
    """argparse type: one of DTYPES, or a vLLM alias of one (half = float16, float = float32)."""
    name = DTYPE_ALIASES.get(text.lower(), text.lower())
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"expected one of {', '.join(DTYPES + tuple(DTYPE_ALIASES))}, got {text!r}")
    return name


def memory_fraction(text: str) -> float:
    """argparse type: a share of the GPU's memory, a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


TRUST_REMOTE_CODE_ERROR = (
    "--trust-remote-code: no remote code runs here: mini_paged_attn implements each model "
    "family it supports itself and never imports a checkpoint's Python files; drop the flag "
    "(a model of a supported family loads without it)")


def add_engine_arguments(parser: argparse.ArgumentParser, *, serving: bool) -> None:
    """The engine's options as an "engine" argument group.

    ``serving=False`` (one interactive request): only dtype, device, max model length and eager
    mode; ``serving=True`` adds the pool and batching knobs a server needs.
    """
    engine = parser.add_argument_group("engine")
    engine.add_argument("--dtype", default="auto", type=dtype_name, metavar="DTYPE",
                        help="auto (the model's, the default), float16 (or half), bfloat16 or "
                             "float32 (or float)")
    engine.add_argument("--device", type=device_name, default=None,
                        help="cuda, cuda:1, cpu ... (default: cuda if available, else cpu)")
    engine.add_argument("--max-model-len", type=positive_int, default=None,
                        help="longest prompt + output (default: the model's"
                             + ("" if serving else ", capped at 8192") + ")")
    engine.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    engine.add_argument("--trust-remote-code", action="store_true",
                        help="refused: no checkpoint's Python code runs here (accepted only to "
                             "say so in one line, for command lines written for vLLM)")
    engine.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1,
                        help="split the model over this many processes, one GPU each on CUDA "
                             "(default 1)")
    engine.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                        help="auto (the model's dtype) or fp8 (e4m3: twice the tokens in the "
                             "same memory)")
    if not serving:
        return
    engine.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    engine.add_argument("--num-kv-blocks", type=positive_int, default=None,
                        help="KV pool size in blocks (default: sized from free memory)")
    engine.add_argument("--gpu-memory-utilization", type=memory_fraction, default=0.9,
                        metavar="FRACTION",
                        help="share in (0, 1] of the GPU's memory the engine may use: weights, "
                             "activations and the KV pool, which gets what is left of it "
                             "(default 0.9; ignored with --num-kv-blocks and on the CPU)")
    engine.add_argument("--max-num-seqs", type=positive_int, default=256,
                        help="most requests in one batch (default 256)")
    engine.add_argument("--max-num-batched-tokens", type=positive_int, default=8192,
                        help="token budget of one step (default 8192)")
    engine.add_argument("--max-num-batched-context-tokens", type=context_budget,
                        default="auto", metavar="N|auto|none",
                        help="KV tokens the running requests of one step may attend over, "
                             "summed; past it short contexts go first and long ones take "
                             "turns. auto (default): 2048 on the CPU, where long contexts "
                             "slow every step; no bound on a GPU. none: no bound")
    engine.add_argument("--no-prefix-caching", action="store_true",
                        help="turn automatic prefix caching off")
    engine.add_argument("--cascade-attention", choices=("auto", "on", "off"), default="auto",
                        help="attend over a prefix that requests share once per group, where "
                             "its rule says it pays. auto (default) and on: the rule decides "
                             "each step; off: plain attention on every step")
    engine.add_argument("--no-cascade-attention", dest="cascade_attention",
                        action="store_const", const="off", help="--cascade-attention off")
    engine.add_argument("--seed", type=int, default=0,
                        help="seed of the engine's sampling, for requests without a seed of "
                             "their own (default 0)")
