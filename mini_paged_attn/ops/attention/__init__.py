"""Attention backends: objects that declare what they run and are chosen once.

- ``base.py``: :class:`AttentionSpec` (what a model needs), :class:`Capabilities` (what a
  backend declares: devices, GPU generation, dtypes, head sizes, windows, soft-cap, sinks,
  fp8 KV), :class:`AttentionLimits` (the engine's bounds) and :class:`AttentionBackend`, the
  interface: ``refusal(spec)``, ``decode_workspace(limits)``, ``workspace_bytes(limits)``,
  ``warmup_shapes(limits)``, ``decode(...)``, ``prefill(...)``.
- ``torch_backend.py`` (the reference, any device), ``triton_backend.py`` (split-KV decode,
  the varlen prefill, the page copy), ``hopper_backend.py`` (the Gluon prefill on sm_90, the
  rest delegated to Triton).
- ``select.py``: :func:`select_backend` / :func:`choose_backend` (once, for an engine) and :func:`backend_for_call`
  (once per call of ``paged_decode`` / ``paged_prefill``).
- ``decode_plan.py``: how a Triton decode call tiles and splits its KV, and
  :func:`explain_decode`, which prints that plan and why.

Per-call thresholds (when the Hopper kernel or the page copy pays, how decode splits) are
plans inside a backend; the engine asks the backend, never the thresholds.
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
