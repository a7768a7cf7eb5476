"""A minimal stand-in for the engine's KV bookkeeping, to drive a model step by step in tests.

``PagedBatchBuilder`` owns NaN-poisoned per-layer caches and hands out physical blocks in a
shuffled order as sequences grow; ``step({seq_id: new_token_ids})`` returns the flattened
``input_ids``, ``positions`` and the :class:`AttentionMetadata` of one forward.
"""

from __future__ import annotations

import random

import torch

from mini_paged_attn.models.attention import AttentionMetadata
from mini_paged_attn.models.config import ModelConfig


class PagedBatchBuilder:
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
