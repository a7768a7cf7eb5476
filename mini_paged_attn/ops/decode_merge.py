"""The split-KV merge of paged decode: the splits' normalised partial outputs combined by
their log-sum-exp (the online-softmax merge), in one of two places.

- A second, tiny launch (:func:`prepare_merge`): one program per (sequence, query head), with
  its own launch options. Under CUDA graphs only GPU time counts, and there a merge inside
  the decode kernel measured slower at batch 1 (docs/performance-notes.md, "The kernel's
  tiles, merge and splits", with the two compared at eager calls).
- Inside the decode kernel (:func:`merge_group_splits`, ``FUSED_MERGE``): the program that
  finishes a (sequence, KV head) last merges that group's query heads. One launch instead of
  two saves the host the second launch (eager calls are host-bound at small batches).

Either way this module is the one place the workspace's partials are read back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.args import next_pow2
from .launch import PreparedLaunch

MERGE_VALUES_PER_THREAD = 64
"""Partial-output values one thread holds per chunk of a fused merge (see :func:`merge_chunk`).
Compiled for sm_90 ahead of time on a CPU (split tiles, 4 warps): at GQA 4,
head 128, chunks of 16 splits keep the kernel at its unfused 96 registers; chunks of all 32
(one round trip at batch 1) took 165. None spills."""


def merge_rows(group_size: int) -> int:
    """Rows of a fused merge's tiles: the group's query heads padded to a power of two >= 2."""
    return max(2, next_pow2(group_size))


def merge_chunk(group_size: int, head_size_padded: int, num_splits: int,
                num_warps: int) -> int:
    """Splits a fused merge reads at once: all of them where ``rows x chunk x head_size``
    float32 values fit :data:`MERGE_VALUES_PER_THREAD` a thread, else fewer (a power of two,
    1..32), so the merge adds little register pressure to the decode kernel it runs in."""
    budget = MERGE_VALUES_PER_THREAD * 32 * num_warps // (merge_rows(group_size)
                                                         * head_size_padded)
    chunk = 1 << max(0, budget.bit_length() - 1)      # largest power of two <= budget
    return max(1, min(chunk, 32, next_pow2(num_splits)))


@triton.jit
def merge_group_splits(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, seq, first_head, num_splits,
    stride_po_seq, stride_po_head, stride_po_split, stride_pl_seq, stride_pl_head,
    stride_o_seq, stride_o_head, stride_o_dim, stride_lse_seq, stride_lse_head,
    GROUP_SIZE: tl.constexpr, ROWS: tl.constexpr, HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr, CHUNK: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    """Merge the ``num_splits`` partials of query heads ``first_head .. + GROUP_SIZE`` of one
    sequence into ``out`` (its dtype) and, with WRITE_LSE, ``lse`` (float32); strides as in
    :func:`_merge_splits_kernel`. An online merge over chunks of ``CHUNK`` splits: each
    chunk's lse and partial outputs load together.

    Called by a decode program after every split of its group has stored its partials (an
    acquire on the group's counter orders those stores first). The partials are read with
    ``.cg`` (from L2, not the SM's L1): other SMs wrote them during this launch.
    """
    rows = tl.arange(0, ROWS)                                        # [ROWS]
    row_valid = rows < GROUP_SIZE
    heads = first_head + rows
    chunk = tl.arange(0, CHUNK)                                      # [CHUNK]
    dims = tl.arange(0, HEAD_SIZE_PADDED)                            # [HEAD_SIZE_PADDED]
    dim_valid = dims < HEAD_SIZE
    lse_rows = part_lse_ptr + seq.to(tl.int64) * stride_pl_seq + heads * stride_pl_head
    out_rows = part_out_ptr + seq.to(tl.int64) * stride_po_seq + heads * stride_po_head

    m = tl.full([ROWS], float("-inf"), tl.float32)                   # running max of lse
    total = tl.zeros([ROWS], tl.float32)                             # running sum of weights
    acc = tl.zeros([ROWS, HEAD_SIZE_PADDED], tl.float32)
    for s0 in range(0, num_splits, CHUNK):
        splits = s0 + chunk
        valid = row_valid[:, None] & (splits < num_splits)[None, :]  # [ROWS, CHUNK]
        lse = tl.load(lse_rows[:, None] + splits[None, :], mask=valid, other=float("-inf"),
                      cache_modifier=".cg")                          # [ROWS, CHUNK]
        o_valid = valid[:, :, None] & dim_valid[None, None, :]
        # o: [ROWS, CHUNK, HEAD_SIZE_PADDED]
        o = tl.load(out_rows[:, None, None] + splits[None, :, None] * stride_po_split
                    + dims[None, None, :], mask=o_valid, other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, axis=1))                   # [ROWS]
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)         # no keys yet: weights 0
        rescale = tl.exp(m - m_ref)                                  # [ROWS]
        w = tl.exp(lse - m_ref[:, None])                             # [ROWS, CHUNK]
        total = total * rescale + tl.sum(w, axis=1)
        acc = acc * rescale[:, None] + tl.sum(w[:, :, None] * o, axis=1)
        m = m_new
    has_keys = total > 0.0                                           # False: length 0
    total_safe = tl.where(has_keys, total, 1.0)
    merged = acc / total_safe[:, None]                               # [ROWS, HEAD_SIZE_PADDED]
    o_ptrs = (out_ptr + seq.to(tl.int64) * stride_o_seq + heads[:, None] * stride_o_head
              + dims[None, :] * stride_o_dim)
    tl.store(o_ptrs, merged.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & dim_valid[None, :])
    if WRITE_LSE:
        lse_out = tl.where(has_keys, m + tl.log(total_safe), float("-inf"))
        tl.store(lse_ptr + seq.to(tl.int64) * stride_lse_seq + heads * stride_lse_head,
                 lse_out, mask=row_valid)


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
    # is pure latency, which more warps and an in-kernel wait of a programmatic dependent
    # launch only add to (docs/performance-notes.md, "Figures behind the code's rules").
    # Wider heads take 2 warps, to keep a chunk of 32 float32 partials at <= 128 values a
    # thread.
    merge = PreparedLaunch(_merge_splits_kernel, (h, n), (
        part_out, part_lse, out, lse_arg, splits,
        po_seq, po_head, po_split, pl_seq, pl_head,
        os_[0], os_[1], os_[2], lse_seq, lse_head),
        dict(HEAD_SIZE=d, HEAD_SIZE_PADDED=head_size_padded,
             SPLIT_TILE=min(32, max(16, triton.next_power_of_2(splits))),
             WRITE_LSE=lse is not None, num_warps=1 if head_size_padded <= 128 else 2))
    return merge


__all__ = ["merge_chunk", "merge_group_splits", "merge_rows", "prepare_merge"]
