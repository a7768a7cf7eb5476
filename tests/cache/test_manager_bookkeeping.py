"""PagedAttentionManager's block bookkeeping: its own by default (the seed API), an injected
``KVCacheManager`` (the engine's, shared with its scheduler), or none (a tensor-parallel rank
other than 0); bad combinations are refused before anything is built."""

from __future__ import annotations

import pytest
import torch

from mini_paged_attn import PagedAttentionManager
from mini_paged_attn.core.block_manager import BlockManager
from mini_paged_attn.core.kv_cache_manager import KVCacheManager


def make(num_blocks=16, block_size=4, **kw):
    return PagedAttentionManager(4, 2, 8, block_size, num_blocks, dtype=torch.float32, **kw)


def test_without_a_manager_the_pool_builds_its_own():
    m = make(enable_prefix_caching=True, sliding_window=8)
    assert isinstance(m.kv_manager, KVCacheManager)
    assert m.block_manager is m.kv_manager.block_manager
    assert m.kv_manager.enable_prefix_caching and m.kv_manager.sliding_window == 8
    assert m.kv_manager is not make().kv_manager


def test_an_injected_manager_is_the_one_the_pool_follows():
    kv = KVCacheManager(BlockManager(16), 4, enable_prefix_caching=True)
    m = make(kv_manager=kv)
    assert m.kv_manager is kv and m.block_manager is kv.block_manager
    m.add_sequence(0, 6)                     # the seed API allocates from it too
    assert kv.block_manager.get_num_free_blocks() == 14
    m.fork_sequence(0, 1)
    m.append_token(1, 6)                     # copy-on-write of the shared last block
    assert kv.block_manager.get_num_free_blocks() == 13
    refs = [b.ref_count for b in m.memory_map().blocks]
    assert refs == [kv.block_manager.get_ref_count(i) for i in range(16)]


@pytest.mark.parametrize("kwargs, match", [
    (dict(kv_manager=KVCacheManager(BlockManager(8), 4)), "16 blocks of 4 tokens"),
    (dict(kv_manager=KVCacheManager(BlockManager(16), 8)), "got 16 blocks of 8"),
    (dict(kv_manager=KVCacheManager(BlockManager(16), 4), enable_prefix_caching=True),
     "enable_prefix_caching"),
    (dict(kv_manager=KVCacheManager(BlockManager(16), 4), sliding_window=8), "sliding_window"),
    (dict(kv_manager=KVCacheManager(BlockManager(16), 4), block_bookkeeping=False),
     "block_bookkeeping=False"),
    (dict(kv_manager=BlockManager(16)), "expected a KVCacheManager or None, got BlockManager"),
    (dict(block_bookkeeping=1), "block_bookkeeping"),
])
def test_bad_bookkeeping_arguments_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make(**kwargs)


def test_a_pool_without_bookkeeping_stores_and_copies_only():
    m = make(block_bookkeeping=False)
    assert m.kv_manager is None and m.block_manager is None
    m.kv_caches[0][1].fill_(3.0)
    m.copy_blocks([(1, 5)])
    assert torch.equal(m.kv_caches[0][5], m.kv_caches[0][1])
    for call in (lambda: m.add_sequence(0, 4), m.memory_map):
        with pytest.raises(RuntimeError, match="no block bookkeeping"):
            call()
    with pytest.raises(ValueError, match="unknown sequence"):
        m.append_token(0, 0)
    m.free_sequence(0)                       # unknown ids are a no-op, as with bookkeeping
    assert "free_blocks=-/16" in repr(m)
