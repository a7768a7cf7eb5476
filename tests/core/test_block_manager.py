"""BlockManager: seed 002's semantics, every error leaving the state unchanged, threads, and a
Hypothesis state machine against an independent model (free stack + reference counts)."""

from __future__ import annotations

import random
import sys
import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import mini_paged_attn
from mini_paged_attn import BlockManager, BlockStateError, OutOfBlocksError


def state(bm: BlockManager) -> tuple[list[int], list[int]]:
    """Everything observable: the free stack (next first) and every reference count."""
    return bm.get_free_blocks(), [bm.get_ref_count(i) for i in range(bm.num_blocks)]


def test_exported_and_error_types():
    assert mini_paged_attn.BlockManager is BlockManager
    assert issubclass(OutOfBlocksError, MemoryError)
    assert issubclass(BlockStateError, RuntimeError)


def test_fresh_manager_hands_out_blocks_in_order_starting_at_zero():
    bm = BlockManager(5)
    assert bm.num_blocks == 5 and bm.get_num_free_blocks() == 5
    assert [bm.allocate() for _ in range(5)] == [0, 1, 2, 3, 4]
    assert bm.get_num_free_blocks() == 0 and bm.get_num_used_blocks() == 5
    assert all(bm.get_ref_count(i) == 1 for i in range(5))


def test_most_recently_freed_block_comes_back_first():
    bm = BlockManager(8)
    assert bm.allocate_blocks(5) == [0, 1, 2, 3, 4]
    bm.free(2)
    bm.free(4)
    assert bm.get_free_blocks() == [4, 2, 5, 6, 7]
    assert [bm.allocate(), bm.allocate(), bm.allocate()] == [4, 2, 5]


def test_reference_counting_returns_block_only_at_zero():
    bm = BlockManager(3)
    b = bm.allocate()
    bm.increase_ref_count(b)
    bm.increase_ref_count(b)
    assert bm.get_ref_count(b) == 3
    bm.free(b)
    bm.free(b)
    assert bm.get_ref_count(b) == 1 and bm.get_num_free_blocks() == 2
    bm.free(b)
    assert bm.get_ref_count(b) == 0 and bm.get_num_free_blocks() == 3
    assert bm.allocate() == b  # freed last, handed out first


def test_allocate_blocks_matches_repeated_allocate():
    a, b = BlockManager(10), BlockManager(10)
    for bm in (a, b):
        bm.allocate_blocks(6)
        for i in (3, 0, 5):
            bm.free(i)
    assert a.allocate_blocks(5) == [b.allocate() for _ in range(5)]
    assert state(a) == state(b)
    assert a.allocate_blocks(0) == []


def test_free_many_is_free_in_order_and_all_or_nothing():
    bm = BlockManager(6)
    bm.allocate_blocks(4)
    bm.increase_ref_count(1)
    bm.free_many([3, 1, 1, 0])
    assert bm.get_free_blocks() == [0, 1, 3, 4, 5]
    before = state(bm)
    with pytest.raises(BlockStateError, match="block 2"):
        bm.free_many([2, 2])  # count 1, listed twice
    with pytest.raises(IndexError):
        bm.free_many([2, 99])
    with pytest.raises(TypeError):
        bm.free_many([2, "3"])
    assert state(bm) == before


def test_out_of_blocks_message_says_asked_and_free():
    bm = BlockManager(4)
    bm.allocate_blocks(2)
    before = state(bm)
    with pytest.raises(OutOfBlocksError, match=r"asked for 3 block.*only 2 of 4 are free"):
        bm.allocate_blocks(3)
    assert state(bm) == before
    bm.allocate_blocks(2)
    with pytest.raises(OutOfBlocksError, match=r"asked for 1 block.*only 0 of 4"):
        bm.allocate()
    with pytest.raises(MemoryError):
        bm.allocate()


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_non_positive_pool_is_value_error(num_blocks):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks)


@pytest.mark.parametrize("num_blocks", [2.0, "3", True, None])
def test_non_integer_pool_is_type_error(num_blocks):
    with pytest.raises(TypeError, match="num_blocks"):
        BlockManager(num_blocks)


def test_integer_scalars_of_numpy_and_torch_are_accepted():
    bm = BlockManager(np.int64(4))
    b = bm.allocate()
    bm.increase_ref_count(np.int32(b))
    assert bm.get_ref_count(torch.tensor(b)) == 2
    bm.free(torch.tensor(b, dtype=torch.int64))
    assert bm.allocate_blocks(np.int64(2)) == [1, 2]


METHODS = ["free", "increase_ref_count", "get_ref_count"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("idx", [-1, 4, 100])
def test_index_out_of_range_is_index_error_and_changes_nothing(method, idx):
    bm = BlockManager(4)
    bm.allocate_blocks(4)
    before = state(bm)
    with pytest.raises(IndexError, match=rf"0 <= block_idx < 4, got {idx}"):
        getattr(bm, method)(idx)
    assert state(bm) == before


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("idx", [1.0, "1", None, True, np.bool_(True), torch.tensor(True),
                                 torch.tensor(1.0)])
def test_non_integer_index_is_type_error_and_changes_nothing(method, idx):
    bm = BlockManager(4)
    bm.allocate_blocks(4)
    before = state(bm)
    with pytest.raises(TypeError, match="block_idx"):
        getattr(bm, method)(idx)
    assert state(bm) == before


@pytest.mark.parametrize("n, exc", [(-1, ValueError), (1.5, TypeError), (True, TypeError)])
def test_bad_allocate_blocks_count(n, exc):
    bm = BlockManager(4)
    before = state(bm)
    with pytest.raises(exc, match="n:"):
        bm.allocate_blocks(n)
    assert state(bm) == before


@pytest.mark.parametrize("method", ["free", "increase_ref_count"])
def test_free_block_state_errors_change_nothing(method):
    bm = BlockManager(3)
    bm.allocate_blocks(2)
    bm.free(0)
    before = state(bm)
    for idx in (0, 2):  # freed, never allocated
        with pytest.raises(BlockStateError, match=rf"{method}\({idx}\).*count 0"):
            getattr(bm, method)(idx)
    assert state(bm) == before


def test_concurrent_allocate_and_free_end_consistent():
    """Threads allocate, share and free their own blocks; mid-run no block is held by two
    threads, and at the end the pool is whole with every count 0.

    Under the GIL, a check-then-act window (e.g. allocate_blocks checking the free count, then
    popping in a loop without the lock) is hit within these rounds; a tiny switch interval
    makes it likely."""
    num_threads, rounds, num_blocks = 8, 5000, 64
    bm = BlockManager(num_blocks)
    barrier = threading.Barrier(num_threads + 1)
    held: list[list[int]] = [[] for _ in range(num_threads)]
    errors: list[BaseException] = []

    def work(t: int) -> None:
        rng = random.Random(t)
        mine = held[t]
        try:
            for _ in range(rounds):
                op = rng.random()
                try:
                    if op < 0.3:
                        mine.append(bm.allocate())
                    elif op < 0.5:
                        mine.extend(bm.allocate_blocks(rng.randint(1, 3)))
                    elif op < 0.6 and mine:
                        b = rng.choice(mine)
                        bm.increase_ref_count(b)
                        mine.append(b)
                    elif mine:
                        bm.free(mine.pop(rng.randrange(len(mine))))
                except OutOfBlocksError:
                    pass
            barrier.wait()  # main thread checks ownership now
            barrier.wait()
            bm.free_many(mine)
            mine.clear()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
            barrier.abort()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often to expose races
    try:
        threads = [threading.Thread(target=work, args=(t,)) for t in range(num_threads)]
        for th in threads:
            th.start()
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            for th in threads:
                th.join()
            raise AssertionError(f"a worker failed: {errors!r}") from None
        owners: dict[int, int] = {}
        for t, mine in enumerate(held):
            for b in mine:
                assert owners.setdefault(b, t) == t, f"block {b} held by threads {owners[b]}, {t}"
        for b in range(num_blocks):
            assert bm.get_ref_count(b) == sum(m.count(b) for m in held)
        assert bm.get_num_free_blocks() == num_blocks - len(owners)
        barrier.wait()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors
    free, counts = state(bm)
    assert sorted(free) == list(range(num_blocks)) and counts == [0] * num_blocks


BAD_INDICES = st.sampled_from([1.5, "0", None, True, False, np.bool_(False)])


class BlockManagerMachine(RuleBasedStateMachine):
    """Model: a free stack (list, top at the end) and a count per block."""

    @initialize(num_blocks=st.integers(1, 8))
    def setup(self, num_blocks):
        self.bm = BlockManager(num_blocks)
        self.n = num_blocks
        self.free_stack = list(range(num_blocks - 1, -1, -1))
        self.counts = [0] * num_blocks

    def _unchanged_after(self, exc, fn, *args):
        before = state(self.bm)
        with pytest.raises(exc):
            fn(*args)
        assert state(self.bm) == before

    @rule()
    def allocate(self):
        if not self.free_stack:
            return self._unchanged_after(OutOfBlocksError, self.bm.allocate)
        expected = self.free_stack.pop()
        assert self.bm.allocate() == expected
        self.counts[expected] = 1

    @rule(n=st.integers(0, 10))
    def allocate_blocks(self, n):
        if n > len(self.free_stack):
            return self._unchanged_after(OutOfBlocksError, self.bm.allocate_blocks, n)
        expected = [self.free_stack.pop() for _ in range(n)]
        assert self.bm.allocate_blocks(n) == expected
        for b in expected:
            self.counts[b] = 1

    def _drop(self, b):
        self.counts[b] -= 1
        if self.counts[b] == 0:
            self.free_stack.append(b)

    @rule(idx=st.integers(-2, 9))
    def free(self, idx):
        if not 0 <= idx < self.n:
            return self._unchanged_after(IndexError, self.bm.free, idx)
        if self.counts[idx] == 0:
            return self._unchanged_after(BlockStateError, self.bm.free, idx)
        self.bm.free(idx)
        self._drop(idx)

    @rule(data=st.data())
    def free_used(self, data):
        used = [b for b in range(self.n) if self.counts[b]]
        if used:
            self.free(data.draw(st.sampled_from(used)))

    @rule(blocks=st.lists(st.integers(-1, 8), max_size=4))
    def free_many(self, blocks):
        if any(not 0 <= b < self.n for b in blocks):
            return self._unchanged_after(IndexError, self.bm.free_many, blocks)
        if any(blocks.count(b) > self.counts[b] for b in blocks):
            return self._unchanged_after(BlockStateError, self.bm.free_many, blocks)
        self.bm.free_many(blocks)
        for b in blocks:
            self._drop(b)

    @rule(idx=st.integers(-2, 9))
    def increase_ref_count(self, idx):
        if not 0 <= idx < self.n:
            return self._unchanged_after(IndexError, self.bm.increase_ref_count, idx)
        if self.counts[idx] == 0:
            return self._unchanged_after(BlockStateError, self.bm.increase_ref_count, idx)
        self.bm.increase_ref_count(idx)
        self.counts[idx] += 1

    @rule(idx=BAD_INDICES, method=st.sampled_from(METHODS))
    def bad_index_type(self, idx, method):
        self._unchanged_after(TypeError, getattr(self.bm, method), idx)

    @invariant()
    def matches_model(self):
        free, counts = state(self.bm)
        assert free == self.free_stack[::-1]
        assert counts == self.counts
        num_free = self.bm.get_num_free_blocks()
        assert num_free + self.bm.get_num_used_blocks() == self.n
        assert num_free == len(free) == len(set(free))
        assert set(free) == {b for b in range(self.n) if counts[b] == 0}


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=60, stateful_step_count=40,
                                            deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
