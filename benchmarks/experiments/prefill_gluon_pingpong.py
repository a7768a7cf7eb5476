"""Causal prefill in Gluon, FlashAttention-3's full schedule: two consumer warp groups in ping-pong.

``prefill_gluon.py`` overlaps one tile's softmax with the last tile's PV dot inside one warp
group, but its two warp groups (8 warps, 64 query rows each) run the same instruction stream in
step, so both compute their softmax while the tensor cores idle. Profiled on an H100
(``ncu``, causal 4 x 4k), the library's Triton kernel and that Gluon kernel keep the tensor
pipe busy 57% and 54% of the time, cuDNN's kernel 69%; in the Triton kernel a third of the
warps' stall samples sit on the wait for the QK dot.

Here each warp group is a partition of its own (Gluon warp specialization) with its own 64
query rows of the 128-row tile, and a third partition, one warp, loads K and V by TMA:

- ping-pong: a warp group issues its dots only on its turn and hands the turn over once they
  are issued (two mbarriers), so one group's softmax runs while the other's dots do;
- within a group, tile ``j``'s QK and tile ``j - 1``'s PV are issued together and the softmax
  of tile ``j`` runs under that PV, as in ``prefill_gluon.py``;
- K and V have separate ring slots and barriers: a K slot is handed back once both groups'
  QK dots of it are done, a V slot once both PV dots are.

Registers: 12 warps at ``maxnreg`` 168; the loader warp's group keeps 24 a thread, so the
consumer groups get 240 (the default partition takes what is left).

    python -m benchmarks.experiments.prefill_gluon --compile-only
    python -m benchmarks.experiments.prefill_gluon --check pingpong2
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from benchmarks.experiments.prefill_gluon import _softmax_tile

NUM_WARPS = 4             # one consumer warp group a partition
MAXNREG = 168
HALF = 64                 # query rows of one consumer warp group


@gluon.jit
def _softmax(s, m_i, l_i, qk_scale, q_start, k_start, diagonal, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, layout: gl.constexpr, p_layout: gl.constexpr):
    """``_softmax_tile`` with the causal mask only where ``diagonal`` (a runtime flag)."""
    if diagonal:
        p, m_new, l_new, alpha = _softmax_tile(s, m_i, l_i, qk_scale, q_start, k_start, True,
                                               BLOCK_M, BLOCK_N, layout, p_layout)
    else:
        p, m_new, l_new, alpha = _softmax_tile(s, m_i, l_i, qk_scale, q_start, k_start,
                                               False, BLOCK_M, BLOCK_N, layout, p_layout)
    return p, m_new, l_new, alpha


@gluon.jit
def _consume(WG: gl.constexpr, q_desc, o_desc, q_smem, k_smem, v_smem, q_bar, k_ready,
             v_ready, k_empty, v_empty, turn, q_row, q_col, q_start, n_tiles, qk_scale,
             HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
             STAGES: gl.constexpr):
    """Warp group ``WG``'s 64 query rows: load them, walk the K/V tiles in turn with the
    other group, store the output."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    my_q = q_smem.index(WG)                                  # [HALF_M, HEAD_D]
    my_bar = q_bar.index(WG)
    my_turn = turn.index(WG)
    their_turn = turn.index(1 - WG)
    row0 = q_start + WG * HALF_M                             # first query position
    mbarrier.expect(my_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row + WG * HALF_M, q_col], my_bar, my_q)

    acc = gl.zeros([HALF_M, HEAD_D], gl.float32, o_layout)
    m_i = gl.full([HALF_M], -float("inf"), gl.float32, row_layout)
    l_i = gl.zeros([HALF_M], gl.float32, row_layout)
    s = gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout)

    # Turn t of this group waits for phase (t & 1) ^ WG ^ 1 of its barrier: group 0's first
    # wait is on the barrier's initial (complete) phase, group 1's on group 0's first handover.
    mbarrier.wait(my_bar, 0)
    mbarrier.wait(k_ready.index(0), 0)
    mbarrier.wait(my_turn, 1 ^ WG)
    s = warpgroup_mma(my_q, k_smem.index(0).permute((1, 0)), s, use_acc=False, is_async=True)
    mbarrier.arrive(their_turn, count=1)
    s = warpgroup_mma_wait(0, deps=(s,))
    mbarrier.arrive(k_empty.index(0), count=1)
    p, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, row0, 0, n_tiles == 1, HALF_M,
                                  BLOCK_N, s_layout, p_layout)

    for j in range(1, n_tiles):
        slot = j % STAGES
        prev = (j - 1) % STAGES
        p_op = p
        mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        mbarrier.wait(my_turn, (j & 1) ^ WG ^ 1)
        s = warpgroup_mma(my_q, k_smem.index(slot).permute((1, 0)), s, use_acc=False,
                          is_async=True)
        acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        mbarrier.arrive(their_turn, count=1)
        s = warpgroup_mma_wait(1, deps=(s,))                 # the QK; the PV may still run
        mbarrier.arrive(k_empty.index(slot), count=1)
        p, m_new, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, row0, j * BLOCK_N,
                                        j == n_tiles - 1, HALF_M, BLOCK_N, s_layout, p_layout)
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

    out = acc / gl.convert_layout(l_i, o_row_layout)[:, None]         # [HALF_M, HEAD_D]
    my_q.store(out.to(o_desc.dtype))             # this group's Q rows are no longer read
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row + WG * HALF_M, q_col], my_q)
    tma.store_wait(pendings=0)


@gluon.jit
def _load(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, kv_row0,
          kv_col, n_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The loader warp: K tile ``t`` once both groups' QK of tile ``t - STAGES`` is done,
    V tile ``t`` once both PV dots of tile ``t - STAGES`` are."""
    for t in range(n_tiles):
        slot = t % STAGES
        phase = ((t // STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(slot), phase)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row0 + t * BLOCK_N, kv_col],
                                        k_ready.index(slot), k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), phase)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [kv_row0 + t * BLOCK_N, kv_col],
                                        v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _worker(ROLE: gl.constexpr, q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem,
            q_bar, k_ready, v_ready, k_empty, v_empty, turn, q_row, q_col, kv_row0, kv_col,
            q_start, n_tiles, qk_scale, HALF_M: gl.constexpr, BLOCK_N: gl.constexpr,
            HEAD_D: gl.constexpr, STAGES: gl.constexpr):
    """The worker partitions share one signature: ``ROLE`` 1 is consumer group 1, 2 the
    loader."""
    if ROLE == 1:
        _consume(1, q_desc, o_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready,
                 k_empty, v_empty, turn, q_row, q_col, q_start, n_tiles, qk_scale, HALF_M,
                 BLOCK_N, HEAD_D, STAGES)
    else:
        _load(k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, kv_row0,
              kv_col, n_tiles, BLOCK_N, STAGES)


@gluon.jit
def _attn_fwd_pingpong(q_desc, k_desc, v_desc, o_desc, seq_len, qk_scale,
                       NUM_Q_HEADS: gl.constexpr, GROUP: gl.constexpr,
                       HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                       STAGES: gl.constexpr):
    """One program: one 128-row query tile (two halves of ``HALF_M``) of one head of one
    sequence, heaviest tiles first. q_desc / o_desc: block [HALF_M, HEAD_D] over
    ``[tokens, NUM_Q_HEADS * HEAD_D]``; k_desc / v_desc: block [BLOCK_N, HEAD_D] over
    ``[tokens, num_kv_heads * HEAD_D]``; bf16. ``seq_len`` a multiple of 2 * HALF_M ==
    BLOCK_N."""
    gl.static_assert(2 * HALF_M == BLOCK_N)
    num_m = seq_len // BLOCK_N
    pid = gl.program_id(0)
    m_tile = num_m - 1 - pid % num_m
    head = (pid // num_m) % NUM_Q_HEADS
    seq = pid // (num_m * NUM_Q_HEADS)
    q_start = m_tile * BLOCK_N
    q_row = seq * seq_len + q_start
    kv_row0 = seq * seq_len
    q_col = head * HEAD_D
    kv_col = (head // GROUP) * HEAD_D
    n_tiles = m_tile + 1

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, HALF_M, HEAD_D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
    for i in gl.static_range(2):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)         # one arrival from each group
        mbarrier.init(v_empty.index(i), count=2)
    # Spelled out for each partition: a tuple built here would turn the constexprs into
    # tensors.
    gl.warp_specialize([
        (_consume, (0, q_desc, o_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready,
                    k_empty, v_empty, turn, q_row, q_col, q_start, n_tiles, qk_scale, HALF_M,
                    BLOCK_N, HEAD_D, STAGES)),
        (_worker, (1, q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, q_bar, k_ready,
                   v_ready, k_empty, v_empty, turn, q_row, q_col, kv_row0, kv_col, q_start,
                   n_tiles, qk_scale, HALF_M, BLOCK_N, HEAD_D, STAGES)),
        (_worker, (2, q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, q_bar, k_ready,
                   v_ready, k_empty, v_empty, turn, q_row, q_col, kv_row0, kv_col, q_start,
                   n_tiles, qk_scale, HALF_M, BLOCK_N, HEAD_D, STAGES)),
    ], [4, 1], [240, 24])


def pingpong_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_seqs: int,
                       *, stages: int = 2) -> torch.Tensor:
    """Causal attention of ``num_seqs`` equal-length sequences (a multiple of 128 tokens).

    q: bf16 ``[num_seqs * seq_len, H_Q, 128]``; k, v: bf16 ``[num_seqs * seq_len, H_KV, 128]``.
    Returns bf16 ``[num_seqs * seq_len, H_Q, 128]``."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    total, num_q_heads, head = q.shape
    seq_len = total // num_seqs
    block = 2 * HALF
    assert seq_len % block == 0 and head == 128
    out = torch.empty_like(q)

    def desc(t, rows):
        flat = t.view(t.shape[0], -1)
        layout = gl.NVMMASharedLayout.get_default_for([rows, head], gl.bfloat16)
        return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [rows, head],
                                layout)
    grid = (num_seqs * num_q_heads * (seq_len // block),)
    _attn_fwd_pingpong[grid](desc(q, HALF), desc(k, block), desc(v, block), desc(out, HALF),
                             seq_len, head ** -0.5 * 1.4426950408889634, num_q_heads,
                             num_q_heads // k.shape[1], HALF, block, head, stages,
                             num_warps=NUM_WARPS, maxnreg=MAXNREG)
    return out
