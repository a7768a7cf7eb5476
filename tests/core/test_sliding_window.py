"""KV blocks left of a uniform sliding window go back to the pool while a sequence runs.

Unit tests of the window arithmetic and of KVCacheManager / Scheduler with a window, and a
Hypothesis state machine (submit / step / failed step / stop / abort, prefix caching, n > 1
forks, preemption) checked against a simulated device that stores which token each KV slot holds
and reads, for each query, only the keys its window reaches.
"""

import random
import sys

import hypothesis.strategies as st
import pytest
from hypothesis.stateful import initialize, rule

from helpers.scheduler_sim import (SchedulerMachine, assert_all_free, check_blocks, drain, held,
                                   machine_test, make_scheduler, step, submit)
from mini_paged_attn.core.args import cdiv
from mini_paged_attn.core.block_manager import BlockManager
from mini_paged_attn.core.kv_cache_manager import KVCacheManager
from mini_paged_attn.core.request import FinishReason, Request, Sequence, SequenceStatus
from mini_paged_attn.core.sliding_window import (PAD_BLOCK_ID, check_sliding_window,
                                                 first_needed_block, min_blocks_to_run,
                                                 window_blocks)


# ---- the arithmetic ---------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, -3, 2.0, True, "8"])
def test_window_must_be_a_positive_int_or_none(bad):
    assert check_sliding_window(None) is None and check_sliding_window(5) == 5
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheManager(BlockManager(4), 2, sliding_window=bad)


def test_first_needed_block_and_window_blocks():
    # W = 4, block 4: the query at 7 sees 4..7, so block 0 (0..3) is dead, block 1 is not.
    assert first_needed_block(7, 4, 4) == 1
    assert first_needed_block(6, 4, 4) == 0                 # the query at 6 still sees 3
    assert first_needed_block(1000, None, 4) == 0
    assert first_needed_block(0, 1, 1) == 0 and first_needed_block(5, 1, 1) == 5
    # W consecutive positions span at most cdiv(W - 1, bs) + 1 blocks: brute force.
    for w in range(1, 12):
        for bs in (1, 2, 3, 4, 8):
            most = max(cdiv(s + w, bs) - s // bs for s in range(3 * bs))
            assert window_blocks(w, bs) == most, (w, bs)
    assert min_blocks_to_run(32768, 16, 4096) == 257
    assert min_blocks_to_run(100, 16, 4096) == 7 and min_blocks_to_run(100, 16, None) == 7


def test_chunk_limit_fills_the_pool_next_to_the_window():
    kv = KVCacheManager(BlockManager(5), 4, sliding_window=6)
    assert kv.chunk_limit(0) == 20                      # the whole pool
    # At 13 the window starts at 8 (block 2): blocks 2..6 (5 blocks) end at position 28.
    assert kv.chunk_limit(13) == 28 - 13
    assert KVCacheManager(BlockManager(5), 4).chunk_limit(13) == sys.maxsize


# ---- the manager ------------------------------------------------------------------------------

def test_decode_holds_one_window_and_pads_what_it_gave_back():
    sched, device = make_scheduler(4, 2, 3, prefix_caching=False)
    rng = random.Random(0)
    request = submit(sched, "a", [1, 2], max_tokens=30)
    seq = request.sequences[0]
    most = 0
    while sched.has_unfinished():
        step(sched, device, rng)
        check_blocks(sched)
        if sched.running:
            most = max(most, len(held(seq)))
    assert seq.num_output_tokens == 30 and most == window_blocks(3, 2) == 2
    assert_all_free(sched)


def test_a_prompt_of_many_windows_runs_on_a_pool_of_one_window():
    # 40 prompt tokens, window 5, blocks of 2: 3 blocks are enough (chunks shrink to fit).
    sched, device = make_scheduler(3, 2, 5, max_num_batched_tokens=16)
    rng = random.Random(1)
    assert min_blocks_to_run(40 + 5 - 1, 2, 5) == 3
    request = submit(sched, "a", [rng.randrange(1, 50) for _ in range(40)], max_tokens=5)
    chunks = []
    while sched.has_unfinished():
        out = step(sched, device, rng)
        chunks.append(out.num_new_tokens[0])
        check_blocks(sched)
    assert request.sequences[0].num_output_tokens == 5
    assert sum(chunks) == 40 + 4 and max(chunks) < 16      # the pool, not the budget, capped
    assert_all_free(sched)


def test_a_forked_sample_keeps_a_shared_block_alive():
    kv = KVCacheManager(BlockManager(8), 2, enable_prefix_caching=False, sliding_window=2)
    request = Request("a", [1, 2, 3, 4], 4, n=2)
    parent = Sequence(0, request, 0, [1, 2, 3, 4])
    child = Sequence(1, request, 1, [1, 2, 3, 4])
    assert kv.allocate_slots(parent, 3) == []
    parent.num_computed_tokens = 3
    kv.fork(parent, child)
    first, second = parent.block_ids
    assert kv.block_manager.get_ref_count(first) == 2
    # The next query (3) sees 2..3: block 0 is dead for both, but each holds a reference.
    assert kv.drop_out_of_window(parent) == 1
    assert parent.block_ids == [PAD_BLOCK_ID, second] and parent.num_dropped_blocks == 1
    assert kv.block_manager.get_ref_count(first) == 1        # the child's
    assert kv.drop_out_of_window(parent) == 0                # nothing is released twice
    kv.free(parent)
    assert kv.block_manager.get_ref_count(first) == 1 and kv.block_manager.get_ref_count(second) == 1
    kv.free(child)
    assert kv.block_manager.get_num_free_blocks() == 8


def test_a_dropped_cached_block_becomes_evictable_and_a_hit_takes_only_its_window():
    bs, window = 2, 3
    sched, device = make_scheduler(12, bs, window)
    rng = random.Random(2)
    prompt = [rng.randrange(1, 50) for _ in range(11)]
    first = submit(sched, "a", prompt, max_tokens=1)
    step(sched, device, rng)                  # the whole prompt; its 5 full blocks are cached
    kv = sched.kv
    assert not sched.has_unfinished()
    assert kv.prefix_cache.num_evictable_blocks == 5
    blocks_of_a = first.sequences[0]
    assert blocks_of_a.block_ids == []
    # The same prompt again: the chain of 5 blocks is found, but the first new query (10) sees
    # 8..10, so only block 4 is taken; blocks 0..3 stay evictable.
    second = submit(sched, "b", prompt, max_tokens=3)
    out = sched.schedule()
    seq = second.sequences[0]
    assert out.num_new_tokens == [1] and seq.num_cached_tokens == 10
    assert seq.num_dropped_blocks == 4 and seq.block_ids[:4] == [PAD_BLOCK_ID] * 4
    assert kv.prefix_cache.num_evictable_blocks == 4
    device.run(out)
    sched.update(out, [[7]])
    check_blocks(sched)
    drain(sched, device, rng)
    assert_all_free(sched)


def test_a_finished_windowed_prompt_is_evicted_tail_first():
    # Dropped blocks were given back head first; a hit needs the chain from its head, so on
    # finishing they move behind the tail in the eviction order.
    kv = KVCacheManager(BlockManager(8), 2, sliding_window=4)
    prompt = list(range(1, 12))
    seq = Sequence(0, Request("a", prompt, 2), 0, prompt)
    assert kv.allocate_slots(seq, 11) == []
    logical = list(seq.block_ids)
    seq.num_computed_tokens = 11
    kv.drop_out_of_window(seq)
    assert kv.prefix_cache.evictable_blocks() == logical[:4]      # head first: evicted first
    kv.free(seq)
    assert kv.prefix_cache.evictable_blocks() == logical[4::-1]   # block 5 is partial: freed


def test_a_hit_that_needs_more_than_the_free_blocks_fails_and_changes_nothing():
    kv = KVCacheManager(BlockManager(6), 2, sliding_window=4)
    prompt = list(range(1, 12))
    seq = Sequence(0, Request("a", prompt, 2), 0, prompt)
    assert kv.allocate_slots(seq, 11) == []
    seq.num_computed_tokens = 11
    assert kv.drop_out_of_window(seq) == 4       # the next query (11) sees 8..11
    kv.free(seq)
    assert kv.prefix_cache.num_evictable_blocks == 5 and kv.block_manager.get_num_free_blocks() == 1
    longer = prompt + [60, 61, 62, 63, 64, 65]
    again = Sequence(1, Request("b", longer, 2), 0, longer)
    hit = kv.find_cached_prefix(again)
    assert hit.num_tokens == 10 and len(hit.block_ids) == 5
    # Query 10 sees 7..10: the hit revives blocks 3 and 4 only; 7 new tokens need 4 more blocks,
    # but with one block held elsewhere only 6 - 1 - 2 = 3 are left.
    hog = kv.block_manager.allocate()
    assert kv.allocate_slots(again, 7, hit) is None
    assert again.block_ids == [] and again.num_dropped_blocks == 0
    assert kv.prefix_cache.num_evictable_blocks == 5 and kv.num_free_blocks() == 5
    kv.block_manager.free(hog)
    assert kv.allocate_slots(again, 7, hit) == []
    assert again.num_dropped_blocks == 3 and again.block_ids[3:5] == list(hit.block_ids[3:])
    assert len(again.block_ids) == 9 and kv.num_free_blocks() == 0


def test_preemption_frees_only_the_held_blocks():
    # Two windowed sequences on a pool that holds about one window each: preemptions happen,
    # nothing is freed twice (the block manager would raise), everything finishes.
    sched, device = make_scheduler(5, 2, 4, max_num_batched_tokens=6, prefix_caching=False)
    rng = random.Random(3)
    a = submit(sched, "a", [rng.randrange(1, 50) for _ in range(9)], max_tokens=12)
    b = submit(sched, "b", [rng.randrange(1, 50) for _ in range(9)], max_tokens=12)
    while sched.has_unfinished():
        step(sched, device, rng)
        check_blocks(sched)
    assert sched.num_preemptions > 0
    assert [r.sequences[0].num_output_tokens for r in (a, b)] == [12, 12]
    assert_all_free(sched)


def test_rollback_of_a_windowed_step_requeues_without_double_free():
    sched, device = make_scheduler(6, 2, 3)
    rng = random.Random(4)
    request = submit(sched, "a", [rng.randrange(1, 50) for _ in range(9)], max_tokens=6)
    step(sched, device, rng)
    step(sched, device, rng)
    seq = request.sequences[0]
    assert seq.num_dropped_blocks > 0
    out = sched.schedule()
    sched.rollback(out)
    assert seq.status is SequenceStatus.WAITING and seq.num_dropped_blocks == 0
    check_blocks(sched)
    drain(sched, device, rng)
    assert seq.num_output_tokens == 6 and seq.finish_reason is FinishReason.LENGTH
    assert_all_free(sched)


# ---- the state machine ------------------------------------------------------------------------

class WindowedSchedulerMachine(SchedulerMachine):
    """Random submit / step / failed step / stop / abort with a sliding window on a pool smaller
    than the prompts: no block is leaked or freed twice, progress is always made, a running
    sequence holds exactly its window, and every query reads its own tokens in its window."""

    @initialize(num_blocks=st.integers(3, 12), block_size=st.sampled_from([1, 2, 4]),
                window=st.integers(1, 9), budget=st.integers(1, 12),
                max_num_seqs=st.integers(1, 4), caching=st.booleans(),
                seed=st.integers(0, 2**16))
    def setup(self, num_blocks, block_size, window, budget, max_num_seqs, caching, seed):
        self.start(*make_scheduler(
            num_blocks, block_size, window, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget, max_model_len=64, prefix_caching=caching),
            seed, prefix_len=16)

    def fits(self, prompt_len, max_tokens):
        kv = self.sched.kv
        need = min_blocks_to_run(prompt_len + max_tokens - 1, kv.block_size, kv.sliding_window)
        return need <= kv.num_blocks

    @rule(prefix=st.integers(0, 2), prompt_len=st.integers(1, 30), max_tokens=st.integers(1, 12),
          n=st.integers(1, 3))
    def submit(self, prefix, prompt_len, max_tokens, n):
        self.submit_random(prefix, prompt_len, max_tokens, n)


test_windowed_scheduler_state_machine = machine_test(WindowedSchedulerMachine)
