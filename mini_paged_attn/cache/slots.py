"""Slots: where a token's K/V lives in the paged pool, and the plain-torch write of K/V there.

A *slot* is ``physical_block * block_size + offset``: token ``p`` of a sequence lives in block
``block_table[p // block_size]`` at offset ``p % block_size``. Slot ``-1`` means "no slot"
(padding): writes skip it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..core.args import as_int, positive_int

PAD_SLOT = -1
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def slot_mapping(block_ids: torch.Tensor | Sequence[int], positions: torch.Tensor | Sequence[int],
                 block_size: int) -> torch.Tensor:
    """Slots of tokens at logical ``positions``, vectorised.

    Args:
        block_ids: integer ``[num_logical_blocks]`` (one sequence's blocks, e.g. a block-table
            row, shared by all tokens) or ``[num_tokens, num_logical_blocks]`` (one table row per
            token, e.g. ``block_tables[seq_index_of_token]``). A list works too.
        positions: integer ``[num_tokens]``, each token's position in its sequence, or ``-1``
            for a padding token.
        block_size: tokens per block.

    Returns:
        int64 ``[num_tokens]`` on ``block_ids``' device: ``block * block_size + offset``, and
        ``-1`` where the position is ``-1``.

    Raises:
        ValueError: a position outside ``[-1, num_logical_blocks * block_size)``, bad ranks.
            (Checking values reads them on the host: build slot mappings from host tensors.)
    """
    block_size = positive_int("block_size", as_int("block_size", block_size))
    blocks = torch.as_tensor(block_ids).to(torch.int64)
    pos = torch.as_tensor(positions, device=blocks.device).to(torch.int64)
    if pos.dim() != 1:
        raise ValueError(f"positions: expected a 1-D tensor, got shape {tuple(pos.shape)}")
    if blocks.dim() not in (1, 2) or (blocks.dim() == 2 and blocks.shape[0] != pos.shape[0]):
        raise ValueError(f"block_ids: expected shape [num_logical_blocks] or [{pos.shape[0]}, "
                         f"num_logical_blocks] (one row per token), got {tuple(blocks.shape)}")
    capacity = blocks.shape[-1] * block_size
    bad = (pos < PAD_SLOT) | (pos >= capacity)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        raise ValueError(f"positions: expected positions in [0, {capacity}) (the blocks given "
                         f"hold {capacity} tokens) or -1 for padding, got positions[{i}]="
                         f"{int(pos[i])}")
    is_pad = pos == PAD_SLOT
    logical = torch.where(is_pad, 0, pos) // block_size
    if blocks.dim() == 1:
        physical = blocks[logical]
    else:
        physical = torch.gather(blocks, 1, logical[:, None])[:, 0]
    slots = physical * block_size + pos % block_size
    return torch.where(is_pad, PAD_SLOT, slots)


def write_slots(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new tokens' K/V into the paged caches, in place (the torch ``store_kv``).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_size]`` in the caches' dtype and device
            (for an fp8 cache: already quantized, see :mod:`.fp8`).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, any
            strides (e.g. the views of ``PagedAttentionManager.kv_cache``); written in place.
        slot_mapping: int32 or int64 ``[num_tokens]``; token ``t`` goes to block
            ``slot // block_size``, offset ``slot % block_size``; ``-1`` skips the token.

    Only the slots named are written; nothing else in the caches changes. Arguments are not
    checked here (``ops.store_kv`` and ``PagedAttentionManager.write_kv`` check them); slots must
    lie in ``[-1, num_blocks * block_size)`` and be distinct apart from ``-1`` (if two tokens
    name the same slot, which one lands is unspecified).
    """
    block_size = key_cache.shape[1]
    if key_cache.dtype in FP8_DTYPES:
        # Copy fp8 values as their bytes: indexing works for uint8 on every device.
        key, value = key.view(torch.uint8), value.view(torch.uint8)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].to(torch.int64)
    blocks, offsets = slots // block_size, slots % block_size
    # Advanced-index assignment is index_put_ on the (possibly strided) view: it writes the
    # pool's storage in place and touches only the indexed rows.
    key_cache[blocks, offsets] = key[keep]
    value_cache[blocks, offsets] = value[keep]
