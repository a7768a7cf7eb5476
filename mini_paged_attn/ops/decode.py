"""Triton paged decode: one pass over each sequence's paged K/V, split-KV, and the merge kernel.

``_paged_decode_kernel``: one program per (sequence, KV head, split) serves all the query heads
of that KV head (the GQA group, padded to ``BLOCK_H >= 16`` rows so QK^T and PV run on tensor
cores), so every K/V tile is read from HBM once. The program walks its share of the sequence in
tiles of ``BLOCK_N`` tokens; ``BLOCK_N`` does not depend on the cache's ``block_size``: each tile
looks its tokens' physical blocks up in the block table (one lookup when the tile lies inside
one block, one per token otherwise). The softmax is online, in float32, with ``exp2`` (log2(e)
is folded into the scale). Cache addresses are computed in 64 bits (block id cast first), so
pools over 2^31 elements work.

Split-KV: sequence ``i`` cuts *its own* ``ceil(len_i / BLOCK_N)`` tiles into ``num_splits``
equal runs; each split writes its normalised partial output and log-sum-exp to a float32
workspace, and ``_merge_splits_kernel`` combines them (the online-softmax merge). Splits past a
sequence's last tile exit without writing; the merge recomputes how many splits had work, so
the grid is fixed by the launch arguments alone (CUDA-graph friendly) and nothing is read
uninitialised. ``num_splits == 1`` is one launch writing ``out`` directly: a sequence's result
then depends only on its own data (batch-invariant, deterministic).
"""

from __future__ import annotations

import logging
import os

import torch
import triton
import triton.language as tl

from .checks import PagedShapes
from .explain import MAX_SPLITS, DecodePlan, DecodeTiles, num_sms_of, plan_decode

logger = logging.getLogger(__name__)

LOG2E = 1.4426950408889634
MAX_HEAD_SIZE = 256
MAX_GRID_Z = 65535


@triton.jit
def _attend_tile(q, m_i, l_i, acc, tile, context_len, table_row, k_head, v_head, dims,
                 dim_valid, scale_log2, stride_k_block, stride_k_token, stride_v_block,
                 stride_v_token, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 MASK_TOKENS: tl.constexpr, MASK_DIMS: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """One KV tile of the online softmax; returns the updated (m_i, l_i, acc).

    MASK_TOKENS: the tile may run past ``context_len`` (the sequence's last tile).
    MASK_DIMS: head_size is not a power of two.
    """
    tokens = tile * BLOCK_N + tl.arange(0, BLOCK_N)           # [BLOCK_N] positions
    token_valid = tokens < context_len                         # [BLOCK_N]
    if BLOCK_SIZE >= BLOCK_N:
        # The tile lies inside one cache block (both powers of two): one table lookup.
        block = tl.load(table_row + (tile * BLOCK_N) // BLOCK_SIZE).to(tl.int64)
        k_rows = block * stride_k_block + (tokens % BLOCK_SIZE) * stride_k_token
        v_rows = block * stride_v_block + (tokens % BLOCK_SIZE) * stride_v_token
    else:
        if MASK_TOKENS:   # table entries past the sequence's length may be garbage
            blocks = tl.load(table_row + tokens // BLOCK_SIZE, mask=token_valid, other=0)
        else:
            blocks = tl.load(table_row + tokens // BLOCK_SIZE)
        blocks = blocks.to(tl.int64)                           # [BLOCK_N]
        k_rows = blocks * stride_k_block + (tokens % BLOCK_SIZE) * stride_k_token
        v_rows = blocks * stride_v_block + (tokens % BLOCK_SIZE) * stride_v_token
    k_ptrs = k_head + k_rows[:, None] + dims[None, :]          # [BLOCK_N, HEAD_SIZE_PADDED]
    v_ptrs = v_head + v_rows[:, None] + dims[None, :]
    # Unused cache slots may hold NaN: load zeros there (p = 0 times NaN would leak).
    if MASK_TOKENS:
        kv_valid = token_valid[:, None] & dim_valid[None, :]  # [BLOCK_N, HEAD_SIZE_PADDED]
        k = tl.load(k_ptrs, mask=kv_valid, other=0.0)
        v = tl.load(v_ptrs, mask=kv_valid, other=0.0)
    elif MASK_DIMS:
        k = tl.load(k_ptrs, mask=dim_valid[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=dim_valid[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    # k, v: [BLOCK_N, HEAD_SIZE_PADDED]

    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    # s: [BLOCK_H, BLOCK_N] fp32, log2 domain
    if MASK_TOKENS:
        s = tl.where(token_valid[None, :], s, float("-inf"))
    # Every visited tile holds a valid token, so m_new is finite.
    m_new = tl.maximum(m_i, tl.max(s, axis=1))                 # [BLOCK_H]
    alpha = tl.exp2(m_i - m_new)                               # [BLOCK_H]
    p = tl.exp2(s - m_new[:, None])                            # [BLOCK_H, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_decode_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, lse_ptr, scale_log2,
    stride_q_seq, stride_q_head,
    stride_k_block, stride_k_token, stride_k_head,
    stride_v_block, stride_v_token, stride_v_head,
    stride_bt_seq,
    stride_o_seq, stride_o_head, stride_o_split, stride_o_dim,
    stride_lse_seq, stride_lse_head, stride_lse_split,
    GROUP_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_SIZE_PADDED: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    SPLIT_KV: tl.constexpr, WRITE_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    EXP_ALL_MASKED: tl.constexpr, EXP_SEQ_FIRST: tl.constexpr,
):
    """Grid ``(num_kv_heads, num_splits, num_seqs)``: the KV heads of one sequence run side by
    side, so the token rows of a block (all heads' K and V) are read at about the same time.

    SPLIT_KV: write float32 partials ``out[seq, head, split, :]`` (normalised) and
    ``lse[seq, head, split]`` to the workspace; else the final output in the query's dtype
    (and the lse when WRITE_LSE). The lse is natural-log, of the scaled scores.
    """
    if EXP_SEQ_FIRST:
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        num_splits = tl.num_programs(2)
    else:
        kv_head = tl.program_id(0)
        split = tl.program_id(1)
        seq = tl.program_id(2)
        num_splits = tl.num_programs(1)

    context_len = tl.load(context_lens_ptr + seq)
    num_tiles = tl.cdiv(context_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)
    # Tiles wholly inside the sequence need no token mask; only the last one may.
    if EXP_ALL_MASKED:
        full_end = tile_begin
    else:
        full_end = tl.maximum(tl.minimum(tile_end, context_len // BLOCK_N), tile_begin)

    rows = tl.arange(0, BLOCK_H)                # [BLOCK_H] query heads of the group (padded)
    dims = tl.arange(0, HEAD_SIZE_PADDED)       # [HEAD_SIZE_PADDED]
    row_valid = rows < GROUP_SIZE               # [BLOCK_H]
    dim_valid = dims < HEAD_SIZE                # [HEAD_SIZE_PADDED]
    heads = kv_head * GROUP_SIZE + rows         # [BLOCK_H] query head ids

    q_ptrs = (query_ptr + seq.to(tl.int64) * stride_q_seq
              + heads[:, None] * stride_q_head + dims[None, :])
    q = tl.load(q_ptrs, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    # q: [BLOCK_H, HEAD_SIZE_PADDED]

    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    k_head = key_cache_ptr + kv_head.to(tl.int64) * stride_k_head
    v_head = value_cache_ptr + kv_head.to(tl.int64) * stride_v_head

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)       # running max (log2 domain)
    l_i = tl.zeros([BLOCK_H], tl.float32)                      # running sum of exp2
    acc = tl.zeros([BLOCK_H, HEAD_SIZE_PADDED], tl.float32)   # running sum of p * v

    for tile in range(tile_begin, full_end):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, tile, context_len, table_row, k_head, v_head, dims, dim_valid,
            scale_log2, stride_k_block, stride_k_token, stride_v_block, stride_v_token,
            BLOCK_N, BLOCK_SIZE, False, HEAD_SIZE != HEAD_SIZE_PADDED, DOT_PRECISION)
    for tile in range(full_end, tile_end):     # at most one tile: the sequence's last
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, tile, context_len, table_row, k_head, v_head, dims, dim_valid,
            scale_log2, stride_k_block, stride_k_token, stride_v_block, stride_v_token,
            BLOCK_N, BLOCK_SIZE, True, HEAD_SIZE != HEAD_SIZE_PADDED, DOT_PRECISION)

    has_keys = l_i > 0.0                                       # [BLOCK_H]; False: no tokens
    l_safe = tl.where(has_keys, l_i, 1.0)
    o = acc / l_safe[:, None]                                  # [BLOCK_H, HEAD_SIZE_PADDED]
    lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))

    o_ptrs = (out_ptr + seq.to(tl.int64) * stride_o_seq + heads[:, None] * stride_o_head
              + dims[None, :] * stride_o_dim)
    lse_ptrs = lse_ptr + seq.to(tl.int64) * stride_lse_seq + heads * stride_lse_head
    o_valid = row_valid[:, None] & dim_valid[None, :]         # [BLOCK_H, HEAD_SIZE_PADDED]
    if SPLIT_KV:
        # Splits without tiles write nothing; the merge counts only splits that had work.
        has_work = tile_begin < tile_end
        tl.store(o_ptrs + split * stride_o_split, o, mask=o_valid & has_work)
        tl.store(lse_ptrs + split * stride_lse_split, lse, mask=row_valid & has_work)
    else:
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=o_valid)
        if WRITE_LSE:
            tl.store(lse_ptrs, lse, mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, context_lens_ptr, out_ptr, lse_ptr, num_splits,
    stride_po_seq, stride_po_head, stride_po_split,
    stride_pl_seq, stride_pl_head,
    stride_o_seq, stride_o_head, stride_o_dim, stride_lse_seq, stride_lse_head,
    HEAD_SIZE: tl.constexpr, HEAD_SIZE_PADDED: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLITS_PADDED: tl.constexpr, SPLIT_TILE: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    """Grid ``(num_q_heads, num_seqs)``: out = sum_s w_s o_s / sum_s w_s, w_s = exp(lse_s - max).

    Recomputes the decode kernel's split of the sequence to know which splits wrote a result.
    """
    head = tl.program_id(0)
    seq = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    num_tiles = tl.cdiv(context_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    active = tl.cdiv(num_tiles, tl.maximum(tiles_per_split, 1))   # splits that wrote

    lse_row = part_lse_ptr + seq.to(tl.int64) * stride_pl_seq + head * stride_pl_head
    out_row = part_out_ptr + seq.to(tl.int64) * stride_po_seq + head * stride_po_head
    splits = tl.arange(0, SPLITS_PADDED)                            # [SPLITS_PADDED]
    lse_all = tl.load(lse_row + splits, mask=splits < active, other=float("-inf"))
    lse_max = tl.max(lse_all, axis=0)
    # No split had keys (length 0): weights are 0, not NaN.
    lse_ref = tl.where(lse_max == float("-inf"), 0.0, lse_max)

    dims = tl.arange(0, HEAD_SIZE_PADDED)                           # [HEAD_SIZE_PADDED]
    dim_valid = dims < HEAD_SIZE
    acc = tl.zeros([HEAD_SIZE_PADDED], tl.float32)
    weight_sum = tl.zeros([SPLIT_TILE], tl.float32)
    for s0 in range(0, active, SPLIT_TILE):
        chunk = s0 + tl.arange(0, SPLIT_TILE)                       # [SPLIT_TILE]
        chunk_valid = chunk < active
        w = tl.exp(tl.load(lse_row + chunk, mask=chunk_valid, other=float("-inf")) - lse_ref)
        o = tl.load(out_row + chunk[:, None] * stride_po_split + dims[None, :],
                    mask=chunk_valid[:, None] & dim_valid[None, :], other=0.0)
        # o: [SPLIT_TILE, HEAD_SIZE_PADDED]
        acc += tl.sum(w[:, None] * o, axis=0)
        weight_sum += w
    total = tl.sum(weight_sum, axis=0)
    total_safe = tl.where(total > 0.0, total, 1.0)
    merged = acc / total_safe
    tl.store(out_ptr + seq.to(tl.int64) * stride_o_seq + head * stride_o_head
             + dims * stride_o_dim, merged.to(out_ptr.dtype.element_ty), mask=dim_valid)
    if WRITE_LSE:
        lse = tl.where(total > 0.0, lse_ref + tl.log(total_safe), float("-inf"))
        tl.store(lse_ptr + seq.to(tl.int64) * stride_lse_seq + head * stride_lse_head, lse)


def workspace_size(num_seqs: int, num_q_heads: int, head_size: int,
                   num_splits: int = MAX_SPLITS) -> int:
    """float32 elements of a workspace for split-KV decode of up to these sizes.

    Allocate once, e.g. ``torch.empty(workspace_size(max_num_seqs, num_q_heads, head_size),
    dtype=torch.float32, device="cuda")``, and pass it to every ``paged_decode`` call (needed
    for CUDA-graph capture). A call with fewer sequences uses the front of it.
    """
    return num_seqs * num_q_heads * num_splits * (head_size + 1)


def _check_supported(shapes: PagedShapes) -> None:
    if shapes.head_size > MAX_HEAD_SIZE:
        raise ValueError(f"query: expected head_size <= {MAX_HEAD_SIZE} for the triton "
                         f"backend, got {shapes.head_size}")
    if shapes.num_seqs > MAX_GRID_Z:
        raise ValueError(f"query: expected at most {MAX_GRID_Z} sequences per call (the CUDA "
                         f"grid's z limit), got {shapes.num_seqs}")
    bs = shapes.block_size
    if bs & (bs - 1):
        raise ValueError(f"key_cache: expected a power-of-two block_size for the triton "
                         f"backend, got {bs}")


def _workspace_splits(workspace: torch.Tensor, shapes: PagedShapes,
                      device: torch.device) -> int:
    """Splits that ``workspace`` holds for this call (ValueError if it is unusable)."""
    if not isinstance(workspace, torch.Tensor) or workspace.dtype != torch.float32:
        raise ValueError("workspace: expected a float32 tensor (see decode.workspace_size), "
                         f"got {getattr(workspace, 'dtype', type(workspace).__name__)}")
    if workspace.device != device or not workspace.is_contiguous():
        raise ValueError(f"workspace: expected a contiguous tensor on {device}, got one on "
                         f"{workspace.device} with strides {workspace.stride()}")
    per_split = workspace_size(shapes.num_seqs, shapes.num_q_heads, shapes.head_size, 1)
    return workspace.numel() // max(per_split, 1)


def triton_paged_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: torch.Tensor,
                        shapes: PagedShapes, *, out: torch.Tensor, lse: torch.Tensor | None,
                        num_splits: int | None = None, workspace: torch.Tensor | None = None,
                        explain: bool = False, tiles: DecodeTiles | None = None) -> None:
    """Launch paged decode; arguments as :func:`~mini_paged_attn.ops.paged_decode`, validated.

    Writes ``out`` ``[num_seqs, num_q_heads, head_size]`` (query dtype) and, if given, ``lse``
    float32 ``[num_seqs, num_q_heads]``. No host sync; with ``workspace`` (float32, at least
    ``workspace_size(num_seqs, num_q_heads, head_size, num_splits)`` elements) no allocation
    either. ``tiles`` overrides the planned tiles (benchmarks, tests).
    """
    _check_supported(shapes)
    device = query.device
    max_splits = MAX_SPLITS
    if workspace is not None:
        max_splits = _workspace_splits(workspace, shapes, device)
        if num_splits is not None and num_splits > max(max_splits, 1):
            need = workspace_size(shapes.num_seqs, shapes.num_q_heads, shapes.head_size,
                                  num_splits)
            raise ValueError(f"workspace: expected room for num_splits={num_splits} ({need} "
                             f"float32 elements), got {workspace.numel()}")
    plan = plan_decode(shapes.num_seqs, shapes.num_q_heads, shapes.num_kv_heads,
                       shapes.head_size, shapes.max_blocks_per_seq * shapes.block_size,
                       shapes.block_size, query.dtype, num_sms_of(device), num_splits,
                       max(1, min(max_splits, MAX_SPLITS)), device.type == "cuda", tiles)
    if explain:
        logger.info("%s", plan)
    if shapes.num_seqs == 0:
        return
    _launch(plan, shapes, query, key_cache, value_cache, block_tables, context_lens, out, lse,
            workspace)


def _launch(plan: DecodePlan, shapes: PagedShapes, query, key_cache, value_cache,
            block_tables, context_lens, out, lse, workspace) -> None:
    splits = plan.num_splits
    common = dict(
        GROUP_SIZE=plan.group_size, HEAD_SIZE=shapes.head_size,
        HEAD_SIZE_PADDED=plan.head_size_padded, BLOCK_H=plan.block_h,
        BLOCK_N=plan.tiles.block_n, BLOCK_SIZE=shapes.block_size,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=plan.tiles.num_warps, num_stages=plan.tiles.num_stages,
    )
    cache_strides = (key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
                     value_cache.stride(0), value_cache.stride(1), value_cache.stride(2))
    experiment = os.environ.get("MPA_DECODE_EXPERIMENT", "")   # TEMPORARY: tuning only
    common.update(EXP_ALL_MASKED="allmasked" in experiment,
                  EXP_SEQ_FIRST="seqfirst" in experiment)
    grid = ((shapes.num_seqs, shapes.num_kv_heads, splits) if "seqfirst" in experiment
            else (shapes.num_kv_heads, splits, shapes.num_seqs))
    lse_arg = lse if lse is not None else out  # never written when WRITE_LSE is False
    lse_strides = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
    if splits == 1:
        _paged_decode_kernel[grid](
            query, key_cache, value_cache, block_tables, context_lens, out, lse_arg,
            shapes.scale * LOG2E, query.stride(0), query.stride(1), *cache_strides,
            block_tables.stride(0), out.stride(0), out.stride(1), 0, out.stride(2),
            *lse_strides, 0, SPLIT_KV=False, WRITE_LSE=lse is not None, **common)
        return

    n, h, d = shapes.num_seqs, shapes.num_q_heads, shapes.head_size
    if workspace is None:
        workspace = torch.empty(workspace_size(n, h, d, splits), dtype=torch.float32,
                                device=query.device)
    part_out = workspace[: n * h * splits * d].view(n, h, splits, d)
    part_lse = workspace[n * h * splits * d: n * h * splits * (d + 1)].view(n, h, splits)
    _paged_decode_kernel[grid](
        query, key_cache, value_cache, block_tables, context_lens, part_out, part_lse,
        shapes.scale * LOG2E, query.stride(0), query.stride(1), *cache_strides,
        block_tables.stride(0), *part_out.stride(), *part_lse.stride(),
        SPLIT_KV=True, WRITE_LSE=True, **common)
    _merge_splits_kernel[(h, n)](
        part_out, part_lse, context_lens, out, lse_arg, splits,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1), out.stride(2), *lse_strides,
        HEAD_SIZE=d, HEAD_SIZE_PADDED=plan.head_size_padded, BLOCK_N=plan.tiles.block_n,
        SPLITS_PADDED=max(16, triton.next_power_of_2(splits)), SPLIT_TILE=16,
        WRITE_LSE=lse is not None, num_warps=4)


__all__ = ["triton_paged_decode", "workspace_size"]
