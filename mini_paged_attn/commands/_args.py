"""Argument helpers shared by the CLI's sub-commands."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value}")
    return value


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


def add_engine_arguments(parser: argparse.ArgumentParser, *, serving: bool) -> None:
    """The engine's options as an "engine" argument group.

    ``serving=False`` (one interactive request): only dtype, device, max model length and eager
    mode; ``serving=True`` adds the pool and batching knobs a server needs.
    """
    engine = parser.add_argument_group("engine")
    engine.add_argument("--dtype", default="auto", choices=DTYPES,
                        help="auto (the model's), float16, bfloat16 or float32")
    engine.add_argument("--device", type=device_name, default=None,
                        help="cuda, cuda:1, cpu ... (default: cuda if available, else cpu)")
    engine.add_argument("--max-model-len", type=positive_int, default=None,
                        help="longest prompt + output (default: the model's"
                             + ("" if serving else ", capped at 8192") + ")")
    engine.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
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
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="share of GPU memory the engine may use (default 0.9)")
    engine.add_argument("--max-num-seqs", type=positive_int, default=256,
                        help="most requests in one batch (default 256)")
    engine.add_argument("--max-num-batched-tokens", type=positive_int, default=8192,
                        help="token budget of one step (default 8192)")
    engine.add_argument("--no-prefix-caching", action="store_true",
                        help="turn automatic prefix caching off")
    engine.add_argument("--seed", type=int, default=0, help="engine seed (default 0)")
