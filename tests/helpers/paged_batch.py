"""Paged batches for tests: the ops' arguments, and a model's step-by-step inputs.

- :class:`PagedBatch` / :func:`make_paged_batch`: one attention call's arguments, K/V in
  shuffled physical blocks, NaN (or ``unused``) in every slot no sequence uses and garbage ids
  in every table entry past a sequence's blocks, so a kernel that reads either shows it;
  :func:`make_decode_batch` and :func:`make_prefill_batch` shape it for each op.
- :class:`PagedBatchBuilder`: a minimal stand-in for the engine's KV bookkeeping, to drive a
  model step by step: NaN-poisoned per-layer caches, physical blocks handed out in a shuffled
  order as sequences grow; ``step({seq_id: new_token_ids})`` returns the flattened
  ``input_ids``, ``positions`` and the :class:`AttentionMetadata` of one forward.

Use from any test (tests/ is on sys.path through tests/conftest.py)::

    from helpers.paged_batch import make_decode_batch, make_prefill_batch
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from mini_paged_attn.core.args import cdiv
from mini_paged_attn.models.attention import AttentionMetadata
from mini_paged_attn.models.config import ModelConfig

# A block id past any test pool: what table entries past a sequence's blocks hold by default.
PAST_POOL_ID = 10 ** 6
# Harsher garbage for those entries: negative, past any pool, and the int32 extremes.
GARBAGE_IDS = (-1, PAST_POOL_ID, 2 ** 31 - 1, -(2 ** 31))


@dataclass
class PagedBatch:
    """Sequence ``i``'s query rows ``cu_seqlens_q[i] .. cu_seqlens_q[i+1]`` are the last of its
    ``context_lens[i]`` tokens in the cache (for a decode batch: one row per sequence).

    ``keys`` / ``values``: each sequence's K/V as written into the caches, dense
    ``[context_len, num_kv_heads, head_size]`` (None for a batch built around given caches).
    """

    query: torch.Tensor          # [total_q, num_q_heads, head_size]
    key_cache: torch.Tensor      # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor
    block_tables: torch.Tensor   # int32 [num_seqs, max_blocks_per_seq]
    cu_seqlens_q: torch.Tensor   # int32 [num_seqs + 1]
    context_lens: torch.Tensor   # int32 [num_seqs]
    keys: list[torch.Tensor] | None = None
    values: list[torch.Tensor] | None = None

    @classmethod
    def decode(cls, query, key_cache, value_cache, block_tables, context_lens) -> PagedBatch:
        """A decode batch (one query row per sequence) from ``paged_decode``'s arguments."""
        cu = torch.arange(query.shape[0] + 1, dtype=torch.int32, device=query.device)
        return cls(query, key_cache, value_cache, block_tables, cu, context_lens)

    @property
    def decode_args(self) -> tuple[torch.Tensor, ...]:
        """``paged_decode``'s positional arguments."""
        return (self.query, self.key_cache, self.value_cache, self.block_tables,
                self.context_lens)

    @property
    def prefill_args(self) -> tuple[torch.Tensor, ...]:
        """``paged_prefill``'s positional arguments."""
        return (self.query, self.key_cache, self.value_cache, self.block_tables,
                self.cu_seqlens_q, self.context_lens)


def paginate(keys: list[torch.Tensor], values: list[torch.Tensor], block_size: int, *,
             head_shape: tuple[int, int], dtype: torch.dtype, gen: torch.Generator,
             device: str | torch.device = "cpu", spare_blocks: int = 3,
             spare_columns: int = 2, unused: float = float("nan"),
             garbage: tuple[int, ...] = (PAST_POOL_ID,), pool_layout: bool = False):
    """Write each sequence's dense K/V (CPU ``[n_i, *head_shape]``, head_shape
    ``(num_kv_heads, head_size)``) into shuffled blocks of a new ``dtype`` pool on ``device``;
    return ``(key_cache, value_cache, block_tables)``.

    Slots no sequence uses hold ``unused``; table entries past a sequence's blocks cycle
    through ``garbage``. ``pool_layout``: the caches are the strided views of one
    ``(num_blocks, block_size, 2, num_kv_heads, head_size)`` pool, as ``PagedAttentionManager``
    holds them; else two contiguous tensors.
    """
    blocks_per_seq = [cdiv(k.shape[0], block_size) for k in keys]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    width = max(blocks_per_seq + [0]) + spare_columns
    pool = torch.full((num_blocks, block_size, 2, *head_shape), unused, dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.tensor([[garbage[(i + j) % len(garbage)] for j in range(width)]
                           for i in range(len(keys))], dtype=torch.int32).view(-1, width)
    start = 0
    for i, (k, v) in enumerate(zip(keys, values)):
        own = perm[start:start + blocks_per_seq[i]]
        start += blocks_per_seq[i]
        tables[i, :own.numel()] = own.to(torch.int32)
        pos = torch.arange(k.shape[0])
        pool[own[pos // block_size], pos % block_size, 0] = k
        pool[own[pos // block_size], pos % block_size, 1] = v
    # Views of the pool on the device (moving a strided view would make it contiguous).
    pool, tables = pool.to(device), tables.to(device)
    if pool_layout:
        return pool[:, :, 0], pool[:, :, 1], tables
    return pool[:, :, 0].contiguous(), pool[:, :, 1].contiguous(), tables


def make_paged_batch(q_lens, context_lens, *, num_q_heads: int, num_kv_heads: int,
                     head_size: int, block_size: int, dtype: torch.dtype = torch.float32,
                     seed: int = 0, pool_layout: bool = False, device: str = "cpu",
                     unused: float = float("nan"),
                     garbage: tuple[int, ...] = (PAST_POOL_ID,)) -> PagedBatch:
    """Sequence ``i`` has ``context_lens[i]`` tokens of random K/V in the cache and
    ``q_lens[i]`` query rows (random values, seeded). ``pool_layout``, ``unused``,
    ``garbage``: as :func:`paginate`'s."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    keys = [randn(n, num_kv_heads, head_size) for n in context_lens]
    values = [randn(n, num_kv_heads, head_size) for n in context_lens]
    key_cache, value_cache, tables = paginate(
        keys, values, block_size, head_shape=(num_kv_heads, head_size), dtype=dtype, gen=gen,
        device=device, unused=unused, garbage=garbage, pool_layout=pool_layout)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
    query = randn(int(cu[-1]), num_q_heads, head_size)
    return PagedBatch(query.to(device), key_cache, value_cache, tables, cu.to(device),
                      torch.tensor(list(context_lens), dtype=torch.int32, device=device),
                      [k.to(device) for k in keys], [v.to(device) for v in values])


def make_decode_batch(lens, **kwargs) -> PagedBatch:
    """A decode batch: one query row per sequence, whose context holds ``lens[i]`` tokens
    (0 allowed). Keyword arguments as :func:`make_paged_batch`'s."""
    return make_paged_batch([1] * len(lens), lens, **kwargs)


def make_prefill_batch(q_lens, prefix_lens, **kwargs) -> PagedBatch:
    """A prefill batch: sequence ``i`` has ``prefix_lens[i]`` cached tokens, then ``q_lens[i]``
    query tokens. Keyword arguments as :func:`make_paged_batch`'s."""
    return make_paged_batch(q_lens, [q + p for q, p in zip(q_lens, prefix_lens)], **kwargs)


class PagedBatchBuilder:
    """Per-layer caches and block tables that grow with the sequences a test steps."""

    def __init__(self, config: ModelConfig, *, num_blocks: int = 64, block_size: int = 4,
                 max_blocks_per_seq: int = 16, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", seed: int = 0, interleaved: bool = False):
        """``interleaved``: each layer's caches are the strided K and V views of one
        ``[num_blocks, block_size, 2, num_kv_heads, head_size]`` pool (PagedAttentionManager's
        layout) instead of two contiguous tensors."""
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = torch.device(device)
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_size)
        # NaN everywhere no token was written: a kernel that reads an unused slot poisons the output.
        self.kv_caches = []
        for _ in range(config.num_layers):
            if interleaved:
                pool = torch.full((num_blocks, block_size, 2, *shape[2:]), float("nan"), dtype=dtype,
                                  device=device)
                self.kv_caches.append((pool[:, :, 0], pool[:, :, 1]))
            else:
                self.kv_caches.append((torch.full(shape, float("nan"), dtype=dtype, device=device),
                                       torch.full(shape, float("nan"), dtype=dtype, device=device)))
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.blocks: dict[object, list[int]] = {}
        self.tokens: dict[object, list[int]] = {}

    def share_prefix(self, seq_id, source_id, num_full_blocks: int) -> None:
        """Start ``seq_id`` on ``source_id``'s first full blocks (a prefix-cache hit)."""
        assert len(self.tokens[source_id]) >= num_full_blocks * self.block_size
        self.blocks[seq_id] = list(self.blocks[source_id][:num_full_blocks])
        self.tokens[seq_id] = list(self.tokens[source_id][:num_full_blocks * self.block_size])

    def step(self, new_tokens: dict, *, pad_to: int | None = None,
             backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """One forward's inputs for ``{seq_id: [new token ids]}`` (in dict order).

        ``pad_to``: append padding sequences (slot -1, context length 0) up to this many rows,
        as a CUDA-graph batch bucket does; valid for decode-only steps.
        """
        ids, positions, slots, q_lens, ctx_lens, tables = [], [], [], [], [], []
        for seq_id, toks in new_tokens.items():
            blocks = self.blocks.setdefault(seq_id, [])
            seq = self.tokens.setdefault(seq_id, [])
            start = len(seq)
            for pos in range(start, start + len(toks)):
                if pos // self.block_size >= len(blocks):
                    blocks.append(self.free.pop())
                slots.append(blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
                positions.append(pos)
            seq.extend(toks)
            ids.extend(toks)
            q_lens.append(len(toks))
            ctx_lens.append(len(seq))
            tables.append(blocks + [-1] * (self.max_blocks_per_seq - len(blocks)))
        decode_only = all(q == 1 for q in q_lens)
        if pad_to is not None:
            assert decode_only and pad_to >= len(q_lens)
            for _ in range(pad_to - len(q_lens)):
                ids.append(0)
                positions.append(0)
                slots.append(-1)
                q_lens.append(1)
                ctx_lens.append(0)
                tables.append([-1] * self.max_blocks_per_seq)
        cu = [0]
        for q in q_lens:
            cu.append(cu[-1] + q)

        def t(values, dtype):
            return torch.tensor(values, dtype=dtype, device=self.device)

        meta = AttentionMetadata(slot_mapping=t(slots, torch.int64), cu_seqlens_q=t(cu, torch.int32),
                                 context_lens=t(ctx_lens, torch.int32),
                                 block_tables=t(tables, torch.int32), max_seqlen_q=max(q_lens),
                                 decode_only=decode_only, backend=backend)
        return t(ids, torch.int64), t(positions, torch.int64), meta
