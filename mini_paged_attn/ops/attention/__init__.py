"""Attention backends: objects that declare what they run (torch reference, Triton, Hopper)
and are chosen once; the engine asks the chosen one for its workspaces and warm-up shapes,
never for the per-call thresholds, which stay plans inside it. The files:
docs/architecture.md, ``ops/attention/``.
"""

from .base import (AttentionBackend, AttentionLimits, AttentionSpec, Capabilities,
                   WarmupBatch)
from .decode_plan import explain_decode
from .hopper_backend import HOPPER, HopperBackend
from .select import BACKEND_NAMES, backend_for_call, choose_backend, select_backend
from .torch_backend import TORCH, TorchBackend
from .triton_backend import TRITON, TritonBackend

__all__ = ["AttentionBackend", "AttentionLimits", "AttentionSpec", "BACKEND_NAMES",
           "Capabilities", "HOPPER", "HopperBackend", "TORCH", "TRITON", "TorchBackend",
           "TritonBackend", "WarmupBatch", "backend_for_call", "choose_backend", "explain_decode",
           "select_backend"]
