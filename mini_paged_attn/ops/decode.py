"""Triton paged decode: the launcher, :func:`triton_paged_decode`, and its repeatable runs.

The plan (:func:`~.explain.plan_decode`: tiles and splits) becomes the launches of the decode
kernel (:mod:`.decode_kernel`: one program per sequence, KV head and split reads that split's
paged K/V once) and, when the plan splits, of the merge kernel (:mod:`.decode_merge`). This
module also owns the float32 split workspace (:func:`workspace_size`).

Split-KV: sequence ``i`` cuts *its own* ``ceil(len_i / BLOCK_N)`` tiles into ``num_splits``
equal runs; each split writes its normalised partial output and log-sum-exp to a float32
workspace, and the merge kernel combines them (the online-softmax merge). Splits past a
sequence's last tile load nothing and write 0 with lse ``-inf`` (weight 0 in the merge), so the
grid is fixed by the launch arguments alone (CUDA-graph friendly) and nothing is read
uninitialised. ``num_splits == 1`` is one launch writing ``out`` directly: a sequence's result
then depends only on its own data (batch-invariant, deterministic).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from .checks import PagedShapes
from .decode_kernel import _paged_decode_kernel
from .decode_merge import prepare_merge
from .explain import MAX_SPLITS, DecodePlan, DecodeTiles, num_sms_of, plan_decode
from .kv_quant import scale_pointers, scale_stride
from .launch import PreparedLaunch

logger = logging.getLogger(__name__)

LOG2E = 1.4426950408889634
MAX_HEAD_SIZE = 256
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
                       kv_dtype=None if key_cache.dtype == query.dtype else key_cache.dtype,
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
    merge = prepare_merge(part_out, part_lse, (po_seq, po_head, po_split, pl_seq, pl_head),
                          splits, out, lse, num_seqs=n, num_q_heads=h, head_size=d,
                          head_size_padded=meta["HEAD_SIZE_PADDED"])
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
        FP16_DOTS=plan.fp16_dots,
        num_warps=plan.tiles.num_warps, num_stages=plan.tiles.num_stages,
    )


__all__ = ["DecodeRun", "triton_paged_decode", "workspace_size"]
