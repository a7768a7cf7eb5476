"""Triton paged decode: the launcher, :func:`triton_paged_decode`, and its repeatable runs.

The plan (:func:`~.attention.decode_plan.plan_decode`: tiles and splits) becomes the launches
of the decode kernel (:mod:`.decode_kernel`: one program per sequence, KV head and split reads
that split's paged K/V once) and, when the plan splits, of the merge kernel
(:mod:`.decode_merge`). This module also owns the float32 split workspace
(:func:`workspace_size`).

Split-KV: sequence ``i`` cuts *its own* ``ceil(len_i / BLOCK_N)`` tiles into ``num_splits``
equal runs; each split writes its normalised partial output and log-sum-exp to a float32
workspace, and the merge kernel combines them (the online-softmax merge). Splits past a
sequence's last tile load nothing and write 0 with lse ``-inf`` (weight 0 in the merge), so the
grid is fixed by the launch arguments alone (CUDA-graph friendly) and nothing is read
uninitialised. ``num_splits == 1`` is one launch writing ``out`` directly: a sequence's result
then depends only on its own data (batch-invariant, deterministic).

A fused merge (``fused_merge``, :data:`~.attention.decode_plan.FUSED_MERGE`) makes a split call
one launch: the decode kernel's last program of each (sequence, KV head) merges, counting
finished splits in int32 counters that start at 0 and are left at 0. The counters never live in
a caller's workspace (one made with ``torch.empty`` would hold garbage): an eager run keeps
them in its own zeroed scratch (:class:`~.launch.StreamScratch`), which also holds the partials
of calls without a workspace. Either way the merge reads the splits in the same order, so
results are deterministic.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from .attention.decode_plan import MAX_SPLITS, DecodePlan, DecodeTiles, num_sms_of, plan_decode
from .attention.triton_backend import MAX_HEAD_SIZE
from .checks import PagedShapes
from .decode_kernel import _paged_decode_kernel
from .decode_merge import merge_chunk, merge_rows, prepare_merge
from .decode_tiles import fp8_v_conversion
from .kv_quant import scale_pointers, scale_stride
from .launch import ALIGNMENT, PreparedLaunch, StreamScratch
from .pdl import pdl_options

logger = logging.getLogger(__name__)

LOG2E = 1.4426950408889634
MAX_GRID_Z = 65535


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
    kernel and, when the plan splits without a fused merge, the merge kernel, with where the
    split partials sit in the float32 workspace.

    Split calls need ``scratch_numel`` float32 elements besides a caller's workspace: the
    partials when there is no workspace (at the front), then a fused merge's int32 counters
    (at ``counters_offset``, zero before and after each launch). An eager run keeps them in
    ``scratch``, one buffer per stream; a run made under CUDA-graph capture (``scratch``
    None) allocates them per call, from the graph's pool, which the graph keeps.
    """

    decode: PreparedLaunch
    merge: PreparedLaunch | None
    workspace_numel: int      # float32 elements of the split partials (0 when unsplit)
    lse_offset: int           # element offset of the partial lse in the workspace
    scratch: StreamScratch | None = None
    counters_offset: int | None = None     # None: no fused merge
    scratch_numel: int = 0

    def __call__(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor | None, workspace: torch.Tensor | None,
                 sinks: torch.Tensor | None = None,
                 seq_order: torch.Tensor | None = None) -> bool:
        """Launch for tensors of the prepared shapes; False (nothing launched) if a pointer's
        alignment differs from the prepared one."""
        q, kc = query.data_ptr(), key_cache.data_ptr()
        o, ctx = out.data_ptr(), context_lens.data_ptr()
        lse_p = o if lse is None else lse.data_ptr()
        head = (q, kc, value_cache.data_ptr(),
                kc if k_scale is None else k_scale.data_ptr(),
                kc if v_scale is None else v_scale.data_ptr(),
                block_tables.data_ptr(), ctx, ctx if seq_order is None else seq_order.data_ptr())
        sinks_p = q if sinks is None else sinks.data_ptr()
        decode = self.decode
        stream = decode.stream()
        if self.merge is None and self.counters_offset is None:        # unsplit
            return decode.launch_checked(head + (o, lse_p, sinks_p, o, lse_p, ctx), stream)
        held, base = None, 0     # memory allocated here, alive until the launches are queued
        if self.scratch is not None:
            base = self.scratch.pointer(stream)
        elif self.scratch_numel:
            held = _call_scratch(self.scratch_numel, self.counters_offset, query.device)
            base = held.data_ptr()
        part_out = workspace.data_ptr() if workspace is not None else base
        part_lse = part_out + 4 * self.lse_offset
        if self.counters_offset is not None:                             # fused merge
            counters = base + 4 * self.counters_offset
            return decode.launch_checked(
                head + (part_out, part_lse, sinks_p, o, lse_p, counters), stream)
        return (decode.launch_checked(head + (part_out, part_lse, sinks_p, o, lse_p, ctx), stream)
                and self.merge.launch_checked((part_out, part_lse, o, lse_p), stream))


def _call_scratch(numel: int, counters_offset: int | None,
                  device: torch.device) -> torch.Tensor:
    """One call's float32 scratch of ``numel`` elements, its counters (from
    ``counters_offset``, int32) zeroed."""
    scratch = torch.empty(numel, dtype=torch.float32, device=device)
    if counters_offset is not None:
        scratch[counters_offset:].view(torch.int32).zero_()
    return scratch


def triton_paged_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: torch.Tensor,
                        shapes: PagedShapes, *, out: torch.Tensor, lse: torch.Tensor | None,
                        num_splits: int | None = None, workspace: torch.Tensor | None = None,
                        explain: bool = False, tiles: DecodeTiles | None = None,
                        k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None,
                        window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                        sinks: torch.Tensor | None = None, fused_merge: bool = False,
                        counters: torch.Tensor | None = None,
                        keep_scratch: bool = False,
                        seq_order: torch.Tensor | None = None) -> DecodeRun | None:
    """Launch paged decode; arguments as :func:`~mini_paged_attn.ops.paged_decode`, validated.

    Writes ``out`` ``[num_seqs, num_q_heads, head_size]`` (query dtype) and, if given, ``lse``
    float32 ``[num_seqs, num_q_heads]``. No host sync; with ``workspace`` (float32, at least
    ``workspace_size(num_seqs, num_q_heads, head_size, num_splits)`` elements) no allocation
    either. ``tiles`` overrides the planned tiles (benchmarks, tests). ``k_scale`` /
    ``v_scale``: None or float32 ``[]`` / ``[num_kv_heads]``, the fp8 cache's scales (checked).
    ``window_size`` (checked pair), ``softcap`` (float >= 0), ``sinks`` (None or float32
    ``[num_q_heads]``): see :mod:`.variants`; a left window plans the splits for the window's
    tiles only. ``seq_order``: None or int32 ``[num_seqs]`` (checked, but not that it is a
    permutation), the order the grid takes the sequences in.

    ``fused_merge``: a split launch merges inside the decode kernel (one launch, see
    :mod:`.decode_kernel`); its tickets are taken from ``counters``, int32, contiguous, at
    least ``num_seqs * num_kv_heads`` elements, all 0 (the launch leaves them 0, so one buffer
    serves every call on one stream), or None: zeroed counters next to the partials.
    ``keep_scratch`` (not under CUDA-graph capture): the partials of a call without a
    workspace and the counters live in buffers the returned run keeps, one per stream (see
    :class:`~.launch.StreamScratch`), so its repeats allocate nothing; else each call
    allocates them.

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
    if counters is not None:
        _check_counters(counters, shapes, device)
    plan = plan_decode(shapes.num_seqs, shapes.num_q_heads, shapes.num_kv_heads,
                       shapes.head_size, shapes.max_blocks_per_seq * shapes.block_size,
                       shapes.block_size, query.dtype, num_sms_of(device), num_splits,
                       max(1, min(max_splits, MAX_SPLITS)), device.type == "cuda", tiles,
                       kv_dtype=None if key_cache.dtype == query.dtype else key_cache.dtype,
                       window_left=window_size[0], fused_merge=fused_merge,
                       ordered=seq_order is not None)
    if explain:
        logger.info("%s", plan)
    if shapes.num_seqs == 0:
        return None
    meta = dict(_constexprs(plan), K_SCALED=k_scale is not None, V_SCALED=v_scale is not None,
                WINDOW=window_size[0] >= 0, SOFTCAP=softcap > 0, HAS_SINKS=sinks is not None,
                FP8_V=fp8_v_conversion(
                    plan.head_size, plan.head_size_padded, device.type == "cuda",
                    # 16-byte aligned, as the launch cache keys it: a repeat never meets an
                    # odd pointer.
                    value_cache.data_ptr() % ALIGNMENT == 0
                    and all(s % 2 == 0 for s in value_cache.stride()[:3]))
                if plan.fp16_dots else "cast",
                ORDERED=seq_order is not None, **pdl_options(device))
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
    # The final output's strides, for a fused merge (the unsplit launch writes it directly).
    merged = (os_[0], os_[1], os_[2], lse_seq, lse_head)
    head_args = (query, key_cache, value_cache, *scales, block_tables, context_lens,
                 seq_order if seq_order is not None else context_lens)  # never read unordered
    scalar_args = (scale_log2, *variant_args, *scale_strides, qs[0], qs[1], *cache_strides,
                   block_tables.stride(0))
    if plan.num_splits == 1:
        decode = PreparedLaunch(_paged_decode_kernel, grid, (
            *head_args, out, lse_arg, sinks_arg, out, lse_arg, context_lens, *scalar_args,
            os_[0], os_[1], 0, os_[2], lse_seq, lse_head, *merged),
            dict(SPLIT_KV=False, WRITE_LSE=lse is not None, **meta))
        return DecodeRun(decode, None, 0, 0) if decode.ready else None

    # Split-KV: partial outputs [num_seqs, num_q_heads, splits, head_size] then partial lse
    # [num_seqs, num_q_heads, splits], both float32, at the front of the workspace (or of the
    # run's scratch), and a fused merge's int32 counters [num_seqs, num_kv_heads] after them.
    n, h, d, splits = shapes.num_seqs, shapes.num_q_heads, shapes.head_size, plan.num_splits
    numel = workspace_size(n, h, d, splits)
    num_counters = n * shapes.num_kv_heads
    counters_offset = numel if workspace is None else 0
    scratch_numel = counters_offset + (num_counters if plan.fused_merge else 0)
    scratch = StreamScratch(scratch_numel, device) if keep_scratch and scratch_numel else None
    buffer = None
    if scratch is not None:
        buffer = scratch.tensor()
    elif scratch_numel:
        buffer = _call_scratch(scratch_numel, counters_offset if plan.fused_merge else None,
                               device)
    if workspace is None:
        workspace = buffer
    if plan.fused_merge and counters is None:
        counters = buffer[counters_offset:].view(torch.int32)
    part_out = workspace
    part_lse = workspace[n * h * splits * d:]
    po_seq, po_head, po_split = h * splits * d, splits * d, d
    pl_seq, pl_head = h * splits, splits
    decode = PreparedLaunch(_paged_decode_kernel, grid, (
        *head_args, part_out, part_lse, sinks_arg, out,
        lse_arg, counters if plan.fused_merge else context_lens, *scalar_args,
        po_seq, po_head, po_split, 1, pl_seq, pl_head, *merged),
        dict(SPLIT_KV=True, WRITE_LSE=lse is not None or not plan.fused_merge, **meta))
    if plan.fused_merge:
        return (DecodeRun(decode, None, numel, n * h * splits * d, scratch, counters_offset,
                          scratch_numel) if decode.ready else None)
    merge = prepare_merge(part_out, part_lse, (po_seq, po_head, po_split, pl_seq, pl_head),
                          splits, out, lse, num_seqs=n, num_q_heads=h, head_size=d,
                          head_size_padded=meta["HEAD_SIZE_PADDED"])
    if not (decode.ready and merge.ready):
        return None
    return DecodeRun(decode, merge, numel, n * h * splits * d, scratch, None, scratch_numel)


def _check_counters(counters: torch.Tensor, shapes: PagedShapes, device: torch.device) -> None:
    need = shapes.num_seqs * shapes.num_kv_heads
    if (not isinstance(counters, torch.Tensor) or counters.dtype != torch.int32
            or counters.device != device or not counters.is_contiguous()
            or counters.numel() < need):
        got = (f"{counters.dtype} tensor of {counters.numel()} elements on {counters.device}"
               if isinstance(counters, torch.Tensor) else type(counters).__name__)
        raise ValueError(f"counters: expected a contiguous int32 tensor of at least {need} "
                         f"elements (num_seqs * num_kv_heads) on {device}, got {got}")


@functools.lru_cache(maxsize=256)
def _constexprs(plan: DecodePlan) -> dict:
    """Compile-time arguments and launch options of the decode kernel for a plan."""
    return dict(
        GROUP_SIZE=plan.group_size, HEAD_SIZE=plan.head_size,
        HEAD_SIZE_PADDED=plan.head_size_padded, BLOCK_H=plan.block_h,
        BLOCK_N=plan.tiles.block_n, BLOCK_SIZE=plan.block_size,
        DOT_PRECISION="ieee" if plan.dtype == torch.float32 else "tf32",
        FP16_DOTS=plan.fp16_dots,
        FUSED_MERGE=plan.fused_merge,
        # Fixed when unused, so the other launches compile no variant per split count.
        MERGE_ROWS=merge_rows(plan.group_size) if plan.fused_merge else 2,
        MERGE_CHUNK=merge_chunk(plan.group_size, plan.head_size_padded, plan.num_splits,
                                plan.tiles.num_warps) if plan.fused_merge else 1,
        num_warps=plan.tiles.num_warps, num_stages=plan.tiles.num_stages,
        **({} if plan.tiles.maxnreg is None else {"maxnreg": plan.tiles.maxnreg}),
    )


__all__ = ["DecodeRun", "triton_paged_decode", "workspace_size"]
