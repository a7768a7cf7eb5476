"""Speculative steps in the scheduler and the KV cache manager: a decoding sequence with k
proposals computes k + 1 tokens, the rejected ones' blocks go back, only verified blocks join
the prefix cache, and a stop token or the length inside the accepted run ends the sample where
one token a step would have; then the Hypothesis state machine of test_scheduler with
speculative steps among its rules (simulated device: every query reads its own tokens, every
cached block holds its tokens)."""

import random

import hypothesis.strategies as st
from hypothesis.stateful import rule

from helpers.scheduler_sim import (STOP, assert_all_free, check_blocks, drain, machine_test,
                                   make_scheduler, step, submit)
from mini_paged_attn.core.request import FinishReason
from test_scheduler import PlainSchedulerMachine


def _decoding(sched, device, rng, prompt, max_tokens=20, block_size=4, **kw):
    """A sequence past its prompt step, decoding."""
    request = submit(sched, "a", prompt, max_tokens=max_tokens, **kw)
    step(sched, device, rng)
    return request.sequences[0]


def test_proposals_take_k_plus_one_tokens_and_rejected_blocks_go_back():
    sched, device = make_scheduler(16, 4, max_num_batched_tokens=16)
    rng = random.Random(0)
    seq = _decoding(sched, device, rng, [1, 2, 3, 4, 5, 6, 7])     # 8 tokens, 7 computed
    free = sched.kv.num_free_blocks()
    seq.spec_token_ids = [11, 12, 13, 14, 15, 16]
    out = sched.schedule()
    assert out.num_new_tokens == [7] and out.num_samples == [0]
    assert out.spec_token_ids == {0: [11, 12, 13, 14, 15, 16]} and seq.spec_token_ids == []
    assert len(seq.block_ids) == 4                   # positions 7 .. 13: blocks 1 .. 3 more
    device.run(out)
    sched.update(out, [[11, 40]])                    # one accepted, then the model's own
    assert seq.token_ids[-2:] == [11, 40]
    assert seq.num_computed_tokens == 9 == seq.num_tokens - 1
    assert len(seq.block_ids) == 3                    # the block only rejections reached
    assert sched.kv.num_free_blocks() == free - 1     # block 2 holds token 9 on
    check_blocks(sched)
    device.check_cache(sched.kv)


def test_only_verified_full_blocks_join_the_prefix_cache():
    sched, device = make_scheduler(16, 4, max_num_batched_tokens=16)
    rng = random.Random(1)
    seq = _decoding(sched, device, rng, [1, 2, 3, 4, 5])          # 6 tokens, 5 computed
    cached = sched.kv.prefix_cache.num_cached_blocks
    seq.spec_token_ids = [21, 22, 23, 24]
    out = sched.schedule()
    # Positions 5 .. 9 fill block 1 with proposals: not cached before they are verified.
    assert sched.kv.prefix_cache.num_cached_blocks == cached
    device.run(out)
    sched.update(out, [[21, 30]])                     # 5 + 1 + 1 = 7 computed: block 1 open
    assert sched.kv.prefix_cache.num_cached_blocks == cached
    device.check_cache(sched.kv)
    seq.spec_token_ids = [31, 32, 33]
    out = sched.schedule()
    device.run(out)
    # All accepted: 11 computed. Block 1 was cached with its last token, the one this step
    # computed first (known when it was allocated); block 2 is not full.
    sched.update(out, [[31, 32, 33, 34]])
    assert seq.num_computed_tokens == 11
    assert sched.kv.prefix_cache.num_cached_blocks == cached + 1
    device.check_cache(sched.kv)
    check_blocks(sched)
    drain(sched, device, rng)
    assert_all_free(sched)


def test_a_stop_token_inside_the_accepted_run_ends_the_sample_there():
    sched, device = make_scheduler(16, 4, max_num_batched_tokens=16)
    rng = random.Random(2)
    seq = _decoding(sched, device, rng, [1, 2, 3])
    seq.spec_token_ids = [7, STOP, 9]
    out = sched.schedule()
    device.run(out)
    before = seq.num_tokens
    sched.update(out, [[7, STOP, 9, 10]])
    assert seq.token_ids[before:] == [7, STOP]
    assert seq.finish_reason is FinishReason.STOP and seq.block_ids == []
    assert_all_free(sched)


def test_the_length_inside_the_accepted_run_ends_the_sample_there():
    sched, device = make_scheduler(16, 4, max_num_batched_tokens=16)
    rng = random.Random(3)
    seq = _decoding(sched, device, rng, [1, 2, 3], max_tokens=4)     # 1 generated, 3 to go
    seq.spec_token_ids = [7, 8, 9, 10, 11]
    out = sched.schedule()
    # At most the 2 proposals that leave room for the verification's own token.
    assert out.spec_token_ids == {0: [7, 8]} and out.num_new_tokens == [3]
    device.run(out)
    sched.update(out, [[7, 8, 12]])
    assert seq.num_output_tokens == 4 and seq.finish_reason is FinishReason.LENGTH
    assert_all_free(sched)


def test_proposals_are_cut_to_the_budget():
    sched, device = make_scheduler(8, 4, max_num_batched_tokens=3)
    rng = random.Random(4)
    seq = _decoding(sched, device, rng, [1, 2, 3], max_tokens=8)
    seq.spec_token_ids = [5, 6, 7, 8]
    out = sched.schedule()
    assert out.spec_token_ids == {0: [5, 6]} and out.num_batched_tokens == 3
    device.run(out)
    sched.update(out, [[5, 6, 9]])
    assert seq.token_ids[-3:] == [5, 6, 9] and seq.num_computed_tokens == 6
    check_blocks(sched)


def test_proposals_without_room_in_the_pool_are_dropped_never_preempting():
    # 3 blocks of 4: a holds 2, b 1; a's proposals would need a fourth.
    sched, device = make_scheduler(3, 4, max_num_batched_tokens=16, prefix_caching=False)
    rng = random.Random(4)
    a = _decoding(sched, device, rng, [1, 2, 3, 4, 5], max_tokens=7)
    b = submit(sched, "b", [30, 31, 32], max_tokens=2)
    step(sched, device, rng)
    assert len(a.block_ids) == 2 and len(b.sequences[0].block_ids) == 1
    a.spec_token_ids = [1] * 6
    out = sched.schedule()
    assert out.spec_token_ids == {} and not out.preempted and out.num_new_tokens == [1, 1]
    device.run(out)
    sched.update(out, [[3] for _ in out.seqs])
    drain(sched, device, rng)
    assert b.is_finished and a.num_output_tokens == 7
    assert_all_free(sched)


def test_forked_samples_verify_their_own_proposals_over_shared_blocks():
    sched, device = make_scheduler(24, 4, max_num_batched_tokens=32)
    rng = random.Random(5)
    request = submit(sched, "a", range(1, 7), max_tokens=10, n=2)
    step(sched, device, rng)
    parent, child = request.sequences
    assert parent.block_ids == child.block_ids
    parent.spec_token_ids, child.spec_token_ids = [40, 41, 42], [43, 44]
    out = sched.schedule()
    assert len(out.block_copies) == 1                  # the shared, open block is copied once
    assert out.spec_token_ids == {0: [40, 41, 42], 1: [43, 44]}
    device.run(out)
    sched.update(out, [[40, 5], [9]])
    assert parent.token_ids[-2:] == [40, 5] and child.token_ids[-1] == 9
    assert parent.block_ids[0] == child.block_ids[0] != parent.block_ids[1]
    check_blocks(sched)
    drain(sched, device, rng)
    assert_all_free(sched)


class SpeculativeSchedulerMachine(PlainSchedulerMachine):
    """test_scheduler's machine where most decoding sequences verify random proposals each
    step (a random prefix of them accepted, stops inside the accepted runs), with longer
    outputs so that there is room to propose."""

    propose = 0.8

    @rule(prefix=st.integers(0, 2), prompt_len=st.integers(1, 12), max_tokens=st.integers(1, 16),
          n=st.integers(1, 3))
    def submit(self, prefix, prompt_len, max_tokens, n):
        self.submit_random(prefix, prompt_len, max_tokens, n)


test_speculative_scheduler_state_machine = machine_test(SpeculativeSchedulerMachine)


def test_seeded_speculative_soak():
    """Many requests with shared prefixes through a tiny pool, most steps speculating."""
    rng = random.Random(99)
    sched, device = make_scheduler(12, 2, max_num_seqs=3, max_num_batched_tokens=8,
                                   max_model_len=24)
    prefix = [rng.randrange(1, 50) for _ in range(6)]
    for i in range(60):
        prompt = prefix[:rng.randrange(0, 7)] + [rng.randrange(1, 50)
                                                  for _ in range(rng.randrange(1, 6))]
        submit(sched, f"r{i}", prompt, max_tokens=rng.randrange(1, 24 - len(prompt) + 1),
               n=rng.choice([1, 1, 2]))
        for _ in range(rng.randrange(0, 4)):
            if sched.has_unfinished():
                step(sched, device, rng, stop_prob=0.05, propose=0.8)
                check_blocks(sched)
                device.check_cache(sched.kv)
    drain(sched, device, rng)
    assert sched.num_preemptions > 0 and sched.kv.num_hit_tokens > 0
    assert_all_free(sched)
