"""Triton store_kv: write the new tokens' K/V into the paged caches by slot.

One program per token copies its ``[num_kv_heads, head_size]`` key and value rows to
``cache[slot // block_size, slot % block_size]``. Slot ``-1`` (padding) is skipped. The launch
reads no values on the host (CUDA-graph friendly), so it cannot raise on a slot past the pool:
such a slot is skipped too rather than written out of bounds (the torch backend raises).

An fp8 cache (:mod:`.kv_quant`) gets ``key / k_scale`` (IEEE division, float32) clamped to
+-448 and rounded to nearest e4m3, as the torch reference does; values likewise with ``v_scale``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_last_dim_contiguous
from .kv_quant import FP8_MAX as _FP8_MAX, is_fp8, scale_pointers, scale_stride
from .launch import PreparedLaunch

FP8_MAX = tl.constexpr(_FP8_MAX)


@triton.jit
def _round_to_e4m3(x):
    """float32 ``x`` with ``|x| <= 448`` -> the nearest e4m3 value (ties to even), float32.

    Adding then subtracting ``c = 2^(e + 20)``, ``e = max(floor(log2 |x|), -6)``, rounds
    ``|x|`` to a multiple of ``2^(e - 3)`` (float32's rounding, to nearest even): e4m3's 3
    mantissa bits, and its subnormal step ``2^-9`` below ``2^-6``. The conversion to e4m3 that
    follows is then exact. Rounding here rather than in the conversion gives the same bits on
    a GPU and under the Triton interpreter, whose conversion rounds wrongly where the mantissa
    carries into the exponent (127.7 -> 64). NaN stays NaN; the sign (of -0.0 too) is kept.
    """
    bits = x.to(tl.int32, bitcast=True)
    exp = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)   # floor(log2 |x|), at least -6
    c = ((exp + 20 + 127) << 23).to(tl.float32, bitcast=True)
    r = (tl.abs(x) + c) - c
    # x's sign bit onto r (a negation would be 0 - r: +0.0 where -0.0 is due).
    sign = (bits >> 31) << 31
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _quantize(x, scale_ptr, stride_scale, heads, NUM_KV_HEADS: tl.constexpr,
              SCALED: tl.constexpr):
    """x ``[HEADS_PADDED, HEAD_SIZE_PADDED]`` -> e4m3 of ``x / scale[head]`` saturated at
    +-448 (the conversion alone would give NaN past 448)."""
    x = x.to(tl.float32)
    if SCALED:
        scale = tl.load(scale_ptr + heads * stride_scale, mask=heads < NUM_KV_HEADS, other=1.0)
        x = tl.math.div_rn(x, scale[:, None])          # [HEADS_PADDED] -> per row
    x = tl.clamp(x, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    return _round_to_e4m3(x).to(tl.float8e4nv)


@triton.jit
def store_kv_rows(x, cache_ptr, scale_ptr, stride_scale, slot, num_slots, heads, dims,
                  stride_block, stride_token, stride_head, NUM_KV_HEADS: tl.constexpr,
                  HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, QUANTIZE: tl.constexpr,
                  SCALED: tl.constexpr):
    """Write one token's ``x`` (``[HEADS_PADDED, DIMS]``, the values of KV heads ``heads`` at
    dims ``dims`` of each) into ``cache[slot // BLOCK_SIZE, slot % BLOCK_SIZE]``; quantized to
    e4m3 when QUANTIZE (divided by the head's scale first when SCALED). Slot -1 (padding) and
    slots past the pool write nothing."""
    # The slot as a [1, 1] tile, not a scalar: the pool check is then an int1 tile that
    # broadcasts into the mask. A scalar int1 splat into a block is int1 to the compiler, but
    # Triton 3.9's interpreter fills it with integers and its store rejects such a mask.
    slot = tl.full([1, 1], slot, tl.int64)              # [1, 1]
    in_pool = (slot >= 0) & (slot < num_slots)          # [1, 1], int1
    valid = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_SIZE) & in_pool
    # valid: [HEADS_PADDED, DIMS]
    if QUANTIZE:
        x = _quantize(x, scale_ptr, stride_scale, heads, NUM_KV_HEADS, SCALED)
    dst = ((slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_token
           + heads[:, None] * stride_head + dims[None, :])
    tl.store(cache_ptr + dst, x.to(cache_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, k_scale_ptr, v_scale_ptr,
    slot_mapping_ptr, num_slots, stride_k_scale, stride_v_scale,
    stride_k_token, stride_k_head, stride_v_token, stride_v_head,
    stride_kc_block, stride_kc_token, stride_kc_head,
    stride_vc_block, stride_vc_token, stride_vc_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
    HEADS_PADDED: tl.constexpr, HEAD_SIZE_PADDED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    QUANTIZE: tl.constexpr, K_SCALED: tl.constexpr, V_SCALED: tl.constexpr,
):
    """Grid ``(num_tokens,)``. QUANTIZE: the caches are fp8 (K_SCALED / V_SCALED: divide by
    the KV head's scale at ``*_scale_ptr + head * stride_*_scale`` first)."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    heads = tl.arange(0, HEADS_PADDED)              # [HEADS_PADDED]
    dims = tl.arange(0, HEAD_SIZE_PADDED)           # [HEAD_SIZE_PADDED]
    valid = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_SIZE)
    # valid: [HEADS_PADDED, HEAD_SIZE_PADDED]
    src = token.to(tl.int64) * stride_k_token + heads[:, None] * stride_k_head + dims[None, :]
    k = tl.load(key_ptr + src, mask=valid)          # [HEADS_PADDED, HEAD_SIZE_PADDED]
    store_kv_rows(k, key_cache_ptr, k_scale_ptr, stride_k_scale, slot, num_slots, heads, dims,
                  stride_kc_block, stride_kc_token, stride_kc_head, NUM_KV_HEADS, HEAD_SIZE,
                  BLOCK_SIZE, QUANTIZE, K_SCALED)
    src = token.to(tl.int64) * stride_v_token + heads[:, None] * stride_v_head + dims[None, :]
    v = tl.load(value_ptr + src, mask=valid)        # [HEADS_PADDED, HEAD_SIZE_PADDED]
    store_kv_rows(v, value_cache_ptr, v_scale_ptr, stride_v_scale, slot, num_slots, heads, dims,
                  stride_vc_block, stride_vc_token, stride_vc_head, NUM_KV_HEADS, HEAD_SIZE,
                  BLOCK_SIZE, QUANTIZE, V_SCALED)


def triton_store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None
                    ) -> PreparedLaunch | None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` into the caches
    ``[num_blocks, block_size, num_kv_heads, head_size]`` (key's dtype, or fp8: quantized with
    ``k_scale`` / ``v_scale``, None or float32 ``[]`` / ``[num_kv_heads]``) at ``slot_mapping``
    (int32/int64 ``[num_tokens]``; -1 skips). Arguments are validated by
    :func:`~.dispatch.store_kv`.

    Returns:
        The launch, repeatable for tensors of the same shapes in the order ``(key, value,
        key_cache, value_cache, k_scale or key_cache, v_scale or key_cache, slot_mapping)``
        (None under the interpreter or for no tokens).
    """
    for name, t in (("key", key), ("value", value)):
        check_last_dim_contiguous(name, t)
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return None
    num_blocks, block_size = key_cache.shape[:2]
    launch = PreparedLaunch(_store_kv_kernel, (num_tokens,), (
        key, value, key_cache, value_cache, *scale_pointers(key_cache, k_scale, v_scale),
        slot_mapping, num_blocks * block_size, scale_stride(k_scale), scale_stride(v_scale),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2)), dict(
        NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size,
        HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HEAD_SIZE_PADDED=triton.next_power_of_2(head_size), BLOCK_SIZE=block_size,
        QUANTIZE=is_fp8(key_cache.dtype), K_SCALED=k_scale is not None,
        V_SCALED=v_scale is not None,
        num_warps=4 if num_kv_heads * head_size >= 1024 else 1))
    return launch if launch.ready else None


__all__ = ["store_kv_rows", "triton_store_kv"]
