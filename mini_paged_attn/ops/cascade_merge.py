"""Cascade attention's merge in one launch: each grouped row's prefix part folded into its
suffix part, in place.

The torch form of the same merge (:func:`~.merge.merge_attention_states` on gathered rows,
then a scatter back) is some fifteen small launches; its host time, not the GPU's, bounded an
eager cascade call (on an H200 ~680 us a call, where the GPU's work took ~230 us). Here one
program per (grouped row, KV head) reads the prefix part in its packed layout (rows ``n * gs +
j``, KV head ``k``: what the prefix's prefill wrote), the suffix part of query heads ``k * gs +
j``, and writes the merged rows over the suffix part.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.args import next_pow2


@triton.jit
def _cascade_merge_kernel(
    prefix_out_ptr, prefix_lse_ptr, out_ptr, lse_ptr, group_tokens_ptr,
    stride_po_row, stride_po_head, stride_pl_row, stride_pl_head,
    stride_o_row, stride_o_head, stride_l_row, stride_l_head,
    GROUP_SIZE: tl.constexpr, GROUP_PADDED: tl.constexpr, HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
):
    n = tl.program_id(0)            # grouped row
    kv_head = tl.program_id(1)
    row = tl.load(group_tokens_ptr + n).to(tl.int64)
    j = tl.arange(0, GROUP_PADDED)                    # [GROUP_PADDED] query head in the group
    d = tl.arange(0, HEAD_SIZE_PADDED)                # [HEAD_SIZE_PADDED]
    head_ok = j < GROUP_SIZE
    tile_ok = head_ok[:, None] & (d < HEAD_SIZE)[None, :]
    packed = n.to(tl.int64) * GROUP_SIZE + j          # [GROUP_PADDED] the prefix's rows
    q_head = kv_head * GROUP_SIZE + j                 # [GROUP_PADDED] the suffix's heads

    lse_a = tl.load(prefix_lse_ptr + packed * stride_pl_row + kv_head * stride_pl_head,
                    mask=head_ok, other=float("-inf"))
    lse_b = tl.load(lse_ptr + row * stride_l_row + q_head * stride_l_head,
                    mask=head_ok, other=float("-inf"))
    # Shift by the larger lse; a row empty on both sides shifts by 0 (-inf - -inf is NaN).
    m = tl.maximum(lse_a, lse_b)
    m = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp(lse_a - m)                           # [GROUP_PADDED], 0 for an empty side
    w_b = tl.exp(lse_b - m)
    total = w_a + w_b
    safe = tl.where(total > 0, total, 1.0)

    a_ptrs = (prefix_out_ptr + packed[:, None] * stride_po_row + kv_head * stride_po_head
              + d[None, :])
    b_ptrs = out_ptr + row * stride_o_row + q_head[:, None] * stride_o_head + d[None, :]
    out_a = tl.load(a_ptrs, mask=tile_ok, other=0.0).to(tl.float32)   # [GROUP_PADDED, D]
    out_b = tl.load(b_ptrs, mask=tile_ok, other=0.0).to(tl.float32)   # [GROUP_PADDED, D]
    # Select, not multiply: an empty side's output may be NaN, and 0 * NaN is NaN.
    merged = (tl.where((w_a > 0)[:, None], out_a * (w_a / safe)[:, None], 0.0)
              + tl.where((w_b > 0)[:, None], out_b * (w_b / safe)[:, None], 0.0))
    tl.store(b_ptrs, merged.to(out_ptr.dtype.element_ty), mask=tile_ok)
    tl.store(lse_ptr + row * stride_l_row + q_head * stride_l_head, m + tl.log(total),
             mask=head_ok)


def merge_prefix_into(prefix_out: torch.Tensor, prefix_lse: torch.Tensor, out: torch.Tensor,
                      lse: torch.Tensor, group_tokens: torch.Tensor) -> None:
    """Fold the prefix part of each grouped row into ``out`` / ``lse`` (the suffix part), in
    place; arguments checked by the caller (:func:`~.cascade.cascade_attention`).

    Args:
        prefix_out: ``[num_grouped_tokens * gs, num_kv_heads, head_size]``, last dim
            contiguous: row ``n * gs + j`` is query head ``k * gs + j`` of query row
            ``group_tokens[n]``.
        prefix_lse: float32 ``[num_grouped_tokens * gs, num_kv_heads]``.
        out: ``[total_q, num_q_heads, head_size]`` (prefix_out's dtype), last dim contiguous.
        lse: float32 ``[total_q, num_q_heads]``: the merged lse on return, for grouped rows.
        group_tokens: int32 ``[num_grouped_tokens]``, distinct rows of ``out``.
    """
    n = group_tokens.shape[0]
    num_kv_heads, head_size = prefix_out.shape[1], prefix_out.shape[2]
    gs = out.shape[1] // num_kv_heads
    if n == 0:
        return
    _cascade_merge_kernel[(n, num_kv_heads)](
        prefix_out, prefix_lse, out, lse, group_tokens,
        prefix_out.stride(0), prefix_out.stride(1), prefix_lse.stride(0), prefix_lse.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        GROUP_SIZE=gs, GROUP_PADDED=max(2, next_pow2(gs)), HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=max(16, next_pow2(head_size)), num_warps=2 if head_size <= 64 else 4)


__all__ = ["merge_prefix_into"]
