"""The Hopper prefill kernel (Gluon): FlashAttention-3's schedule over varlen or paged K/V.

Plain Triton 3.6 waits for every ``wgmma`` right after issuing it, so in :mod:`.prefill_kernel`
the tensor cores idle while a program computes its softmax (57% busy at causal 4 x 4k on an
H100, against 69% for cuDNN; docs/performance-notes.md, "Ping-pong warp groups in Gluon").
Gluon, Triton's lower-level dialect, issues and waits for the dots by hand. One program owns
128 query tokens of one query head and runs three partitions (warp specialization):

- two consumer warp groups, 64 query rows each, take turns to issue their dots (two
  mbarriers hand the turn over), so one group's softmax runs under the other's dots; within a
  group, tile ``j``'s QK and tile ``j - 1``'s PV are issued together and the softmax of tile
  ``j`` runs under that PV;
- a loader warp copies K and V tiles by TMA into a ring of ``STAGES`` slots; a K slot is
  handed back once both groups' QK of it is done, a V slot once both PV dots are. Contiguous
  K/V come as one box a tile; a paged cache as one box a block (``BOX`` rows), each block's
  row read from the block table by the loader ahead of its copies.

Varlen as :mod:`.prefill_kernel`: query tiles sit on its flattened slot axis (sequence ``i``
owns slots from ``cu_seqlens_q[i] // 128 + i``; a program finds its sequence with a vector
search), heaviest tile of a sequence first; causal is bottom-right aligned; rows that see no
key give zeros (lse ``-inf``). The last K/V tile of a sequence may reach into rows that are
not its own: their scores are masked, and the loader zeroes those V rows in shared memory
(rows past the last sequence can hold anything, and ``0 * NaN`` would leak into the dot). A
query tile's rows past its sequence are computed and never stored: full 64-row halves leave
by TMA, the sequence's last half by masked stores.

Scope (:func:`~.prefill_plan.hopper_prefill_usable`): sm_90, fp16 / bf16, head_size 128,
blocks of 8-128 tokens dividing 128 or multiples of 128, no window, softcap, sinks or fp8
scales; everything else runs :mod:`.prefill_kernel`. Gluon is an experimental API that
changes with every Triton release, so the kernel is chosen only on the releases
:mod:`.triton_support` lists as tested (:func:`~.triton_support.gluon_prefill_enabled`; not
with ``MINI_PAGED_ATTN_PUBLIC_LAUNCH=1``), and this module is imported only where it runs.
Gluon does not run in the Triton interpreter; tests/ops/test_prefill_hopper.py compiles it for sm_90 on any machine and checks
it against the reference on a GPU.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .launch import PreparedLaunch
from .prefill import LOG2E      # no cycle: .prefill imports this module in its launchers

LN2 = gl.constexpr(0.6931471805599453)


HALF_M = gl.constexpr(64)      # query rows of one consumer warp group
BLOCK_N = gl.constexpr(128)    # K/V rows of a tile; a program's 128 query rows are two halves
HEAD_SIZE = gl.constexpr(128)
STAGES = gl.constexpr(2)       # K/V ring slots (the 3-slot ring measured 1-4% slower)
SEARCH = gl.constexpr(128)     # sequences per vector load of the sequence search
MAXNREG = 168            # 12 warps x 32 x 168 registers fit the SM's 65,536
CONSUMER_REGS = gl.constexpr(240)  # each consumer warp group (setmaxnreg); the default one
LOADER_REGS = gl.constexpr(32)     # gets what is left: (168 x 12 x 32 - 272 x 128) / 128 = 232


@gluon.jit
def _softmax_tile(s, m_i, l_i, qk_scale, pos0, key0, k_len, MASKED: gl.constexpr,
                  CAUSAL: gl.constexpr, layout: gl.constexpr, p_layout: gl.constexpr,
                  dtype: gl.constexpr):
    """One tile's online softmax. s: float32 [HALF_M, BLOCK_N] raw scores (``layout``, the QK
    accumulator's); m_i / l_i: float32 [HALF_M] row max (log2 units, scaled) and row sum.
    ``pos0``: the first row's position among the sequence's keys (the causal bound), ``key0``:
    the tile's first key. Returns (p: ``dtype`` [HALF_M, BLOCK_N] in ``p_layout``, m, l,
    alpha); a row that has seen no key keeps m = -inf and l = 0 and gets p = 0."""
    if MASKED:
        rows = pos0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, layout))    # [HALF_M]
        cols = key0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))   # [BLOCK_N]
        visible = cols[None, :] < k_len                                       # [1, BLOCK_N]
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None])        # [HALF_M, BLOCK_N]
        s = gl.where(visible, s, -float("inf"))
    # The scale is positive: the row max of the raw scores, scaled, is the scaled max, and
    # scale-and-subtract is one FFMA per score.
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    m_use = gl.where(m_new == -float("inf"), 0.0, m_new)    # no NaN from (-inf) - (-inf)
    p = gl.exp2(s * qk_scale - m_use[:, None])                        # [HALF_M, BLOCK_N]
    alpha = gl.exp2(m_i - m_use)
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return gl.convert_layout(p.to(dtype), p_layout), m_new, l_new, alpha


@gluon.jit
def _softmax(s, m_i, l_i, qk_scale, pos0, key0, k_len, CAUSAL: gl.constexpr,
             layout: gl.constexpr, p_layout: gl.constexpr, dtype: gl.constexpr):
    """:func:`_softmax_tile`, masked only where the tile reaches past the sequence's keys or
    (causal) past the first row's position."""
    masked = key0 + BLOCK_N > k_len
    if CAUSAL:
        masked = masked | (key0 + BLOCK_N - 1 > pos0)
    if masked:
        p, m_new, l_new, alpha = _softmax_tile(s, m_i, l_i, qk_scale, pos0, key0, k_len, True,
                                               CAUSAL, layout, p_layout, dtype)
    else:
        p, m_new, l_new, alpha = _softmax_tile(s, m_i, l_i, qk_scale, pos0, key0, k_len,
                                               False, CAUSAL, layout, p_layout, dtype)
    return p, m_new, l_new, alpha


@gluon.jit
def _store_rows(out, l_i, m_i, out_ptr, lse_ptr, row0, rows_left, head, stride_out,
                stride_lse_tok, stride_lse_head, o_layout: gl.constexpr,
                WRITE_LSE: gl.constexpr):
    """Masked stores of one half's first ``rows_left`` rows (token rows from ``row0``) and,
    with ``WRITE_LSE``, their log-sum-exp (natural log)."""
    rows = gl.arange(0, HALF_M, layout=gl.SliceLayout(1, o_layout))            # [HALF_M]
    cols = gl.arange(0, HEAD_SIZE, layout=gl.SliceLayout(0, o_layout))         # [HEAD_SIZE]
    keep = rows < rows_left
    ptrs = (out_ptr + (row0 + rows)[:, None].to(gl.int64) * stride_out + head * HEAD_SIZE
            + cols[None, :])
    gl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=keep[:, None])
    if WRITE_LSE:
        lse = gl.where(l_i == 0.0, -float("inf"), (m_i + gl.log2(l_i)) * LN2)
        lse = gl.convert_layout(lse, gl.SliceLayout(1, o_layout))
        gl.store(lse_ptr + (row0 + rows).to(gl.int64) * stride_lse_tok
                 + head * stride_lse_head, lse, mask=keep)


@gluon.jit
def _consume(WG: gl.constexpr, q_desc, o_desc, out_ptr, lse_ptr, q_smem, k_smem, v_smem,
             q_bar, k_ready, v_ready, k_empty, v_empty, turn, q_tok0, q_len, m_start, k_len,
             head, n_tiles, qk_scale, stride_out, stride_lse_tok, stride_lse_head,
             CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr):
    """Consumer warp group ``WG``: the query rows ``m_start + WG * HALF_M ..`` (+ HALF_M) of
    one head, over the sequence's first ``n_tiles`` K/V tiles, in turn with the other group."""
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_SIZE, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    my_q = q_smem.index(WG)                                    # [HALF_M, HEAD_SIZE]
    my_bar = q_bar.index(WG)
    my_turn = turn.index(WG)
    their_turn = turn.index(1 - WG)
    first = m_start + WG * HALF_M                 # this half's first row in the sequence
    pos0 = k_len - q_len + first                  # its position among the keys (causal)
    mbarrier.expect(my_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_tok0 + first, head * HEAD_SIZE], my_bar, my_q)

    acc = gl.zeros([HALF_M, HEAD_SIZE], gl.float32, o_layout)
    m_i = gl.full([HALF_M], -float("inf"), gl.float32, row_layout)
    l_i = gl.zeros([HALF_M], gl.float32, row_layout)
    s = gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout)

    # The groups alternate: turn t of group WG waits for phase (t & 1) ^ WG ^ 1 of its
    # barrier. Group 0's first wait is on the barrier's initial phase (complete), group 1's on
    # group 0's first handover; each group hands over once it has issued its dots.
    mbarrier.wait(my_bar, 0)
    mbarrier.wait(k_ready.index(0), 0)
    mbarrier.wait(my_turn, 1 ^ WG)
    s = warpgroup_mma(my_q, k_smem.index(0).permute((1, 0)), s, use_acc=False, is_async=True)
    mbarrier.arrive(their_turn, count=1)
    s = warpgroup_mma_wait(0, deps=(s,))
    mbarrier.arrive(k_empty.index(0), count=1)
    p, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, pos0, 0, k_len, CAUSAL, s_layout,
                                  p_layout, dtype)

    for j in range(1, n_tiles):
        slot = j % STAGES
        prev = (j - 1) % STAGES
        p_op = p
        mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        mbarrier.wait(my_turn, (j & 1) ^ WG ^ 1)
        # The last tile's scores are dead: their registers take this tile's.
        s = warpgroup_mma(my_q, k_smem.index(slot).permute((1, 0)), s, use_acc=False,
                          is_async=True)
        acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        mbarrier.arrive(their_turn, count=1)
        s = warpgroup_mma_wait(1, deps=(s,))                 # the QK; the PV may still run
        mbarrier.arrive(k_empty.index(slot), count=1)
        p, m_new, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, pos0, j * BLOCK_N, k_len,
                                        CAUSAL, s_layout, p_layout, dtype)
        acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
        mbarrier.arrive(v_empty.index(prev), count=1)
        acc = acc * gl.convert_layout(alpha, o_row_layout)[:, None]
        m_i = m_new

    last = (n_tiles - 1) % STAGES
    p_op = p
    mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // STAGES) & 1)
    mbarrier.wait(my_turn, (n_tiles & 1) ^ WG ^ 1)
    acc = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
    mbarrier.arrive(their_turn, count=1)
    acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))

    l_o = gl.convert_layout(l_i, o_row_layout)
    out = acc / gl.where(l_o == 0.0, 1.0, l_o)[:, None]       # [HALF_M, HEAD_SIZE]
    rows_left = q_len - first
    if WRITE_LSE:
        _store_rows(out, l_i, m_i, out_ptr, lse_ptr, q_tok0 + first, rows_left, head,
                    stride_out, stride_lse_tok, stride_lse_head, o_layout, True)
    elif rows_left >= HALF_M:
        my_q.store(out.to(dtype))                 # this half's Q rows are no longer read
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [q_tok0 + first, head * HEAD_SIZE], my_q)
        tma.store_wait(pendings=0)
    else:
        _store_rows(out, l_i, m_i, out_ptr, lse_ptr, q_tok0 + first, rows_left, head,
                    stride_out, stride_lse_tok, stride_lse_head, o_layout, False)


@gluon.jit
def _zero_tail(v_tile, valid):
    """Zero rows ``valid ..`` of a [BLOCK_N, HEAD_SIZE] shared tile, 8 rows at a time (the
    swizzle's period), from one warp."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [1, 1], [1, 0])
    for c in gl.static_range(BLOCK_N // 8):
        if (c + 1) * 8 > valid:
            chunk = v_tile.slice(c * 8, 8, dim=0)                        # [8, HEAD_SIZE]
            rows = c * 8 + gl.arange(0, 8, layout=gl.SliceLayout(1, layout))
            x = chunk.load(layout)
            chunk.store(gl.where(rows[:, None] < valid, x, gl.zeros_like(x)))


@gluon.jit
def _kv_copy(desc, dst, bar, rows, kv_col, PAGED: gl.constexpr, BOX: gl.constexpr):
    """Start the copies of one K/V tile into ``dst`` ([BLOCK_N, HEAD_SIZE]), signalled on
    ``bar``: one box of BLOCK_N rows from row ``rows`` (contiguous), or one box of ``BOX``
    rows from each of ``rows`` (paged: a tuple, a cache row per box)."""
    mbarrier.expect(bar, BLOCK_N // BOX * desc.block_type.nbytes)
    if PAGED:
        for b in gl.static_range(BLOCK_N // BOX):
            tma.async_copy_global_to_shared(desc, [rows[b], kv_col], bar,
                                            dst.slice(b * BOX, BOX))
    else:
        tma.async_copy_global_to_shared(desc, [rows, kv_col], bar, dst)


@gluon.jit
def _cache_rows(table, t, k_len, BOX: gl.constexpr, BLOCK_SIZE: gl.constexpr):
    """The cache rows of tile ``t``'s boxes, from the sequence's block table. A box past the
    sequence's keys (the barrier expects every box) copies the cache's first rows instead of
    reading the table past its end; its rows are masked (K) and zeroed (V) like any row past
    the keys."""
    rows = ()
    for b in gl.static_range(BLOCK_N // BOX):
        token = t * BLOCK_N + b * BOX
        block = gl.load(table + token // BLOCK_SIZE, mask=token < k_len, other=0)
        rows = rows + (block * BLOCK_SIZE + token % BLOCK_SIZE,)
    return rows


@gluon.jit
def _load(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, v_land,
          k_tok0, k_len, kv_col, n_tiles, table, PAGED: gl.constexpr, BOX: gl.constexpr,
          BLOCK_SIZE: gl.constexpr):
    """The loader warp: K tile ``t`` once both groups' QK of tile ``t - STAGES`` is done, V
    tile ``t`` once both PV dots of tile ``t - STAGES`` are. A V tile reaching past the
    sequence's keys lands on ``v_land`` first and has its foreign rows zeroed."""
    for t in range(n_tiles):
        slot = t % STAGES
        phase = ((t // STAGES) & 1) ^ 1           # a fresh barrier's phase 1 is complete
        if PAGED:           # the table's entries before the wait: their loads overlap it
            rows = _cache_rows(table, t, k_len, BOX, BLOCK_SIZE)
        else:
            rows = k_tok0 + t * BLOCK_N
        mbarrier.wait(k_empty.index(slot), phase)
        _kv_copy(k_desc, k_smem.index(slot), k_ready.index(slot), rows, kv_col, PAGED, BOX)
        mbarrier.wait(v_empty.index(slot), phase)
        valid = k_len - t * BLOCK_N
        if valid >= BLOCK_N:
            _kv_copy(v_desc, v_smem.index(slot), v_ready.index(slot), rows, kv_col, PAGED,
                     BOX)
        else:                                     # the sequence's last tile, once
            _kv_copy(v_desc, v_smem.index(slot), v_land, rows, kv_col, PAGED, BOX)
            mbarrier.wait(v_land, 0)
            _zero_tail(v_smem.index(slot), valid)
            fence_async_shared()                  # the stores before the dots' async reads
            mbarrier.arrive(v_ready.index(slot), count=1)


@gluon.jit
def _worker(ROLE: gl.constexpr, q_desc, k_desc, v_desc, o_desc, out_ptr, lse_ptr, q_smem,
            k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, v_land, turn, q_tok0,
            q_len, m_start, k_tok0, k_len, head, kv_col, n_tiles, qk_scale, stride_out,
            stride_lse_tok, stride_lse_head, table, CAUSAL: gl.constexpr,
            WRITE_LSE: gl.constexpr, PAGED: gl.constexpr, BOX: gl.constexpr,
            BLOCK_SIZE: gl.constexpr):
    """The worker partitions, one signature: ``ROLE`` 1 is consumer group 1, 2 the loader."""
    if ROLE == 1:
        _consume(1, q_desc, o_desc, out_ptr, lse_ptr, q_smem, k_smem, v_smem, q_bar, k_ready,
                 v_ready, k_empty, v_empty, turn, q_tok0, q_len, m_start, k_len, head,
                 n_tiles, qk_scale, stride_out, stride_lse_tok, stride_lse_head, CAUSAL,
                 WRITE_LSE)
    else:
        _load(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, v_land,
              k_tok0, k_len, kv_col, n_tiles, table, PAGED, BOX, BLOCK_SIZE)


@gluon.jit
def _find_sequence(cu_seqlens_q, num_seqs, slot, ONE_SEQ: gl.constexpr):
    """The sequence owning tile slot ``slot``: the last ``i`` with ``cu_seqlens_q[i] //
    BLOCK_N + i <= slot`` (one vector load per ``SEARCH`` sequences)."""
    if ONE_SEQ:
        seq = 0
    else:
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        seq = num_seqs * 0 - 1
        for c in range(0, num_seqs, SEARCH):
            i = c + gl.arange(0, SEARCH, layout=layout)                         # [SEARCH]
            start = gl.load(cu_seqlens_q + i, mask=i < num_seqs, other=0)
            seq += gl.sum(((i < num_seqs) & (start // BLOCK_N + i <= slot)).to(gl.int32),
                          axis=0)
    return seq


@gluon.jit
def _prefill_hopper_kernel(
        q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, out_ptr, lse_ptr, block_tables_ptr,
        cu_seqlens_q, cu_seqlens_k, sinks_ptr,
        q_desc, k_desc, v_desc, o_desc,
        num_seqs, qk_scale, stride_out, stride_lse_tok, stride_lse_head, stride_table,
        NUM_Q_HEADS: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr,
        WRITE_LSE: gl.constexpr, ONE_SEQ: gl.constexpr, PAGED: gl.constexpr,
        BOX: gl.constexpr, BLOCK_SIZE: gl.constexpr):
    """Grid ``(slots, NUM_Q_HEADS)``: one 128-row query tile of one head a program.

    The leading tensors follow :mod:`.prefill_kernel`'s order so one prepared launch serves
    either; ``q_ptr``, ``k_ptr``, ``v_ptr``, the scales, ``block_tables_ptr`` and ``sinks_ptr``
    are unused (K/V come through the descriptors). q_desc / o_desc: blocks [HALF_M, HEAD_SIZE]
    over ``[total_q, NUM_Q_HEADS * HEAD_SIZE]``; k_desc / v_desc: blocks [BOX, HEAD_SIZE]
    over ``[K/V token rows, num_kv_heads * HEAD_SIZE]`` (contiguous: ``total_k`` rows, BOX =
    BLOCK_N; paged: the cache's blocks end to end, ``cu_seqlens_k`` then holds the context
    lengths and ``block_tables_ptr`` the tables, ``stride_table`` apart). out: ``stride_out`` elements a token row,
    heads adjacent; lse float32 ``[total_q, NUM_Q_HEADS]`` (strides in elements)."""
    slot = gl.program_id(0)
    head = gl.program_id(1)
    seq = _find_sequence(cu_seqlens_q, num_seqs, slot, ONE_SEQ)
    q_tok0 = gl.load(cu_seqlens_q + seq)
    q_len = gl.load(cu_seqlens_q + seq + 1) - q_tok0
    if PAGED:           # cu_seqlens_k holds each sequence's context length
        k_tok0 = 0
        k_len = gl.load(cu_seqlens_k + seq)
    else:
        k_tok0 = gl.load(cu_seqlens_k + seq)
        k_len = gl.load(cu_seqlens_k + seq + 1) - k_tok0
    n_q_tiles = gl.cdiv(q_len, BLOCK_N)
    t = slot - (q_tok0 // BLOCK_N + seq)
    if t >= n_q_tiles:                            # a sequence's spare slot
        return
    m_start = (n_q_tiles - 1 - t) * BLOCK_N       # heaviest tile first
    n_tiles = gl.cdiv(k_len, BLOCK_N)
    if CAUSAL:         # keys up to the tile's last row's position, bottom-right aligned
        last_pos = k_len - q_len + gl.minimum(m_start + BLOCK_N, q_len) - 1
        n_tiles = gl.minimum(n_tiles, gl.cdiv(gl.maximum(last_pos + 1, 0), BLOCK_N))
    if n_tiles == 0:                              # no row sees a key: zeros, lse -inf
        zero_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_SIZE, 16])
        zero = gl.zeros([HALF_M, HEAD_SIZE], gl.float32, zero_layout)
        zero_l = gl.zeros([HALF_M], gl.float32, gl.SliceLayout(1, zero_layout))
        for half in gl.static_range(2):
            _store_rows(zero, zero_l, zero_l, out_ptr, lse_ptr, q_tok0 + m_start + half * HALF_M,
                        q_len - m_start - half * HALF_M, head, stride_out, stride_lse_tok,
                        stride_lse_head, zero_layout, WRITE_LSE)
        return
    kv_col = (head // GROUP) * HEAD_SIZE
    table = block_tables_ptr + seq * stride_table

    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, HALF_M, HEAD_SIZE], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_SIZE], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_SIZE], v_desc.layout)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    v_land = gl.allocate_shared_memory(gl.int64, [1, 1], bar_layout).index(0)
    for i in gl.static_range(2):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)         # one arrival from each group
        mbarrier.init(v_empty.index(i), count=2)
    mbarrier.init(v_land, count=1)
    # Spelled out for each partition: a tuple built here would turn the constexprs into
    # tensors.
    gl.warp_specialize([
        (_consume, (0, q_desc, o_desc, out_ptr, lse_ptr, q_smem, k_smem, v_smem, q_bar,
                    k_ready, v_ready, k_empty, v_empty, turn, q_tok0, q_len, m_start, k_len,
                    head, n_tiles, qk_scale, stride_out, stride_lse_tok, stride_lse_head,
                    CAUSAL, WRITE_LSE)),
        (_worker, (1, q_desc, k_desc, v_desc, o_desc, out_ptr, lse_ptr, q_smem, k_smem,
                   v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, v_land, turn, q_tok0,
                   q_len, m_start, k_tok0, k_len, head, kv_col, n_tiles, qk_scale,
                   stride_out, stride_lse_tok, stride_lse_head, table, CAUSAL, WRITE_LSE,
                   PAGED, BOX, BLOCK_SIZE)),
        (_worker, (2, q_desc, k_desc, v_desc, o_desc, out_ptr, lse_ptr, q_smem, k_smem,
                   v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, v_land, turn, q_tok0,
                   q_len, m_start, k_tok0, k_len, head, kv_col, n_tiles, qk_scale,
                   stride_out, stride_lse_tok, stride_lse_head, table, CAUSAL, WRITE_LSE,
                   PAGED, BOX, BLOCK_SIZE)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


def hopper_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor | None, block_tables: torch.Tensor,
                  cu_seqlens_q: torch.Tensor, kv_lens: torch.Tensor, *, num_seqs: int,
                  scale: float, causal: bool, block_size: int | None = None
                  ) -> PreparedLaunch | None:
    """Launch :func:`_prefill_hopper_kernel` into ``out`` (and ``lse``); the caller has
    checked :func:`~.prefill_plan.hopper_prefill_usable`.

    Args:
        q: ``[total_q, num_q_heads, 128]`` fp16 / bf16; out: like q.
        k, v: contiguous ``[total_k, num_kv_heads, 128]``, or with ``block_size`` the caches
            ``[num_blocks, block_size, num_kv_heads, 128]``; q's dtype.
        lse: float32 ``[total_q, num_q_heads]`` (natural log) or None.
        block_tables: int32 ``[num_seqs, max_blocks]`` (paged; contiguous: any int32 tensor).
        cu_seqlens_q: int32 ``[num_seqs + 1]``.
        kv_lens: int32, contiguous: ``cu_seqlens_k`` ``[num_seqs + 1]``; paged: the context
            lengths ``[num_seqs]``.
        scale: softmax scale; causal: bottom-right aligned.

    Returns:
        The launch, repeatable with tensors in :mod:`.prefill`'s order ``(q, k, v, k, k, out,
        lse or out, block_tables, cu_seqlens_q, kv_lens, q)`` (None if not repeatable).
    """
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    num_q_heads = q.shape[1]
    element = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    box = BLOCK_N.value if block_size is None else min(block_size, BLOCK_N.value)

    def descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
        """Over ``t`` as ``[token rows, heads * 128]`` (a cache's blocks end to end)."""
        flat_rows = t.shape[0] if t.dim() == 3 else t.shape[0] * t.shape[1]
        layout = gl.NVMMASharedLayout.get_default_for([rows, HEAD_SIZE.value], element)
        return TensorDescriptor(t, [flat_rows, t.shape[-2] * t.shape[-1]], [t.stride(-3), 1],
                                [rows, HEAD_SIZE.value], layout)
    lse_arg, lse_strides = (lse, lse.stride()) if lse is not None else (out, (0, 0))
    slots = -(-q.shape[0] // BLOCK_N.value) + num_seqs
    launch = PreparedLaunch(_prefill_hopper_kernel, (slots, num_q_heads), (
        q, k, v, k, k, out, lse_arg, block_tables, cu_seqlens_q, kv_lens, q,
        descriptor(q, HALF_M.value), descriptor(k, box), descriptor(v, box),
        descriptor(out, HALF_M.value), num_seqs, scale * LOG2E, out.stride(0), *lse_strides,
        block_tables.stride(0) if block_size is not None else 0), dict(
        NUM_Q_HEADS=num_q_heads, GROUP=num_q_heads // k.shape[-2], CAUSAL=causal,
        WRITE_LSE=lse is not None, ONE_SEQ=num_seqs == 1, PAGED=block_size is not None,
        BOX=box, BLOCK_SIZE=block_size or 1, num_warps=4, maxnreg=MAXNREG),
        descriptor_sources=(0, 1, 2, 5))
    return launch if launch.ready else None
