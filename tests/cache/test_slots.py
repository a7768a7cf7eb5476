"""slot_mapping and write_slots against plain Python loops, on NaN-poisoned strided caches."""

from __future__ import annotations

import pytest
import torch

from mini_paged_attn.cache.slots import slot_mapping, write_slots


def expected_slot(blocks: list[int], pos: int, block_size: int) -> int:
    return -1 if pos == -1 else blocks[pos // block_size] * block_size + pos % block_size


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_slot_mapping_one_row(block_size):
    g = torch.Generator().manual_seed(block_size)
    blocks = torch.randperm(40, generator=g)[:5].tolist()
    capacity = 5 * block_size
    positions = [0, block_size - 1, block_size, capacity - 1, -1,
                 *torch.randint(0, capacity, (10,), generator=g).tolist()]
    got = slot_mapping(torch.tensor(blocks, dtype=torch.int32), positions, block_size)
    assert got.dtype == torch.int64 and got.shape == (len(positions),)
    assert got.tolist() == [expected_slot(blocks, p, block_size) for p in positions]
    assert slot_mapping(blocks, torch.tensor(positions), block_size).tolist() == got.tolist()


def test_slot_mapping_one_row_per_token():
    block_size = 4
    g = torch.Generator().manual_seed(0)
    table = torch.randperm(24, generator=g)[:18].reshape(3, 6).to(torch.int32)
    seq_of_token = torch.tensor([2, 0, 0, 1, 2, 1, 0])
    positions = torch.tensor([23, 0, 5, 12, -1, 3, 17])
    got = slot_mapping(table[seq_of_token], positions, block_size)
    want = [expected_slot(table[s].tolist(), int(p), block_size)
            for s, p in zip(seq_of_token.tolist(), positions)]
    assert got.tolist() == want


@pytest.mark.parametrize("positions", [[8], [-2], [0, 100]])
def test_slot_mapping_rejects_positions_outside_the_blocks(positions):
    with pytest.raises(ValueError, match=r"positions: expected positions in \[0, 8\)"):
        slot_mapping([3, 1], positions, 4)


def test_slot_mapping_rejects_bad_shapes_and_block_size():
    with pytest.raises(ValueError, match="block_size"):
        slot_mapping([0], [0], 0)
    with pytest.raises(ValueError, match="positions: expected a 1-D"):
        slot_mapping([0], [[0]], 4)
    with pytest.raises(ValueError, match="block_ids"):
        slot_mapping(torch.zeros(3, 2, dtype=torch.int64), [0, 1], 4)


def poisoned_pool(num_blocks, block_size, num_kv_heads, head_size, dtype):
    pool = torch.full((num_blocks, block_size, 2, num_kv_heads, head_size), float("nan"),
                      dtype=dtype)
    return pool, pool[:, :, 0], pool[:, :, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_write_slots_writes_only_the_named_slots(dtype, slot_dtype):
    num_blocks, block_size, num_kv_heads, head_size = 6, 4, 2, 8
    pool, key_cache, value_cache = poisoned_pool(num_blocks, block_size, num_kv_heads,
                                                 head_size, dtype)
    g = torch.Generator().manual_seed(1)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:9]
    slots[[2, 7]] = -1  # padding tokens
    key = torch.randn(9, num_kv_heads, head_size, generator=g).to(dtype)
    value = torch.randn(9, num_kv_heads, head_size, generator=g).to(dtype)
    write_slots(key, value, key_cache, value_cache, slots.to(slot_dtype))

    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for t, s in enumerate(slots.tolist()):
        if s == -1:
            continue
        b, o = divmod(s, block_size)
        written[b, o] = True
        assert torch.equal(pool[b, o, 0], key[t]) and torch.equal(pool[b, o, 1], value[t])
    assert pool[~written].isnan().all()  # every other slot, K and V, untouched


def test_write_slots_into_contiguous_caches_and_empty_batch():
    key_cache = torch.full((3, 2, 1, 4), float("nan"))
    value_cache = torch.full((3, 2, 1, 4), float("nan"))
    write_slots(torch.empty(0, 1, 4), torch.empty(0, 1, 4), key_cache, value_cache,
                torch.empty(0, dtype=torch.int64))
    assert key_cache.isnan().all() and value_cache.isnan().all()
    key, value = torch.ones(2, 1, 4), torch.full((2, 1, 4), 2.0)
    write_slots(key, value, key_cache, value_cache, torch.tensor([5, -1]))
    assert torch.equal(key_cache[2, 1], key[0]) and torch.equal(value_cache[2, 1], value[0])
    assert key_cache.isnan().sum() == value_cache.isnan().sum() == 5 * 4
