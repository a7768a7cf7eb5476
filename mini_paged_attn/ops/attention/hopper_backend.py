"""The Hopper backend: the Triton backend plus the Gluon prefill of
:mod:`mini_paged_attn.ops.prefill_hopper` on an H100 / H200 (sm_90).

It is chosen where :func:`~mini_paged_attn.ops.prefill_plan.hopper_prefill_runs_on` holds
for the model (the device, fp16 / bf16, head_size 128, Triton's Gluon present); that
predicate is the one gate of the Gluon kernel. A call then still takes the Gluon kernel only
where its shapes pay, it has no variant and (paged) the kernel copies the cache's blocks as
boxes (:func:`~mini_paged_attn.ops.prefill_plan.hopper_prefill_usable`, a per-call plan;
a cache of other blocks may still reach it through the page copy of
:mod:`mini_paged_attn.ops.prefill_gather`); every other call, and every decode call, runs
the Triton backend's kernels.
"""

from __future__ import annotations

import torch

from ..backend import triton_available
from ..prefill_plan import hopper_prefill_runs_on
from .base import AttentionSpec, Capabilities
from .triton_backend import TritonBackend

CAPABILITIES = Capabilities(
    device_types=("cuda",), compute_capability=(9, 0),
    dtypes=(torch.float16, torch.bfloat16), head_sizes=(128,))


class HopperBackend(TritonBackend):
    """Gluon prefill on sm_90; the rest delegated to :class:`TritonBackend`."""

    name = "hopper"
    _hopper_prefill = True

    @property
    def capabilities(self) -> Capabilities:
        return CAPABILITIES

    def refusal(self, spec: AttentionSpec) -> str | None:
        if not triton_available():
            return "triton is not importable"
        reason = CAPABILITIES.refusal(spec)
        if reason is None and not hopper_prefill_runs_on(spec.device, spec.head_size,
                                                         spec.dtype):
            reason = "the Gluon prefill does not run with this Triton"
        return reason


HOPPER = HopperBackend()

__all__ = ["HOPPER", "HopperBackend"]
