"""A scheduler driven against a simulated device, with or without a sliding window.

The device stores which token id each KV slot holds; after every step each query must read its
own tokens back from the slots its window reaches, and every block the prefix cache can hand out
must hold the tokens it is named by. A step may verify speculative proposals
(``step(..., propose=p)``): their slots hold the proposals, and a random prefix of them is
accepted. ``SchedulerMachine`` is the Hypothesis state
machine (submit / step / failed step / stop / abort / pause) both the plain and the windowed scheduler
tests subclass: they add the ``@initialize`` setup and the ``submit`` rule, whose strategies and
admission rule differ.

    from helpers.scheduler_sim import make_scheduler, submit, step, drain, check_blocks
"""

from __future__ import annotations

import random

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mini_paged_attn.core.block_manager import BlockManager
from mini_paged_attn.core.kv_cache_manager import KVCacheManager
from mini_paged_attn.core.request import FinishReason, Request, Sequence, SequenceStatus
from mini_paged_attn.core.scheduler import Scheduler, SchedulerConfig
from mini_paged_attn.core.sliding_window import PAD_BLOCK_ID, first_needed_block, window_blocks

STOP = 0


class SimDevice:
    """The KV pool as token ids: slot contents are what a sequence's K/V would be made of.

    A step copies its copy-on-write blocks, writes its tokens' slots, then every query of the
    step reads the keys of its window (all earlier keys without one) and must find its own
    tokens there."""

    def __init__(self, num_blocks: int, block_size: int, window: int | None = None):
        self.block_size, self.window = block_size, window
        self.slots = [[None] * block_size for _ in range(num_blocks)]

    def run(self, out):
        for src, dst in out.block_copies:
            self.slots[dst] = list(self.slots[src])
        bs = self.block_size
        # A sequence that verifies proposals writes them after its token.
        tokens = [seq.token_ids + out.spec_token_ids.get(i, []) for i, seq in enumerate(out.seqs)]
        for seq, n, ids in zip(out.seqs, out.num_new_tokens, tokens):
            for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                self.slots[seq.block_ids[p // bs]][p % bs] = ids[p]
        for seq, n, ids in zip(out.seqs, out.num_new_tokens, tokens):
            start = seq.num_computed_tokens
            # The earliest query of the step has the earliest window: the others see a suffix.
            first = 0 if self.window is None else max(0, start - self.window + 1)
            assert first // bs >= seq.num_dropped_blocks, seq   # no query reads a dropped block
            seen = [self.slots[seq.block_ids[p // bs]][p % bs] for p in range(first, start + n)]
            assert seen == ids[first:start + n], (seq, seen)

    def check_cache(self, kv):
        """Every block the prefix cache can hand out holds the tokens it is named by: no block
        was registered before its tokens were known (a rejected proposal's, say)."""
        for entry in kv.prefix_cache._by_hash.values():
            assert self.slots[entry.block_id] == list(entry.tokens), entry


def make_scheduler(num_blocks, block_size, window=None, *, max_num_seqs=8,
                   max_num_batched_tokens=64, max_model_len=256, prefix_caching=True,
                   max_num_batched_context_tokens=None):
    """A scheduler over a fresh pool of ``num_blocks`` blocks, and its simulated device."""
    kv = KVCacheManager(BlockManager(num_blocks), block_size, prefix_caching, window)
    config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len,
                             max_num_batched_context_tokens)
    return Scheduler(config, kv), SimDevice(num_blocks, block_size, window)


def submit(sched, rid, prompt, max_tokens=4, n=1):
    request = Request(rid, list(prompt), max_tokens, frozenset({STOP}), n)
    sched.add_request(request)
    return request


def step(sched, device, rng, stop_prob=0.0, propose=0.0, max_proposals=4):
    """Schedule, run on ``device`` and feed back random tokens (``STOP`` with ``stop_prob``).

    ``propose``: the chance that a decoding sequence gets 1 .. ``max_proposals`` random
    proposals for this step; a random prefix of those it verifies is accepted, then one more
    token."""
    def token():
        return STOP if rng.random() < stop_prob else rng.randrange(1, 50)

    for seq in sched.running:
        if seq.num_computed_tokens == seq.num_tokens - 1 and rng.random() < propose:
            seq.spec_token_ids = [rng.randrange(1, 50)
                                  for _ in range(rng.randint(1, max_proposals))]
    out = sched.schedule()
    device.run(out)
    sampled = []
    for i, k in enumerate(out.num_samples):
        proposals = out.spec_token_ids.get(i)
        if proposals is None:
            sampled.append([token() for _ in range(k)])
        else:
            sampled.append(proposals[:rng.randint(0, len(proposals))] + [token()])
    sched.update(out, sampled)
    return out


def held(seq: Sequence) -> list[int]:
    """The blocks ``seq`` holds: its table past the entries its window dropped."""
    return seq.block_ids[seq.num_dropped_blocks:]


def check_blocks(sched):
    """Every reference is accounted for and no block is counted twice; a running sequence holds
    exactly the blocks from its window's first to its last computed token (nothing reserved
    ahead; at most one window's worth), and its dropped entries are pads; waiting and finished
    ones hold none; the running set fits its seats."""
    kv = sched.kv
    bm, cache, bs, window = kv.block_manager, kv.prefix_cache, kv.block_size, kv.sliding_window
    holders = [0] * bm.num_blocks
    for seq in sched.running:
        assert seq.status is SequenceStatus.RUNNING
        assert len(seq.block_ids) == kv.blocks_for(seq.num_computed_tokens), seq
        assert seq.num_dropped_blocks == first_needed_block(seq.num_computed_tokens, window, bs)
        assert seq.block_ids[:seq.num_dropped_blocks] == [PAD_BLOCK_ID] * seq.num_dropped_blocks
        if window is not None:
            assert len(held(seq)) <= window_blocks(window, bs), seq
        for b in held(seq):
            holders[b] += 1
    for seq in sched.waiting:
        assert seq.block_ids == [] and seq.num_dropped_blocks == 0
        assert seq.status is SequenceStatus.WAITING
    for b in range(bm.num_blocks):
        assert bm.get_ref_count(b) == holders[b] + cache.is_evictable(b), b
    free = set(bm.get_free_blocks())
    assert all(bm.get_ref_count(b) == 0 for b in free)
    assert bm.get_num_free_blocks() + bm.get_num_used_blocks() == bm.num_blocks
    assert kv.num_free_blocks() == sum(1 for h in holders if h == 0)
    seats = sum(1 if s.request.forked else s.request.n for s in sched.running)
    assert seats <= sched.config.max_num_seqs


def drain(sched, device, rng, max_steps=3000, propose=0.0):
    """Step until nothing is unfinished, checking progress and the blocks after every step."""
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        out = step(sched, device, rng, propose=propose)
        assert not out.is_empty, "no progress"
        check_blocks(sched)
    assert not sched.has_unfinished()


def assert_all_free(sched):
    sched.kv.reset_prefix_cache()
    bm = sched.kv.block_manager
    assert bm.get_num_free_blocks() == bm.num_blocks
    assert all(bm.get_ref_count(b) == 0 for b in range(bm.num_blocks))


class SchedulerMachine(RuleBasedStateMachine):
    """Random step / failed step / stop / abort / pause on the scheduler ``start`` was given: no
    block is leaked or freed twice, progress is always made on the requests not paused, a
    paused one never computes and is preempted before one that does, and every query reads its
    own tokens.

    A subclass adds an ``@initialize`` rule that calls :meth:`start`, and a ``submit`` rule that
    calls :meth:`submit_random` with its own strategies; :meth:`fits` is its admission rule.
    ``propose``: the chance a decoding sequence verifies proposals in a step (see :func:`step`).
    """

    propose = 0.0

    def start(self, sched, device, seed: int, prefix_len: int) -> None:
        self.sched, self.device = sched, device
        self.rng = random.Random(seed)
        self.prefixes = [[self.rng.randrange(1, 50) for _ in range(prefix_len)] for _ in range(2)]
        self.next_id = 0

    def fits(self, prompt_len: int, max_tokens: int) -> bool:
        """Whether the engine would accept such a request (it rejects what can never run)."""
        raise NotImplementedError

    def submit_random(self, prefix: int, prompt_len: int, max_tokens: int, n: int) -> None:
        """Submit a random prompt that starts with shared prefix ``prefix`` (none when 2): shared
        prefixes make prefix-cache hits."""
        prompt = (self.prefixes[prefix] if prefix < 2 else [])[:prompt_len]
        prompt += [self.rng.randrange(1, 50) for _ in range(prompt_len - len(prompt))]
        if not self.fits(prompt_len, max_tokens) or n > self.sched.config.max_num_seqs:
            return
        submit(self.sched, f"r{self.next_id}", prompt, max_tokens, n)
        self.next_id += 1

    @precondition(lambda self: self.sched.has_unfinished())
    @rule(stop_prob=st.sampled_from([0.0, 0.2]))
    def step(self, stop_prob):
        sched = self.sched
        unpaused = any(not r.paused for r in sched.requests.values())
        was_running = {s.seq_id for s in sched.running}
        out = step(sched, self.device, self.rng, stop_prob, self.propose)
        assert not out.is_empty or not unpaused, "no progress with unfinished requests"
        assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
        for i, proposals in out.spec_token_ids.items():
            assert out.num_new_tokens[i] == len(proposals) + 1 and out.num_samples[i] == 0
        limit = sched.config.max_num_batched_context_tokens
        if limit is not None:
            # Counted after the step: computed tokens now = context the step attended over.
            window = sched.kv.sliding_window
            costs = [s.num_computed_tokens if window is None
                     else min(s.num_computed_tokens, window + n)
                     for s, n in zip(out.seqs, out.num_new_tokens) if s.seq_id in was_running]
            # Within the limit but for the one taking its turn (and the shortest, always).
            assert len(costs) <= 2 or sum(costs) - max(costs) <= limit, (costs, limit)
            assert all(s.num_deferred <= sched.config.max_num_seqs for s in sched.running)
        assert not any(s.request.paused for s in out.seqs), "a paused request computed"
        if any(not s.request.paused for s in out.preempted):
            # Paused sequences are preempted first: none may be left holding blocks.
            assert not any(s.request.paused for s in sched.running), out.preempted

    @precondition(lambda self: self.sched.requests)
    @rule(data=st.data(), paused=st.booleans())
    def pause(self, data, paused):
        """A consumer stops (or starts again) taking a request's output."""
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        assert self.sched.set_paused(rid, paused).paused is paused

    @precondition(lambda self: self.sched.has_unfinished())
    @rule()
    def failed_step(self):
        """The forward of a scheduled step raises: nothing is written to the device, and the
        blocks it registered must not be found later (the device would read them)."""
        out = self.sched.schedule()
        self.sched.rollback(out)
        assert all(s.status is not SequenceStatus.RUNNING for s in out.seqs)

    @precondition(lambda self: self.sched.running)
    @rule(data=st.data())
    def stop_string(self, data):
        seq = data.draw(st.sampled_from(self.sched.running))
        self.sched.finish_sequence(seq, FinishReason.STOP)
        assert seq.block_ids == [] and seq.num_dropped_blocks == 0

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
            self.device.check_cache(self.sched.kv)

    def teardown(self):
        if hasattr(self, "sched"):
            for rid in list(self.sched.requests):
                self.sched.set_paused(rid, False)
            drain(self.sched, self.device, self.rng, propose=self.propose)
            assert_all_free(self.sched)


def machine_test(machine: type[SchedulerMachine]):
    """The pytest test case of ``machine``: Hypothesis' default example and step counts, no
    deadline and no health check (a step drives a whole scheduler)."""
    # ``Machine.TestCase`` builds a new class on every access: set the settings on the one
    # returned, or they never apply.
    case = machine.TestCase
    case.settings = settings(deadline=None, suppress_health_check=list(HealthCheck))
    return case
