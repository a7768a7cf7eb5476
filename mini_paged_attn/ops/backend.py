"""Which backend runs an op: ``"torch"`` (the reference, any device) or ``"triton"``.

Every op family (attention, varlen, the decoder's elementwise ops, MoE) chooses by the same
rule, so it lives apart from the attention dispatcher (:mod:`.dispatch`), which re-exports it.
"""

from __future__ import annotations

import functools

import torch

BACKENDS = ("auto", "torch", "triton")


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether ``import triton`` works here (the result is cached)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map ``backend`` ("auto" | "torch" | "triton") to the one that runs for ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "triton" and not triton_available():
        raise ValueError("backend: 'triton' was asked for, but triton is not importable "
                         "(pip install triton, or use backend='torch')")
    return backend


__all__ = ["BACKENDS", "resolve_backend", "triton_available"]
