"""Paged varlen prefill batches for kernel tests: shuffled blocks, NaN in unused slots, garbage
in table entries past each sequence's length.

Use from any test (tests/ is on sys.path through tests/conftest.py)::

    from helpers.prefill_batches import make_prefill_batch, run_and_compare
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from helpers.decode_batches import TOL
from mini_paged_attn.ops import reference
from mini_paged_attn.ops.checks import check_paged_prefill_args
from mini_paged_attn.ops.dispatch import paged_prefill
from mini_paged_attn.ops.prefill import triton_paged_prefill
from mini_paged_attn.ops.prefill_plan import PrefillConfig



@dataclass
class PrefillBatch:
    query: torch.Tensor          # [total_q, num_q_heads, head_size]
    key_cache: torch.Tensor      # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor
    block_tables: torch.Tensor   # int32 [num_seqs, max_blocks_per_seq]
    cu_seqlens_q: torch.Tensor   # int32 [num_seqs + 1]
    context_lens: torch.Tensor   # int32 [num_seqs]

    @property
    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.query, self.key_cache, self.value_cache, self.block_tables,
                self.cu_seqlens_q, self.context_lens)


def make_prefill_batch(q_lens: list[int], prefix_lens: list[int], *, num_q_heads: int,
                       num_kv_heads: int, head_size: int, block_size: int, dtype: torch.dtype,
                       seed: int, seed_layout: bool = False, device: str = "cpu") -> PrefillBatch:
    """Sequence i has ``prefix_lens[i]`` cached tokens followed by ``q_lens[i]`` query tokens.

    ``seed_layout``: the caches are the strided views of a ``(num_blocks, block_size, 2,
    num_kv_heads, head_size)`` pool, as ``PagedAttentionManager`` holds them.
    """
    gen = torch.Generator().manual_seed(seed)
    ctx = torch.tensor([q + p for q, p in zip(q_lens, prefix_lens)], dtype=torch.int64)
    blocks_per_seq = (ctx + block_size - 1) // block_size
    num_blocks = int(blocks_per_seq.sum()) + 3
    max_blocks = int(blocks_per_seq.max()) + 2 if len(q_lens) else 1
    kv = torch.randn((num_blocks, block_size, 2, num_kv_heads, head_size), generator=gen)
    kv = kv.to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = torch.full((len(q_lens), max_blocks), 10 ** 6, dtype=torch.int32)
    used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    start = 0
    for i, n in enumerate(blocks_per_seq.tolist()):
        tables[i, :n] = perm[start:start + n]
        pos = torch.arange(int(ctx[i]))
        used[tables[i, pos // block_size].long(), pos % block_size] = True
        start += n
    kv[~used] = float("nan")
    kv = kv.to(device)
    if seed_layout:
        key_cache, value_cache = kv[:, :, 0], kv[:, :, 1]
    else:
        key_cache, value_cache = kv[:, :, 0].contiguous(), kv[:, :, 1].contiguous()
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
    query = torch.randn(int(cu[-1]), num_q_heads, head_size, generator=gen).to(dtype)
    return PrefillBatch(query.to(device), key_cache, value_cache, tables.to(device),
                        cu.to(device), ctx.to(torch.int32).to(device))


def run_and_compare(batch: PrefillBatch, *, causal: bool, config: PrefillConfig | None,
                    scale: float | None = None, tol: float | None = None) -> None:
    """Run the Triton kernel (``config`` None: through the public dispatcher) on a NaN-filled
    ``out`` and compare out and lse with ``reference.paged_prefill_gather``."""
    query = batch.query
    out = torch.full_like(query, float("nan"))  # every element must be written
    if config is None:
        _, lse = paged_prefill(*batch.args, causal=causal, scale=scale, out=out,
                               return_lse=True, backend="triton")
    else:
        shapes = check_paged_prefill_args(*batch.args, scale, out)
        lse = torch.full(query.shape[:2], float("nan"), device=query.device)
        triton_paged_prefill(*batch.args, shapes, causal=causal, out=out, lse=lse,
                             config=config)
    ref_out, ref_lse = reference.paged_prefill_gather(
        *batch.args, causal=causal, scale=scale or query.shape[-1] ** -0.5)
    tol = tol or TOL[query.dtype]
    torch.testing.assert_close(out.float(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=tol)
