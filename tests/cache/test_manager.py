"""PagedAttentionManager: seed 001's scenario (corrected), fork and copy-on-write, every error
leaving the state unchanged, the memory map, and a Hypothesis state machine that keeps a shadow
of every sequence's K/V and reads it back through the device block table after every step."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import mini_paged_attn
from mini_paged_attn import OutOfBlocksError, PagedAttentionManager


def make(num_sequences=4, num_heads=2, head_size=8, block_size=4, num_blocks=16, **kw):
    kw.setdefault("dtype", torch.float32)
    return PagedAttentionManager(num_sequences, num_heads, head_size, block_size, num_blocks, **kw)


def snapshot(m: PagedAttentionManager):
    """Everything a failing call must leave alone (the pool compared bit for bit)."""
    bm = m.block_manager
    return (copy.deepcopy(m.seq_block_mapping), m.block_table.clone(), m.context_lens.clone(),
            bm.get_free_blocks(), [bm.get_ref_count(i) for i in range(m.num_blocks)],
            m.kv_cache.view(torch.uint8).clone())


def assert_same(a, b):
    assert a[0] == b[0] and a[3] == b[3] and a[4] == b[4]
    for x, y in zip(a[1:3] + a[5:], b[1:3] + b[5:]):
        assert torch.equal(x, y)


def tokens(n, num_kv_heads=2, head_size=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, num_kv_heads, head_size, generator=g).to(dtype)
    v = torch.randn(n, num_kv_heads, head_size, generator=g).to(dtype)
    return k, v


def read_back(m, seq_id):
    """K/V of a sequence gathered through its device block-table row and context_lens."""
    n = int(m.context_lens[seq_id])
    pos = torch.arange(n)
    blocks = m.block_table[seq_id].long()[pos // m.block_size]
    return m.key_cache[blocks, pos % m.block_size], m.value_cache[blocks, pos % m.block_size]


# -- seed 001's tests, corrected: block 0 is the first block handed out ----------------------

def test_seed_add_sequence():
    m = make()
    m.add_sequence(seq_id=0, num_prompt_tokens=7)
    assert m.seq_block_mapping[0] == [0, 1]
    assert m.block_table[0, :2].tolist() == [0, 1]
    assert m.block_manager.get_num_free_blocks() == 16 - 2
    assert m.context_lens.tolist() == [7, 0, 0, 0]


def test_seed_append_token():
    m = make()
    m.add_sequence(seq_id=0, num_prompt_tokens=3)
    assert m.append_token(seq_id=0, current_seq_len=3) == 0 * 4 + 3  # last slot of block 0
    assert m.seq_block_mapping[0] == [0]
    assert m.append_token(seq_id=0, current_seq_len=4) == 1 * 4 + 0  # starts block 1
    assert m.seq_block_mapping[0] == [0, 1]
    assert m.get_block_table_for_seq(0)[:2].tolist() == [0, 1]
    assert int(m.context_lens[0]) == m.get_seq_len(0) == 5


def test_seed_free_sequence():
    m = make()
    m.add_sequence(seq_id=1, num_prompt_tokens=5)
    m.free_sequence(seq_id=1)
    assert 1 not in m.seq_block_mapping
    assert m.block_manager.get_num_free_blocks() == 16
    assert m.block_table[1].eq(0).all() and int(m.context_lens[1]) == 0
    m.add_sequence(2, 5)
    assert m.seq_block_mapping[2] == [0, 1]  # freed blocks come back in logical order
    m.free_sequence(3)  # unknown: no-op
    m.free_sequence(1)


# -- layout ----------------------------------------------------------------------------------

def test_pool_layout_and_views_share_storage():
    m = PagedAttentionManager(3, 8, 16, 4, 10, num_kv_heads=2)
    assert mini_paged_attn.PagedAttentionManager is PagedAttentionManager
    assert m.kv_cache.shape == (10, 4, 2, 2, 16) and m.kv_cache.dtype == torch.float16
    for cache in (m.key_cache, m.value_cache):
        assert cache.shape == (10, 4, 2, 16) and cache.stride(-1) == 1
        assert cache.untyped_storage().data_ptr() == m.kv_cache.untyped_storage().data_ptr()
    m.key_cache[3, 1] = 1.0
    m.value_cache[3, 1] = 2.0
    assert m.kv_cache[3, 1, 0].eq(1).all() and m.kv_cache[3, 1, 1].eq(2).all()
    assert m.kv_cache.ne(0).sum() == 2 * 2 * 16
    assert m.block_table.shape == (3, 10) and m.block_table.dtype == torch.int32
    assert m.context_lens.shape == (3,) and m.context_lens.dtype == torch.int32
    assert m.num_kv_heads == 2 and m.max_blocks_per_seq == 10
    assert make(num_heads=4).num_kv_heads == 4


def test_write_kv_round_trip_and_nothing_else_changes():
    m = make(block_size=4, num_blocks=8)
    m.kv_cache.fill_(float("nan"))
    m.add_sequence(0, 9)
    m.add_sequence(1, 3)
    k, v = tokens(9)
    m.write_kv(0, 0, k[:5], v[:5])
    m.write_kv(0, 5, k[5:], v[5:])
    kb, vb = read_back(m, 0)
    assert torch.equal(kb, k) and torch.equal(vb, v)
    slots = m.get_slot_mapping(0, 0, 9)
    assert slots.dtype == torch.int64
    assert slots.tolist() == [m.seq_block_mapping[0][p // 4] * 4 + p % 4 for p in range(9)]
    written = torch.zeros(8 * 4, dtype=torch.bool)
    written[slots] = True
    assert m.kv_cache.view(32, -1)[~written].isnan().all()


# -- fork and copy-on-write ------------------------------------------------------------------

def test_fork_shares_then_append_copies_partly_filled_last_block():
    m = make(block_size=4, num_blocks=8)
    m.add_sequence(0, 6)
    k, v = tokens(6)
    m.write_kv(0, 0, k, v)
    m.fork_sequence(0, 1)
    assert m.seq_block_mapping[1] == m.seq_block_mapping[0] == [0, 1]
    assert [m.block_manager.get_ref_count(b) for b in (0, 1)] == [2, 2]
    assert m.block_manager.get_num_free_blocks() == 6  # nothing copied yet
    assert torch.equal(m.block_table[1], m.block_table[0]) and int(m.context_lens[1]) == 6

    slot = m.append_token(1, 6)  # lands in the shared block 1: the child gets a copy
    assert m.seq_block_mapping[1] == [0, 2] and slot == 2 * 4 + 2
    assert [m.block_manager.get_ref_count(b) for b in (0, 1, 2)] == [2, 1, 1]
    assert m.block_table[1, :2].tolist() == [0, 2]
    ck, cv = tokens(1, seed=1)
    m.write_kv(1, 6, ck, cv)
    m.append_token(0, 6)  # the parent's block 1 is now its own: written in place
    assert m.seq_block_mapping[0] == [0, 1]
    pk, pv = tokens(1, seed=2)
    m.write_kv(0, 6, pk, pv)

    for seq, (nk, nv) in ((0, (pk, pv)), (1, (ck, cv))):
        kb, vb = read_back(m, seq)
        assert torch.equal(kb, torch.cat([k, nk])) and torch.equal(vb, torch.cat([v, nv]))


def test_fork_at_block_boundary_copies_nothing():
    m = make(block_size=4, num_blocks=8)
    m.add_sequence(0, 8)
    m.fork_sequence(0, 1)
    m.append_token(1, 8)
    m.append_token(0, 8)
    assert m.seq_block_mapping[0] == [0, 1, 3] and m.seq_block_mapping[1] == [0, 1, 2]
    assert m.block_manager.get_ref_count(0) == m.block_manager.get_ref_count(1) == 2


def test_write_into_shared_full_block_copies_it():
    m = make(block_size=4, num_blocks=8)
    m.add_sequence(0, 8)
    k, v = tokens(8)
    m.write_kv(0, 0, k, v)
    m.fork_sequence(0, 1)
    nk, nv = tokens(2, seed=5)
    m.write_kv(1, 3, nk, nv)  # spans both shared blocks: both copied
    assert m.seq_block_mapping[1] == [2, 3] and m.seq_block_mapping[0] == [0, 1]
    kb, vb = read_back(m, 0)
    assert torch.equal(kb, k) and torch.equal(vb, v)
    kb, vb = read_back(m, 1)
    assert torch.equal(kb, torch.cat([k[:3], nk, k[5:]]))
    assert torch.equal(vb, torch.cat([v[:3], nv, v[5:]]))


def test_copy_on_write_without_a_free_block_fails_cleanly():
    m = make(block_size=4, num_blocks=2)
    m.add_sequence(0, 6)
    m.fork_sequence(0, 1)
    before = snapshot(m)
    with pytest.raises(OutOfBlocksError):
        m.append_token(1, 6)
    with pytest.raises(OutOfBlocksError):
        m.write_kv(0, 0, *tokens(1))
    assert_same(before, snapshot(m))
    m.free_sequence(0)  # now block 1 is the child's alone: no copy needed
    m.append_token(1, 6)
    assert m.seq_block_mapping[1] == [0, 1]


# -- errors: each raises and changes nothing ---------------------------------------------------

def populated():
    m = make(num_sequences=4, block_size=4, num_blocks=5, max_blocks_per_seq=3)
    m.add_sequence(0, 8)  # blocks 0, 1 (full)
    m.add_sequence(1, 3)  # block 2
    m.fork_sequence(1, 2)
    m.write_kv(0, 0, *tokens(8))
    return m


k1, v1 = tokens(1)
ERRORS = [
    ("add duplicate", lambda m: m.add_sequence(0, 1), ValueError, "exists"),
    ("add negative id", lambda m: m.add_sequence(-1, 1), ValueError, "num_sequences=4"),
    ("add id too large", lambda m: m.add_sequence(4, 1), ValueError, "num_sequences=4"),
    ("add float id", lambda m: m.add_sequence(3.0, 1), TypeError, "seq_id"),
    ("add bool id", lambda m: m.add_sequence(True, 1), TypeError, "seq_id"),
    ("add negative length", lambda m: m.add_sequence(3, -1), ValueError, "num_prompt_tokens"),
    ("add row too short", lambda m: m.add_sequence(3, 13), ValueError, "max_blocks_per_seq=3"),
    ("add out of blocks", lambda m: m.add_sequence(3, 12), OutOfBlocksError, "asked for 3"),
    ("append unknown", lambda m: m.append_token(3, 0), ValueError, "unknown sequence 3"),
    ("append short", lambda m: m.append_token(0, 7), ValueError, "expected the length"),
    ("append long", lambda m: m.append_token(0, 9), ValueError, "expected the length"),
    ("fork unknown parent", lambda m: m.fork_sequence(3, 2), ValueError, "parent_id"),
    ("fork onto live child", lambda m: m.fork_sequence(0, 1), ValueError, "child_id"),
    ("fork onto itself", lambda m: m.fork_sequence(0, 0), ValueError, "child_id"),
    ("fork child out of range", lambda m: m.fork_sequence(0, 9), ValueError, "child_id"),
    ("write unknown", lambda m: m.write_kv(3, 0, k1, v1), ValueError, "unknown sequence"),
    ("write past length", lambda m: m.write_kv(1, 3, k1, v1), ValueError, "start_pos"),
    ("write negative start", lambda m: m.write_kv(0, -1, k1, v1), ValueError, "start_pos"),
    ("write wrong dtype", lambda m: m.write_kv(0, 0, k1.half(), v1.half()), ValueError, "key:"),
    ("write wrong heads", lambda m: m.write_kv(0, 0, *tokens(1, num_kv_heads=1)), ValueError,
     "num_kv_heads=2"),
    ("write 2-D", lambda m: m.write_kv(0, 0, k1[0], v1[0]), ValueError, "key:"),
    ("write mismatched value", lambda m: m.write_kv(0, 0, k1, tokens(2)[1]), ValueError,
     "value:"),
    ("write non-tensor", lambda m: m.write_kv(0, 0, k1.tolist(), v1), ValueError, "torch.Tensor"),
    ("table of unknown", lambda m: m.get_block_table_for_seq(3), ValueError, "unknown"),
    ("slots past length", lambda m: m.get_slot_mapping(1, 2, 2), ValueError, "start_pos"),
]


@pytest.mark.parametrize("call, exc, match", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_errors_change_nothing(call, exc, match):
    m = populated()
    before = snapshot(m)
    with pytest.raises(exc, match=match):
        call(m)
    assert_same(before, snapshot(m))


def test_append_with_full_row_and_out_of_blocks_change_nothing():
    m = make(num_sequences=2, block_size=2, num_blocks=3, max_blocks_per_seq=2)
    m.add_sequence(0, 4)
    before = snapshot(m)
    with pytest.raises(ValueError, match="max_blocks_per_seq=2"):
        m.append_token(0, 4)
    assert_same(before, snapshot(m))
    m.add_sequence(1, 2)
    before = snapshot(m)
    with pytest.raises(OutOfBlocksError):
        m.append_token(1, 2)
    assert_same(before, snapshot(m))


def test_free_unknown_is_a_noop():
    m = populated()
    before = snapshot(m)
    m.free_sequence(3)
    m.free_sequence(99)
    assert_same(before, snapshot(m))


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_sequences=0), "num_sequences"), (dict(block_size=0), "block_size"),
    (dict(num_blocks=-2), "num_blocks"), (dict(head_size=0), "head_size"),
    (dict(num_heads=4, num_kv_heads=3), "num_kv_heads"),
    (dict(max_blocks_per_seq=0), "max_blocks_per_seq"), (dict(dtype=torch.int32), "dtype"),
    (dict(sliding_window=0), "sliding_window"), (dict(sliding_window=True), "sliding_window")])
def test_bad_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make(**kwargs)


def test_sliding_window_reaches_the_block_logic():
    assert make(sliding_window=7).kv_manager.sliding_window == 7
    assert make().kv_manager.sliding_window is None


# -- memory map ------------------------------------------------------------------------------

def test_memory_map_describes_owners_sharing_fill_and_free():
    m = make(block_size=4, num_blocks=8)
    m.add_sequence(0, 6)
    m.fork_sequence(0, 1)
    m.add_sequence(2, 1)
    mm = m.memory_map()
    assert mm.num_blocks == 8 and mm.block_size == 4
    assert [(s.seq_id, s.num_tokens, s.blocks, s.last_block_fill) for s in mm.sequences] == [
        (0, 6, (0, 1), 2), (1, 6, (0, 1), 2), (2, 1, (2,), 1)]
    assert mm.shared_blocks == (0, 1) and mm.free_blocks == (3, 4, 5, 6, 7)
    assert [(b.owners, b.ref_count, b.num_tokens) for b in mm.blocks[:3]] == [
        ((0, 1), 2, 4), ((0, 1), 2, 2), ((2,), 1, 1)]
    text = str(mm)
    assert "3 used (2 shared), 5 free" in text and "#3-#7" in text and "shared by 2" in text
    m.free_sequence(0)
    m.free_sequence(1)
    m.free_sequence(2)
    assert m.memory_map().free_blocks == tuple(range(8))


def test_memory_map_text_stays_short_for_long_sequences():
    m = make(block_size=2, num_blocks=64)
    m.add_sequence(1, 40)
    text = str(m.memory_map())
    assert "blocks [0 1 2 3 4 5 6 7 8 ... 18 19 (20 blocks)]" in text
    assert "#0-#19" in text and "seq 1 (20 blocks)" in text and "#20-#63   free (44 blocks)" in text
    assert len(text.splitlines()) == 6


# -- the state machine -------------------------------------------------------------------------

class ManagerMachine(RuleBasedStateMachine):
    """Shadow model: per live sequence, the token id written at each position (None: slot
    reserved, not yet written). Token ``t`` is written as K = t, V = -t everywhere."""

    @initialize(block_size=st.sampled_from([1, 2, 3]), num_blocks=st.integers(1, 10),
                max_blocks=st.one_of(st.none(), st.integers(1, 5)))
    def setup(self, block_size, num_blocks, max_blocks):
        self.m = PagedAttentionManager(4, 2, 2, block_size, num_blocks, dtype=torch.float32,
                                       num_kv_heads=1, max_blocks_per_seq=max_blocks)
        self.bs, self.max_blocks = block_size, max_blocks or num_blocks
        self.seqs: dict[int, list[int | None]] = {}
        self.free = num_blocks
        self.next_token = 1

    def _fails(self, exc, fn, *args):
        before = snapshot(self.m)
        with pytest.raises(exc):
            fn(*args)
        assert_same(before, snapshot(self.m))

    def _shared(self, seq, logical):
        blocks = self.m.seq_block_mapping[seq]
        return sum(self.m.block_manager.get_ref_count(blocks[j]) > 1 for j in logical)

    @rule(seq=st.integers(-1, 4), n=st.integers(0, 10))
    def add(self, seq, n):
        need = -(-n // self.bs)
        if not 0 <= seq < 4 or seq in self.seqs or need > self.max_blocks:
            return self._fails(ValueError, self.m.add_sequence, seq, n)
        if need > self.free:
            return self._fails(OutOfBlocksError, self.m.add_sequence, seq, n)
        self.m.add_sequence(seq, n)
        self.seqs[seq], self.free = [None] * n, self.free - need

    @rule(seq=st.integers(0, 4), delta=st.sampled_from([0, 0, 0, -1, 1]))
    def append(self, seq, delta):
        length = len(self.seqs.get(seq, []))
        if seq not in self.seqs or delta:
            return self._fails(ValueError, self.m.append_token, seq, length + delta)
        new_block = length % self.bs == 0
        if new_block and length // self.bs + 1 > self.max_blocks:
            return self._fails(ValueError, self.m.append_token, seq, length)
        need = 1 if new_block else self._shared(seq, [length // self.bs])
        if need > self.free:
            return self._fails(OutOfBlocksError, self.m.append_token, seq, length)
        slot = self.m.append_token(seq, length)
        self.seqs[seq].append(None)
        self.free -= need
        assert slot == int(self.m.get_slot_mapping(seq, length, 1)[0])

    @rule(parent=st.integers(0, 4), child=st.integers(0, 4))
    def fork(self, parent, child):
        if parent not in self.seqs or child in self.seqs or child >= 4:
            return self._fails(ValueError, self.m.fork_sequence, parent, child)
        self.m.fork_sequence(parent, child)
        self.seqs[child] = list(self.seqs[parent])

    @rule(seq=st.integers(0, 4), start=st.integers(-1, 10), n=st.integers(0, 4),
          bad_dtype=st.booleans())
    def write(self, seq, start, n, bad_dtype):
        ids = list(range(self.next_token, self.next_token + n))
        key = torch.tensor(ids, dtype=torch.float32)[:, None, None].expand(n, 1, 2)
        key = key.to(torch.float16) if bad_dtype else key
        length = len(self.seqs.get(seq, []))
        if seq not in self.seqs or bad_dtype or start < 0 or start + n > length:
            return self._fails(ValueError, self.m.write_kv, seq, start, key, -key)
        touched = range(start // self.bs, (start + n - 1) // self.bs + 1) if n else []
        need = self._shared(seq, touched)
        if need > self.free:
            return self._fails(OutOfBlocksError, self.m.write_kv, seq, start, key, -key)
        self.m.write_kv(seq, start, key.contiguous(), -key)
        self.seqs[seq][start:start + n] = ids
        self.free -= need
        self.next_token += n

    # The rules above draw arguments blindly (mostly invalid calls); these pick a live sequence
    # and valid arguments, so long histories of forks, appends and writes happen too.
    @rule(data=st.data())
    def add_live(self, data):
        unused = [s for s in range(4) if s not in self.seqs]
        capacity = min(self.free // 2, self.max_blocks) * self.bs  # leave room to grow
        if unused and capacity:
            seq = data.draw(st.sampled_from(unused))
            n = data.draw(st.integers(1, capacity))
            self.add(seq, n)
            self.write(seq, 0, n, False)  # the prompt's K/V, as a prefill writes it

    @rule(data=st.data())
    def append_live(self, data):
        if self.seqs:
            seq = data.draw(st.sampled_from(sorted(self.seqs)))
            self.append(seq, 0)

    @rule(data=st.data())
    def fork_live(self, data):
        unused = [s for s in range(4) if s not in self.seqs]
        if self.seqs and unused:
            self.fork(data.draw(st.sampled_from(sorted(self.seqs))),
                      data.draw(st.sampled_from(unused)))

    @rule(data=st.data())
    def write_live(self, data):
        live = [s for s, ids in self.seqs.items() if ids]
        if live:
            seq = data.draw(st.sampled_from(sorted(live)))
            start = data.draw(st.integers(0, len(self.seqs[seq]) - 1))
            n = data.draw(st.integers(1, len(self.seqs[seq]) - start))
            self.write(seq, start, n, False)

    @rule(seq=st.integers(0, 4))
    def free_seq(self, seq):
        if seq in self.seqs:
            blocks = self.m.seq_block_mapping[seq]
            self.free += sum(self.m.block_manager.get_ref_count(b) == 1 for b in blocks)
            del self.seqs[seq]
        self.m.free_sequence(seq)

    @invariant()
    def blocks_are_accounted_for(self):
        bm, m = self.m.block_manager, self.m
        assert set(m.seq_block_mapping) == set(self.seqs)
        refs = Counter(b for blocks in m.seq_block_mapping.values() for b in blocks)
        free = bm.get_free_blocks()
        assert bm.get_num_free_blocks() == len(free) == self.free
        assert bm.get_num_free_blocks() + bm.get_num_used_blocks() == m.num_blocks
        assert len(refs) + len(free) == m.num_blocks and not set(free) & set(refs)
        for b in range(m.num_blocks):
            assert bm.get_ref_count(b) == refs[b]

    @invariant()
    def tables_and_lengths_match(self):
        for seq in range(4):
            tokens_ = self.seqs.get(seq)
            if tokens_ is None:
                assert int(self.m.context_lens[seq]) == 0
                continue
            blocks = self.m.seq_block_mapping[seq]
            assert len(blocks) == -(-len(tokens_) // self.bs)
            assert self.m.block_table[seq, :len(blocks)].tolist() == blocks
            assert int(self.m.context_lens[seq]) == self.m.get_seq_len(seq) == len(tokens_)

    @invariant()
    def every_sequence_reads_back_what_was_written_to_it(self):
        for seq, ids in self.seqs.items():
            k, v = read_back(self.m, seq)
            for pos, t in enumerate(ids):
                if t is not None:
                    assert k[pos].eq(t).all() and v[pos].eq(-t).all(), (seq, pos, t)


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])
