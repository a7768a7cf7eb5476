"""BlockManager: which physical KV blocks are free, and how many owners each used block has.

Seed 002's interface, in Python. The manager never touches tensors: it hands out block ids
``0 .. num_blocks-1`` and counts references, so sequences (or forks of one) can share a block and
the block returns to the pool only when its last owner frees it.

- A fresh manager hands out 0, 1, 2, … in order; afterwards the most recently freed block comes
  back first (a stack, so every call is O(1) and recently used memory is reused while warm).
- Every public method takes one lock, so concurrent calls from several threads are safe, and a
  check and the change it guards happen under the same lock.
- A failing call raises before changing anything.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable

from ..errors import BlockStateError, OutOfBlocksError
from .args import as_int, positive_int


class BlockManager:
    """Reference-counted allocator of ``num_blocks`` physical blocks (ids ``0 .. num_blocks-1``).

    Invariant: a block's reference count is 0 exactly when it is on the free stack.

    Raises (each leaving the state unchanged):
        ValueError: ``num_blocks <= 0``, ``allocate_blocks(n)`` with ``n < 0``.
        OutOfBlocksError: fewer free blocks than asked for (a ``MemoryError``).
        IndexError: a block id outside ``[0, num_blocks)``.
        TypeError: a block id (or count) that is not an integer (``bool`` included).
        BlockStateError: ``free`` / ``increase_ref_count`` of a block whose count is 0.
    """

    def __init__(self, num_blocks: int) -> None:
        num_blocks = positive_int("num_blocks", as_int("num_blocks", num_blocks))
        self._num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        # The top of the stack is the end of the list; reversed so block 0 is handed out first.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._lock = threading.Lock()

    @property
    def num_blocks(self) -> int:
        """Total number of physical blocks in the pool."""
        return self._num_blocks

    def _index(self, block_idx: object) -> int:
        idx = as_int("block_idx", block_idx)
        if not 0 <= idx < self._num_blocks:
            raise IndexError(f"block_idx: expected 0 <= block_idx < {self._num_blocks}, got {idx}")
        return idx

    def _out_of_blocks(self, asked: int) -> OutOfBlocksError:
        return OutOfBlocksError(f"asked for {asked} block(s), but only {len(self._free)} of "
                                f"{self._num_blocks} are free")

    def allocate(self) -> int:
        """Take one free block; its reference count becomes 1. Raises OutOfBlocksError."""
        with self._lock:
            if not self._free:
                raise self._out_of_blocks(1)
            idx = self._free.pop()
            self._ref_counts[idx] = 1
            return idx

    def allocate_blocks(self, n: int) -> list[int]:
        """Take ``n`` free blocks, all or nothing (``n == 0`` gives ``[]``).

        The blocks come in the order ``n`` calls of :meth:`allocate` would give them.
        """
        n = as_int("n", n)
        if n < 0:
            raise ValueError(f"n: expected a non-negative number of blocks, got {n}")
        with self._lock:
            if n > len(self._free):
                raise self._out_of_blocks(n)
            taken = self._free[len(self._free) - n:]
            del self._free[len(self._free) - n:]
            taken.reverse()
            for idx in taken:
                self._ref_counts[idx] = 1
            return taken

    def free(self, block_idx: int) -> None:
        """Drop one reference; at 0 the block returns to the pool (and is handed out next)."""
        idx = self._index(block_idx)
        with self._lock:
            if self._ref_counts[idx] == 0:
                raise BlockStateError(f"free({idx}): expected a block with reference count >= 1, "
                                      "got a free block (count 0)")
            self._release(idx)

    def free_many(self, blocks: Iterable[int]) -> None:
        """``free(b)`` for each ``b`` in order, under one lock and all or nothing.

        A block may appear several times (once per reference dropped).
        """
        indices = [self._index(b) for b in blocks]
        with self._lock:
            for idx, times in Counter(indices).items():
                if self._ref_counts[idx] < times:
                    raise BlockStateError(
                        f"free_many: expected block {idx} to have >= {times} reference(s) "
                        f"(it is listed {times} time(s)), got count {self._ref_counts[idx]}")
            for idx in indices:
                self._release(idx)

    def _release(self, idx: int) -> None:
        # Caller holds the lock and has checked the count is positive.
        self._ref_counts[idx] -= 1
        if self._ref_counts[idx] == 0:
            self._free.append(idx)

    def increase_ref_count(self, block_idx: int) -> None:
        """Add one reference to a used block (a new owner shares it)."""
        idx = self._index(block_idx)
        with self._lock:
            if self._ref_counts[idx] == 0:
                raise BlockStateError(f"increase_ref_count({idx}): expected a used block "
                                      "(reference count >= 1), got a free block (count 0)")
            self._ref_counts[idx] += 1

    def get_ref_count(self, block_idx: int) -> int:
        """Number of owners of ``block_idx`` (0 when it is free)."""
        idx = self._index(block_idx)
        with self._lock:
            return self._ref_counts[idx]

    def get_num_free_blocks(self) -> int:
        """Blocks that :meth:`allocate` can hand out now."""
        with self._lock:
            return len(self._free)

    def get_num_used_blocks(self) -> int:
        """Blocks with at least one owner (``num_blocks - get_num_free_blocks()``)."""
        with self._lock:
            return self._num_blocks - len(self._free)

    def get_free_blocks(self) -> list[int]:
        """The free block ids, the next one :meth:`allocate` hands out first (a copy)."""
        with self._lock:
            return self._free[::-1]

    def __repr__(self) -> str:
        with self._lock:
            free = len(self._free)
        return f"BlockManager(num_blocks={self._num_blocks}, free={free})"
