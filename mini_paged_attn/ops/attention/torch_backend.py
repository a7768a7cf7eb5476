"""The reference backend: :mod:`mini_paged_attn.ops.reference` in plain PyTorch, on any
device, every dtype, head size and variant. It is the specification the kernels are tested
against, so it refuses nothing the ops' checks let through; it takes no workspace, and its
warm-up is the decode steps of a few batch sizes (it compiles nothing).
"""

from __future__ import annotations

import torch

from .. import reference
from ..checks import PagedShapes, check_paged_values, check_seq_order_values
from .base import AttentionBackend, AttentionLimits, Capabilities, WarmupBatch, outputs


def _into(query: torch.Tensor, out: torch.Tensor | None, return_lse: bool,
          result: tuple[torch.Tensor, torch.Tensor]):
    """The reference's float32 (out ``[rows, num_q_heads, head_size]``, lse ``[rows,
    num_q_heads]``) written into the caller's ``out`` (or a new tensor in the query's dtype)."""
    o, l = result
    out, lse = outputs(query, out, return_lse, o.shape[0], o.shape[1])
    out.copy_(o)
    if lse is not None:
        lse.copy_(l)
    return out, lse


class TorchBackend(AttentionBackend):
    """The reference (any device). Its calls read lengths and block ids on the host to check
    them, which the kernels never do."""

    name = "torch"
    op_backend = "torch"
    capabilities = Capabilities()

    def warmup_shapes(self, limits: AttentionLimits) -> list[WarmupBatch]:
        """Decode steps of 1, 2 and 16 sequences (within the step's token budget): they load
        the device kernels the gather and the softmax use."""
        return [WarmupBatch(n, 1) for n in (1, 2, 16) if n <= limits.max_num_batched_tokens]

    def decode(self, query, key_cache, value_cache, block_tables, context_lens,
               shapes: PagedShapes, *, out, return_lse, num_splits, workspace, explain,
               k_scale, v_scale, window, softcap, sinks, seq_order, cacheable, capturing):
        """``paged_decode`` after the dispatcher's checks (arguments as documented there).
        Returns ``(out, lse or None, None)``: nothing to repeat."""
        del explain, cacheable, capturing
        if num_splits is not None or workspace is not None:
            raise ValueError("num_splits/workspace: only the triton backend takes them, "
                             f"got num_splits={num_splits}, workspace given={workspace is not None}")
        check_paged_values(shapes, block_tables, context_lens)
        if seq_order is not None:
            check_seq_order_values(seq_order)
        out, lse = _into(query, out, return_lse, reference.paged_decode_gather(
            query, key_cache, value_cache, block_tables, context_lens, scale=shapes.scale,
            k_scale=k_scale, v_scale=v_scale, window_size=window, softcap=softcap,
            sinks=sinks))
        return out, lse, None

    def prefill(self, query, key_cache, value_cache, block_tables, cu_seqlens_q, context_lens,
                shapes: PagedShapes, *, causal, out, return_lse, max_seqlen_q, k_scale,
                v_scale, window, softcap, sinks):
        """``paged_prefill`` after the dispatcher's checks. Returns ``(out, lse or None,
        None)``."""
        del max_seqlen_q
        check_paged_values(shapes, block_tables, context_lens, cu_seqlens_q, query.shape[0])
        out, lse = _into(query, out, return_lse, reference.paged_prefill_gather(
            query, key_cache, value_cache, block_tables, cu_seqlens_q, context_lens,
            causal=causal, scale=shapes.scale, k_scale=k_scale, v_scale=v_scale,
            window_size=window, softcap=softcap, sinks=sinks))
        return out, lse, None


TORCH = TorchBackend()

__all__ = ["TORCH", "TorchBackend"]
