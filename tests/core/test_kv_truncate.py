"""KVCacheManager.truncate, allocate_slots' lookahead and register_computed: unit cases, and a
Hypothesis state machine of allocate / verify / truncate / fork / free against a simulated
device (which token each slot holds): reference counts and free counts add up, a sequence
holds the blocks of its computed tokens and no more, reads its own tokens back, and every
block the prefix cache can hand out holds the tokens its hash names (no proposal's, no
overwritten ones)."""

import random

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mini_paged_attn.core.args import cdiv
from mini_paged_attn.core.block_manager import BlockManager
from mini_paged_attn.core.kv_cache_manager import KVCacheManager
from mini_paged_attn.core.request import Request, Sequence


def _manager(num_blocks=8, block_size=4, caching=True):
    return KVCacheManager(BlockManager(num_blocks), block_size, caching)


def _seq(seq_id, tokens, n=1):
    return Sequence(seq_id, Request(f"r{seq_id}", list(tokens), 64, n=n), 0, list(tokens))


def _computed(kv, seq, num_new, lookahead=0):
    """Allocate and count ``num_new`` tokens as computed (what a step does)."""
    assert kv.allocate_slots(seq, num_new, num_lookahead_tokens=lookahead) is not None
    seq.num_computed_tokens += num_new


def test_truncate_gives_back_the_blocks_past_the_length():
    kv = _manager()
    seq = _seq(0, range(1, 8))
    _computed(kv, seq, 7, lookahead=6)              # 13 positions: 4 blocks
    assert len(seq.block_ids) == 4 and kv.num_free_blocks() == 4
    last = seq.block_ids[-1]
    assert kv.truncate(seq, 9) == 1
    assert len(seq.block_ids) == 3 and kv.num_free_blocks() == 5
    assert kv.block_manager.get_ref_count(last) == 0
    assert seq.num_computed_tokens == 7 and seq.blocks_changed_from <= 3
    assert kv.truncate(seq, 5) == 1 and seq.num_computed_tokens == 5
    assert kv.truncate(seq, 5) == 0


def test_lookahead_blocks_are_not_registered_until_computed():
    kv = _manager()
    seq = _seq(0, range(1, 4))
    _computed(kv, seq, 3, lookahead=6)     # positions 3 .. 8 are proposals
    assert kv.prefix_cache.num_cached_blocks == 0
    seq.token_ids += [10, 11, 12, 13, 14]          # verified: 8 tokens, 2 blocks full
    seq.num_computed_tokens = 8
    kv.truncate(seq, 8)
    kv.register_computed(seq, 0)
    assert kv.prefix_cache.num_cached_blocks == 2
    kv.register_computed(seq, 0)                     # registered blocks are skipped
    assert kv.prefix_cache.num_cached_blocks == 2


@pytest.mark.parametrize("shared", ["fork", "cached"])
def test_truncate_refuses_to_cut_a_shared_or_cached_block_and_changes_nothing(shared):
    kv = _manager(caching=shared == "cached")
    seq = _seq(0, range(1, 10), n=2)
    _computed(kv, seq, 9)
    if shared == "fork":
        kv.fork(seq, _seq(1, seq.token_ids, n=2))
    cut = 6                                          # inside the second block
    before = (list(seq.block_ids), seq.num_computed_tokens, kv.num_free_blocks())
    with pytest.raises(ValueError, match="num_tokens: expected a length that cuts no shared"):
        kv.truncate(seq, cut)
    assert (seq.block_ids, seq.num_computed_tokens, kv.num_free_blocks()) == before
    with pytest.raises(TypeError, match="num_tokens"):
        kv.truncate(seq, 2.0)
    with pytest.raises(ValueError, match="num_tokens"):
        kv.truncate(seq, -1)


def test_truncate_to_a_block_boundary_keeps_cached_blocks_cached():
    kv = _manager()
    seq = _seq(0, range(1, 10))
    _computed(kv, seq, 9)
    assert kv.prefix_cache.num_cached_blocks == 2
    kv.truncate(seq, 4)
    # The second block, cached, nobody else's: evictable now, not free.
    assert kv.prefix_cache.num_cached_blocks == 2 and kv.prefix_cache.num_evictable_blocks == 1
    assert kv.block_manager.get_num_free_blocks() == 6


class TruncateMachine(RuleBasedStateMachine):
    """Sequences through a tiny pool: prompts (with prefix hits), speculative steps (random
    proposals, a random prefix accepted), truncations to any length (after which the tokens
    past it change, as after rejected proposals), forks and frees."""

    @initialize(num_blocks=st.integers(3, 10), block_size=st.sampled_from([1, 2, 3, 4]),
                seed=st.integers(0, 2**16))
    def setup(self, num_blocks, block_size, seed):
        self.kv = _manager(num_blocks, block_size)
        self.bs = block_size
        self.slots = [[None] * block_size for _ in range(num_blocks)]
        self.rng = random.Random(seed)
        self.prefix = [self.rng.randrange(1, 9) for _ in range(8)]
        self.live: list[Sequence] = []
        self.next_id = 0

    # ---- the simulated device -----------------------------------------------------------------
    def _run(self, seq, copies, tokens, start):
        for src, dst in copies:
            self.slots[dst] = list(self.slots[src])
        for p, token in enumerate(tokens, start):
            self.slots[seq.block_ids[p // self.bs]][p % self.bs] = token

    def _token(self):
        return self.rng.randrange(1, 9)     # a small alphabet: contents repeat, hashes collide

    # ---- rules --------------------------------------------------------------------------------
    @rule(prefix_len=st.integers(0, 8), extra=st.integers(1, 6))
    def add(self, prefix_len, extra):
        tokens = self.prefix[:prefix_len] + [self._token() for _ in range(extra)]
        seq = _seq(self.next_id, tokens, n=2)
        self.next_id += 1
        hit = self.kv.find_cached_prefix(seq)
        copies = self.kv.allocate_slots(seq, len(tokens) - hit.num_tokens, hit)
        if copies is None:
            assert seq.block_ids == []
            return
        start = seq.num_computed_tokens
        self._run(seq, copies, tokens[start:], start)
        seq.num_computed_tokens = len(tokens)
        seq.token_ids.append(self._token())
        self.live.append(seq)

    def _pick(self, data, ready):
        candidates = [s for s in self.live if ready(s)]
        return data.draw(st.sampled_from(candidates)) if candidates else None

    @precondition(lambda self: self.live)
    @rule(data=st.data(), k=st.integers(0, 5))
    def speculate(self, data, k):
        seq = self._pick(data, lambda s: s.num_computed_tokens == s.num_tokens - 1)
        if seq is None:
            return
        proposals = [self._token() for _ in range(k)]
        before = (list(seq.block_ids), self.kv.num_free_blocks())
        copies = self.kv.allocate_slots(seq, 1, num_lookahead_tokens=k)
        if copies is None:
            assert (seq.block_ids, self.kv.num_free_blocks()) == before
            return
        start = seq.num_computed_tokens
        self._run(seq, copies, [seq.token_ids[-1], *proposals], start)
        accepted = data.draw(st.integers(0, k))
        seq.num_computed_tokens = start + accepted + 1
        self.kv.truncate(seq, seq.num_computed_tokens)
        seq.token_ids += proposals[:accepted] + [self._token()]
        self.kv.register_computed(seq, (start + 1) // self.bs)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def recompute(self, data):
        """A sequence truncated below its tokens computes them again (a new token last)."""
        seq = self._pick(data, lambda s: s.num_computed_tokens < s.num_tokens - 1)
        if seq is None:
            return
        start = seq.num_computed_tokens
        copies = self.kv.allocate_slots(seq, seq.num_tokens - start)
        if copies is None:
            return
        self._run(seq, copies, seq.token_ids[start:], start)
        seq.num_computed_tokens = seq.num_tokens
        seq.token_ids.append(self._token())

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def truncate(self, data):
        seq = data.draw(st.sampled_from(self.live))
        length = data.draw(st.integers(0, seq.num_computed_tokens))
        before = (list(seq.block_ids), seq.num_computed_tokens, self.kv.num_free_blocks())
        try:
            self.kv.truncate(seq, length)
        except ValueError:
            assert (seq.block_ids, seq.num_computed_tokens, self.kv.num_free_blocks()) == before
            return
        assert seq.num_computed_tokens == length
        # What follows the kept tokens changes, as after rejected proposals.
        del seq.token_ids[max(length, 1):]
        seq.token_ids.append(self._token())

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = self._pick(data, lambda s: s.num_computed_tokens == s.num_tokens - 1)
        if parent is None:
            return
        child = Sequence(self.next_id, parent.request, 1, list(parent.token_ids))
        self.next_id += 1
        self.kv.fork(parent, child)
        child.token_ids[-1] = self._token()         # its own first sample
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.kv.free(seq)
        self.live.remove(seq)

    # ---- invariants ---------------------------------------------------------------------------
    @invariant()
    def consistent(self):
        if not hasattr(self, "kv"):
            return
        kv, bs = self.kv, self.bs
        bm, cache = kv.block_manager, kv.prefix_cache
        holders = [0] * bm.num_blocks
        for seq in self.live:
            assert len(seq.block_ids) == cdiv(seq.num_computed_tokens, bs), seq
            for b in seq.block_ids:
                holders[b] += 1
            read = [self.slots[seq.block_ids[p // bs]][p % bs]
                    for p in range(seq.num_computed_tokens)]
            assert read == seq.token_ids[:seq.num_computed_tokens], seq
        for b in range(bm.num_blocks):
            assert bm.get_ref_count(b) == holders[b] + cache.is_evictable(b), b
        assert kv.num_free_blocks() == sum(1 for h in holders if h == 0)
        for entry in cache._by_hash.values():
            assert self.slots[entry.block_id] == list(entry.tokens), entry

    def teardown(self):
        if hasattr(self, "kv"):
            for seq in self.live:
                self.kv.free(seq)
            self.kv.reset_prefix_cache()
            assert self.kv.block_manager.get_num_free_blocks() == self.kv.num_blocks


TestTruncateMachine = TruncateMachine.TestCase
TestTruncateMachine.settings = settings(deadline=None, suppress_health_check=list(HealthCheck))
