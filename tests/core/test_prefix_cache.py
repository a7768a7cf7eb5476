"""Prefix cache and KV cache manager: hashes, hits, token check, LRU eviction, fork/COW, accounting."""

from mini_paged_attn.core.block_manager import BlockManager
from mini_paged_attn.core.kv_cache_manager import NO_HIT, KVCacheManager
from mini_paged_attn.core.prefix_cache import ROOT_HASH, PrefixCache, hash_block
from mini_paged_attn.core.request import Request, Sequence

BS = 4


def make_seq(tokens, seq_id=0, n=1):
    request = Request(f"r{seq_id}", list(tokens), max_tokens=8, n=n)
    seq = Sequence(seq_id, request, 0, list(tokens))
    request.sequences.append(seq)
    return seq


def admit(kv, seq):
    """Schedule the whole sequence at once, as the scheduler admits it (hits first)."""
    hit = kv.find_cached_prefix(seq)
    copies = kv.allocate_slots(seq, seq.num_tokens - hit.num_tokens, hit)
    assert copies is not None
    seq.num_computed_tokens = seq.num_tokens
    return hit


def ref_counts(kv):
    return [kv.block_manager.get_ref_count(b) for b in range(kv.num_blocks)]


def test_chained_hash_depends_on_prefix():
    h1 = hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert hash_block(ROOT_HASH, [1, 2, 3, 4]) == h1
    assert hash_block(h1, [5, 6, 7, 8]) != hash_block(hash_block(ROOT_HASH, [9, 9, 9, 9]),
                                                        [5, 6, 7, 8])


def test_chained_hash_is_not_pythons_invertible_hash():
    # Python hashes ints modulo 2**61 - 1: parents p and p + 2**61 - 1 would name one block,
    # and the token check compares only the parent *hash*, so that would be wrong KV.
    h1 = hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert hash_block(h1, [5, 6, 7, 8]) != hash_block(h1 + 2**61 - 1, [5, 6, 7, 8])
    assert hash((h1, (5, 6, 7, 8))) == hash((h1 + 2**61 - 1, (5, 6, 7, 8)))


def test_token_check_rejects_a_colliding_hash():
    cache = PrefixCache()
    assert cache.insert(123, ROOT_HASH, (1, 2, 3, 4), block_id=7)
    assert cache.lookup(123, ROOT_HASH, (1, 2, 3, 4)) == 7
    assert cache.lookup(123, ROOT_HASH, (1, 2, 3, 5)) is None      # same hash, other tokens
    assert cache.lookup(123, 99, (1, 2, 3, 4)) is None             # other prefix
    assert not cache.insert(123, ROOT_HASH, (1, 2, 3, 4), block_id=8)  # first block stays


def test_hit_reuses_full_blocks_and_counts_free_blocks():
    kv = KVCacheManager(BlockManager(8), BS)
    a = make_seq(range(10), 0)
    admit(kv, a)
    assert len(a.block_ids) == 3 and kv.num_free_blocks() == 5
    kv.free(a)
    # Two full blocks stay cached (evictable, still counted as free); the partial one is freed.
    assert kv.prefix_cache.num_evictable_blocks == 2
    assert kv.num_free_blocks() == 8
    assert kv.block_manager.get_num_free_blocks() == 6

    b = make_seq([*range(9), 42, 43], 1)
    hit = admit(kv, b)
    assert hit.num_tokens == 8 and b.block_ids[:2] == list(hit.block_ids)
    assert b.num_cached_tokens == 8
    assert kv.prefix_cache.num_evictable_blocks == 0       # taken over by b
    assert [kv.block_manager.get_ref_count(x) for x in hit.block_ids] == [1, 1]

    # A third sequence shares the blocks b holds: their counts go up.
    c = make_seq([*range(8), 7], 2)
    hit_c = admit(kv, c)
    assert hit_c.block_ids == hit.block_ids
    assert [kv.block_manager.get_ref_count(x) for x in hit.block_ids] == [2, 2]
    for s in (b, c):
        kv.free(s)
    assert kv.num_free_blocks() == 8
    kv.reset_prefix_cache()
    assert ref_counts(kv) == [0] * 8 and kv.block_manager.get_num_free_blocks() == 8


def test_fully_cached_prompt_still_computes_its_last_token():
    kv = KVCacheManager(BlockManager(8), BS)
    a = make_seq(range(8))
    admit(kv, a)
    kv.free(a)
    again = make_seq(range(8), 1)
    hit = kv.find_cached_prefix(again)
    assert hit.num_tokens == 4      # the second block holds the last token: recomputed


def test_caching_off_gives_no_hits_and_frees_everything():
    kv = KVCacheManager(BlockManager(8), BS, enable_prefix_caching=False)
    a = make_seq(range(10))
    admit(kv, a)
    kv.free(a)
    assert kv.block_manager.get_num_free_blocks() == 8
    assert kv.find_cached_prefix(make_seq(range(10), 1)) is NO_HIT


def test_lru_eviction_order():
    kv = KVCacheManager(BlockManager(6), BS)
    a = make_seq(range(8), 0)          # 2 full blocks
    b = make_seq(range(100, 108), 1)   # 2 full blocks
    admit(kv, a)
    admit(kv, b)
    a_blocks, b_blocks = list(a.block_ids), list(b.block_ids)
    kv.free(a)
    kv.free(b)
    assert kv.prefix_cache.evictable_blocks() == [a_blocks[1], a_blocks[0], b_blocks[1], b_blocks[0]]
    # 2 free in the pool + 4 evictable; a 5-block sequence takes the 2 free, then evicts a's.
    c = make_seq(range(200, 220), 2)
    assert kv.allocate_slots(c, 20) is not None
    assert kv.prefix_cache.evictable_blocks() == [b_blocks[0]]
    assert kv.find_cached_prefix(make_seq([*range(8), 1], 3)) is NO_HIT   # a's prefix is gone
    assert kv.find_cached_prefix(make_seq([*range(100, 108), 1], 4)).num_tokens == 4  # b's head stays


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(BlockManager(4), BS)
    a = make_seq(range(12))
    admit(kv, a)
    before = (ref_counts(kv), list(a.block_ids), a.num_computed_tokens)
    b = make_seq(range(50, 58), 1)
    assert kv.allocate_slots(b, 8) is None
    assert (ref_counts(kv), list(a.block_ids), a.num_computed_tokens) == before
    assert b.block_ids == []


def test_fork_shares_blocks_and_copies_a_shared_partial_block_once():
    kv = KVCacheManager(BlockManager(8), BS)
    parent = make_seq(range(6), 0, n=2)
    admit(kv, parent)
    child = Sequence(1, parent.request, 1, list(parent.token_ids))
    kv.fork(parent, child)
    assert child.block_ids == parent.block_ids
    assert [kv.block_manager.get_ref_count(b) for b in parent.block_ids] == [2, 2]
    parent.token_ids.append(7)
    child.token_ids.append(8)
    shared_last = parent.block_ids[1]
    parent.blocks_changed_from = 2          # as if the runner had copied the table row
    copies = kv.allocate_slots(parent, 1)       # first writer into the shared partial block
    assert copies == [(shared_last, parent.block_ids[1])] and parent.block_ids[1] != shared_last
    assert parent.blocks_changed_from == 1
    assert kv.allocate_slots(child, 1) == []    # now the only owner: writes in place
    assert child.block_ids[1] == shared_last
    assert kv.block_manager.get_ref_count(parent.block_ids[0]) == 2      # full block: shared
    for s in (parent, child):
        kv.free(s)
    kv.reset_prefix_cache()
    assert ref_counts(kv) == [0] * 8


def test_hit_accounting_does_not_count_revived_blocks_twice():
    # 3 blocks: a's 2 full blocks are evictable; b hits both and needs 1 more: fits exactly.
    kv = KVCacheManager(BlockManager(3), BS)
    a = make_seq(range(8))
    admit(kv, a)
    kv.free(a)
    b = make_seq([*range(8), 1, 2, 3], 1)
    hit = kv.find_cached_prefix(b)
    assert hit.num_tokens == 8
    assert kv.allocate_slots(b, 3, hit) == []
    # c would need 1 block, none left (b holds all 3).
    c = make_seq([5], 2)
    assert kv.allocate_slots(c, 1, kv.find_cached_prefix(c)) is None
