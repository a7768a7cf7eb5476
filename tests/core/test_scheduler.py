"""Scheduler + KV cache manager: token budget, chunked prefill, preemption, fork, and a
Hypothesis state machine (submit / step / stop / abort against a tiny pool) checked against a
simulated device that stores which token each KV slot holds."""

import random

import hypothesis.strategies as st
from hypothesis.stateful import initialize, rule

from helpers.scheduler_sim import (SchedulerMachine, assert_all_free, check_blocks, drain,
                                   machine_test, make_scheduler, step, submit)
from mini_paged_attn.core.request import FinishReason


def test_prompt_chunks_and_decodes_share_a_step():
    sched, device = make_scheduler(32, 4, max_num_batched_tokens=10)
    rng = random.Random(0)
    submit(sched, "a", range(1, 7), max_tokens=5)
    out = step(sched, device, rng)
    assert out.num_new_tokens == [6] and out.num_samples == [1]
    submit(sched, "b", range(20, 40))                   # 20 tokens: chunked by the budget
    out = step(sched, device, rng)
    assert [s.request.request_id for s in out.seqs] == ["a", "b"]
    assert out.num_new_tokens == [1, 9] and out.num_samples == [1, 0]
    assert not out.decode_only and out.num_prefill_seqs == 1
    out = step(sched, device, rng)
    assert out.num_new_tokens == [1, 9] and out.num_samples == [1, 0]
    out = step(sched, device, rng)
    assert out.num_new_tokens == [1, 2] and out.num_samples == [1, 1]
    drain(sched, device, rng)
    assert_all_free(sched)


def test_max_num_seqs_limits_the_running_set():
    sched, device = make_scheduler(64, 4, max_num_seqs=2)
    rng = random.Random(0)
    for i in range(4):
        submit(sched, f"r{i}", range(10 * i + 1, 10 * i + 5))
    out = step(sched, device, rng)
    assert out.num_seqs == 2 and sched.num_waiting == 2
    drain(sched, device, rng)


def test_preemption_requeues_the_newest_first_and_everything_finishes():
    # 6 blocks of 2 tokens: two sequences of 5 prompt tokens growing to 10 cannot both fit.
    sched, device = make_scheduler(6, 2, prefix_caching=False)
    rng = random.Random(1)
    a = submit(sched, "a", [1, 2, 3, 4, 5], max_tokens=6)
    b = submit(sched, "b", [6, 7, 8, 9, 10], max_tokens=6)
    preempted = []
    while sched.has_unfinished():
        out = step(sched, device, rng)
        check_blocks(sched)
        preempted += [s.request.request_id for s in out.preempted]
        if out.preempted:
            assert sched.waiting[0] is out.preempted[-1]
    assert preempted and set(preempted) == {"b"} and sched.num_preemptions == len(preempted)
    for r in (a, b):
        assert r.sequences[0].num_output_tokens == 6
        assert r.sequences[0].finish_reason is FinishReason.LENGTH
    assert_all_free(sched)


def test_fork_n2_shares_the_prompt_blocks():
    sched, device = make_scheduler(16, 4)
    rng = random.Random(2)
    request = submit(sched, "a", range(1, 7), max_tokens=3, n=2)
    out = step(sched, device, rng)
    assert out.num_samples == [2]
    parent, child = request.sequences
    assert child.block_ids == parent.block_ids and sched.num_running == 2
    out = step(sched, device, rng)                     # first writes: one copy-on-write
    assert len(out.block_copies) == 1 and out.num_new_tokens == [1, 1]
    assert parent.block_ids[0] == child.block_ids[0]   # the full block stays shared
    assert parent.block_ids[1] != child.block_ids[1]
    drain(sched, device, rng)
    assert [s.num_output_tokens for s in request.sequences] == [3, 3]
    assert_all_free(sched)


def test_fork_reserves_seats_for_the_children():
    sched, device = make_scheduler(32, 4, max_num_seqs=2)
    rng = random.Random(3)
    submit(sched, "a", range(1, 5), n=2)
    submit(sched, "b", range(5, 9))
    out = step(sched, device, rng)
    assert [s.request.request_id for s in out.seqs] == ["a"]
    drain(sched, device, rng)


def test_abort_frees_blocks_in_any_state():
    sched, device = make_scheduler(8, 2, max_num_batched_tokens=3)
    rng = random.Random(4)
    submit(sched, "a", range(1, 8), max_tokens=8)
    submit(sched, "b", range(10, 18), max_tokens=8)
    step(sched, device, rng)                      # a mid-prefill, b waiting
    assert sched.abort_request("b").sequences[0].finish_reason is FinishReason.ABORT
    assert sched.abort_request("a") is not None
    assert sched.abort_request("a") is None       # already gone
    assert not sched.has_unfinished()
    assert_all_free(sched)


def test_a_paused_request_gets_no_tokens_and_keeps_its_blocks():
    sched, device = make_scheduler(32, 4)
    rng = random.Random(5)
    a = submit(sched, "a", range(1, 6), max_tokens=6)
    b = submit(sched, "b", range(10, 15), max_tokens=6)
    step(sched, device, rng)
    blocks = list(a.sequences[0].block_ids)
    assert sched.set_paused("a", True) is a
    for _ in range(3):
        out = step(sched, device, rng)
        assert [s.request.request_id for s in out.seqs] == ["b"]
    assert a.sequences[0].block_ids == blocks and a.sequences[0].num_output_tokens == 1
    sched.set_paused("a", False)
    assert [s.request.request_id for s in step(sched, device, rng).seqs] == ["a", "b"]
    drain(sched, device, rng)
    assert [r.sequences[0].num_output_tokens for r in (a, b)] == [6, 6]
    assert sched.set_paused("a", True) is None      # finished: unknown
    assert_all_free(sched)


def test_a_paused_sequence_is_preempted_before_one_that_computes():
    # 6 blocks of 2 tokens: a (older, paused) and b cannot both grow to 10 tokens.
    sched, device = make_scheduler(6, 2, prefix_caching=False)
    rng = random.Random(6)
    a = submit(sched, "a", [1, 2, 3, 4, 5], max_tokens=6)
    b = submit(sched, "b", [6, 7, 8, 9, 10], max_tokens=6)
    step(sched, device, rng)
    sched.set_paused("a", True)
    preempted = []
    while not b.is_finished:
        out = step(sched, device, rng)
        check_blocks(sched)
        preempted += [s.request.request_id for s in out.preempted]
    assert preempted == ["a"] and b.sequences[0].num_output_tokens == 6
    sched.set_paused("a", False)
    drain(sched, device, rng)
    assert a.sequences[0].num_output_tokens == 6
    assert_all_free(sched)


def test_paused_requests_holding_every_seat_make_room_for_a_waiting_one():
    sched, device = make_scheduler(64, 4, max_num_seqs=2)
    rng = random.Random(7)
    submit(sched, "a", range(1, 5), max_tokens=8, n=2)
    step(sched, device, rng)
    sched.set_paused("a", True)
    c = submit(sched, "c", range(20, 24), max_tokens=3)
    out = step(sched, device, rng)      # one seat is enough: one sample of a goes
    assert [s.request.request_id for s in out.preempted] == ["a"]
    assert [s.request.request_id for s in out.seqs] == ["c"]
    while not c.is_finished:
        assert [s.request.request_id for s in step(sched, device, rng).seqs] == ["c"]
    sched.set_paused("a", False)
    drain(sched, device, rng)
    assert_all_free(sched)


def test_the_context_budget_takes_short_contexts_first_and_long_ones_in_turn():
    # Three long sequences (40-70 tokens of context) and two short ones (3-11): the budget
    # holds the short ones, and one long one takes its turn each step.
    sched, device = make_scheduler(128, 4, max_num_batched_context_tokens=30)
    rng = random.Random(8)
    longs = [submit(sched, f"long{i}", range(10 * i + 1, 10 * i + 41), max_tokens=30)
             for i in range(3)]
    for _ in range(3):      # prompts in (admission is not counted), then in turn
        step(sched, device, rng)
    shorts = [submit(sched, f"short{i}", range(200 + 3 * i, 203 + 3 * i), max_tokens=8)
              for i in range(2)]
    step(sched, device, rng)        # the short ones are admitted
    ran = {r.request_id: 0 for r in longs}
    while not all(r.is_finished for r in shorts):
        out = step(sched, device, rng)
        ids = [s.request.request_id for s in out.seqs]
        # The short ones run every step, beside the one long one whose turn it is.
        assert all(r.sequences[0] in out.seqs for r in shorts)
        assert sum(i.startswith("long") for i in ids) == 1
        for i in ids:
            if i in ran:
                ran[i] += 1
    assert max(ran.values()) - min(ran.values()) <= 1      # each long one in its turn
    drain(sched, device, rng)
    assert all(r.sequences[0].num_output_tokens == 30 for r in longs)
    assert_all_free(sched)


def test_a_sequence_over_the_context_budget_alone_still_runs():
    sched, device = make_scheduler(64, 4, max_num_batched_context_tokens=8)
    rng = random.Random(9)
    request = submit(sched, "a", range(1, 21), max_tokens=5)
    drain(sched, device, rng)
    assert request.sequences[0].num_output_tokens == 5
    assert_all_free(sched)


class PlainSchedulerMachine(SchedulerMachine):
    """Random submit / step / failed step / stop / abort without a window: blocks are never
    leaked, progress is always made, and every sequence always reads its own tokens from the
    simulated KV pool."""

    @initialize(num_blocks=st.integers(4, 12), block_size=st.sampled_from([1, 2, 4]),
                budget=st.integers(1, 12), max_num_seqs=st.integers(1, 4),
                caching=st.booleans(), seed=st.integers(0, 2**16),
                context=st.one_of(st.none(), st.integers(1, 24)))
    def setup(self, num_blocks, block_size, budget, max_num_seqs, caching, seed, context):
        self.capacity = num_blocks * block_size
        self.start(*make_scheduler(
            num_blocks, block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
            max_model_len=self.capacity, prefix_caching=caching,
            max_num_batched_context_tokens=context), seed, prefix_len=8)

    def fits(self, prompt_len, max_tokens):
        return prompt_len + max_tokens - 1 <= self.capacity

    @rule(prefix=st.integers(0, 2), prompt_len=st.integers(1, 12), max_tokens=st.integers(1, 8),
          n=st.integers(1, 3))
    def submit(self, prefix, prompt_len, max_tokens, n):
        self.submit_random(prefix, prompt_len, max_tokens, n)


test_scheduler_state_machine = machine_test(PlainSchedulerMachine)


def test_seeded_soak():
    """A longer seeded run: many requests with shared prefixes through a tiny pool."""
    rng = random.Random(1234)
    sched, device = make_scheduler(10, 2, max_num_seqs=3, max_num_batched_tokens=5,
                                   max_model_len=20)
    prefix = [rng.randrange(1, 50) for _ in range(6)]
    for i in range(60):
        prompt = prefix[:rng.randrange(0, 7)] + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 6))]
        submit(sched, f"r{i}", prompt, max_tokens=rng.randrange(1, 20 - len(prompt) + 1),
               n=rng.choice([1, 1, 2]))
        for _ in range(rng.randrange(0, 4)):
            if sched.has_unfinished():
                step(sched, device, rng, stop_prob=0.05)
                check_blocks(sched)
        if rng.random() < 0.1 and sched.requests:
            sched.abort_request(rng.choice(sorted(sched.requests)))
    drain(sched, device, rng)
    assert sched.num_preemptions > 0 and sched.kv.num_hit_tokens > 0
    assert_all_free(sched)
