"""Triton paged decode: one pass over each sequence's paged K/V, split-KV, and the merge kernel.

``_paged_decode_kernel``: one program per (sequence, KV head, split) serves all the query heads
of that KV head (the GQA group, padded to ``BLOCK_H >= 16`` rows so QK^T and PV run on tensor
cores), so every K/V tile is read from HBM once. The program walks its share of the sequence in
tiles of ``BLOCK_N`` tokens; ``BLOCK_N`` does not depend on the cache's ``block_size``: each tile
looks its tokens' physical blocks up in the block table (one lookup when the tile lies inside
one block, one per token otherwise). The softmax is online, in float32, with ``exp2`` (log2(e)
is folded into the scale). Cache addresses are computed in 64 bits (block id cast first), so
pools over 2^31 elements work.

An fp8 cache (:mod:`.kv_quant`) is read as fp8 (half the bytes) and converted to the query's
dtype right after the load (exact: every e4m3 value is an fp16 / bf16 value), so the dots run
as for a cache in the query's dtype. The program's KV head has one ``k_scale`` and one
``v_scale``: the first is folded into the softmax scale, the second multiplies the normalised
output, instead of scaling every loaded element.

Split-KV: sequence ``i`` cuts *its own* ``ceil(len_i / BLOCK_N)`` tiles into ``num_splits``
equal runs; each split writes its normalised partial output and log-sum-exp to a float32
workspace, and ``_merge_splits_kernel`` combines them (the online-softmax merge). Splits past a
sequence's last tile load nothing and write 0 with lse ``-inf`` (weight 0 in the merge), so the
grid is fixed by the launch arguments alone (CUDA-graph friendly) and nothing is read
uninitialised. ``num_splits == 1`` is one launch writing ``out`` directly: a sequence's result
then depends only on its own data (batch-invariant, deterministic).

Variants (:mod:`.variants`), each a constexpr switch so the default launch compiles as before:
a left window starts each sequence's tiles at the one holding its first visible key (tiles and
cache blocks wholly left of it are never read, so a windowed decode costs O(window), and the
splits share out only the window's tiles); soft-capping maps the scores through
:func:`soft_cap`; sinks start split 0's online softmax at ``m = sink, l = 1``, so the merged
denominator holds the sink exactly once and the lse includes it.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .checks import PagedShapes
from .explain import MAX_SPLITS, DecodePlan, DecodeTiles, num_sms_of, plan_decode
from .kv_quant import scale_pointers, scale_stride
from .launch import PreparedLaunch

logger = logging.getLogger(__name__)

LOG2E = 1.4426950408889634
MAX_HEAD_SIZE = 256
MAX_GRID_Z = 65535


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
def _paged_decode_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, k_scale_ptr, v_scale_ptr,
    block_tables_ptr, context_lens_ptr, out_ptr, lse_ptr, sinks_ptr, scale_log2,
    window_left, softcap_log2, stride_k_scale, stride_v_scale,
    stride_q_seq, stride_q_head,
    stride_k_block, stride_k_token, stride_k_head,
    stride_v_block, stride_v_token, stride_v_head,
    stride_bt_seq,
    stride_o_seq, stride_o_head, stride_o_split, stride_o_dim,
    stride_lse_seq, stride_lse_head,
    GROUP_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_SIZE_PADDED: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    SPLIT_KV: tl.constexpr, WRITE_LSE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    K_SCALED: tl.constexpr, V_SCALED: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
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
    """
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2)
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
    acc = tl.zeros([BLOCK_H, HEAD_SIZE_PADDED], tl.float32)   # running sum of p * v

    # Masking every tile (not only the sequence's last) measured the same on an H100: the loop
    # is bound by memory, not by the mask arithmetic.
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
        v = tl.load(v_head + v_rows[:, None] + dims[None, :], mask=kv_valid, other=0.0)
        # k, v: [BLOCK_N, HEAD_SIZE_PADDED] in the query's dtype (no-op unless the cache is fp8)
        k = k.to(q.dtype)
        v = v.to(q.dtype)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP:
            s = soft_cap(s, softcap_log2)
        s = tl.where(token_valid[None, :], s, float("-inf"))  # [BLOCK_H, BLOCK_N] fp32
        # Every visited tile holds a valid token, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))             # [BLOCK_H]
        alpha = tl.exp2(m_i - m_new)                           # [BLOCK_H]
        p = tl.exp2(s - m_new[:, None])                        # [BLOCK_H, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

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
    else:
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=o_valid)
        if WRITE_LSE:
            tl.store(lse_ptrs, lse, mask=row_valid)


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


@dataclass(frozen=True)
class DecodeRun:
    """The prepared launches of one paged decode call shape (see :mod:`.launch`): the decode
    kernel and, when the plan splits, the merge kernel, with where the split partials sit in
    the float32 workspace."""

    decode: PreparedLaunch
    merge: PreparedLaunch | None
    workspace_numel: int      # float32 elements of the split partials (0 when unsplit)
    lse_offset: int           # element offset of the partial lse in the workspace

    def __call__(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor | None, workspace: torch.Tensor | None,
                 sinks: torch.Tensor | None = None) -> bool:
        """Launch for tensors of the prepared shapes; False (nothing launched) if a pointer's
        alignment differs from the prepared one."""
        lse_arg = lse if lse is not None else out
        k_arg, v_arg = scale_pointers(key_cache, k_scale, v_scale)
        sinks_arg = sinks if sinks is not None else query
        if self.merge is None:
            return self.decode((query, key_cache, value_cache, k_arg, v_arg, block_tables,
                                context_lens, out, lse_arg, sinks_arg))
        if workspace is None:
            workspace = torch.empty(self.workspace_numel, dtype=torch.float32,
                                    device=query.device)
        part_out = workspace.data_ptr()
        part_lse = part_out + 4 * self.lse_offset
        return (self.decode((query, key_cache, value_cache, k_arg, v_arg, block_tables,
                             context_lens, part_out, part_lse, sinks_arg))
                and self.merge((part_out, part_lse, out, lse_arg)))


def triton_paged_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: torch.Tensor,
                        shapes: PagedShapes, *, out: torch.Tensor, lse: torch.Tensor | None,
                        num_splits: int | None = None, workspace: torch.Tensor | None = None,
                        explain: bool = False, tiles: DecodeTiles | None = None,
                        k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None,
                        window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                        sinks: torch.Tensor | None = None) -> DecodeRun | None:
    """Launch paged decode; arguments as :func:`~mini_paged_attn.ops.paged_decode`, validated.

    Writes ``out`` ``[num_seqs, num_q_heads, head_size]`` (query dtype) and, if given, ``lse``
    float32 ``[num_seqs, num_q_heads]``. No host sync; with ``workspace`` (float32, at least
    ``workspace_size(num_seqs, num_q_heads, head_size, num_splits)`` elements) no allocation
    either. ``tiles`` overrides the planned tiles (benchmarks, tests). ``k_scale`` /
    ``v_scale``: None or float32 ``[]`` / ``[num_kv_heads]``, the fp8 cache's scales (checked).
    ``window_size`` (checked pair), ``softcap`` (float >= 0), ``sinks`` (None or float32
    ``[num_q_heads]``): see :mod:`.variants`; a left window plans the splits for the window's
    tiles only.

    Returns:
        The launches as a :class:`DecodeRun` that repeats them for other tensors of the same
        shapes without planning again (None under the interpreter or for an empty batch).
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
                       max(1, min(max_splits, MAX_SPLITS)), device.type == "cuda", tiles,
                       window_left=window_size[0])
    if explain:
        logger.info("%s", plan)
    if shapes.num_seqs == 0:
        return None
    meta = dict(_constexprs(plan), K_SCALED=k_scale is not None, V_SCALED=v_scale is not None,
                WINDOW=window_size[0] >= 0, SOFTCAP=softcap > 0, HAS_SINKS=sinks is not None)
    # Unused values still pass as arguments: the launch's argument list never changes shape.
    variant_args = (max(window_size[0], 0), softcap * LOG2E if softcap > 0 else 1.0)
    sinks_arg = sinks if sinks is not None else query  # never read without HAS_SINKS
    scales = scale_pointers(key_cache, k_scale, v_scale)
    scale_strides = (scale_stride(k_scale), scale_stride(v_scale))
    ks, vs = key_cache.stride(), value_cache.stride()
    cache_strides = (ks[0], ks[1], ks[2], vs[0], vs[1], vs[2])
    qs = query.stride()
    grid = (shapes.num_kv_heads, plan.num_splits, shapes.num_seqs)
    scale_log2 = shapes.scale * LOG2E
    lse_arg = lse if lse is not None else out  # never written when lse is None
    lse_seq, lse_head = lse.stride() if lse is not None else (0, 0)
    os_ = out.stride()
    if plan.num_splits == 1:
        decode = PreparedLaunch(_paged_decode_kernel, grid, (
            query, key_cache, value_cache, *scales, block_tables, context_lens, out, lse_arg,
            sinks_arg, scale_log2, *variant_args, *scale_strides, qs[0], qs[1], *cache_strides, block_tables.stride(0),
            os_[0], os_[1], 0, os_[2], lse_seq, lse_head),
            dict(SPLIT_KV=False, WRITE_LSE=lse is not None, **meta))
        return DecodeRun(decode, None, 0, 0) if decode.ready else None

    # Split-KV: partial outputs [num_seqs, num_q_heads, splits, head_size] then partial lse
    # [num_seqs, num_q_heads, splits], both float32, at the front of the workspace.
    n, h, d, splits = shapes.num_seqs, shapes.num_q_heads, shapes.head_size, plan.num_splits
    numel = workspace_size(n, h, d, splits)
    if workspace is None:
        workspace = torch.empty(numel, dtype=torch.float32, device=device)
    part_out = workspace
    part_lse = workspace[n * h * splits * d:]
    po_seq, po_head, po_split = h * splits * d, splits * d, d
    pl_seq, pl_head = h * splits, splits
    decode = PreparedLaunch(_paged_decode_kernel, grid, (
        query, key_cache, value_cache, *scales, block_tables, context_lens, part_out, part_lse,
        sinks_arg, scale_log2, *variant_args, *scale_strides, qs[0], qs[1], *cache_strides, block_tables.stride(0),
        po_seq, po_head, po_split, 1, pl_seq, pl_head),
        dict(SPLIT_KV=True, WRITE_LSE=True, **meta))
    # One warp per (sequence, query head), launched plainly: at batch 1 (32 programs) the merge
    # is pure latency. Under CUDA graphs on an H100 (head_size 128), 1 warp was 0.6-0.7 us
    # faster than 4, and a plain launch 0.5 us faster than a programmatic dependent launch
    # (PDL) waiting in-kernel. Wider heads take 2 warps, to keep a chunk of 32 float32 partials
    # at <= 128 values a thread.
    merge = PreparedLaunch(_merge_splits_kernel, (h, n), (
        part_out, part_lse, out, lse_arg, splits,
        po_seq, po_head, po_split, pl_seq, pl_head,
        os_[0], os_[1], os_[2], lse_seq, lse_head),
        dict(HEAD_SIZE=d, HEAD_SIZE_PADDED=meta["HEAD_SIZE_PADDED"],
             SPLIT_TILE=min(32, max(16, triton.next_power_of_2(splits))),
             WRITE_LSE=lse is not None, num_warps=1 if meta["HEAD_SIZE_PADDED"] <= 128 else 2))
    if not (decode.ready and merge.ready):
        return None
    return DecodeRun(decode, merge, numel, n * h * splits * d)


@functools.lru_cache(maxsize=256)
def _constexprs(plan: DecodePlan) -> dict:
    """Compile-time arguments and launch options of the decode kernel for a plan."""
    return dict(
        GROUP_SIZE=plan.group_size, HEAD_SIZE=plan.head_size,
        HEAD_SIZE_PADDED=plan.head_size_padded, BLOCK_H=plan.block_h,
        BLOCK_N=plan.tiles.block_n, BLOCK_SIZE=plan.block_size,
        DOT_PRECISION="ieee" if plan.dtype == torch.float32 else "tf32",
        num_warps=plan.tiles.num_warps, num_stages=plan.tiles.num_stages,
    )


__all__ = ["DecodeRun", "triton_paged_decode", "workspace_size"]
