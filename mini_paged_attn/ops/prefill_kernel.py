"""The Triton varlen prefill kernel: FlashAttention-2 style tiles over paged (or contiguous) K/V.

Kept apart from its launcher (:mod:`.prefill`, which picks the tiles and builds the launch for
paged and contiguous K/V) so the device code reads on its own.

One launch serves a whole varlen batch: full prompts, a chunk on a long cached prefix,
prefix-cache hits and decode rows (q_len 1) together. Each program owns one tile of query rows
(query token x query head of one KV head, see :mod:`.prefill_plan`) and walks that sequence's
K/V in tiles of ``BLOCK_N`` tokens, looking each token's physical block up in the block table
(``BLOCK_N`` does not depend on ``block_size``, which may be any positive size). Scores and P @ V run on tensor cores
(``tl.dot``); the online softmax runs in float32 with ``exp2`` (log2(e) is folded into the
scale). Causal masks are aligned bottom-right: query token ``t`` of a sequence with ``q_len``
queries and ``kv_len`` keys sees keys ``<= kv_len - q_len + t``. K/V tiles entirely above the
diagonal are never visited, and tiles entirely below it run without any mask.

The same kernel reads contiguous varlen K/V (``flash_attn_varlen_func`` without a block table)
when ``PAGED`` is false: key ``t`` of sequence ``i`` is row ``cu_seqlens_k[i] + t``. There, with
``KV_TMA``, K/V tiles come through host tensor descriptors (Hopper's bulk tensor copies, see
:mod:`.prefill_plan`): the copy engine fills shared memory three stages ahead while the warps
compute, which pointer loads through the block table cannot match.

Variants (:mod:`.variants`), constexpr switches off by default: a right window generalises the
causal bound (causal is a right window of 0); a left window starts each query tile's walk at
the tile holding its first row's first visible key, masks the tiles left of where every row's
window has begun, and never loads a key left of all the tile's windows; soft-capping and sinks
work as in :mod:`.decode_kernel` (a sink starts each row's softmax at ``m = sink, l = 1``).

An fp8 cache (:mod:`.kv_quant`) is converted to the query's dtype right after each load (exact);
a program's KV head ``k_scale`` is folded into the softmax scale and its ``v_scale`` multiplies
the normalised output.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .decode_kernel import soft_cap


@triton.jit
def _attend_kv_tile(acc, l_i, m_i, q, start_n, first_visible, last_visible, kv_lo, kv_len,
                    qk_scale, softcap, k_base, v_base, k_desc, v_desc, desc_col, table_row,
                    kv_row0, offs_d, stride_kb, stride_kt, stride_vb, stride_vt,
                    HEAD_SIZE: tl.constexpr, HEAD_SIZE_PADDED: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr,
                    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, KV_TMA: tl.constexpr,
                    PAST_END: tl.constexpr):
    """One K/V tile of the online softmax; MASKED tiles mask keys outside each row's
    ``first_visible .. last_visible`` (the first only with WINDOW) and load nothing outside
    ``kv_lo .. kv_len - 1``, the keys some row of the tile may see. KV_TMA loads whole rows
    of the sequence's contiguous K/V instead; PAST_END (a tile that may reach past the
    sequence's last key) then zeroes V past it."""
    offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions in the sequence
    kv_in_range = offs_n < kv_len             # [BLOCK_N]
    if WINDOW:
        # A tile may start left of every row's window: its keys there (and the blocks
        # holding only them, possibly freed and reused) are never read.
        kv_in_range = kv_in_range & (offs_n >= kv_lo)
    if KV_TMA:
        # Whole tiles of contiguous rows; rows past the tensor come back as zeros.
        k = k_desc.load([kv_row0 + start_n, desc_col])  # [BLOCK_N, HEAD_SIZE]
        v = v_desc.load([kv_row0 + start_n, desc_col])
        if PAST_END:
            # Rows past the sequence's keys belong to the next sequence (or, past
            # cu_seqlens_k[-1], to nobody): their scores are masked below, and their values,
            # which may not even be finite, must not reach P @ V. (Rows left of a window
            # are the sequence's own, finite keys.) Only the tiles that reach past the end
            # pay for this, which takes V from shared memory to registers and back.
            v = tl.where((offs_n < kv_len)[:, None], v, 0.0)
    elif PAGED:
        if BLOCK_SIZE % BLOCK_N == 0:
            # Tiles start at multiples of BLOCK_N, so when BLOCK_N divides BLOCK_SIZE a tile
            # never straddles two cache blocks: one table lookup. Any other block_size (24,
            # 80, 96, ...) takes the per-token lookup below.
            block = tl.load(table_row + start_n // BLOCK_SIZE).to(tl.int64)
            k_rows = block * stride_kb + (offs_n % BLOCK_SIZE) * stride_kt  # [BLOCK_N] int64
            v_rows = block * stride_vb + (offs_n % BLOCK_SIZE) * stride_vt
        else:
            if MASKED:  # table entries past the sequence's length may be garbage: never read
                blocks = tl.load(table_row + offs_n // BLOCK_SIZE, mask=kv_in_range, other=0)
            else:
                blocks = tl.load(table_row + offs_n // BLOCK_SIZE)
            blocks = blocks.to(tl.int64)  # [BLOCK_N]
            k_rows = blocks * stride_kb + (offs_n % BLOCK_SIZE) * stride_kt
            v_rows = blocks * stride_vb + (offs_n % BLOCK_SIZE) * stride_vt
    else:
        rows = (kv_row0 + offs_n).to(tl.int64)  # [BLOCK_N]
        k_rows = rows * stride_kt
        v_rows = rows * stride_vt
    if not KV_TMA:
        k_ptrs = k_base + k_rows[:, None] + offs_d[None, :]  # [BLOCK_N, HEAD_SIZE_PADDED]
        v_ptrs = v_base + v_rows[:, None] + offs_d[None, :]
        # Unused cache slots may hold NaN: masked tiles load zeros there (0 * NaN would leak).
        if MASKED:
            kv_mask = kv_in_range[:, None] & (offs_d[None, :] < HEAD_SIZE)
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        elif HEAD_SIZE != HEAD_SIZE_PADDED:
            d_mask = (offs_d < HEAD_SIZE)[None, :]
            k = tl.load(k_ptrs, mask=d_mask, other=0.0)
            v = tl.load(v_ptrs, mask=d_mask, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
    # In the query's dtype for the dots (a no-op unless the cache is fp8).
    k = k.to(q.dtype)
    v = v.to(q.dtype)

    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] fp32
    if SOFTCAP:
        s = soft_cap(s * qk_scale, softcap)  # in log2 units, as the scale is
        qk_scale = 1.0
    if MASKED:
        visible = offs_n[None, :] <= last_visible[:, None]  # [BLOCK_M, BLOCK_N]
        if WINDOW:
            visible = visible & (offs_n[None, :] >= first_visible[:, None])
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
        # A row that has seen no key yet keeps m = -inf; subtract 0 so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _attend_q_tile(q_ptr, out_ptr, lse_ptr, sinks_ptr, k_base, v_base, k_desc, v_desc, desc_col,
                   table_row, kv_row0, kv_len, q_start, q_len, first_tok, kv_head, head_chunk,
                   qk_scale, v_scale,
                   window_left, window_right, softcap,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_od, stride_lt, stride_lh,
                   stride_kb, stride_kt, stride_vb, stride_vt,
                   ROWS: tl.constexpr, TOKENS: tl.constexpr, HEADS_PER_TILE: tl.constexpr,
                   GROUP: tl.constexpr, HEAD_SIZE: tl.constexpr,
                   HEAD_SIZE_PADDED: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr, BOUNDED_RIGHT: tl.constexpr,
                   WRITE_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   V_SCALED: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                   HAS_SINKS: tl.constexpr, KV_TMA: tl.constexpr):
    """Query tokens first_tok .. first_tok + TOKENS - 1 of one sequence, ROWS rows; the output
    is multiplied by ``v_scale`` when V_SCALED.

    Token t sits at position ``p = kv_len - q_len + t``. BOUNDED_RIGHT (causal, or a right
    window): it sees keys ``<= p + window_right`` (0 for causal); WINDOW: keys
    ``>= p - window_left``. K/V tiles are walked in three runs: masked tiles left of where
    every row's window has begun (WINDOW only), unmasked tiles every row sees whole, masked
    tiles up to the last key any row sees."""
    rows = tl.arange(0, ROWS)                        # [ROWS] row = token-major (token, head)
    tok = first_tok + rows // HEADS_PER_TILE
    head_in_group = head_chunk * HEADS_PER_TILE + rows % HEADS_PER_TILE
    row_valid = (rows < TOKENS * HEADS_PER_TILE) & (tok < q_len) & (head_in_group < GROUP)
    head = kv_head * GROUP + head_in_group           # [ROWS] query head of each row
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)          # [HEAD_SIZE_PADDED]
    d_valid = offs_d < HEAD_SIZE

    q_rows = (q_start + tok).to(tl.int64)            # [ROWS]
    q_ptrs = q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    # [ROWS, HEAD_SIZE_PADDED]

    # Keys every row may see: up to its own position plus the right window (causal: 0), or
    # the whole sequence.
    q_offset = kv_len - q_len  # bottom-right alignment
    if BOUNDED_RIGHT:
        last_visible = tl.minimum(q_offset + tok + window_right, kv_len - 1)   # [ROWS]
        last_tok = tl.minimum(first_tok + TOKENS, q_len) - 1
        kv_end = tl.minimum(q_offset + last_tok + 1 + window_right, kv_len)
        unmasked_end = tl.minimum(tl.maximum(q_offset + first_tok + 1 + window_right, 0),
                                  kv_len) // BLOCK_N * BLOCK_N
    else:
        last_visible = tl.zeros([ROWS], dtype=tl.int32) + (kv_len - 1)
        kv_end = kv_len
        unmasked_end = kv_len // BLOCK_N * BLOCK_N
    first_visible = last_visible  # (unused without WINDOW)
    kv_lo = 0
    unmasked_begin = 0
    if WINDOW:
        first_visible = tl.maximum(q_offset + tok - window_left, 0)        # [ROWS]
        kv_lo = tl.maximum(q_offset + first_tok - window_left, 0)
        last_first = q_offset + tl.minimum(first_tok + TOKENS, q_len) - 1 - window_left
        unmasked_begin = tl.cdiv(tl.maximum(last_first, 0), BLOCK_N) * BLOCK_N

    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    if HAS_SINKS:
        # The sink is a key of value 0 and logit sinks[head]: the softmax starts from it.
        m_i = tl.load(sinks_ptr + head, mask=row_valid, other=0.0) * 1.4426950408889634
        l_i += 1.0
    acc = tl.zeros([ROWS, HEAD_SIZE_PADDED], dtype=tl.float32)
    if WINDOW:
        for start_n in range(kv_lo // BLOCK_N * BLOCK_N, tl.minimum(unmasked_begin, kv_end),
                             BLOCK_N):
            acc, l_i, m_i = _attend_kv_tile(
                acc, l_i, m_i, q, start_n, first_visible, last_visible, kv_lo, kv_len,
                qk_scale, softcap, k_base, v_base, k_desc, v_desc, desc_col, table_row, kv_row0,
                offs_d, stride_kb, stride_kt, stride_vb, stride_vt, HEAD_SIZE, HEAD_SIZE_PADDED,
                BLOCK_N, BLOCK_SIZE, PAGED, True, DOT_PRECISION, WINDOW, SOFTCAP, KV_TMA, True)
    for start_n in range(unmasked_begin, unmasked_end, BLOCK_N):
        acc, l_i, m_i = _attend_kv_tile(
            acc, l_i, m_i, q, start_n, first_visible, last_visible, kv_lo, kv_len, qk_scale,
            softcap, k_base, v_base, k_desc, v_desc, desc_col, table_row, kv_row0, offs_d,
            stride_kb, stride_kt, stride_vb, stride_vt, HEAD_SIZE, HEAD_SIZE_PADDED,
            BLOCK_N, BLOCK_SIZE, PAGED, False, DOT_PRECISION, WINDOW, SOFTCAP, KV_TMA, False)
    tail_begin = unmasked_end
    if WINDOW:
        tail_begin = tl.maximum(unmasked_end, unmasked_begin)  # no middle run: all masked
    if KV_TMA:
        # Masked tiles that end inside the sequence (the diagonal of every query tile but
        # the last) need no V zeroing.
        inside_end = tl.maximum(tl.minimum(kv_end, kv_len // BLOCK_N * BLOCK_N), tail_begin)
        for start_n in range(tail_begin, inside_end, BLOCK_N):
            acc, l_i, m_i = _attend_kv_tile(
                acc, l_i, m_i, q, start_n, first_visible, last_visible, kv_lo, kv_len,
                qk_scale, softcap, k_base, v_base, k_desc, v_desc, desc_col, table_row, kv_row0,
                offs_d, stride_kb, stride_kt, stride_vb, stride_vt, HEAD_SIZE, HEAD_SIZE_PADDED,
                BLOCK_N, BLOCK_SIZE, PAGED, True, DOT_PRECISION, WINDOW, SOFTCAP, KV_TMA, False)
        tail_begin = inside_end
    for start_n in range(tail_begin, kv_end, BLOCK_N):
        acc, l_i, m_i = _attend_kv_tile(
            acc, l_i, m_i, q, start_n, first_visible, last_visible, kv_lo, kv_len, qk_scale,
            softcap, k_base, v_base, k_desc, v_desc, desc_col, table_row, kv_row0, offs_d,
            stride_kb, stride_kt, stride_vb, stride_vt, HEAD_SIZE, HEAD_SIZE_PADDED,
            BLOCK_N, BLOCK_SIZE, PAGED, True, DOT_PRECISION, WINDOW, SOFTCAP, KV_TMA, True)

    # Rows that saw no key and no sink (only possible for contiguous K/V shorter than Q) give
    # 0 and -inf.
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)               # [ROWS]
    out = acc / l_safe[:, None]                     # [ROWS, HEAD_SIZE_PADDED]
    if V_SCALED:
        out = out * v_scale
    o_ptrs = (out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh
              + offs_d[None, :] * stride_od)
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty),
             mask=row_valid[:, None] & d_valid[None, :])
    if WRITE_LSE:
        # m_i and log2(l_i) are in log2 units (the scale carries log2(e)); lse is natural.
        lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        tl.store(lse_ptr + q_rows * stride_lt + head * stride_lh, lse, mask=row_valid)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, out_ptr, lse_ptr,
    block_tables_ptr, cu_seqlens_q_ptr, kv_lens_ptr, sinks_ptr, k_desc, v_desc,
    num_seqs, qk_scale, window_left, window_right, softcap, stride_k_scale, stride_v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_od, stride_lt, stride_lh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEADS_PER_TILE: tl.constexpr,
    HEAD_CHUNKS: tl.constexpr, TOKENS_PER_TILE: tl.constexpr, SMALL_ROWS: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HEAD_SIZE_PADDED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    PAGED: tl.constexpr, BOUNDED_RIGHT: tl.constexpr, WRITE_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, K_SCALED: tl.constexpr, V_SCALED: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    KV_TMA: tl.constexpr, SAME_KV_STRIDES: tl.constexpr,
):
    # KV_TMA (contiguous K/V only): k_desc / v_desc are tensor descriptors over K / V as
    # [total_k, num_kv_heads * HEAD_SIZE] with [BLOCK_N, HEAD_SIZE] boxes; else None.
    # K_SCALED / V_SCALED: the KV head's scale is at ``*_scale_ptr + kv_head * stride_*_scale``
    # (stride 0: one for all heads); else the pointers are never read (scale 1).
    # BOUNDED_RIGHT, WINDOW, SOFTCAP, HAS_SINKS: see _attend_q_tile (causal is a right window
    # of 0); softcap is in log2 units, as qk_scale is.
    # Programs are ordered sequence, then (KV head, head chunk), then tile slot: sequence i
    # owns programs [start_i * HEADS, start_{i+1} * HEADS) with start_i = cu_seqlens_q[i] //
    # TOKENS_PER_TILE + i (see prefill_plan), one run of its slots per head. The programs
    # resident at once then mostly share one KV head's K/V, which stays in L2; ordered KV
    # head-fastest they stream every head's K/V together, which a 16k prompt's 64 MB does not
    # fit. Sequences in batch order keep a mixed batch's decode rows first. (Taking slots from
    # both ends in turn, to pair heavy tiles with light ones, measured slower; both:
    # docs/performance-notes.md, "Program order, V zeroing, the sequence lookup".)
    HEADS: tl.constexpr = NUM_KV_HEADS * HEAD_CHUNKS
    pid = tl.program_id(0)

    # Sequence of this program: the largest i with start_i * HEADS <= pid.
    SEQ_LOOKUP: tl.constexpr = 64
    if (num_seqs > 1) & (num_seqs < SEQ_LOOKUP):
        # Batches of 2 to 63 sequences: the sequence, its bounds and its K/V length come out
        # of two independent vector loads. A binary search takes one dependent load per
        # halving, and one program per SM (the 128 x 128 tiles) leaves that latency exposed
        # at every program's start (docs/performance-notes.md, "Program order, V zeroing,
        # the sequence lookup"). One sequence (num_seqs specialised to 1) needs no search.
        offs = tl.arange(0, SEQ_LOOKUP)                               # [SEQ_LOOKUP]
        cu_q = tl.load(cu_seqlens_q_ptr + offs, mask=offs <= num_seqs, other=0)
        kv_valid = offs < num_seqs          # context_lens: one entry per sequence
        if not PAGED:
            kv_valid = offs <= num_seqs     # cu_seqlens_k: num_seqs + 1 entries
        kv_rows = tl.load(kv_lens_ptr + offs, mask=kv_valid, other=0)
        owns = (offs < num_seqs) & ((cu_q // TOKENS_PER_TILE + offs) * HEADS <= pid)
        seq = tl.sum(owns.to(tl.int32), axis=0) - 1  # the starts increase: a prefix owns
        q_start = tl.sum(tl.where(offs == seq, cu_q, 0), axis=0)
        q_end = tl.sum(tl.where(offs == seq + 1, cu_q, 0), axis=0)
        kv_first = tl.sum(tl.where(offs == seq, kv_rows, 0), axis=0)
        kv_next = tl.sum(tl.where(offs == seq + 1, kv_rows, 0), axis=0)
    else:
        lo = pid * 0  # int32 scalars (num_seqs may be specialised to a constexpr 1)
        hi = lo + num_seqs
        while hi - lo > 1:
            mid = (lo + hi) // 2
            mid_start = tl.load(cu_seqlens_q_ptr + mid) // TOKENS_PER_TILE + mid
            lo = tl.where(mid_start * HEADS <= pid, mid, lo)
            hi = tl.where(mid_start * HEADS <= pid, hi, mid)
        seq = lo
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_end = tl.load(cu_seqlens_q_ptr + seq + 1)
        kv_first = tl.load(kv_lens_ptr + seq)
        kv_next = kv_first
        if not PAGED:
            kv_next = tl.load(kv_lens_ptr + seq + 1)
    q_len = q_end - q_start
    first_slot = q_start // TOKENS_PER_TILE + seq
    num_slots = q_end // TOKENS_PER_TILE + seq + 1 - first_slot  # >= cdiv(q_len, TOKENS_PER_TILE)
    local = pid - first_slot * HEADS
    head_index = local // num_slots
    local = local % num_slots
    num_tiles = tl.cdiv(q_len, TOKENS_PER_TILE)
    if (head_index >= HEADS) | (local >= num_tiles):
        # A spare slot, a sequence with q_len 0, or a program past the last sequence's slots
        # (the grid is an upper bound): nothing to compute or write.
        return
    kv_head = head_index // HEAD_CHUNKS
    head_chunk = head_index % HEAD_CHUNKS
    # Heaviest tile first: the last query tokens see the most keys.
    tile = num_tiles - 1 - local
    if PAGED:
        kv_len = kv_first
        kv_row0 = 0
    else:
        kv_row0 = kv_first
        kv_len = kv_next - kv_first
    if SAME_KV_STRIDES:
        # One set of row offsets serves K and V (the compiler merges the equal expressions):
        # half the address arithmetic per tile, which the pointer loads' pipeline pays for.
        stride_vb = stride_kb
        stride_vt = stride_kt
        stride_vh = stride_kh
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(tl.int64) * stride_vh
    if K_SCALED:
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head * stride_k_scale)
    v_scale = 1.0
    if V_SCALED:
        v_scale = tl.load(v_scale_ptr + kv_head * stride_v_scale)
    if SMALL_ROWS > 0 and q_len * HEADS_PER_TILE <= SMALL_ROWS:
        # Decode rows and other short sequences: a tile of SMALL_ROWS rows instead of BLOCK_M,
        # so a memory-bound walk over a long context wastes no tensor-core work on empty rows.
        _attend_q_tile(
            q_ptr, out_ptr, lse_ptr, sinks_ptr, k_base, v_base, k_desc, v_desc,
            kv_head * HEAD_SIZE, table_row, kv_row0, kv_len,
            q_start, q_len, 0, kv_head, head_chunk, qk_scale, v_scale, window_left, window_right, softcap,
            stride_qt, stride_qh, stride_ot, stride_oh, stride_od, stride_lt, stride_lh,
            stride_kb, stride_kt, stride_vb, stride_vt,
            SMALL_ROWS, SMALL_ROWS // HEADS_PER_TILE, HEADS_PER_TILE, GROUP, HEAD_SIZE,
            HEAD_SIZE_PADDED, BLOCK_N, BLOCK_SIZE, PAGED, BOUNDED_RIGHT, WRITE_LSE,
            DOT_PRECISION, V_SCALED, WINDOW, SOFTCAP, HAS_SINKS, KV_TMA)
    else:
        _attend_q_tile(
            q_ptr, out_ptr, lse_ptr, sinks_ptr, k_base, v_base, k_desc, v_desc,
            kv_head * HEAD_SIZE, table_row, kv_row0, kv_len,
            q_start, q_len, tile * TOKENS_PER_TILE, kv_head, head_chunk, qk_scale, v_scale, window_left, window_right, softcap,
            stride_qt, stride_qh, stride_ot, stride_oh, stride_od, stride_lt, stride_lh,
            stride_kb, stride_kt, stride_vb, stride_vt,
            BLOCK_M, TOKENS_PER_TILE, HEADS_PER_TILE, GROUP, HEAD_SIZE,
            HEAD_SIZE_PADDED, BLOCK_N, BLOCK_SIZE, PAGED, BOUNDED_RIGHT, WRITE_LSE,
            DOT_PRECISION, V_SCALED, WINDOW, SOFTCAP, HAS_SINKS, KV_TMA)
