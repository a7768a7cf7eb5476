"""Which attention backend runs: chosen once for an engine (:func:`select_backend`), once per
call for the public ops (:func:`backend_for_call`).

Preference, among the backends a ``requested`` name allows: Hopper (sm_90), then Triton,
then the torch reference; "auto" takes the Triton backends on CUDA where Triton imports and
the reference elsewhere, the rule of :func:`~mini_paged_attn.ops.backend.resolve_backend`.
A backend never stands in for another silently: where none of the allowed ones fits, the
ValueError names each and why it refused.
"""

from __future__ import annotations

import torch

from ..backend import BACKENDS, resolve_backend
from ..prefill_plan import hopper_prefill_runs_on
from .base import AttentionBackend, AttentionSpec
from .hopper_backend import HOPPER
from .torch_backend import TORCH
from .triton_backend import TRITON

BACKEND_NAMES = {b.name: b for b in (HOPPER, TRITON, TORCH)}


def _candidates(requested: str, device: torch.device) -> tuple[AttentionBackend, ...]:
    if requested not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {requested!r}")
    if requested == "torch":
        return (TORCH,)
    if requested == "triton" or resolve_backend("auto", device) == "triton":
        return (HOPPER, TRITON)
    return (TORCH,)


def select_backend(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
                   head_size: int, *, window: bool = False, softcap: bool = False,
                   sinks: bool = False, block_size: int = 16,
                   requested: str = "auto") -> AttentionBackend:
    """The backend an engine runs its attention with, chosen once.

    Args:
        device, dtype, kv_dtype, head_size, block_size, window, softcap, sinks: the
            model's attention, as :class:`~.base.AttentionSpec` describes them.
        requested: "auto" | "torch" | "triton", the engine's ``backend`` (Hopper is a
            Triton backend).

    Returns:
        The first backend of the preference order (module doc) that takes the spec.

    Raises:
        ValueError: a bad argument, or no allowed backend fits (each one's reason given).
    """
    return choose_backend(AttentionSpec(torch.device(device), dtype, kv_dtype, head_size,
                                        block_size, window, softcap, sinks), requested)


def choose_backend(spec: AttentionSpec, requested: str = "auto") -> AttentionBackend:
    """:func:`select_backend` for a spec already made (the engine keeps it for its limits)."""
    reasons = []
    for backend in _candidates(requested, spec.device):
        reason = backend.refusal(spec)
        if reason is None:
            return backend
        reasons.append(f"{backend.name}: {reason}")
    raise ValueError(f"backend: no attention backend for {requested!r} runs {spec}: "
                     + "; ".join(reasons))


def backend_for_call(backend: str, device: torch.device, head_size: int,
                     dtype: torch.dtype, *, prefill: bool = True) -> AttentionBackend:
    """The backend of one public op call (arguments already checked): the reference, or
    the Triton backend, or for a prefill on sm_90 the Hopper one, by :func:`resolve_backend`
    and the Gluon kernel's device-side predicate. Runs on a call that missed the op's launch
    cache only.

    Args:
        backend: the op's ``backend=`` ("auto" | "torch" | "triton").
        device, head_size, dtype: the call's queries (``paged_decode`` / ``paged_prefill``
            / ``flash_attn_varlen_func``) or keys (``store_kv``).
        prefill: whether the call attends over several query rows (``paged_prefill``,
            ``flash_attn_varlen_func``), the one kind the Hopper backend runs differently
            from Triton; a decode or a ``store_kv`` call never asks its gate.

    Raises:
        ValueError: ``backend`` is not a backend name, names Triton where it does not
            import, or the backend it picks refuses the call
            (:meth:`~.base.AttentionBackend.call_refusal`, e.g. Triton on a CPU outside the
            interpreter), before anything is written.
    """
    if resolve_backend(backend, device) == "torch":
        return TORCH
    chosen = (HOPPER if prefill and hopper_prefill_runs_on(device, head_size, dtype)
              else TRITON)
    reason = chosen.call_refusal(AttentionSpec(device, dtype, dtype, head_size))
    if reason is not None:
        raise ValueError(f"backend: {chosen.name} {reason}")
    return chosen


__all__ = ["BACKEND_NAMES", "backend_for_call", "choose_backend", "select_backend"]
