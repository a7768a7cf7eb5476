"""Cache block sizes that are not powers of two, on every paged path.

The Triton kernels read K/V in tiles of ``BLOCK_N`` tokens that do not depend on the cache's
``block_size``. A tile takes one table lookup only when ``BLOCK_N`` divides ``block_size``;
any other size (24, 80, 96, 192 against a 64- or 128-token tile) must take the per-token
lookup, since such a tile straddles two cache blocks. Each case below puts tiles across a block
boundary, with shuffled blocks and NaN in every unused slot.
"""

from __future__ import annotations

import pytest
import torch

from helpers.paged_batch import make_decode_batch, make_prefill_batch
from helpers.reference_checks import assert_decode_matches_reference, run_and_compare
from mini_paged_attn.ops import flash_attn_varlen_func, paged_prefill, store_kv
from mini_paged_attn.ops.checks import check_paged_decode_args
from mini_paged_attn.ops.decode import triton_paged_decode
from mini_paged_attn.ops.attention.decode_plan import DecodeTiles
from mini_paged_attn.ops.prefill_plan import PrefillConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ODD_BLOCK_SIZES = (24, 80, 96, 192)


def _tile_for(block_size: int) -> int:
    """A K/V tile that does not divide ``block_size`` (so tiles straddle cache blocks)."""
    return 128 if block_size == 192 else 64


def _lens(block_size: int) -> tuple[list[int], list[int]]:
    """(q_lens, prefix_lens): 1 and block_size +- 1 queries, prefixes ending mid-block."""
    return ([1, block_size - 1, block_size + 1, 7], [0, 5, block_size + 3, 2 * block_size - 1])


@pytest.mark.parametrize("block_size", ODD_BLOCK_SIZES)
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_kernel_with_straddling_tiles(block_size, causal):
    q_lens, prefix = _lens(block_size)
    batch = make_prefill_batch(q_lens, prefix, num_q_heads=4, num_kv_heads=2, head_size=16,
                               block_size=block_size, dtype=torch.float16, seed=block_size,
                               device=DEVICE)
    config = PrefillConfig(block_m=16, block_n=_tile_for(block_size), num_stages=1)
    run_and_compare(batch, causal=causal, config=config)


@pytest.mark.parametrize("block_size", ODD_BLOCK_SIZES)
def test_prefill_dispatcher_default_tiles(block_size):
    q_lens, prefix = _lens(block_size)
    batch = make_prefill_batch(q_lens, prefix, num_q_heads=8, num_kv_heads=2, head_size=32,
                               block_size=block_size, dtype=torch.float32, seed=block_size + 1,
                               pool_layout=True, device=DEVICE)
    run_and_compare(batch, causal=True, config=None)


@pytest.mark.parametrize("block_size", ODD_BLOCK_SIZES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_kernel_with_straddling_tiles(block_size, num_splits):
    lens = [1, block_size - 1, block_size, block_size + 1, 2 * block_size + 5]
    batch = make_decode_batch(lens, num_q_heads=8, num_kv_heads=2, head_size=32,
                              block_size=block_size, dtype=torch.float16, seed=block_size,
                              device=DEVICE)
    shapes = check_paged_decode_args(*batch.decode_args, None, None)
    out = torch.full_like(batch.query, float("nan"))
    lse = torch.full(batch.query.shape[:2], float("nan"), device=DEVICE)
    tiles = DecodeTiles(block_n=_tile_for(block_size), num_warps=4, num_stages=1)
    triton_paged_decode(*batch.decode_args, shapes, out=out, lse=lse, num_splits=num_splits,
                        tiles=tiles)
    assert_decode_matches_reference(batch, out, lse)


@pytest.mark.parametrize("block_size", ODD_BLOCK_SIZES)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_flash_attn_varlen_block_table_matches_contiguous(block_size, backend):
    q_lens, prefix = _lens(block_size)
    batch = make_prefill_batch(q_lens, prefix, num_q_heads=4, num_kv_heads=1, head_size=16,
                               block_size=block_size, dtype=torch.float32, seed=7,
                               device=DEVICE)
    ctx = batch.context_lens.long()
    # The same K/V, contiguous: gather every sequence's tokens through its table.
    keys, values = [], []
    for i, n in enumerate(ctx.tolist()):
        pos = torch.arange(n, device=DEVICE)
        blocks = batch.block_tables[i, pos // block_size].long()
        keys.append(batch.key_cache[blocks, pos % block_size])
        values.append(batch.value_cache[blocks, pos % block_size])
    cu_k = torch.zeros(len(q_lens) + 1, dtype=torch.int32, device=DEVICE)
    cu_k[1:] = torch.cumsum(ctx, 0)
    max_q, max_k = max(q_lens), int(ctx.max())
    paged = flash_attn_varlen_func(batch.query, batch.key_cache, batch.value_cache,
                                   batch.cu_seqlens_q, cu_k, max_q, max_k, causal=True,
                                   block_table=batch.block_tables, backend=backend)
    dense = flash_attn_varlen_func(batch.query, torch.cat(keys), torch.cat(values),
                                   batch.cu_seqlens_q, cu_k, max_q, max_k, causal=True,
                                   backend="torch")
    torch.testing.assert_close(paged, dense, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("block_size", ODD_BLOCK_SIZES)
def test_store_kv_then_prefill_over_odd_blocks(block_size):
    """store_kv (Triton) writes by slot; paged_prefill then reads the same tokens back."""
    gen = torch.Generator().manual_seed(block_size)
    num_tokens, num_kv_heads, head_size = 2 * block_size + 3, 2, 16
    num_blocks = 5
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_size), float("nan"))
    value_cache = key_cache.clone()
    blocks = torch.randperm(num_blocks, generator=gen)[:3].to(torch.int32)
    pos = torch.arange(num_tokens)
    slots = blocks[pos // block_size].long() * block_size + pos % block_size
    k = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen)
    key_cache, value_cache = key_cache.to(DEVICE), value_cache.to(DEVICE)
    store_kv(k.to(DEVICE), v.to(DEVICE), key_cache, value_cache, slots.to(DEVICE),
             backend="triton")
    torch.testing.assert_close(key_cache.view(-1, num_kv_heads, head_size)[slots.to(DEVICE)],
                               k.to(DEVICE))
    q = torch.randn(num_tokens, 4, head_size, generator=gen).to(DEVICE)
    table = blocks[None].to(DEVICE)
    cu_q = torch.tensor([0, num_tokens], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([num_tokens], dtype=torch.int32, device=DEVICE)
    got = paged_prefill(q, key_cache, value_cache, table, cu_q, lens, backend="triton")
    want = paged_prefill(q, key_cache, value_cache, table, cu_q, lens, backend="torch")
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
