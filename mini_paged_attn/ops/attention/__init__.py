"""Attention backends: objects that declare what they run and are chosen once.

- ``base.py``: :class:`AttentionSpec` (what a model needs), :class:`Capabilities` (what a
  backend declares: devices, GPU generation, dtypes, head sizes, windows, soft-cap, sinks,
  fp8 KV), :class:`AttentionLimits` (the engine's bounds) and :class:`AttentionBackend`, the
  interface: ``refusal(spec)`` (a model), ``call_refusal(spec)`` (one op call),
  ``decode_workspace(limits)``, ``workspace_bytes(limits)``, ``warmup_shapes(limits)``,
  and the ops: ``decode(...)``, ``prefill(...)``, ``varlen(...)`` (contiguous K/V),
  ``store_kv(...)``, with the host-side value checks only the reference makes
  (``check_varlen_lengths``, ``check_store_slots``).
- ``torch_backend.py`` (the reference, any device), ``triton_backend.py`` (split-KV decode,
  the varlen prefill over paged or contiguous K/V, the page copy, the K/V write),
  ``hopper_backend.py`` (the Gluon prefill on sm_90, for ``paged_prefill`` and
  ``flash_attn_varlen_func``; the rest delegated to Triton).
- ``select.py``: :func:`select_backend` / :func:`choose_backend` (once, for an engine) and
  :func:`backend_for_call` (once per call of ``paged_decode`` / ``paged_prefill`` /
  ``flash_attn_varlen_func`` / ``store_kv`` that misses the op's launch cache; the backend
  string the model layers pass is mapped to its object there).
- ``decode_plan.py``: how a Triton decode call tiles and splits its KV, and
  :func:`explain_decode`, which prints that plan and why.

What each refuses: the reference nothing the ops' checks let through; Triton a CPU outside
``TRITON_INTERPRET=1`` (every op) and, for an engine, head sizes over 256 (decode's bound,
which the decode launcher also checks per call); Hopper anything but fp16 / bf16, head size
128 on sm_90 with a Triton its Gluon kernel is tested on. A ``store_kv`` call is never the
Hopper backend's (its writes are Triton's), so it never asks the Gluon gate.

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
