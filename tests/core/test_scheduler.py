"""Scheduler + KV cache manager: token budget, chunked prefill, preemption, fork, and a
Hypothesis state machine (submit / step / stop / abort against a tiny pool) checked against a
simulated device that stores which token each KV slot holds."""

import random

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mini_paged_attn.core.block_manager import BlockManager
from mini_paged_attn.core.kv_cache_manager import KVCacheManager
from mini_paged_attn.core.request import FinishReason, Request, SequenceStatus
from mini_paged_attn.core.scheduler import Scheduler, SchedulerConfig

STOP = 0


class FakeDevice:
    """The KV pool as token ids: slot contents are what a sequence's K/V would be made of."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.slots = [[None] * block_size for _ in range(num_blocks)]

    def run(self, out):
        """Copy COW blocks, write every scheduled token, then check each sequence reads back its
        own tokens at every computed position (prefix hits and copies included)."""
        for src, dst in out.block_copies:
            self.slots[dst] = list(self.slots[src])
        bs = self.block_size
        for seq, n in zip(out.seqs, out.num_new_tokens):
            for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                self.slots[seq.block_ids[p // bs]][p % bs] = seq.token_ids[p]
        for seq, n in zip(out.seqs, out.num_new_tokens):
            end = seq.num_computed_tokens + n
            seen = [self.slots[seq.block_ids[p // bs]][p % bs] for p in range(end)]
            assert seen == seq.token_ids[:end], (seq, seen)


def make_scheduler(num_blocks, block_size, *, max_num_seqs=8, max_num_batched_tokens=64,
                   max_model_len=64, prefix_caching=True):
    kv = KVCacheManager(BlockManager(num_blocks), block_size, prefix_caching)
    config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len)
    return Scheduler(config, kv), FakeDevice(num_blocks, block_size)


def submit(sched, rid, prompt, max_tokens=4, n=1):
    request = Request(rid, list(prompt), max_tokens, frozenset({STOP}), n)
    sched.add_request(request)
    return request


def step(sched, device, rng, stop_prob=0.0):
    out = sched.schedule()
    device.run(out)
    sampled = [[STOP if rng.random() < stop_prob else rng.randrange(1, 50) for _ in range(k)]
               for k in out.num_samples]
    sched.update(out, sampled)
    return out


def check_blocks(sched):
    """Every reference is accounted for; running sequences hold exactly the blocks their
    computed tokens need (nothing reserved ahead); waiting and finished ones hold none."""
    kv = sched.kv
    bm, cache = kv.block_manager, kv.prefix_cache
    holders = [0] * bm.num_blocks
    for seq in sched.running:
        assert seq.status is SequenceStatus.RUNNING
        assert len(seq.block_ids) == kv.blocks_for(seq.num_computed_tokens), seq
        for b in seq.block_ids:
            holders[b] += 1
    for seq in sched.waiting:
        assert seq.block_ids == [] and seq.status is SequenceStatus.WAITING
    for b in range(bm.num_blocks):
        assert bm.get_ref_count(b) == holders[b] + cache.is_evictable(b), b
    free = set(bm.get_free_blocks())
    assert all(bm.get_ref_count(b) == 0 for b in free)
    assert kv.num_free_blocks() == sum(1 for h in holders if h == 0)
    seats = sum(1 if s.request.forked else s.request.n for s in sched.running)
    assert seats <= sched.config.max_num_seqs


def drain(sched, device, rng, max_steps=2000):
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        out = step(sched, device, rng)
        assert not out.is_empty, "no progress"
        check_blocks(sched)
    assert not sched.has_unfinished()


def assert_all_free(sched):
    sched.kv.reset_prefix_cache()
    bm = sched.kv.block_manager
    assert bm.get_num_free_blocks() == bm.num_blocks
    assert all(bm.get_ref_count(b) == 0 for b in range(bm.num_blocks))


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


class SchedulerMachine(RuleBasedStateMachine):
    """Random submit / step / stop / abort; blocks are never leaked, progress is always made,
    and every sequence always reads its own tokens from the simulated KV pool."""

    @initialize(num_blocks=st.integers(4, 12), block_size=st.sampled_from([1, 2, 4]),
                budget=st.integers(1, 12), max_num_seqs=st.integers(1, 4),
                caching=st.booleans(), seed=st.integers(0, 2**16))
    def setup(self, num_blocks, block_size, budget, max_num_seqs, caching, seed):
        self.sched, self.device = make_scheduler(
            num_blocks, block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
            max_model_len=num_blocks * block_size, prefix_caching=caching)
        self.rng = random.Random(seed)
        self.capacity = num_blocks * block_size
        self.prefixes = [[self.rng.randrange(1, 50) for _ in range(8)] for _ in range(2)]
        self.next_id = 0

    @rule(prefix=st.integers(0, 2), prompt_len=st.integers(1, 12), max_tokens=st.integers(1, 8),
          n=st.integers(1, 3))
    def submit(self, prefix, prompt_len, max_tokens, n):
        # Shared prefixes make prefix-cache hits; the engine would reject what cannot fit.
        prompt = (self.prefixes[prefix] if prefix < 2 else [])[:prompt_len]
        prompt += [self.rng.randrange(1, 50) for _ in range(prompt_len - len(prompt))]
        if prompt_len + max_tokens - 1 > self.capacity or n > self.sched.config.max_num_seqs:
            return
        submit(self.sched, f"r{self.next_id}", prompt, max_tokens, n)
        self.next_id += 1

    @precondition(lambda self: self.sched.has_unfinished())
    @rule(stop_prob=st.sampled_from([0.0, 0.2]))
    def step(self, stop_prob):
        out = step(self.sched, self.device, self.rng, stop_prob)
        assert not out.is_empty, "no progress with unfinished requests"
        assert out.num_batched_tokens <= self.sched.config.max_num_batched_tokens

    @precondition(lambda self: self.sched.has_unfinished())
    @rule()
    def failed_step(self):
        """The forward of a scheduled step raises: nothing is written to the device, and the
        blocks it registered must not be found later (the fake device would read them)."""
        out = self.sched.schedule()
        self.sched.rollback(out)
        assert all(s.status is not SequenceStatus.RUNNING for s in out.seqs)

    @precondition(lambda self: self.sched.running)
    @rule(data=st.data())
    def stop_string(self, data):
        seq = data.draw(st.sampled_from(self.sched.running))
        self.sched.finish_sequence(seq, FinishReason.STOP)

    @precondition(lambda self: self.sched.requests)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        request = self.sched.abort_request(rid)
        assert request.is_finished and all(not s.block_ids for s in request.sequences)

    @invariant()
    def blocks_consistent(self):
        if hasattr(self, "sched"):
            check_blocks(self.sched)

    def teardown(self):
        if hasattr(self, "sched"):
            drain(self.sched, self.device, self.rng)
            assert_all_free(self.sched)


SchedulerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_scheduler_state_machine = SchedulerMachine.TestCase


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
