"""A snapshot of the paged KV pool a person can read: who owns which block, what is shared, free.

:meth:`PagedAttentionManager.memory_map` returns a :class:`MemoryMap`; ``str()`` of it is the
table the CLI demo prints. The data is plain Python (no tensors), so it can also be asserted on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

_BAR_WIDTH = 8


@dataclass(frozen=True)
class SequenceMap:
    """One sequence: its length and its physical blocks in logical order."""

    seq_id: int
    num_tokens: int
    blocks: tuple[int, ...]
    block_size: int

    @property
    def last_block_fill(self) -> int:
        """Tokens in the last block (0 when the sequence has no block)."""
        if not self.blocks:
            return 0
        return self.num_tokens - (len(self.blocks) - 1) * self.block_size


@dataclass(frozen=True)
class BlockMap:
    """One physical block: its reference count, the sequences that use it, its fill."""

    block: int
    ref_count: int
    owners: tuple[int, ...]
    num_tokens: int

    @property
    def is_free(self) -> bool:
        return self.ref_count == 0

    @property
    def is_shared(self) -> bool:
        return self.ref_count > 1


@dataclass(frozen=True)
class MemoryMap:
    """The whole pool: ``blocks[i]`` describes physical block ``i``."""

    block_size: int
    sequences: tuple[SequenceMap, ...]
    blocks: tuple[BlockMap, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def free_blocks(self) -> tuple[int, ...]:
        return tuple(b.block for b in self.blocks if b.is_free)

    @property
    def shared_blocks(self) -> tuple[int, ...]:
        return tuple(b.block for b in self.blocks if b.is_shared)

    def __str__(self) -> str:
        num_free = len(self.free_blocks)
        lines = [f"KV pool: {self.num_blocks} blocks x {self.block_size} tokens; "
                 f"{self.num_blocks - num_free} used ({len(self.shared_blocks)} shared), "
                 f"{num_free} free"]
        if self.sequences:
            lines.append("sequences:")
        listed = [f"[{_block_list(s.blocks)}]" for s in self.sequences]
        width = max(map(len, listed), default=0)
        for s, blocks in zip(self.sequences, listed):
            lines.append(f"  seq {s.seq_id:<3} {s.num_tokens:>5} tokens  blocks {blocks:<{width}}"
                         f"  last block {s.last_block_fill}/{self.block_size}")
        lines.append("blocks:")
        # Runs of neighbouring blocks that read the same (free, or same owners and fill) are
        # one line, so a large pool stays a screenful.
        i = 0
        while i < self.num_blocks:
            b, j = self.blocks[i], i
            while j + 1 < self.num_blocks and _same_line(self.blocks[j + 1], b):
                j += 1
            span = f"#{i}" if i == j else f"#{i}-#{j}"
            count = f" ({j - i + 1} blocks)" if j > i else ""
            if b.is_free:
                lines.append(f"  {span:<9} free{count}")
            else:
                owners = ", ".join(f"seq {o}" for o in b.owners)
                shared = f"  shared by {b.ref_count}" if b.is_shared else ""
                lines.append(f"  {span:<9} [{_bar(b.num_tokens, self.block_size)}] "
                             f"{b.num_tokens:>3}/{self.block_size}  {owners}{shared}{count}")
            i = j + 1
        return "\n".join(lines)


def _block_list(blocks: tuple[int, ...], most: int = 12) -> str:
    if len(blocks) <= most:
        return " ".join(map(str, blocks))
    head, tail = blocks[:most - 3], blocks[-2:]  # long sequences: keep the line readable
    return (" ".join(map(str, head)) + " ... " + " ".join(map(str, tail))
            + f" ({len(blocks)} blocks)")


def _same_line(a: BlockMap, b: BlockMap) -> bool:
    return (a.is_free and b.is_free) or (a.owners, a.ref_count, a.num_tokens) == (
        b.owners, b.ref_count, b.num_tokens)


def _bar(filled: int, block_size: int) -> str:
    n = filled * _BAR_WIDTH // block_size
    if filled and not n:
        n = 1  # a block holding any token never looks empty
    return "#" * n + "." * (_BAR_WIDTH - n)


def build_memory_map(block_size: int, seq_blocks: Mapping[int, Sequence[int]],
                     seq_lens: Mapping[int, int], ref_counts: Sequence[int]) -> MemoryMap:
    """Assemble a :class:`MemoryMap` from the manager's host-side state.

    Args:
        block_size: tokens per block.
        seq_blocks: seq_id -> physical blocks in logical order.
        seq_lens: seq_id -> number of tokens.
        ref_counts: reference count of every physical block (``len == num_blocks``).
    """
    owners: list[list[int]] = [[] for _ in ref_counts]
    fill = [0] * len(ref_counts)
    sequences = []
    for seq_id in sorted(seq_blocks):
        blocks, length = seq_blocks[seq_id], seq_lens[seq_id]
        sequences.append(SequenceMap(seq_id, length, tuple(blocks), block_size))
        for j, b in enumerate(blocks):
            owners[b].append(seq_id)
            fill[b] = max(fill[b], min(block_size, length - j * block_size))
    blocks = tuple(BlockMap(i, ref_counts[i], tuple(owners[i]), fill[i])
                   for i in range(len(ref_counts)))
    return MemoryMap(block_size, tuple(sequences), blocks)
