"""The Triton backend: split-KV decode (kernel, merge), the varlen prefill kernel over paged
or contiguous K/V and the page copy in front of it (:mod:`mini_paged_attn.ops.prefill_gather`),
and the K/V write (:mod:`mini_paged_attn.ops.kv_write`).

It owns what the engine used to know about it: the decode workspace (a float32 scratch for
split-KV partials, :data:`WORKSPACE_SPLITS_PER_SEQ` splits a sequence), the memory the page
copy may take beyond a profiled step, and the warm-up batches whose shapes cross its
kernels' thresholds. The kernel modules import ``triton``, so they are imported where a call
needs them; this module imports without it.
"""

from __future__ import annotations

import os

import torch

from ..backend import triton_available
from ..checks import PagedShapes
from .base import AttentionBackend, AttentionLimits, AttentionSpec, Capabilities, WarmupBatch

MAX_HEAD_SIZE = 256
"""The largest head size the decode kernel takes (its tiles hold a head in registers)."""

WORKSPACE_SPLITS_PER_SEQ = 16
"""Split-KV partial results the engine's decode workspace holds per sequence (a smaller
batch's calls may take more: the splits a call gets are what the workspace holds for it)."""

# Warm-up query lengths. Triton specialises integer arguments equal to 1 or divisible by 16;
# the prefill tiles follow the mean query length (prefill_plan.SHORT_QUERY_AVG = 128 splits
# decode-heavy from prompt tiles; the Hopper kernel takes over from HOPPER_MIN_AVG_Q_LEN = 128),
# and a step of long queries over an fp8 cache copies its pages first (prefill_gather: over
# GATHER_MIN_Q_LEN = 256 queries and GATHER_MIN_ROWS = 1024 rows a sequence, so 1040 crosses
# it for any number of query heads a KV head). tests/ops/test_attention_backends.py checks
# these lengths against those thresholds.
WARMUP_Q_LENS = (1, 4, 200, 1040)
WARMUP_NUM_SEQS = (1, 2, 16)


def _interpreted() -> bool:
    """Whether Triton runs its kernels in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _device_types() -> tuple[str, ...]:
    return ("cuda", "cpu") if _interpreted() else ("cuda",)


def _explained(capabilities: Capabilities, spec: AttentionSpec) -> str | None:
    """``capabilities.refusal(spec)``, with why a CPU is refused and whether Triton imports."""
    if not triton_available():
        return "triton is not importable"
    reason = capabilities.refusal(spec)
    if reason is not None and spec.device.type == "cpu":
        reason += " (a CPU runs Triton only under TRITON_INTERPRET=1)"
    return reason


class TritonBackend(AttentionBackend):
    """The Triton kernels: CUDA (or the CPU interpreter), fp16 / bf16 / fp32, head sizes up
    to :data:`MAX_HEAD_SIZE`, every variant and an fp8 cache."""

    name = "triton"
    op_backend = "triton"

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(device_types=_device_types(), max_head_size=MAX_HEAD_SIZE)

    @property
    def call_capabilities(self) -> Capabilities:
        """One op call's: the device. The prefill, varlen and store kernels take any head
        size; the decode launcher checks its own bound, :data:`MAX_HEAD_SIZE`."""
        return Capabilities(device_types=_device_types())

    def refusal(self, spec: AttentionSpec) -> str | None:
        return _explained(self.capabilities, spec)

    def call_refusal(self, spec: AttentionSpec) -> str | None:
        return _explained(self.call_capabilities, spec)

    # ---- engine-facing ---------------------------------------------------------------------
    def decode_workspace(self, limits: AttentionLimits) -> torch.Tensor:
        from ..decode import workspace_size
        size = workspace_size(limits.max_num_seqs, limits.num_q_heads, limits.spec.head_size,
                              WORKSPACE_SPLITS_PER_SEQ)
        return torch.empty(size, dtype=torch.float32, device=limits.spec.device)

    def workspace_bytes(self, limits: AttentionLimits) -> int:
        """The largest page copy a step may allocate (0 where it never copies)."""
        from ..prefill_gather import gather_reserve_bytes
        spec = limits.spec
        return gather_reserve_bytes(
            spec.device, max_num_seqs=limits.max_num_seqs, width=limits.table_width,
            block_size=spec.block_size, num_kv_heads=limits.num_kv_heads,
            head_size=spec.head_size, dtype=spec.dtype, cache_dtype=spec.kv_dtype)

    def warmup_shapes(self, limits: AttentionLimits) -> list[WarmupBatch]:
        """Batches of 1, 2 and 16 sequences of :data:`WARMUP_Q_LENS` tokens each (within
        the step's token budget and the model's length), prompts both over their new K/V and
        through the block tables."""
        batches = []
        for num_seqs in WARMUP_NUM_SEQS:
            for q_len in WARMUP_Q_LENS:
                if (num_seqs * q_len > limits.max_num_batched_tokens
                        or q_len > limits.max_model_len):
                    continue
                for no_prefix in (True, False) if q_len > 1 else (True,):
                    batches.append(WarmupBatch(num_seqs, q_len, no_prefix))
        return batches

    # ---- op-facing (after the dispatcher's checks) ------------------------------------------
    def decode(self, query, key_cache, value_cache, block_tables, context_lens,
               shapes: PagedShapes, *, out, return_lse, num_splits, workspace, explain,
               k_scale, v_scale, window, softcap, sinks, seq_order, cacheable, capturing):
        """``paged_decode`` (arguments as documented there); ``cacheable``: the dispatcher
        keeps the returned run for repeats; ``capturing``: under CUDA-graph capture (None:
        not known yet). Returns ``(out, lse or None, run or None)``."""
        from ..decode import triton_paged_decode
        from . import decode_plan
        from .base import outputs
        out, lse = outputs(query, out, return_lse, shapes.num_seqs, shapes.num_q_heads)
        if capturing is None:
            capturing = query.is_cuda and torch.cuda.is_current_stream_capturing()
        # Calls without a workspace merge the splits in the decode kernel (FUSED_MERGE); a
        # workspace, what CUDA-graph capture takes, keeps the merge kernel, so the eager
        # warm-up before a capture compiles the kernels the capture uses.
        run = triton_paged_decode(query, key_cache, value_cache, block_tables, context_lens,
                                  shapes, out=out, lse=lse, num_splits=num_splits,
                                  workspace=workspace, explain=explain, k_scale=k_scale,
                                  v_scale=v_scale, window_size=window, softcap=softcap,
                                  sinks=sinks, seq_order=seq_order,
                                  fused_merge=decode_plan.FUSED_MERGE and workspace is None,
                                  keep_scratch=cacheable and not capturing)
        return out, lse, run

    # The Hopper backend sets it: whether a call may take the Gluon prefill.
    _hopper_prefill = False

    def prefill(self, query, key_cache, value_cache, block_tables, cu_seqlens_q, context_lens,
                shapes: PagedShapes, *, causal, out, return_lse, max_seqlen_q, k_scale,
                v_scale, window, softcap, sinks):
        """``paged_prefill`` (arguments as documented there). Returns ``(out, lse or None,
        launch or None)``."""
        from ..prefill import triton_paged_prefill
        from .base import outputs
        out, lse = outputs(query, out, return_lse, query.shape[0], shapes.num_q_heads)
        launch = triton_paged_prefill(query, key_cache, value_cache, block_tables,
                                      cu_seqlens_q, context_lens, shapes, causal=causal,
                                      out=out, lse=lse, max_seqlen_q=max_seqlen_q,
                                      k_scale=k_scale, v_scale=v_scale, window_size=window,
                                      softcap=softcap, sinks=sinks,
                                      hopper=self._hopper_prefill)
        return out, lse, launch

    def varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
               causal, scale, window, softcap, sinks, lse=None):
        """``flash_attn_varlen_func`` over contiguous K/V (arguments as documented there;
        last dims contiguous; ``lse`` None or float32 ``[total_q, num_q_heads]``, any
        strides, written). Returns ``(out, launch or None)``: out ``[total_q,
        num_q_heads, head_size]`` in q's dtype, contiguous."""
        from ..prefill import triton_varlen_contiguous
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        launch = triton_varlen_contiguous(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                          max_seqlen_k, causal=causal, scale=scale, out=out,
                                          lse=lse, window_size=window, softcap=softcap,
                                          sinks=sinks, hopper=self._hopper_prefill)
        return out, launch

    def store_kv(self, key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale):
        """``store_kv`` after :func:`~mini_paged_attn.ops.dispatch.check_store_kv`; a slot
        past the pool is skipped (the kernel reads no value on the host). Returns the launch
        or None."""
        from ..kv_write import triton_store_kv
        return triton_store_kv(key, value, key_cache, value_cache, slot_mapping, k_scale,
                               v_scale)


TRITON = TritonBackend()

__all__ = ["MAX_HEAD_SIZE", "TRITON", "TritonBackend", "WARMUP_NUM_SEQS", "WARMUP_Q_LENS",
           "WORKSPACE_SPLITS_PER_SEQ"]
