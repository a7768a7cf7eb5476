"""The reference backend: :mod:`mini_paged_attn.ops.reference` in plain PyTorch, on any
device, every dtype, head size and variant. It is the specification the kernels are tested
against, so it refuses nothing the ops' checks let through; it takes no workspace, and its
warm-up is the decode steps of a few batch sizes (it compiles nothing). Unlike the kernels,
its calls read lengths, block ids and slots on the host and check them (a host sync).
"""

from __future__ import annotations

import torch

from .. import reference
from ..checks import (PagedShapes, check_cu_seqlens, check_paged_values,
                      check_seq_order_values)
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


def _check_cu_values(name: str, cu: torch.Tensor, total: int, total_name: str, exact: bool,
                     max_seqlen_name: str, max_seqlen: int) -> None:
    """Values of a cu_seqlens tensor (a host sync): 0, non-decreasing, ends at / within total,
    no length over its max_seqlen."""
    lens = check_cu_seqlens(name, cu, total, total_name, exact=exact)
    if lens.numel() and int(lens.max()) > max_seqlen:
        raise ValueError(f"{max_seqlen_name}: expected >= the longest sequence in {name} "
                         f"({int(lens.max())}), got {max_seqlen}")


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
        check_paged_values(shapes, block_tables, context_lens, cu_seqlens_q, query.shape[0],
                           causal=causal)
        out, lse = _into(query, out, return_lse, reference.paged_prefill_gather(
            query, key_cache, value_cache, block_tables, cu_seqlens_q, context_lens,
            causal=causal, scale=shapes.scale, k_scale=k_scale, v_scale=v_scale,
            window_size=window, softcap=softcap, sinks=sinks))
        return out, lse, None

    def check_varlen_lengths(self, cu_seqlens_q, cu_seqlens_k, total_q, total_k,
                             max_seqlen_q, max_seqlen_k) -> None:
        """The cumulative lengths' values (see :class:`~.base.AttentionBackend`): paged K/V
        (``total_k`` None) checks ``cu_seqlens_k`` first, contiguous K/V ``cu_seqlens_q``."""
        if total_k is None:
            last = int(cu_seqlens_k[-1]) if cu_seqlens_k.numel() else 0
            _check_cu_values("cu_seqlens_k", cu_seqlens_k, last, "its last value", True,
                             "max_seqlen_k", max_seqlen_k)
            _check_cu_values("cu_seqlens_q", cu_seqlens_q, total_q, "total_q", True,
                             "max_seqlen_q", max_seqlen_q)
            return
        _check_cu_values("cu_seqlens_q", cu_seqlens_q, total_q, "total_q", True,
                         "max_seqlen_q", max_seqlen_q)
        _check_cu_values("cu_seqlens_k", cu_seqlens_k, total_k, "total_k", False,
                         "max_seqlen_k", max_seqlen_k)

    def varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
               causal, scale, window, softcap, sinks, lse=None):
        """``flash_attn_varlen_func`` over contiguous K/V after its checks (arguments as
        documented there), the lengths' values checked here; ``lse``: None or a float32
        ``[total_q, num_q_heads]`` tensor (any strides) the log-sum-exp is written into.
        Returns ``(out, None)``: out ``[total_q, num_q_heads, head_size]`` in q's dtype,
        nothing to repeat."""
        self.check_varlen_lengths(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0],
                                  max_seqlen_q, max_seqlen_k)
        out, row_lse = reference.varlen_attention_contiguous(
            q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, scale=scale,
            window_size=window, softcap=softcap, sinks=sinks)
        if lse is not None:
            lse.copy_(row_lse)
        return out.to(q.dtype), None

    def check_store_slots(self, slot_mapping, num_slots) -> None:
        """Every slot in ``[-1, num_slots)`` (-1 skips), read on the host."""
        slots = slot_mapping.detach().to("cpu", torch.int64)
        bad = (slots < -1) | (slots >= num_slots)
        if bad.any():
            i = int(torch.nonzero(bad)[0])
            raise ValueError(f"slot_mapping: expected slots in [-1, {num_slots}) "
                             f"(-1 skips), got slot_mapping[{i}]={int(slots[i])}")

    def store_kv(self, key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale):
        """``store_kv`` after :func:`~mini_paged_attn.ops.dispatch.check_store_kv` (slots
        included). Returns None: nothing to repeat."""
        reference.store_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


TORCH = TorchBackend()

__all__ = ["TORCH", "TorchBackend"]
