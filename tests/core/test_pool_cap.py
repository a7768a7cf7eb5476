"""The pool's automatic size is capped at the most blocks the running sequences can ever hold
(``max_blocks_in_use``): every sequence at full length, or about one window each when every
layer is windowed. The bound is checked against a brute force over every step shape, and
against the scheduler's peak on a pool far larger than it."""

import itertools
import random

import pytest

from mini_paged_attn.core.args import cdiv
from mini_paged_attn.core.block_manager import BlockManager
from mini_paged_attn.core.kv_cache_manager import KVCacheManager
from mini_paged_attn.core.request import Request
from mini_paged_attn.core.scheduler import Scheduler, SchedulerConfig
from mini_paged_attn.core.sliding_window import (first_needed_block, max_blocks_in_use,
                                                 min_blocks_to_run, window_blocks)

STOP = 0


def brute_force(num_seqs, max_model_len, budget, bs, window) -> int:
    """The most blocks ``num_seqs`` sequences hold in one step whose new tokens add up to at
    most ``budget``: a sequence with ``c`` tokens computed and ``t`` new ones holds blocks
    ``first_needed_block(c) .. cdiv(c + t) - 1``."""
    most_for = [max((cdiv(c + t, bs) - first_needed_block(c, window, bs)
                     for c in range(max_model_len - t + 1)), default=None)
                for t in range(budget + 1)]
    best = [0] + [None] * budget     # best[u]: the most blocks with u new tokens in all
    for _ in range(num_seqs):
        nxt = [None] * (budget + 1)
        for used, blocks in enumerate(best):
            for t in range(budget + 1 - used):
                if blocks is not None and most_for[t] is not None:
                    cand = blocks + most_for[t]
                    if nxt[used + t] is None or cand > nxt[used + t]:
                        nxt[used + t] = cand
        best = nxt
    return max(b for b in best if b is not None)


@pytest.mark.parametrize("num_seqs", [1, 3])
def test_the_cap_bounds_every_step_and_is_nearly_tight(num_seqs):
    for max_len, budget, bs, window in itertools.product((7, 20, 33), (1, 4, 9, 16),
                                                         (1, 2, 4, 5), (1, 2, 5, 8, 40)):
        case = (num_seqs, max_len, budget, bs, window)
        cap, most = max_blocks_in_use(*case), brute_force(*case)
        assert most <= cap <= most + num_seqs, (case, most, cap)
        assert cap <= max_blocks_in_use(num_seqs, max_len, budget, bs, None)


def test_full_attention_needs_every_sequence_at_full_length():
    assert max_blocks_in_use(256, 32768, 8192, 16, None) == 256 * 2048
    assert max_blocks_in_use(3, 33, 9, 4, None) == 3 * 9


def test_a_long_context_windowed_model_needs_about_a_window_per_sequence():
    # 4096-token window, blocks of 16: a window spans cdiv(4095, 16) + 1 = 257 blocks. The
    # 8192-token step budget adds at most 256 + (8192 - 512) // 16 = 736 blocks of new tokens.
    cap = max_blocks_in_use(256, 32768, 8192, 16, 4096)
    assert window_blocks(4096, 16) == 257 and cap == 256 * 257 + 736
    assert cap * 7 < max_blocks_in_use(256, 32768, 8192, 16, None)
    # A window longer than the context saves nothing.
    assert max_blocks_in_use(4, 100, 64, 16, 4096) == 4 * cdiv(100, 16)
    # Each sequence can still run alone in the capped pool.
    assert cap >= min_blocks_to_run(32768, 16, 4096)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_the_scheduler_never_holds_more_than_the_cap(prefix_caching):
    bs, window, max_num_seqs, budget, max_len = 2, 5, 4, 16, 64
    cap = max_blocks_in_use(max_num_seqs, max_len, budget, bs, window)
    # A pool far larger than the cap: nothing but the window limits what is held.
    kv = KVCacheManager(BlockManager(cap * 10), bs, prefix_caching, window)
    sched = Scheduler(SchedulerConfig(max_num_seqs, budget, max_len), kv)
    rng = random.Random(0)
    shared = [rng.randrange(1, 50) for _ in range(12)]
    for i in range(10):
        prompt = (shared if i % 2 else []) + [rng.randrange(1, 50)
                                              for _ in range(rng.randrange(1, 40))]
        sched.add_request(Request(f"r{i}", prompt, rng.randrange(1, 20), frozenset({STOP})))
    peak = 0
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        held = sum(len(s.block_ids) - s.num_dropped_blocks for s in sched.running)
        peak = max(peak, held)
        sched.update(out, [[rng.randrange(1, 50) for _ in range(k)] for k in out.num_samples])
    assert not sched.has_unfinished()
    assert window_blocks(window, bs) * max_num_seqs < peak <= cap, (peak, cap)
