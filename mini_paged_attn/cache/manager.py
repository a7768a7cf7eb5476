"""PagedAttentionManager: the paged KV cache: the device pool, the block tables, copy-on-write.

Seed 001's manager with its gaps closed, and the one KV cache of the engine too. It owns

- ``pool``: every layer's K/V, ``(num_layers, num_blocks, block_size, 2, num_kv_heads,
  head_size)``; layer ``i``'s ``(num_blocks, block_size, 2, num_kv_heads, head_size)`` pool is
  ``kv_caches[i]`` and its strided ``[num_blocks, block_size, num_kv_heads, head_size]`` views
  ``layer_caches[i] = (key_cache, value_cache)`` (no copy) are what every op accepts. The seed's
  one-layer names ``kv_cache`` / ``key_cache`` / ``value_cache`` are layer 0's. This class is
  the one place that knows the layout;
- ``tables``: the :class:`~.block_table.BlockTable` rows of the sequences, mirrored in
  ``block_table`` (int32 ``[num_sequences, max_blocks_per_seq]`` on the device; under the seed
  API row ``seq_id`` is that sequence's); ``context_lens``: int32 ``[num_sequences]``;
- ``kv_manager``: the block-level logic (:class:`~mini_paged_attn.core.KVCacheManager`: the
  reference-counted ``block_manager``, the prefix cache, copy-on-write decisions), which hands
  this class ``(src, dst)`` block pairs to copy (:meth:`copy_blocks`). Given to the
  constructor, it is the caller's (the engine builds it and hands it to its scheduler, so the
  scheduler and this pool follow one set of blocks); left out, the pool builds one of its own
  for the seed API. A pool with ``block_bookkeeping=False`` has none (a tensor-parallel rank
  other than 0 only stores K/V and copies the blocks rank 0's scheduler names).

Seed API (``add_sequence`` / ``append_token`` / ``fork_sequence`` / ``write_kv`` /
``free_sequence``): ``seq_block_mapping`` mirrors seq_id -> blocks on the host. Copy-on-write
rule: a sequence never writes into a block it shares. ``fork_sequence`` shares every block of
the parent (reference counts go up, nothing is copied). A later ``append_token`` whose new token
lands in a shared, partly filled last block first copies that block (K and V, all layers) into a
fresh one for the appending sequence, so the slot it reserves is private; ``write_kv`` does the
same for every shared block it writes into.

The engine's scheduler allocates per :class:`~mini_paged_attn.core.request.Sequence` through
the ``kv_manager`` it shares with this pool; the model runner drives ``tables.rows_for`` and
:meth:`copy_blocks`; :meth:`memory_map` reads either kind of sequence.

Every failing call raises before changing anything. Not thread-safe: one owner (the engine loop)
drives it; the block manager underneath is.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..core.args import as_int, cdiv, check_bool, positive_int
from ..core.block_manager import BlockManager
from ..core.kv_cache_manager import KVCacheManager
from .block_table import BlockTable
from .fp8 import is_fp8, quantize
from .memory_map import MemoryMap, build_memory_map
from .slots import slot_mapping, write_slots

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheConfig:
    """Sizes of a paged KV cache (validated on construction)."""

    num_sequences: int
    num_heads: int
    head_size: int
    block_size: int
    num_blocks: int
    num_kv_heads: int
    max_blocks_per_seq: int
    dtype: torch.dtype
    device: torch.device
    num_layers: int = 1

    def __post_init__(self) -> None:
        for name in ("num_sequences", "num_heads", "head_size", "block_size", "num_blocks",
                     "num_kv_heads", "max_blocks_per_seq", "num_layers"):
            # A non-integer is a TypeError, as for every index argument of the manager.
            value = positive_int(name, as_int(name, getattr(self, name)))
            object.__setattr__(self, name, value)  # numpy / torch integers -> int
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: expected a divisor of num_heads={self.num_heads}, "
                             f"got {self.num_kv_heads}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"dtype: expected a floating torch.dtype, got {self.dtype!r}")


def _check_injected(kv_manager: KVCacheManager, cfg: CacheConfig, enable_prefix_caching: bool,
                    sliding_window: int | None, block_bookkeeping: bool) -> None:
    """An injected manager must describe this pool's blocks, and brings its own options."""
    if not isinstance(kv_manager, KVCacheManager):
        raise ValueError(f"kv_manager: expected a KVCacheManager or None, got "
                         f"{type(kv_manager).__name__}")
    if not block_bookkeeping:
        raise ValueError("kv_manager: expected None with block_bookkeeping=False, got a "
                         "KVCacheManager")
    if (kv_manager.num_blocks, kv_manager.block_size) != (cfg.num_blocks, cfg.block_size):
        raise ValueError(f"kv_manager: expected a manager of {cfg.num_blocks} blocks of "
                         f"{cfg.block_size} tokens (this pool's), got {kv_manager.num_blocks} "
                         f"blocks of {kv_manager.block_size}")
    if enable_prefix_caching or sliding_window is not None:
        raise ValueError("enable_prefix_caching / sliding_window: expected their defaults "
                         "with a kv_manager given (they are the manager's own), got "
                         f"{enable_prefix_caching} / {sliding_window}")


class PagedAttentionManager:
    """The paged KV cache of up to ``num_sequences`` sequences (ids ``0 .. num_sequences-1``).

    Args:
        num_sequences: rows of the block table; seq ids are ``0 .. num_sequences-1``.
        num_heads: query heads (``num_kv_heads`` must divide it).
        head_size: size of one head.
        block_size: tokens per block.
        num_blocks: physical blocks in the pool.
        device, dtype: of the pool (``torch.float8_e4m3fn`` for an fp8 cache, see
            :mod:`.fp8`) and the tables (tables are int32).
        num_kv_heads: K/V heads stored (default ``num_heads``; fewer for GQA / MQA).
        max_blocks_per_seq: columns of the block table (default ``num_blocks``).
        num_layers: layers whose K/V the pool holds (a block id names the same block in each).
        enable_prefix_caching: let the pool's own ``kv_manager`` look up and register full
            blocks by content (the seed API never does; an injected manager has its own).
        sliding_window: the model's window when every layer has one (else None), for the
            pool's own ``kv_manager`` (the seed API keeps every block).
        kv_manager: the block bookkeeping to follow (the engine's, shared with its scheduler):
            its pool must have ``num_blocks`` blocks of ``block_size`` tokens. None: the pool
            builds its own from ``enable_prefix_caching`` and ``sliding_window``.
        block_bookkeeping: False for a pool that keeps none (``kv_manager`` and
            ``block_manager`` are None, the seed API raises): the K/V store of a rank whose
            blocks another process allocates.

    Raises:
        ValueError: a bad size, or a ``kv_manager`` whose pool differs from ``num_blocks`` /
            ``block_size``, or given together with its own options or
            ``block_bookkeeping=False``.
    """

    def __init__(self, num_sequences: int, num_heads: int, head_size: int, block_size: int,
                 num_blocks: int, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float16, num_kv_heads: int | None = None,
                 max_blocks_per_seq: int | None = None, *, num_layers: int = 1,
                 enable_prefix_caching: bool = False, sliding_window: int | None = None,
                 kv_manager: KVCacheManager | None = None,
                 block_bookkeeping: bool = True) -> None:
        cfg = CacheConfig(num_sequences, num_heads, head_size, block_size, num_blocks,
                          num_heads if num_kv_heads is None else num_kv_heads,
                          num_blocks if max_blocks_per_seq is None else max_blocks_per_seq,
                          dtype, torch.device(device), num_layers)
        check_bool("enable_prefix_caching", enable_prefix_caching)
        check_bool("block_bookkeeping", block_bookkeeping)
        if kv_manager is not None:
            _check_injected(kv_manager, cfg, enable_prefix_caching, sliding_window,
                            block_bookkeeping)
        elif block_bookkeeping:
            kv_manager = KVCacheManager(BlockManager(cfg.num_blocks), cfg.block_size,
                                        enable_prefix_caching, sliding_window)
        self.config = cfg
        self.num_sequences, self.num_heads, self.head_size = (cfg.num_sequences, cfg.num_heads,
                                                               cfg.head_size)
        self.block_size, self.num_blocks, self.dtype = cfg.block_size, cfg.num_blocks, dtype
        self.num_kv_heads, self.max_blocks_per_seq = cfg.num_kv_heads, cfg.max_blocks_per_seq
        self.num_layers = cfg.num_layers

        self.kv_manager = kv_manager
        self.block_manager = kv_manager.block_manager if kv_manager is not None else None
        # Zeroed rather than empty: unwritten slots then hold no garbage (cheap, done once).
        self.pool = torch.zeros((cfg.num_layers, cfg.num_blocks, cfg.block_size, 2,
                                 cfg.num_kv_heads, cfg.head_size), dtype=dtype, device=cfg.device)
        self.device = self.pool.device  # resolved ("cuda" -> "cuda:0")
        self.kv_caches = list(self.pool.unbind(0))
        self.layer_caches = [(kv[:, :, 0], kv[:, :, 1]) for kv in self.kv_caches]
        self.kv_cache = self.kv_caches[0]
        self.key_cache, self.value_cache = self.layer_caches[0]
        self.tables = BlockTable(cfg.num_sequences, cfg.max_blocks_per_seq, self.device)
        self.context_lens = torch.zeros(cfg.num_sequences, dtype=torch.int32, device=self.device)
        self.seq_block_mapping: dict[int, list[int]] = {}
        self._seq_lens: dict[int, int] = {}
        logger.info("KV pool: %d layers x %d blocks x %d tokens x %d kv heads x %d, %s on %s: "
                    "%.1f MiB", cfg.num_layers, cfg.num_blocks, cfg.block_size, cfg.num_kv_heads,
                    cfg.head_size, dtype, self.device, self.pool.nbytes / 2**20)

    @property
    def block_table(self) -> torch.Tensor:
        """int32 ``[num_sequences, max_blocks_per_seq]`` on the device (entries past a
        sequence's last block are never read)."""
        return self.tables.sync()

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write on the device: block ``dst`` := block ``src`` (K and V, every layer)
        for each ``(src, dst)`` pair, in one indexed copy. Unwritten slots are copied too
        (they are never read)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64).to(self.device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64).to(self.device)
        # An fp8 pool is copied as its bytes (uint8 indexing works on every device).
        pool = self.pool.view(torch.uint8) if is_fp8(self.dtype) else self.pool
        pool[:, dst] = pool[:, src]

    # -- argument checks (raise before any change) -------------------------------------------

    def _seq_id(self, seq_id: object, name: str = "seq_id") -> int:
        seq_id = as_int(name, seq_id)
        if not 0 <= seq_id < self.num_sequences:
            raise ValueError(f"{name}: expected 0 <= {name} < num_sequences="
                             f"{self.num_sequences}, got {seq_id}")
        return seq_id

    def _existing(self, seq_id: object, name: str = "seq_id") -> int:
        seq_id = self._seq_id(seq_id, name)
        if seq_id not in self.seq_block_mapping:
            raise ValueError(f"{name}: expected a live sequence, got unknown sequence {seq_id}")
        return seq_id

    def _unused(self, seq_id: object, name: str = "seq_id") -> int:
        if self.block_manager is None:
            raise RuntimeError("this KV pool keeps no block bookkeeping (block_bookkeeping="
                               "False): its blocks are allocated elsewhere, so it has no "
                               "sequences of its own")
        seq_id = self._seq_id(seq_id, name)
        if seq_id in self.seq_block_mapping:
            raise ValueError(f"{name}: expected an unused seq id, got {seq_id}, which exists "
                             "(free_sequence it first)")
        if not self.tables.is_free(seq_id):
            raise ValueError(f"{name}: expected a free block-table row, but row {seq_id} is "
                             "held by the engine driving this cache")
        return seq_id

    def _check_row_fits(self, seq_id: int, num_blocks: int) -> None:
        if num_blocks > self.max_blocks_per_seq:
            raise ValueError(f"sequence {seq_id} would need {num_blocks} blocks, but a block "
                             f"table row holds max_blocks_per_seq={self.max_blocks_per_seq}")

    def _check_kv(self, key: object, value: object) -> int:
        for name, t in (("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 3 or tuple(t.shape[1:]) != (self.num_kv_heads, self.head_size):
                raise ValueError(f"{name}: expected shape [n_tokens, num_kv_heads="
                                 f"{self.num_kv_heads}, head_size={self.head_size}], "
                                 f"got {tuple(t.shape)}")
            # An fp8 cache also takes 16/32-bit K/V and quantizes them (scale 1).
            dtypes = ((self.dtype, torch.float16, torch.bfloat16, torch.float32)
                      if is_fp8(self.dtype) else (self.dtype,))
            if t.dtype not in dtypes or t.device != self.device:
                expected = " or ".join(str(d) for d in dtypes)
                raise ValueError(f"{name}: expected {expected} on {self.device} (the cache's), "
                                 f"got {t.dtype} on {t.device}")
        if value.shape != key.shape:
            raise ValueError(f"value: expected the shape of key {tuple(key.shape)}, "
                             f"got {tuple(value.shape)}")
        return key.shape[0]

    # -- sequences ----------------------------------------------------------------------------

    def add_sequence(self, seq_id: int, num_prompt_tokens: int) -> None:
        """Give a new sequence blocks for ``num_prompt_tokens`` tokens (0 allowed).

        Raises ValueError (bad / duplicate seq_id, negative length, row too short) or
        OutOfBlocksError, changing nothing.
        """
        seq_id = self._unused(seq_id)
        n = as_int("num_prompt_tokens", num_prompt_tokens)
        if n < 0:
            raise ValueError(f"num_prompt_tokens: expected >= 0, got {n}")
        needed = cdiv(n, self.block_size)
        self._check_row_fits(seq_id, needed)
        blocks = self.block_manager.allocate_blocks(needed)
        self.seq_block_mapping[seq_id] = blocks
        self._seq_lens[seq_id] = n
        self.tables.bind(seq_id, row=seq_id)
        self.tables.set_blocks(seq_id, 0, blocks)
        self.tables.sync()
        self.context_lens[seq_id] = n
        logger.debug("add seq %d: %d tokens in blocks %s", seq_id, n, blocks)

    def append_token(self, seq_id: int, current_seq_len: int) -> int:
        """Reserve the slot of one new token at position ``current_seq_len`` (seed 001's call).

        ``current_seq_len`` must equal the sequence's length. A block is allocated when the token
        starts a new block; a shared last block is copied first (copy-on-write). The length
        grows by one. Returns the token's slot (``block * block_size + offset``).

        Raises ValueError (unknown seq, wrong length, row full) or OutOfBlocksError, changing
        nothing.
        """
        seq_id = self._existing(seq_id)
        pos = as_int("current_seq_len", current_seq_len)
        length = self._seq_lens[seq_id]
        if pos != length:
            raise ValueError(f"current_seq_len: expected the length of sequence {seq_id}, "
                             f"{length}, got {pos}")
        blocks = self.seq_block_mapping[seq_id]
        assert len(blocks) == cdiv(length, self.block_size), "blocks out of step with length"
        if pos % self.block_size == 0:
            self._check_row_fits(seq_id, len(blocks) + 1)
            block = self.block_manager.allocate()
            blocks.append(block)
            self.tables.set_blocks(seq_id, len(blocks) - 1, blocks)
            self.tables.sync()
        else:
            self._make_private(seq_id, [len(blocks) - 1])
        self._seq_lens[seq_id] = pos + 1
        self.context_lens[seq_id] = pos + 1
        return blocks[-1] * self.block_size + pos % self.block_size

    def fork_sequence(self, parent_id: int, child_id: int) -> None:
        """Make ``child_id`` a copy of ``parent_id`` sharing all its blocks (nothing copied).

        Raises ValueError (unknown parent, child in use or out of range), changing nothing.
        """
        parent = self._existing(parent_id, "parent_id")
        child = self._unused(child_id, "child_id")
        blocks = list(self.seq_block_mapping[parent])
        for b in blocks:
            self.block_manager.increase_ref_count(b)
        self.seq_block_mapping[child] = blocks
        self._seq_lens[child] = self._seq_lens[parent]
        self.tables.bind(child, row=child)
        self.tables.set_blocks(child, 0, blocks)
        self.tables.sync()
        self.context_lens[child] = self._seq_lens[parent]
        logger.debug("fork seq %d -> %d sharing blocks %s", parent, child, blocks)

    def free_sequence(self, seq_id: int) -> None:
        """Drop the sequence and one reference to each of its blocks. Unknown ids: no-op."""
        seq_id = as_int("seq_id", seq_id)
        if seq_id not in self.seq_block_mapping:
            return
        blocks = self.seq_block_mapping[seq_id]
        # Reversed, so the pool hands these blocks out again in their logical order.
        self.block_manager.free_many(reversed(blocks))
        del self.seq_block_mapping[seq_id], self._seq_lens[seq_id]
        self.tables.clear(seq_id)
        self.tables.release(seq_id)
        self.tables.sync()
        self.context_lens[seq_id] = 0
        logger.debug("free seq %d: blocks %s", seq_id, blocks)

    def get_block_table_for_seq(self, seq_id: int) -> torch.Tensor:
        """Row ``seq_id`` of ``block_table`` (an int32 view ``[max_blocks_per_seq]``)."""
        return self.block_table[self._existing(seq_id)]

    def get_seq_len(self, seq_id: int) -> int:
        """Tokens of the sequence (those with a slot, written or not)."""
        return self._seq_lens[self._existing(seq_id)]

    # -- K/V ----------------------------------------------------------------------------------

    def _check_positions(self, seq_id: int, start_pos: object, num_tokens: int) -> int:
        start = as_int("start_pos", start_pos)
        length = self._seq_lens[seq_id]
        if start < 0 or num_tokens < 0 or start + num_tokens > length:
            raise ValueError(f"start_pos: expected positions start_pos..start_pos+n-1 within "
                             f"the {length} allocated tokens of sequence {seq_id}, got "
                             f"{start}..{start + num_tokens - 1}")
        return start

    def _slots(self, seq_id: int, start: int, num_tokens: int) -> torch.Tensor:
        blocks = self.seq_block_mapping[seq_id]
        positions = torch.arange(start, start + num_tokens)
        return slot_mapping(blocks or [0], positions, self.block_size).to(self.device)

    def get_slot_mapping(self, seq_id: int, start_pos: int, num_tokens: int) -> torch.Tensor:
        """Slots of positions ``start_pos .. start_pos+num_tokens-1`` (already allocated):
        int64 ``[num_tokens]`` on the device. Read-only: no copy-on-write happens."""
        seq_id = self._existing(seq_id)
        n = as_int("num_tokens", num_tokens)
        return self._slots(seq_id, self._check_positions(seq_id, start_pos, n), n)

    def write_kv(self, seq_id: int, start_pos: int, key: torch.Tensor,
                 value: torch.Tensor) -> None:
        """Write K/V of positions ``start_pos .. start_pos+n-1`` (already allocated).

        Args:
            key, value: ``[n, num_kv_heads, head_size]`` in the cache's dtype, on its device
                (an fp8 cache also takes fp16 / bf16 / fp32, rounded to e4m3 with scale 1).

        Shared blocks written into are copied first (copy-on-write). Raises ValueError (unknown
        seq, bad tensors, positions not allocated) or OutOfBlocksError, changing nothing.
        """
        seq_id = self._existing(seq_id)
        n = self._check_kv(key, value)
        start = self._check_positions(seq_id, start_pos, n)
        if n == 0:
            return
        self._make_private(seq_id, range(start // self.block_size,
                                         cdiv(start + n, self.block_size)))
        if is_fp8(self.dtype):
            key, value = quantize(key, None), quantize(value, None)
        write_slots(key, value, self.key_cache, self.value_cache, self._slots(seq_id, start, n))

    def _make_private(self, seq_id: int, logical_blocks: Iterable[int]) -> None:
        """Copy-on-write: give ``seq_id`` its own copy of each shared block among
        ``logical_blocks``. All or nothing (OutOfBlocksError before any change)."""
        blocks = self.seq_block_mapping[seq_id]
        old = list(blocks)
        pairs = self.kv_manager.make_private(blocks, logical_blocks)
        if not pairs:
            return
        self.copy_blocks(pairs)
        self.tables.set_blocks(seq_id, 0, blocks)
        self.tables.sync()
        logger.debug("copy-on-write seq %d: blocks %s -> %s", seq_id, old, blocks)

    # -- inspection ---------------------------------------------------------------------------

    def memory_map(self, sequences: Mapping[int, tuple[Sequence[int], int]] | None = None
                   ) -> MemoryMap:
        """A snapshot of the pool: each block's owners, sharing and fill; ``str()`` it to read.

        Args:
            sequences: seq_id -> (physical blocks in logical order, tokens), e.g. an engine's
                running sequences (see ``LLMEngine.memory_map``); None: the seed API's.
        """
        if sequences is None:
            blocks, lens = self.seq_block_mapping, self._seq_lens
        else:
            blocks = {i: list(b) for i, (b, _) in sequences.items()}
            lens = {i: n for i, (_, n) in sequences.items()}
        if self.block_manager is None:
            raise RuntimeError("memory_map: this KV pool keeps no block bookkeeping "
                               "(block_bookkeeping=False), so it has no reference counts")
        refs = [self.block_manager.get_ref_count(i) for i in range(self.num_blocks)]
        return build_memory_map(self.block_size, blocks, lens, refs)

    def __repr__(self) -> str:
        free = ("-" if self.block_manager is None
                else self.block_manager.get_num_free_blocks())
        return (f"PagedAttentionManager(sequences={len(self.seq_block_mapping)}/"
                f"{self.num_sequences}, free_blocks={free}/"
                f"{self.num_blocks}, block_size={self.block_size}, layers={self.num_layers}, "
                f"dtype={self.dtype}, "
                f"device={self.device})")
