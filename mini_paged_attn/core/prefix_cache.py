"""Automatic prefix caching: find full KV blocks by the tokens they hold (no torch).

A full block is named by a chained hash, ``hash(parent_hash, tokens of the block)``, so equal
hashes mean equal *prefixes*, not just equal blocks. A hit is confirmed by comparing the block's
tokens and parent hash with the cached entry; that check cannot see a collision further up the
chain (two different prefixes with one parent hash), so the hash is a 128-bit BLAKE2b digest,
not Python's 64-bit ``hash`` (whose integer and tuple hashing are easy to invert, which would let
a crafted prompt plant its K/V under another prompt's prefix). The digest costs microseconds
per full block, nothing against a step.

Ownership (with the block manager's reference counts):
- a cached block that sequences use has one reference per sequence, as any block;
- when its last sequence frees it, the cache keeps that reference and the block becomes
  *evictable*: still findable, and reusable by anyone who needs a fresh block. Evictable blocks
  are kept in least-recently-freed order; the oldest is evicted first.
So ``ref_count(b) == (sequences holding b) + (1 if b is evictable)`` for every block.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

# Parent hash of a sequence's first block.
ROOT_HASH = 0x6D696E69  # "mini"
HASH_BYTES = 16


def hash_block(parent_hash: int, tokens: Sequence[int]) -> int:
    """Chained hash of one full block: a 128-bit int (BLAKE2b of the parent hash and the
    tokens as int64), deterministic across processes."""
    data = parent_hash.to_bytes(HASH_BYTES, "little") + array("q", tokens).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=HASH_BYTES).digest(), "little")


@dataclass(frozen=True)
class _Entry:
    block_id: int
    parent_hash: int
    tokens: tuple[int, ...]


class PrefixCache:
    """Maps chained block hashes to physical blocks and keeps the LRU of evictable blocks.

    The cache never allocates or frees: :class:`~.kv_cache_manager.KVCacheManager` moves
    references between sequences, this cache and the block manager, and tells the cache.
    """

    def __init__(self) -> None:
        self._by_hash: dict[int, _Entry] = {}
        self._hash_of_block: dict[int, int] = {}
        # Evictable blocks, least recently freed first.
        self._evictable: OrderedDict[int, None] = OrderedDict()

    # ---- lookups -----------------------------------------------------------------------------
    def lookup(self, block_hash: int, parent_hash: int, tokens: Sequence[int]) -> int | None:
        """The block holding exactly ``tokens`` after the prefix named ``parent_hash``, or None."""
        entry = self._by_hash.get(block_hash)
        if entry is None or entry.parent_hash != parent_hash or entry.tokens != tuple(tokens):
            return None
        return entry.block_id

    def block_of(self, block_hash: int) -> int | None:
        """The block cached under ``block_hash``, or None."""
        entry = self._by_hash.get(block_hash)
        return None if entry is None else entry.block_id

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._hash_of_block

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_of_block)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    def evictable_blocks(self) -> list[int]:
        """Evictable block ids, the next to be evicted first (a copy)."""
        return list(self._evictable)

    # ---- changes -----------------------------------------------------------------------------
    def insert(self, block_hash: int, parent_hash: int, tokens: Sequence[int], block_id: int) -> bool:
        """Register a block whose K/V holds ``tokens``; False (and no change) if that hash is
        already cached (by another block with the same content) or the block already is."""
        if block_hash in self._by_hash or block_id in self._hash_of_block:
            return False
        self._by_hash[block_hash] = _Entry(block_id, parent_hash, tuple(tokens))
        self._hash_of_block[block_id] = block_hash
        return True

    def make_evictable(self, block_id: int) -> None:
        """The last sequence let go of a cached block; the cache now holds its reference."""
        assert block_id in self._hash_of_block and block_id not in self._evictable, block_id
        self._evictable[block_id] = None

    def refresh(self, block_id: int) -> None:
        """An evictable block counts as freed just now: it is evicted last."""
        self._evictable.move_to_end(block_id)

    def take(self, block_id: int) -> None:
        """A sequence takes over an evictable block (a cache hit); it stays cached."""
        del self._evictable[block_id]

    def forget(self, block_id: int) -> bool:
        """Stop finding ``block_id`` (its K/V will never be written). Returns True if it was
        evictable: the cache's reference then passes to the caller, who frees it."""
        block_hash = self._hash_of_block.pop(block_id, None)
        if block_hash is None:
            return False
        del self._by_hash[block_hash]
        if block_id in self._evictable:
            del self._evictable[block_id]
            return True
        return False

    def evict(self) -> int:
        """Forget the least recently freed evictable block and return it (its reference passes
        to the caller). Raises KeyError if none is evictable."""
        block_id, _ = self._evictable.popitem(last=False)
        del self._by_hash[self._hash_of_block.pop(block_id)]
        return block_id


__all__ = ["PrefixCache", "ROOT_HASH", "hash_block"]
