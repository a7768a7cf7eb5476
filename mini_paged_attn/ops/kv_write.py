"""Triton store_kv: write the new tokens' K/V into the paged caches by slot.

One program per token copies its ``[num_kv_heads, head_size]`` key and value rows to
``cache[slot // block_size, slot % block_size]``. Slot ``-1`` (padding) is skipped. The launch
reads no values on the host (CUDA-graph friendly), so it cannot raise on a slot past the pool:
such a slot is skipped too rather than written out of bounds (the torch backend raises).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_last_dim_contiguous
from .launch import PreparedLaunch


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr, num_slots,
    stride_k_token, stride_k_head, stride_v_token, stride_v_head,
    stride_kc_block, stride_kc_token, stride_kc_head,
    stride_vc_block, stride_vc_token, stride_vc_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
    HEADS_PADDED: tl.constexpr, HEAD_SIZE_PADDED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    """Grid ``(num_tokens,)``."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    in_pool = (slot >= 0) & (slot < num_slots)      # -1 is padding; beyond the pool: skip
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = tl.arange(0, HEADS_PADDED)              # [HEADS_PADDED]
    dims = tl.arange(0, HEAD_SIZE_PADDED)           # [HEAD_SIZE_PADDED]
    valid = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_SIZE) & in_pool
    # valid: [HEADS_PADDED, HEAD_SIZE_PADDED]

    src = token.to(tl.int64) * stride_k_token + heads[:, None] * stride_k_head + dims[None, :]
    k = tl.load(key_ptr + src, mask=valid)          # [HEADS_PADDED, HEAD_SIZE_PADDED]
    dst = (block * stride_kc_block + offset * stride_kc_token
           + heads[:, None] * stride_kc_head + dims[None, :])
    tl.store(key_cache_ptr + dst, k, mask=valid)

    src = token.to(tl.int64) * stride_v_token + heads[:, None] * stride_v_head + dims[None, :]
    v = tl.load(value_ptr + src, mask=valid)        # [HEADS_PADDED, HEAD_SIZE_PADDED]
    dst = (block * stride_vc_block + offset * stride_vc_token
           + heads[:, None] * stride_vc_head + dims[None, :])
    tl.store(value_cache_ptr + dst, v, mask=valid)


def triton_store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, slot_mapping: torch.Tensor
                    ) -> PreparedLaunch | None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` into the caches
    ``[num_blocks, block_size, num_kv_heads, head_size]`` at ``slot_mapping`` (int32/int64
    ``[num_tokens]``; -1 skips). Arguments are validated by :func:`~.dispatch.store_kv`.

    Returns:
        The launch, repeatable for tensors of the same shapes in the order ``(key, value,
        key_cache, value_cache, slot_mapping)`` (None under the interpreter or for no tokens).
    """
    for name, t in (("key", key), ("value", value)):
        check_last_dim_contiguous(name, t)
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return None
    num_blocks, block_size = key_cache.shape[:2]
    launch = PreparedLaunch(_store_kv_kernel, (num_tokens,), (
        key, value, key_cache, value_cache, slot_mapping, num_blocks * block_size,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2)), dict(
        NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size,
        HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HEAD_SIZE_PADDED=triton.next_power_of_2(head_size), BLOCK_SIZE=block_size,
        num_warps=4 if num_kv_heads * head_size >= 1024 else 1))
    return launch if launch.ready else None


__all__ = ["triton_store_kv"]
