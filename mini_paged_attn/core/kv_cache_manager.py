"""Per-sequence KV block allocation on top of the block manager and the prefix cache (no torch).

Blocks are allocated as tokens arrive (never reserved for max_tokens up front). Every call that
can fail checks first and changes nothing when it fails, so the scheduler can try, preempt
someone, and try again.

Copy-on-write: after :meth:`KVCacheManager.fork`, parent and child share every block. Full blocks
are only ever read. The first of them to write into a shared, partly filled last block gets a
fresh copy of it; :meth:`allocate_slots` returns the ``(src, dst)`` block pairs that the model
runner must copy on the device before the step writes any K/V.

Sliding window (a model whose every layer attends to the last ``W`` positions only): after each
step, :meth:`KVCacheManager.drop_out_of_window` gives back the blocks wholly left of the next
query's window (see ``sliding_window``), so a long sequence holds about one window of blocks.
A prefix hit takes only the hit blocks its first query's window reaches, and
:meth:`KVCacheManager.chunk_limit` caps a prompt chunk at what the pool can hold next to the
window, so a prompt many times the pool's size still runs.

Speculative decoding: a step that verifies ``k`` proposed tokens writes ``k + 1`` positions, so
:meth:`KVCacheManager.allocate_slots` takes ``num_lookahead_tokens`` slots past the new ones.
Those slots' K/V is a guess until the step's tokens are verified, so no block is registered in
the prefix cache for them when they are allocated; once the step is verified,
:meth:`KVCacheManager.truncate` gives back the blocks only rejected tokens reached and
:meth:`KVCacheManager.register_computed` registers the blocks the accepted tokens filled.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import OutOfBlocksError
from .args import as_int, cdiv, non_negative_int, positive_int
from .block_manager import BlockManager
from .prefix_cache import ROOT_HASH, PrefixCache, hash_block
from .request import PLACEHOLDER_TOKEN, Sequence
from .sliding_window import PAD_BLOCK_ID, check_sliding_window, first_needed_block


@dataclass(frozen=True)
class CacheHit:
    """Blocks a waiting sequence can reuse from the prefix cache: ``block_ids`` hold its first
    ``num_tokens`` tokens (a multiple of block_size)."""

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0


NO_HIT = CacheHit()


class KVCacheManager:
    """Allocates, shares and frees the blocks of sequences; owns the prefix cache.

    Args:
        block_manager: the pool (its reference counts are the single source of truth).
        block_size: tokens per block.
        enable_prefix_caching: look up and register full blocks by content.
        sliding_window: ``W`` when every layer of the model attends only to the last ``W``
            positions (Hugging Face's ``sliding_window``): blocks left of the window are given
            back as sequences advance. None (full attention): a sequence keeps all its blocks.

    Raises:
        ValueError: ``block_size`` or ``sliding_window`` not a positive int (None allowed for
            the window).
    """

    def __init__(self, block_manager: BlockManager, block_size: int,
                 enable_prefix_caching: bool = True, sliding_window: int | None = None) -> None:
        self.block_manager = block_manager
        self.block_size = positive_int("block_size", block_size)
        self.sliding_window = check_sliding_window(sliding_window)
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache = PrefixCache()
        # Prompt tokens looked up in the cache, and those found (for the hit rate).
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        # Blocks registered in the prefix cache since begin_step(): their K/V is written only
        # by that step's forward, so a failed step takes them back out.
        self._step_registrations: list[int] = []

    # ---- accounting --------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.block_manager.num_blocks

    def num_free_blocks(self) -> int:
        """Blocks a sequence could get now: free in the pool, or cached and evictable."""
        return self.block_manager.get_num_free_blocks() + self.prefix_cache.num_evictable_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def chunk_limit(self, num_computed_tokens: int) -> int:
        """The most new tokens a sequence with ``num_computed_tokens`` tokens in the cache can
        compute in one step with the whole pool to itself (its window's blocks plus the new
        ones). Without a window it is unbounded, ``sys.maxsize`` (admission made the whole
        sequence fit)."""
        if self.sliding_window is None:
            return sys.maxsize
        first = first_needed_block(num_computed_tokens, self.sliding_window, self.block_size)
        return (self.num_blocks + first) * self.block_size - num_computed_tokens

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    # ---- prefix cache lookups ---------------------------------------------------------------
    def _extend_hashes(self, seq: Sequence, num_full_blocks: int) -> None:
        """Make seq.block_hashes cover its first ``num_full_blocks`` full blocks."""
        hashes, tokens, bs = seq.block_hashes, seq.token_ids, self.block_size
        parent = hashes[-1] if hashes else ROOT_HASH
        for i in range(len(hashes), num_full_blocks):
            parent = hash_block(parent, tokens[i * bs:(i + 1) * bs])
            hashes.append(parent)

    def find_cached_prefix(self, seq: Sequence) -> CacheHit:
        """The longest run of cached blocks at the start of a sequence that holds no blocks.

        At most ``num_tokens - 1`` tokens are served, so the last token is always computed (its
        logits are needed). Nothing changes; :meth:`allocate_slots` takes the hit.
        """
        assert not seq.block_ids, seq
        if not (self.enable_prefix_caching and seq.request.uses_prefix_cache):
            return NO_HIT
        bs = self.block_size
        num_full = (seq.num_tokens - 1) // bs
        self._extend_hashes(seq, num_full)
        found: list[int] = []
        parent = ROOT_HASH
        for i in range(num_full):
            h = seq.block_hashes[i]
            block = self.prefix_cache.lookup(h, parent, seq.token_ids[i * bs:(i + 1) * bs])
            if block is None:
                break
            found.append(block)
            parent = h
        return CacheHit(tuple(found), len(found) * bs) if found else NO_HIT

    def record_lookup(self, num_queried: int, num_hit: int) -> None:
        """Count one prompt's lookup in the hit rate (the scheduler calls it on admission)."""
        self.num_queried_tokens += num_queried
        self.num_hit_tokens += num_hit

    # ---- allocation --------------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, hit: CacheHit = NO_HIT,
                       num_lookahead_tokens: int = 0) -> list[tuple[int, int]] | None:
        """Give ``seq`` room for its next ``num_new_tokens`` tokens' K/V, and
        ``num_lookahead_tokens`` more past them (speculative proposals the step verifies).

        With a ``hit`` (from :meth:`find_cached_prefix`, for a sequence holding no blocks), the
        hit's blocks are attached first and ``seq.num_computed_tokens`` is set to the hit's token
        count; the new tokens follow them. Under a sliding window only the hit blocks the first
        new token's window reaches are taken; the earlier ones are recorded as dropped. Blocks
        the new tokens fill are registered in the prefix cache now; those that only lookahead
        tokens reach are not (:meth:`register_computed`, once they are verified).

        Returns:
            The copy-on-write ``(src, dst)`` block pairs to copy on the device before the step
            writes K/V (empty almost always), or None if there are not enough blocks, in which
            case nothing changed.
        """
        bs = self.block_size
        num_computed = hit.num_tokens if hit.block_ids else seq.num_computed_tokens
        held = len(seq.block_ids) + len(hit.block_ids)
        num_new_blocks = max(0, cdiv(num_computed + num_new_tokens + num_lookahead_tokens, bs)
                             - held)
        # The first new token lands in an existing block only when it is partly filled; such a
        # block is shared only after a fork (prefix hits are full blocks), so the reference
        # count is read only for requests with several samples.
        cow = (seq.request.n > 1 and num_new_tokens > 0 and num_computed % bs != 0
               and num_computed // bs < held
               and self.block_manager.get_ref_count(seq.block_ids[num_computed // bs]) > 1)
        if num_new_blocks or cow or hit.block_ids:
            revived = sum(1 for b in self._hit_blocks_taken(hit)
                          if self.prefix_cache.is_evictable(b))
            if num_new_blocks + cow > self.num_free_blocks() - revived:
                return None
        elif not self.enable_prefix_caching or (num_computed + num_new_tokens) // bs == num_computed // bs:
            return []   # the decode fast path: room in the last block, nothing to register

        if hit.block_ids:
            self._take_hit(seq, hit)
        copies: list[tuple[int, int]] = []
        if cow:
            index = num_computed // bs
            copies = self.make_private(seq.block_ids, (index,))
            seq.blocks_changed_from = min(seq.blocks_changed_from, index)
        if num_new_blocks:
            seq.block_ids.extend(self._take_free(num_new_blocks))
        if self.enable_prefix_caching:
            self._register_full_blocks(seq, num_computed // bs, (num_computed + num_new_tokens) // bs)
        return copies

    def make_private(self, block_ids: list[int], indices: Iterable[int]) -> list[tuple[int, int]]:
        """Copy-on-write, the one rule: each block among ``block_ids[j]`` (``j`` in ``indices``)
        that is shared (reference count > 1) is replaced, in ``block_ids``, by a fresh block,
        and this owner's share of the old one is dropped (the others keep it).

        Returns:
            The ``(src, dst)`` pairs whose K/V the caller copies on the device before anything
            writes into ``dst`` (``PagedAttentionManager.copy_blocks``).

        Raises:
            OutOfBlocksError: fewer free (or evictable) blocks than shared ones; nothing changed.
        """
        shared = [j for j in indices if self.block_manager.get_ref_count(block_ids[j]) > 1]
        if not shared:
            return []
        if len(shared) > self.num_free_blocks():
            raise OutOfBlocksError(f"copy-on-write needs {len(shared)} fresh block(s), but only "
                                   f"{self.num_free_blocks()} of {self.num_blocks} are free")
        pairs = []
        for j, dst in zip(shared, self._take_free(len(shared))):
            src = block_ids[j]
            self.block_manager.free(src)
            block_ids[j] = dst
            pairs.append((src, dst))
        return pairs

    def _hit_blocks_taken(self, hit: CacheHit) -> tuple[int, ...]:
        """The hit's blocks that its first new token's window reaches (all without a window)."""
        return hit.block_ids[first_needed_block(hit.num_tokens, self.sliding_window,
                                                self.block_size):]

    def _take_hit(self, seq: Sequence, hit: CacheHit) -> None:
        assert not seq.block_ids, seq
        taken = self._hit_blocks_taken(hit)
        for b in taken:
            if self.prefix_cache.is_evictable(b):
                self.prefix_cache.take(b)      # the cache's reference becomes the sequence's
            else:
                self.block_manager.increase_ref_count(b)
        dropped = len(hit.block_ids) - len(taken)
        seq.block_ids.extend([PAD_BLOCK_ID] * dropped)
        seq.block_ids.extend(taken)
        seq.num_dropped_blocks = dropped
        seq.num_computed_tokens = hit.num_tokens
        seq.num_cached_tokens = hit.num_tokens

    def _take_free(self, n: int) -> list[int]:
        """n blocks with reference count 1 for the caller: free ones first, then evicted ones."""
        from_pool = min(n, self.block_manager.get_num_free_blocks())
        blocks = self.block_manager.allocate_blocks(from_pool)
        for _ in range(n - from_pool):
            blocks.append(self.prefix_cache.evict())
        return blocks

    def _register_full_blocks(self, seq: Sequence, start: int, stop: int) -> None:
        """Cache blocks ``start .. stop-1`` of seq, full once this step's K/V is written.

        (Registering before the step runs is safe: a sequence that hits these blocks is
        scheduled in a later step, or in this one, where every layer writes its K/V before any
        attention reads it.)
        """
        if stop <= start:
            return
        if seq.token_ids[stop * self.block_size - 1] == PLACEHOLDER_TOKEN:
            # Its last token is still being sampled: hashed once it is known.
            stop -= 1
            seq.deferred_block = stop
            if stop <= start:
                return
        self._extend_hashes(seq, stop)
        bs, hashes = self.block_size, seq.block_hashes
        for i in range(start, stop):
            parent = hashes[i - 1] if i else ROOT_HASH
            if self.prefix_cache.insert(hashes[i], parent, seq.token_ids[i * bs:(i + 1) * bs],
                                        seq.block_ids[i]):
                self._step_registrations.append(seq.block_ids[i])

    def register_computed(self, seq: Sequence, start: int) -> None:
        """Cache the full blocks ``start ..`` of ``seq`` that its computed tokens fill: after a
        step whose tokens past the new ones were verified only once it ran (speculative
        proposals, see :meth:`allocate_slots`). Blocks cached already are skipped."""
        if self.enable_prefix_caching:
            self._register_full_blocks(seq, start, seq.num_computed_tokens // self.block_size)

    def truncate(self, seq: Sequence, num_tokens: int) -> int:
        """Keep the K/V of the first ``num_tokens`` tokens of ``seq`` only: the blocks past
        them are released (last first, as :meth:`free` does: one that ends up held by nobody
        goes back to the pool), ``seq.num_computed_tokens`` is at most ``num_tokens``, and the
        chained hashes of blocks past the kept full ones are forgotten (the tokens after
        ``num_tokens`` may change). What a speculative step's rejected proposals reached is
        given back so.

        Returns:
            How many blocks were released.

        Raises:
            TypeError: ``num_tokens`` not an int.
            ValueError: ``num_tokens`` negative, left of the blocks a sliding window gave back,
                or inside a block whose tokens past ``num_tokens`` others may read: a block
                shared with another sequence or cached in the prefix cache (the sequence
                would overwrite them). Nothing changed then.
        """
        num_tokens = non_negative_int("num_tokens", as_int("num_tokens", num_tokens))
        bs, blocks = self.block_size, seq.block_ids
        keep = cdiv(num_tokens, bs)
        if keep < seq.num_dropped_blocks:
            raise ValueError(f"num_tokens: expected >= {seq.num_dropped_blocks * bs} (the "
                             f"blocks before are out of the window, given back), got {num_tokens}")
        if num_tokens % bs and keep <= len(blocks) and keep > seq.num_dropped_blocks:
            cut = blocks[keep - 1]
            if (self.block_manager.get_ref_count(cut) > 1
                    or self.prefix_cache.is_cached(cut)):
                raise ValueError(f"num_tokens: expected a length that cuts no shared or cached "
                                 f"block, got {num_tokens} (inside block {cut}, "
                                 f"{self.block_manager.get_ref_count(cut)} owner(s), cached: "
                                 f"{self.prefix_cache.is_cached(cut)})")
        released = max(0, len(blocks) - keep)
        for b in reversed(blocks[keep:]):
            self._release(b)
        del blocks[keep:]
        del seq.block_hashes[num_tokens // bs:]
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)
        seq.blocks_changed_from = min(seq.blocks_changed_from, len(blocks))
        if seq.deferred_block is not None and seq.deferred_block >= keep:
            seq.deferred_block = None
        return released

    def register_deferred(self, seq: Sequence) -> None:
        """Register the block whose last token was a placeholder when it was allocated (see
        ``Sequence.deferred_block``), now that the token is known. Nothing for a sequence
        without one (:meth:`free` forgets it: a finished or preempted sequence has none)."""
        index, seq.deferred_block = seq.deferred_block, None
        if index is not None:
            self._register_full_blocks(seq, index, index + 1)

    def begin_step(self) -> None:
        """A new step is being scheduled: the previous one's registrations are final."""
        self._step_registrations.clear()

    def forget_step_registrations(self) -> None:
        """The step's forward failed: its newly registered blocks never got their K/V, so the
        prefix cache must not hand them out."""
        for b in self._step_registrations:
            if self.prefix_cache.forget(b):
                self.block_manager.free(b)
        self._step_registrations.clear()

    # ---- sharing and freeing ------------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent`` (nothing is copied now)."""
        assert not child.block_ids, child
        for b in parent.block_ids[parent.num_dropped_blocks:]:
            self.block_manager.increase_ref_count(b)
        child.block_ids = list(parent.block_ids)
        child.num_dropped_blocks = parent.num_dropped_blocks
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        child.blocks_changed_from = 0

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's share of each of its blocks; it then holds none.

        Blocks are released last-first, so a prompt's tail is evicted before its head (a later
        request is likelier to share a head). Blocks it dropped already are not released again,
        but those still cached go back behind the tail in the eviction order.
        """
        for b in reversed(seq.block_ids[seq.num_dropped_blocks:]):
            self._release(b)
        if seq.num_dropped_blocks and self.enable_prefix_caching:
            self._refresh_dropped(seq)
        seq.block_ids = []
        seq.deferred_block = None
        seq.num_dropped_blocks = 0
        seq.num_computed_tokens = 0
        seq.blocks_changed_from = 0

    def drop_out_of_window(self, seq: Sequence) -> int:
        """Give back the blocks of a running sequence that lie wholly left of the window of its
        next query (at position ``seq.num_computed_tokens``; with chunked prefill, the next
        chunk's first token). Call it once a step's K/V is written. A block shared with other
        sequences stays theirs; a cached block nobody holds becomes evictable, as in
        :meth:`free`. Their entries in ``seq.block_ids`` become ``PAD_BLOCK_ID``.

        Returns:
            How many blocks were given back (always 0 without a window).
        """
        start = seq.num_dropped_blocks
        stop = first_needed_block(seq.num_computed_tokens, self.sliding_window, self.block_size)
        if stop <= start:
            return 0
        assert stop <= len(seq.block_ids), seq
        blocks = seq.block_ids
        for i in range(start, stop):
            self._release(blocks[i])
            blocks[i] = PAD_BLOCK_ID
        seq.num_dropped_blocks = stop
        # The block-table row then holds the pad too (never read: it is left of the window).
        seq.blocks_changed_from = min(seq.blocks_changed_from, start)
        return stop - start

    def _refresh_dropped(self, seq: Sequence) -> None:
        """Move the sequence's dropped blocks that are still evictable to the end of the
        eviction order, the first block last. They were given back head first, so they would
        be evicted first, and a prefix hit needs the whole chain from its head: evicting a head
        first would make the rest of the chain unfindable."""
        cache, hashes = self.prefix_cache, seq.block_hashes
        for i in reversed(range(min(seq.num_dropped_blocks, len(hashes)))):
            block = cache.block_of(hashes[i])
            if block is not None and cache.is_evictable(block):
                cache.refresh(block)

    def _release(self, block: int) -> None:
        """Drop one sequence's reference; the cache keeps a cached block nobody else holds."""
        if self.block_manager.get_ref_count(block) == 1 and self.prefix_cache.is_cached(block):
            self.prefix_cache.make_evictable(block)
        else:
            self.block_manager.free(block)

    def reset_prefix_cache(self) -> int:
        """Evict every evictable block back to the pool; returns how many were freed."""
        n = 0
        while self.prefix_cache.num_evictable_blocks:
            self.block_manager.free(self.prefix_cache.evict())
            n += 1
        return n


__all__ = ["CacheHit", "KVCacheManager", "NO_HIT"]
