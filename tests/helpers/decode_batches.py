"""Paged decode batches for kernel tests: shuffled blocks, NaN in unused slots, garbage tables.

Use from any test (tests/ is on sys.path through tests/conftest.py)::

    from helpers.decode_batches import make_decode_batch, assert_decode_matches_reference
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mini_paged_attn.ops import reference

# Max |kernel - reference| by dtype, for the decode and prefill kernels alike.
TOL = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}


@dataclass
class DecodeBatch:
    query: torch.Tensor          # [num_seqs, num_q_heads, head_size]
    key_cache: torch.Tensor      # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor
    block_tables: torch.Tensor   # int32 [num_seqs, max_blocks_per_seq]
    context_lens: torch.Tensor   # int32 [num_seqs]

    @property
    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.query, self.key_cache, self.value_cache, self.block_tables,
                self.context_lens)


def make_decode_batch(lens, *, num_q_heads, num_kv_heads, head_size, block_size, dtype, seed,
                      seed_layout=False, device="cpu", spare_blocks=3, spare_columns=2):
    """A decode batch whose K/V sit in shuffled cache blocks.

    Every cache slot no sequence uses holds NaN (it must never reach a result) and table entries
    past each sequence's length hold an out-of-range block id (they must never be read).
    ``seed_layout``: the caches are the manager's views of a ``(num_blocks, block_size, 2,
    num_kv_heads, head_size)`` pool (strided), else contiguous.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    max_blocks = max(blocks_per_seq + [1]) + spare_columns
    kv = torch.randn((num_blocks, block_size, 2, num_kv_heads, head_size), generator=gen)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(lens), max_blocks), 10 ** 6, dtype=torch.int32)
    used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    start = 0
    for i, (nb, n) in enumerate(zip(blocks_per_seq, lens)):
        tables[i, :nb] = perm[start:start + nb].to(torch.int32)
        for j in range(nb):
            used[tables[i, j], : min(block_size, n - j * block_size)] = True
        start += nb
    kv[~used] = float("nan")
    kv = kv.to(device=device, dtype=dtype)
    if seed_layout:
        key_cache, value_cache = kv[:, :, 0], kv[:, :, 1]
    else:
        key_cache, value_cache = kv[:, :, 0].contiguous(), kv[:, :, 1].contiguous()
    query = torch.randn(len(lens), num_q_heads, head_size, generator=gen).to(device, dtype)
    return DecodeBatch(query, key_cache, value_cache, tables.to(device),
                       torch.tensor(lens, dtype=torch.int32, device=device))


def assert_decode_matches_reference(batch: DecodeBatch, out: torch.Tensor,
                                    lse: torch.Tensor | None, scale: float | None = None,
                                    tol: float | None = None) -> None:
    """Compare a decode result with the float32 gather reference (tolerance by dtype)."""
    scale = scale if scale is not None else batch.query.shape[-1] ** -0.5
    ref_out, ref_lse = reference.paged_decode_gather(*batch.args, scale=scale)
    tol = tol if tol is not None else TOL[batch.query.dtype]
    torch.testing.assert_close(out.float(), ref_out, atol=tol, rtol=tol)
    if lse is not None:
        torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=tol)
