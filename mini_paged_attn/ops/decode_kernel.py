"""The Triton paged decode kernel: one pass over each sequence's paged K/V, split-KV.

Kept apart from its launcher (:mod:`.decode`, which plans tiles and splits and owns the
workspace) so the device code reads on its own; the merge of the splits is :mod:`.decode_merge`.

``_paged_decode_kernel``: one program per (sequence, KV head, split) serves all the query heads
of that KV head (the GQA group, padded to ``BLOCK_H >= 16`` rows so QK^T and PV run on tensor
cores), so every K/V tile is read from HBM once. The program walks its share of the sequence in
tiles of ``BLOCK_N`` tokens; ``BLOCK_N`` does not depend on the cache's ``block_size``: each tile
looks its tokens' physical blocks up in the block table (one lookup when the tile lies inside
one block, one per token otherwise). The softmax is online, in float32, with ``exp2`` (log2(e)
is folded into the scale). Cache addresses are computed in 64 bits (block id cast first), so
pools over 2^31 elements work.

An fp8 cache (:mod:`.kv_quant`) is read as fp8 (half the bytes) and converted right after the
load (exact: every e4m3 value is an fp16 / bf16 value). With 16-bit queries the dots run in
fp16 (``FP16_DOTS``): e4m3 -> fp16 is one instruction per pair on Hopper, e4m3 -> bf16 goes
through fp16 and fp32, and that conversion alone held decode at ~68% of copy bandwidth. A
bf16 query is rounded to fp16 for the dot (fp16 has more mantissa than bf16; values past
fp16's range, |q| > 65504, would overflow: attention queries do not come near it); the
softmax probabilities go to fp16 for the PV dot, accumulation stays float32. On a GPU, V is
read as int16 pairs of dims (``FP8_V``), so that its tile reaches the PV dot the way a 16-bit
one does (with the fp8 tiles of :data:`~.decode_tiles.FP8_TILES`, near the copy bandwidth;
BENCHMARKS.md, "FP8 KV cache").
The program's KV head has one ``k_scale`` and one ``v_scale``: the first is folded into the
softmax scale, the second multiplies the normalised output, instead of scaling every loaded
element.

Variants (:mod:`.variants`), each a constexpr switch so the default launch compiles as before:
a left window starts each sequence's tiles at the one holding its first visible key (tiles and
cache blocks wholly left of it are never read, so a windowed decode costs O(window), and the
splits share out only the window's tiles); soft-capping maps the scores through
:func:`soft_cap`; sinks start split 0's online softmax at ``m = sink, l = 1``, so the merged
denominator holds the sink exactly once and the lse includes it.

Fused merge (``FUSED_MERGE``, split launches only): after storing its partials, a program takes
a ticket from its (sequence, KV head)'s int32 counter; the one that draws the last ticket
merges the group's splits (:func:`~.decode_merge.merge_group_splits`) and sets the counter back
to 0, so the counters stay zero between launches (and across CUDA-graph replays) without a
memset. The ticket is an ``acq_rel`` atomic taken after a barrier: every thread's partial stores
are issued before it releases them, and the merging program acquires all the others'.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .decode_merge import merge_group_splits
from .pdl import wait_for_previous


@triton.jit
def soft_cap(s, cap):
    """``cap * tanh(s / cap)``, elementwise; ``s`` and ``cap`` in the same (log2) units.

    tanh through exp2 (``1 - 2 / (e^2x + 1)``), which the interpreter and every GPU have;
    the exponent is clamped at 64 (tanh is 1 in float32 long before), so nothing overflows,
    and it saturates to -1 as ``e^2x`` underflows to 0.
    """
    e2x = tl.exp2(tl.minimum((2.0 * 1.4426950408889634) * (s / cap), 64.0))
    return cap * (1.0 - 2.0 / (e2x + 1.0))


@triton.jit
def e4m3_pairs_to_fp16(x):
    """The two e4m3 values packed in each int16 of ``x`` (an fp8 tile read two dims at a time)
    as two fp16 tensors of x's shape: the low bytes' (even dims) and the high bytes' (odd
    dims), exact. Per pair of elements one ``prmt`` gathers the bytes of each half and one
    ``cvt.rn.f16x2.e4m3x2`` converts them (sm_89+; compiled GPUs only)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 lo, hi; .reg .b16 l0, l1, h0, h1; "
        "prmt.b32 lo, $2, 0, 0x0020; prmt.b32 hi, $2, 0, 0x0031; "
        "mov.b32 {l0, l1}, lo; mov.b32 {h0, h1}, hi; "
        "cvt.rn.f16x2.e4m3x2 $0, l0; cvt.rn.f16x2.e4m3x2 $1, h0; }",
        "=r,=r,r", [x], dtype=(tl.float16, tl.float16), is_pure=True, pack=2)


@triton.jit
def _paged_decode_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, k_scale_ptr, v_scale_ptr,
    block_tables_ptr, context_lens_ptr, seq_order_ptr, out_ptr, lse_ptr, sinks_ptr,
    merged_out_ptr, merged_lse_ptr, counters_ptr, scale_log2,
    window_left, softcap_log2, stride_k_scale, stride_v_scale,
    stride_q_seq, stride_q_head,
    stride_k_block, stride_k_token, stride_k_head,
    stride_v_block, stride_v_token, stride_v_head,
    stride_bt_seq,
    stride_o_seq, stride_o_head, stride_o_split, stride_o_dim,
    stride_lse_seq, stride_lse_head,
    stride_mo_seq, stride_mo_head, stride_mo_dim, stride_mlse_seq, stride_mlse_head,
    GROUP_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_SIZE_PADDED: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    SPLIT_KV: tl.constexpr, WRITE_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    K_SCALED: tl.constexpr, V_SCALED: tl.constexpr, FP16_DOTS: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    FUSED_MERGE: tl.constexpr, MERGE_ROWS: tl.constexpr, MERGE_CHUNK: tl.constexpr,
    FP8_V: tl.constexpr, ORDERED: tl.constexpr, PDL: tl.constexpr,
):
    """Grid ``(num_kv_heads, num_splits, num_seqs)``: the KV heads of one sequence run side by
    side, so the token rows of a block (all heads' K and V) are read at about the same time.

    SPLIT_KV: write float32 partials ``out[seq, head, split, :]`` (normalised) and
    ``lse[seq, head, split]`` (split stride 1) to the workspace; else the final output in the
    query's dtype (and the lse when WRITE_LSE). The lse is natural-log, of the scaled scores.
    K_SCALED / V_SCALED: read the KV head's scale at ``k_scale_ptr + kv_head * stride_k_scale``
    (stride 0: one scale for all heads); else the pointers are never read (scale 1).
    WINDOW: the query (position ``context_len - 1``) sees only keys from
    ``context_len - 1 - window_left``; the splits share out only the tiles from the one holding
    that key, so tiles (and blocks) wholly left of the window are never touched.
    SOFTCAP: scores (log2 units) become ``soft_cap(s, softcap_log2)``.
    HAS_SINKS: split 0 starts its online softmax at ``m = sink, l = 1`` (a key of value 0 and
    logit ``sinks[head]``), so the sink enters the merged denominator exactly once.
    FP8_V (FP16_DOTS): how an fp8 V tile becomes fp16: ``"cast"`` (``.to``) or ``"pairs"``
    (read as int16 pairs of dims, converted by :func:`e4m3_pairs_to_fp16`, the PV dot split
    into even and odd dims; needs HEAD_SIZE == HEAD_SIZE_PADDED; inline PTX, so compiled
    GPUs only).
    ORDERED: grid row ``z`` serves sequence ``seq_order[z]`` (int32, a permutation of the
    batch): the hardware starts programs in grid order, so sequences ordered longest first
    leave the short ones to fill the launch's tail. Without ORDERED the pointer is never read.
    FUSED_MERGE (with SPLIT_KV): the last program of each (sequence, KV head) to finish merges
    the partials into ``merged_out`` (the query's dtype, strides ``stride_mo_*``) and, with
    WRITE_LSE, ``merged_lse``; ``counters`` is int32 ``[num_seqs, num_kv_heads]``, zero
    before the launch and after it. Without FUSED_MERGE these three pointers are never read.
    PDL: launched as a programmatic dependent launch (see :mod:`.pdl`).
    """
    wait_for_previous(PDL)
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2)
    if ORDERED:
        seq = tl.load(seq_order_ptr + seq)
    num_splits = tl.num_programs(1)

    context_len = tl.load(context_lens_ptr + seq)
    window_start = 0
    if WINDOW:
        window_start = tl.maximum(context_len - 1 - window_left, 0)
    first_tile = window_start // BLOCK_N
    num_tiles = tl.cdiv(context_len, BLOCK_N) - first_tile
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_begin = first_tile + split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, first_tile + num_tiles)

    rows = tl.arange(0, BLOCK_H)                # [BLOCK_H] query heads of the group (padded)
    dims = tl.arange(0, HEAD_SIZE_PADDED)       # [HEAD_SIZE_PADDED]
    row_valid = rows < GROUP_SIZE               # [BLOCK_H]
    dim_valid = dims < HEAD_SIZE                # [HEAD_SIZE_PADDED]
    heads = kv_head * GROUP_SIZE + rows         # [BLOCK_H] query head ids

    q_ptrs = (query_ptr + seq.to(tl.int64) * stride_q_seq
              + heads[:, None] * stride_q_head + dims[None, :])
    q = tl.load(q_ptrs, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    # q: [BLOCK_H, HEAD_SIZE_PADDED]
    if FP16_DOTS:
        q = q.to(tl.float16)

    qk_scale = scale_log2
    if K_SCALED:
        qk_scale = scale_log2 * tl.load(k_scale_ptr + kv_head * stride_k_scale)

    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    k_head = key_cache_ptr + kv_head.to(tl.int64) * stride_k_head
    v_head = value_cache_ptr + kv_head.to(tl.int64) * stride_v_head

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)       # running max (log2 domain)
    l_i = tl.zeros([BLOCK_H], tl.float32)                      # running sum of exp2
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=row_valid, other=0.0) * 1.4426950408889634
        m_i = tl.where(split == 0, sink, m_i)                  # [BLOCK_H]
        l_i = tl.where(split == 0, 1.0, l_i)
    if FP8_V == "pairs":
        # The running sums of p * v over the even and the odd dims: V is read as int16 pairs
        # of dims, so its tile's 16-bit elements reach the PV dot's operand layout by
        # ldmatrix.trans like a bf16 tile's (an 8-bit tile goes a byte at a time).
        pairs = tl.arange(0, HEAD_SIZE_PADDED // 2)           # [HEAD_SIZE_PADDED // 2]
        v_head_pairs = value_cache_ptr.to(tl.pointer_type(tl.int16)) + (
            kv_head.to(tl.int64) * stride_v_head) // 2
        acc_even = tl.zeros([BLOCK_H, HEAD_SIZE_PADDED // 2], tl.float32)
        acc_odd = tl.zeros([BLOCK_H, HEAD_SIZE_PADDED // 2], tl.float32)
    else:
        acc = tl.zeros([BLOCK_H, HEAD_SIZE_PADDED], tl.float32)   # running sum of p * v

    # Every tile is masked, not only the sequence's last: the loop is bound by memory, not by
    # the mask arithmetic, so the simpler loop costs nothing.
    for tile in range(tile_begin, tile_end):
        tokens = tile * BLOCK_N + tl.arange(0, BLOCK_N)       # [BLOCK_N] positions
        token_valid = tokens < context_len                     # [BLOCK_N]
        if WINDOW:
            # Keys left of the window, and the blocks holding only them, are never read.
            token_valid = token_valid & (tokens >= window_start)
        if BLOCK_SIZE % BLOCK_N == 0:
            # Tiles start at multiples of BLOCK_N, so when BLOCK_N divides BLOCK_SIZE the tile
            # lies inside one cache block: one table lookup. Other sizes look up per token.
            block = tl.load(table_row + (tile * BLOCK_N) // BLOCK_SIZE).to(tl.int64)
            k_rows = block * stride_k_block + (tokens % BLOCK_SIZE) * stride_k_token
            v_rows = block * stride_v_block + (tokens % BLOCK_SIZE) * stride_v_token
        else:
            # Table entries past the sequence's length may be garbage: never follow them.
            blocks = tl.load(table_row + tokens // BLOCK_SIZE, mask=token_valid, other=0)
            blocks = blocks.to(tl.int64)                       # [BLOCK_N]
            k_rows = blocks * stride_k_block + (tokens % BLOCK_SIZE) * stride_k_token
            v_rows = blocks * stride_v_block + (tokens % BLOCK_SIZE) * stride_v_token
        # Unused cache slots may hold NaN: load zeros there (p = 0 times NaN would leak).
        kv_valid = token_valid[:, None] & dim_valid[None, :]  # [BLOCK_N, HEAD_SIZE_PADDED]
        k = tl.load(k_head + k_rows[:, None] + dims[None, :], mask=kv_valid, other=0.0)
        # k: [BLOCK_N, HEAD_SIZE_PADDED] in the dots' dtype (no-op unless the cache is fp8)
        k = k.to(q.dtype)
        if FP8_V == "pairs":
            v_pairs = tl.load(v_head_pairs + (v_rows >> 1)[:, None] + pairs[None, :],
                              mask=token_valid[:, None], other=0)
            v_even, v_odd = e4m3_pairs_to_fp16(v_pairs)   # [BLOCK_N, HEAD_SIZE_PADDED // 2]
        else:
            v = tl.load(v_head + v_rows[:, None] + dims[None, :], mask=kv_valid, other=0.0)
            v = v.to(q.dtype)          # v: [BLOCK_N, HEAD_SIZE_PADDED]

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP:
            s = soft_cap(s, softcap_log2)
        s = tl.where(token_valid[None, :], s, float("-inf"))  # [BLOCK_H, BLOCK_N] fp32
        # Every visited tile holds a valid token, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))             # [BLOCK_H]
        alpha = tl.exp2(m_i - m_new)                           # [BLOCK_H]
        p = tl.exp2(s - m_new[:, None])                        # [BLOCK_H, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FP8_V == "pairs":
            p = p.to(tl.float16)
            acc_even = acc_even * alpha[:, None] + tl.dot(p, v_even,
                                                          input_precision=DOT_PRECISION)
            acc_odd = acc_odd * alpha[:, None] + tl.dot(p, v_odd, input_precision=DOT_PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v,
                                                input_precision=DOT_PRECISION)
        m_i = m_new

    if FP8_V == "pairs":
        # Dims back in order: [BLOCK_H, HEAD_SIZE_PADDED // 2, 2] -> dim 2j + (0 even, 1 odd)
        acc = tl.reshape(tl.join(acc_even, acc_odd), [BLOCK_H, HEAD_SIZE_PADDED])

    has_keys = l_i > 0.0                              # [BLOCK_H]; False: no tokens, no sink
    l_safe = tl.where(has_keys, l_i, 1.0)
    o = acc / l_safe[:, None]                                  # [BLOCK_H, HEAD_SIZE_PADDED]
    if V_SCALED:
        o = o * tl.load(v_scale_ptr + kv_head * stride_v_scale)
    lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))

    o_ptrs = (out_ptr + seq.to(tl.int64) * stride_o_seq + heads[:, None] * stride_o_head
              + dims[None, :] * stride_o_dim)
    lse_ptrs = lse_ptr + seq.to(tl.int64) * stride_lse_seq + heads * stride_lse_head
    o_valid = row_valid[:, None] & dim_valid[None, :]         # [BLOCK_H, HEAD_SIZE_PADDED]
    if SPLIT_KV:
        # Splits past the sequence's end write 0 and lse -inf: the merge then reads every
        # split without first finding out which had work (one round trip fewer).
        tl.store(o_ptrs + split * stride_o_split, o, mask=o_valid)
        tl.store(lse_ptrs + split, lse, mask=row_valid)
        if FUSED_MERGE:
            # Every thread's stores are issued before the ticket releases them.
            tl.debug_barrier()
            counter = counters_ptr + seq * tl.num_programs(0) + kv_head
            ticket = tl.atomic_add(counter, 1, sem="acq_rel")
            if ticket == num_splits - 1:
                merge_group_splits(
                    out_ptr, lse_ptr, merged_out_ptr, merged_lse_ptr, seq,
                    kv_head * GROUP_SIZE, num_splits, stride_o_seq, stride_o_head,
                    stride_o_split, stride_lse_seq, stride_lse_head, stride_mo_seq,
                    stride_mo_head, stride_mo_dim, stride_mlse_seq, stride_mlse_head,
                    GROUP_SIZE, MERGE_ROWS, HEAD_SIZE, HEAD_SIZE_PADDED, MERGE_CHUNK,
                    WRITE_LSE)
                # Every split has drawn its ticket: nothing else touches the counter in this
                # launch, and the next launch finds it at 0.
                tl.store(counter, 0)
    else:
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=o_valid)
        if WRITE_LSE:
            tl.store(lse_ptrs, lse, mask=row_valid)


__all__ = ["soft_cap"]
