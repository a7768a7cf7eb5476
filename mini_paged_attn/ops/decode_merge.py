"""The split-KV merge of paged decode: one program per (sequence, query head) combines the
splits' normalised partial outputs by their log-sum-exp (the online-softmax merge).

Separate from the decode kernel (:mod:`.decode_kernel`): a second, tiny launch with its own
launch options, and the one place the workspace's partials are read back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import PreparedLaunch


@triton.jit
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, num_splits,
    stride_po_seq, stride_po_head, stride_po_split,
    stride_pl_seq, stride_pl_head,
    stride_o_seq, stride_o_head, stride_o_dim, stride_lse_seq, stride_lse_head,
    HEAD_SIZE: tl.constexpr, HEAD_SIZE_PADDED: tl.constexpr, SPLIT_TILE: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    """Grid ``(num_q_heads, num_seqs)``: out = sum_s w_s o_s / sum_s w_s, w_s = exp(lse_s - max).

    An online merge over chunks of ``SPLIT_TILE`` splits, so the first chunk's partial outputs
    and lse are loaded together, without waiting for a global max (one round trip for up to
    ``SPLIT_TILE`` splits).
    """
    head = tl.program_id(0)
    seq = tl.program_id(1)
    lse_row = part_lse_ptr + seq.to(tl.int64) * stride_pl_seq + head * stride_pl_head
    out_row = part_out_ptr + seq.to(tl.int64) * stride_po_seq + head * stride_po_head
    dims = tl.arange(0, HEAD_SIZE_PADDED)                           # [HEAD_SIZE_PADDED]
    dim_valid = dims < HEAD_SIZE

    m = tl.full([1], float("-inf"), tl.float32)                     # running max of lse
    total = tl.zeros([1], tl.float32)                               # running sum of weights
    acc = tl.zeros([HEAD_SIZE_PADDED], tl.float32)
    for s0 in range(0, num_splits, SPLIT_TILE):
        chunk = s0 + tl.arange(0, SPLIT_TILE)                       # [SPLIT_TILE]
        chunk_valid = chunk < num_splits
        lse = tl.load(lse_row + chunk, mask=chunk_valid, other=float("-inf"))
        o = tl.load(out_row + chunk[:, None] * stride_po_split + dims[None, :],
                    mask=chunk_valid[:, None] & dim_valid[None, :], other=0.0)
        # o: [SPLIT_TILE, HEAD_SIZE_PADDED]
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)      # no keys yet: weights 0
        rescale = tl.exp(m - m_ref)
        w = tl.exp(lse - m_ref)                                     # [SPLIT_TILE]
        total = total * rescale + tl.sum(w, axis=0)
        acc = acc * rescale + tl.sum(w[:, None] * o, axis=0)
        m = m_new
    has_keys = total > 0.0                                          # False: length 0
    total_safe = tl.where(has_keys, total, 1.0)
    merged = acc / total_safe
    tl.store(out_ptr + seq.to(tl.int64) * stride_o_seq + head * stride_o_head
             + dims * stride_o_dim, merged.to(out_ptr.dtype.element_ty), mask=dim_valid)
    if WRITE_LSE:
        lse_out = tl.where(has_keys, m + tl.log(total_safe), float("-inf"))
        offs = tl.zeros([1], tl.int32)
        tl.store(lse_ptr + seq.to(tl.int64) * stride_lse_seq + head * stride_lse_head + offs,
                 lse_out)


def prepare_merge(part_out: torch.Tensor, part_lse: torch.Tensor,
                  part_strides: tuple[int, int, int, int, int], num_splits: int,
                  out: torch.Tensor, lse: torch.Tensor | None, *, num_seqs: int,
                  num_q_heads: int, head_size: int, head_size_padded: int) -> PreparedLaunch:
    """The merge launch of a split decode.

    Args:
        part_out: float32 partial outputs ``[num_seqs, num_q_heads, num_splits, head_size]``
            (normalised), at the front of the workspace.
        part_lse: float32 partial lse ``[num_seqs, num_q_heads, num_splits]`` (natural log).
        part_strides: ``(seq, head, split)`` strides of ``part_out`` then ``(seq, head)`` of
            ``part_lse`` (split stride 1), in elements.
        out: ``[num_seqs, num_q_heads, head_size]`` in the query's dtype, written.
        lse: float32 ``[num_seqs, num_q_heads]`` or None, written when given.
    """
    po_seq, po_head, po_split, pl_seq, pl_head = part_strides
    lse_arg = lse if lse is not None else out  # never written when lse is None
    lse_seq, lse_head = lse.stride() if lse is not None else (0, 0)
    os_ = out.stride()
    h, n, d, splits = num_q_heads, num_seqs, head_size, num_splits
    # One warp per (sequence, query head), launched plainly: at batch 1 (32 programs) the merge
    # is pure latency. Under CUDA graphs on an H100 (head_size 128), 1 warp was 0.6-0.7 us
    # faster than 4, and a plain launch 0.5 us faster than a programmatic dependent launch
    # (PDL) waiting in-kernel. Wider heads take 2 warps, to keep a chunk of 32 float32 partials
    # at <= 128 values a thread.
    merge = PreparedLaunch(_merge_splits_kernel, (h, n), (
        part_out, part_lse, out, lse_arg, splits,
        po_seq, po_head, po_split, pl_seq, pl_head,
        os_[0], os_[1], os_[2], lse_seq, lse_head),
        dict(HEAD_SIZE=d, HEAD_SIZE_PADDED=head_size_padded,
             SPLIT_TILE=min(32, max(16, triton.next_power_of_2(splits))),
             WRITE_LSE=lse is not None, num_warps=1 if head_size_padded <= 128 else 2))
    return merge


__all__ = ["prepare_merge"]
