"""Triton varlen prefill: the launcher and its two entry points.

:func:`triton_paged_prefill` (paged K/V, behind ``paged_prefill``) and
:func:`triton_varlen_contiguous` (contiguous K/V, behind ``flash_attn_varlen_func``) build one
launch of the kernel in :mod:`.prefill_kernel`: one program per tile of query rows, tiles from
:mod:`.prefill_plan`, the variants (:mod:`.variants`) and an fp8 cache's scales
(:mod:`.kv_quant`) passed as constexpr switches and arguments. On an H100 / H200 (sm_90),
batches with default tiles and no variant, contiguous or paged, run the Gluon kernel of
:mod:`.prefill_hopper` instead, where :func:`~.prefill_plan.hopper_prefill_usable` allows.
A paged step of long queries on Hopper that it does not take (an fp8 cache, blocks under 8
tokens) copies its pages into contiguous rows first and runs the contiguous launch
(:mod:`.prefill_gather`).
"""

from __future__ import annotations

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from .checks import PagedShapes
from .kv_quant import scale_pointers, scale_stride
from .launch import PreparedLaunch
from .prefill_gather import (GatheredPrefill, gather_layout, heads_adjacent, prepare_gather,
                             should_gather)
from .prefill_kernel import _prefill_kernel
from .prefill_plan import (PrefillConfig, default_config, hopper_prefill_usable, tiling,
                           tma_usable)
from .variants import effective_right

LOG2E = 1.4426950408889634


def _hopper_runs(q, k, v, out, num_seqs: int, block_size: int | None, right: int, k_scale,
                 v_scale, window_size: tuple[int, int], softcap: float, sinks) -> bool:
    """Whether a launch with default tiles goes to :mod:`.prefill_hopper`: no variant but
    causal (``right``, the right bound :func:`~.variants.effective_right` gives, 0 or
    unbounded) and a batch :func:`~.prefill_plan.hopper_prefill_usable` takes."""
    return (k_scale is None and v_scale is None and softcap == 0 and sinks is None
            and window_size[0] < 0 and right <= 0
            and hopper_prefill_usable(q, k, v, out, num_seqs, block_size))


def _launch(q, k, v, out, lse, block_tables, cu_seqlens_q, kv_lens, *, num_seqs: int,
            num_kv_heads: int, scale: float, causal: bool, paged: bool, block_size: int,
            config: PrefillConfig | None, k_scale: torch.Tensor | None = None,
            v_scale: torch.Tensor | None = None, window_size: tuple[int, int] = (-1, -1),
            softcap: float = 0.0, sinks: torch.Tensor | None = None,
            hopper: bool = True) -> PreparedLaunch | None:
    total_q, num_q_heads, head_size = q.shape
    if total_q == 0 or num_seqs == 0:
        return None
    right = effective_right(window_size, causal)
    if hopper and not paged and config is None and _hopper_runs(
            q, k, v, out, num_seqs, None, right, k_scale, v_scale, window_size, softcap, sinks):
        from .prefill_hopper import hopper_launch    # Gluon: only where it runs
        return hopper_launch(q, k, v, out, lse, block_tables, cu_seqlens_q, kv_lens,
                             num_seqs=num_seqs, scale=scale, causal=right == 0)
    group = num_q_heads // num_kv_heads
    config = config or default_config(head_size, q.dtype, q.device, total_q / num_seqs,
                                      contiguous=not paged)
    plan = tiling(config, group, head_size)
    descriptors = (None, None)
    if config.tma and not paged and tma_usable(k, v, config.block_n):
        descriptors = tuple(TensorDescriptor(t, [t.shape[0], num_kv_heads * head_size],
                                             [t.stride(0), 1], [config.block_n, head_size])
                            for t in (k, v))
    lse_arg, lse_strides = (lse, lse.stride()) if lse is not None else (out, (0, 0))
    grid = plan.grid(total_q, num_seqs, num_kv_heads)
    launch = PreparedLaunch(_prefill_kernel, grid, (
        q, k, v, *scale_pointers(k, k_scale, v_scale),
        out, lse_arg, block_tables, cu_seqlens_q, kv_lens, sinks if sinks is not None else q,
        *descriptors, num_seqs, scale * LOG2E, max(window_size[0], 0), max(right, 0),
        softcap * LOG2E if softcap > 0 else 1.0, scale_stride(k_scale), scale_stride(v_scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), out.stride(2), *lse_strides,
        *(k.stride()[:3] if paged else (0, *k.stride()[:2])),
        *(v.stride()[:3] if paged else (0, *v.stride()[:2])),
        block_tables.stride(0) if paged else 0), dict(
        NUM_KV_HEADS=num_kv_heads, GROUP=group, HEADS_PER_TILE=plan.heads_per_tile,
        HEAD_CHUNKS=plan.head_chunks, TOKENS_PER_TILE=plan.tokens_per_tile,
        SMALL_ROWS=plan.small_rows, HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=plan.head_size_padded, BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, BLOCK_SIZE=block_size if paged else 1, PAGED=paged,
        BOUNDED_RIGHT=right >= 0, WRITE_LSE=lse is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        K_SCALED=k_scale is not None, V_SCALED=v_scale is not None,
        WINDOW=window_size[0] >= 0, SOFTCAP=softcap > 0, HAS_SINKS=sinks is not None,
        KV_TMA=descriptors[0] is not None, SAME_KV_STRIDES=k.stride()[:3] == v.stride()[:3],
        num_warps=config.num_warps, num_stages=config.num_stages),
        descriptor_sources=(1, 2) if descriptors[0] is not None else ())  # over k, over v
    return launch if launch.ready else None


def triton_paged_prefill(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         context_lens: torch.Tensor, shapes: PagedShapes, *, causal: bool,
                         out: torch.Tensor, lse: torch.Tensor | None,
                         max_seqlen_q: int | None = None,
                         config: PrefillConfig | None = None,
                         k_scale: torch.Tensor | None = None,
                         v_scale: torch.Tensor | None = None,
                         window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                         sinks: torch.Tensor | None = None,
                         gather: bool | None = None, hopper: bool = True
                         ) -> PreparedLaunch | GatheredPrefill | None:
    """Paged varlen prefill into ``out`` (and ``lse``); arguments already checked by dispatch.

    Args:
        query: ``[total_q, num_q_heads, head_size]`` fp16 / bf16 / fp32, last dim contiguous.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, any
            strides on the first three dims.
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``, last dim contiguous.
        cu_seqlens_q: int32 ``[num_seqs + 1]``; context_lens: int32 ``[num_seqs]``.
        shapes: the validated sizes (``scale`` included).
        out: ``[total_q, num_q_heads, head_size]`` in the query's dtype, written.
        lse: float32 ``[total_q, num_q_heads]`` (natural log) or None.
        max_seqlen_q: accepted for the dispatcher's signature; the launch needs no bound on
            q_len (the grid comes from ``total_q`` and ``num_seqs``), so no host sync either.
        config: tile sizes (default: :func:`~.prefill_plan.default_config`).
        k_scale, v_scale: None or float32 ``[]`` / ``[num_kv_heads]``, an fp8 cache's scales.
        gather: copy the pages into contiguous rows and attend over those
            (:mod:`.prefill_gather`; the cache's tokens must have their heads adjacent);
            None (and ``config`` None): the Hopper kernel (:mod:`.prefill_hopper`) where it
            runs, else copy where :func:`~.prefill_gather.should_gather` says so.
        hopper: whether this call may take the Hopper kernel at all (the attention
            backend's choice, :mod:`.attention.hopper_backend`; False skips its per-call
            plan where it never runs).

    Returns:
        The launch, repeatable for other tensors of the same shapes with the tensors in the
        kernel's order ``(query, key_cache, value_cache, k_scale or key_cache, v_scale or
        key_cache, out, lse or out, block_tables, cu_seqlens_q, context_lens, sinks or
        query)`` (None under the interpreter or for an empty batch).
    """
    del max_seqlen_q  # the flattened tile schedule makes it unnecessary
    right = effective_right(window_size, causal)
    if hopper and gather is None and config is None and _hopper_runs(
            query, key_cache, value_cache, out, shapes.num_seqs, shapes.block_size, right,
            k_scale, v_scale, window_size, softcap, sinks):
        from .prefill_hopper import hopper_launch    # Gluon: only where it runs
        return hopper_launch(query, key_cache, value_cache, out, lse, block_tables,
                             cu_seqlens_q, context_lens, num_seqs=shapes.num_seqs,
                             scale=shapes.scale, causal=right == 0,
                             block_size=shapes.block_size)
    if gather is None:
        gather = config is None and should_gather(query, key_cache, value_cache,
                                                  shapes.num_seqs, shapes.max_blocks_per_seq,
                                                  window_size[0])
    variant = dict(k_scale=k_scale, v_scale=v_scale, window_size=window_size, softcap=softcap,
                   sinks=sinks)
    if gather and shapes.num_seqs and query.shape[0]:
        return _gathered(query, key_cache, value_cache, block_tables, context_lens,
                         cu_seqlens_q, shapes, causal=causal, out=out, lse=lse, config=config,
                         hopper=hopper, **variant)
    return _launch(query, key_cache, value_cache, out, lse, block_tables, cu_seqlens_q, context_lens,
            num_seqs=shapes.num_seqs, num_kv_heads=shapes.num_kv_heads, scale=shapes.scale,
            causal=causal, paged=True, block_size=shapes.block_size, config=config,
            hopper=hopper, **variant)


def _gathered(query, key_cache, value_cache, block_tables, context_lens, cu_seqlens_q,
              shapes: PagedShapes, *, causal: bool, out, lse, config, hopper: bool,
              **variant) -> GatheredPrefill | None:
    """:func:`triton_paged_prefill` by copy (see :mod:`.prefill_gather`)."""
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not heads_adjacent(cache):
            raise ValueError(f"{name}: the page copy needs each token's heads adjacent "
                             f"(strides [..., {shapes.head_size}, 1]), got strides "
                             f"{tuple(cache.stride())}")
    layout = gather_layout(shapes.num_seqs, shapes.max_blocks_per_seq, shapes.block_size,
                           shapes.num_kv_heads, shapes.head_size, query.dtype)
    workspace = torch.empty(layout.nbytes, dtype=torch.uint8, device=query.device)
    k, v, cu_k = layout.views(workspace, shapes.num_kv_heads, shapes.head_size, query.dtype)
    gather = prepare_gather(key_cache, value_cache, block_tables, context_lens, k, v, cu_k)
    attend = _launch(query, k, v, out, lse, cu_k, cu_seqlens_q, cu_k, num_seqs=shapes.num_seqs,
                     num_kv_heads=shapes.num_kv_heads, scale=shapes.scale, causal=causal,
                     paged=False, block_size=1, config=config, hopper=hopper, **variant)
    if attend is None or not gather.ready:     # the interpreter: nothing to repeat
        return None
    return GatheredPrefill(gather, attend, layout, (variant["k_scale"] is not None,
                                                    variant["v_scale"] is not None))


def triton_varlen_contiguous(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                             max_seqlen_q: int, max_seqlen_k: int, *, causal: bool,
                             scale: float, out: torch.Tensor, lse: torch.Tensor | None = None,
                             config: PrefillConfig | None = None,
                             window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                             sinks: torch.Tensor | None = None,
                             hopper: bool = True) -> PreparedLaunch | None:
    """Varlen attention over contiguous K/V into ``out`` (FlashAttention's varlen semantics).

    Args:
        q: ``[total_q, num_q_heads, head_size]``; k, v: ``[total_k, num_kv_heads, head_size]``,
            all in one dtype, last dims contiguous.
        cu_seqlens_q, cu_seqlens_k: int32 ``[num_seqs + 1]``.
        max_seqlen_q, max_seqlen_k: accepted for FlashAttention's signature; unused.
        causal: bottom-right aligned: query ``t`` of sequence i sees keys
            ``<= k_len_i - q_len_i + t``; a query row that sees no key gives zeros.
        scale: softmax scale.
        out: ``[total_q, num_q_heads, head_size]`` in q's dtype, written.
        lse: optional float32 ``[total_q, num_q_heads]`` (natural log, ``-inf`` for empty rows).
        config: tile sizes (default: :func:`~.prefill_plan.default_config` for contiguous K/V,
            tensor-descriptor loads included where :func:`~.prefill_plan.tma_usable` allows).
        hopper: whether this call may take the Hopper kernel, as in
            :func:`triton_paged_prefill`.

    Returns:
        The launch, repeatable for tensors of the same shapes in the kernel's order ``(q, k,
        v, k, k, out, lse or out, cu_seqlens_k, cu_seqlens_q, cu_seqlens_k, sinks or q)``
        (None under the interpreter or for an empty batch).
    """
    del max_seqlen_q, max_seqlen_k
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and q.stride(-1) == 1, "last dims contiguous"
    return _launch(q, k, v, out, lse, cu_seqlens_k, cu_seqlens_q, cu_seqlens_k,
            num_seqs=cu_seqlens_q.shape[0] - 1, num_kv_heads=k.shape[1], scale=float(scale),
            causal=causal, paged=False, block_size=1, config=config, window_size=window_size,
            softcap=softcap, sinks=sinks, hopper=hopper)


__all__ = ["triton_paged_prefill", "triton_varlen_contiguous", "PrefillConfig"]
