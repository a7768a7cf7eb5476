"""Paged prefill by copy (ops/prefill_gather.py): the pages copied into contiguous rows, then
the contiguous kernel, against the torch reference.

On CPU the Triton interpreter runs both kernels with ``gather=True`` forced (the automatic
choice needs a Hopper GPU: tests/ops/test_prefill_gpu.py); small shapes, fp16/fp32, caches
NaN-poisoned wherever no sequence wrote, block tables shuffled.
"""

from __future__ import annotations

import pytest
import torch

from helpers.fp8_batch import dequantized_batch, fp8_batch, per_head_scales
from helpers.paged_batch import make_prefill_batch
from helpers.reference_checks import TOL
from mini_paged_attn.ops import reference
from mini_paged_attn.ops.checks import check_paged_prefill_args
from mini_paged_attn.ops.prefill import triton_paged_prefill
from mini_paged_attn.ops.prefill_gather import (GATHER_MAX_BYTES, copy_pays,
                                                gather_layout, gather_reserve_bytes,
                                                heads_adjacent, prepare_gather, should_gather)
from mini_paged_attn.ops.prefill_plan import PrefillConfig

SMALL = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
TMA_SMALL = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, tma=True)


def run_gathered(batch, *, causal=True, config=SMALL, **variant):
    """``triton_paged_prefill(..., gather=True)`` into NaN-filled out and lse."""
    query = batch.query
    out = torch.full_like(query, float("nan"))
    lse = torch.full(query.shape[:2], float("nan"))
    shapes = check_paged_prefill_args(*batch.prefill_args, None, out)
    triton_paged_prefill(*batch.prefill_args, shapes, causal=causal, out=out, lse=lse,
                         config=config, gather=True, **variant)
    return out, lse


# q_len 0 and 1, block_size - 1 and + 1, a cached prefix of 0, part of a block and many.
Q_LENS = [0, 1, 7, 9, 37, 20]
PREFIX = [5, 0, 0, 5, 26, 72]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", [(4, 2), (8, 1), (6, 3)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("causal", [True, False])
def test_gathered_prefill_matches_reference(dtype, heads, causal):
    batch = make_prefill_batch(Q_LENS, PREFIX, num_q_heads=heads[0], num_kv_heads=heads[1],
                               head_size=16, block_size=8, dtype=dtype, seed=sum(heads),
                               pool_layout=True)
    out, lse = run_gathered(batch, causal=causal)
    ref_out, ref_lse = reference.paged_prefill_gather(*batch.prefill_args, causal=causal,
                                                      scale=16 ** -0.5)
    torch.testing.assert_close(out.float(), ref_out, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("block_size", [1, 6, 16, 64])
@pytest.mark.parametrize("config", [SMALL, TMA_SMALL], ids=["pointer", "descriptor"])
def test_block_sizes_and_descriptor_loads(block_size, config):
    """Pages of any size (6: not a power of two; 64: several copy iterations a page), the
    contiguous attention loading through pointers or tensor descriptors."""
    batch = make_prefill_batch(Q_LENS, PREFIX, num_q_heads=4, num_kv_heads=2, head_size=32,
                               block_size=block_size, dtype=torch.float16, seed=block_size)
    out, lse = run_gathered(batch, config=config)
    ref_out, ref_lse = reference.paged_prefill_gather(*batch.prefill_args, causal=True,
                                                      scale=32 ** -0.5)
    torch.testing.assert_close(out.float(), ref_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-2, rtol=1e-2)


def test_copy_writes_each_sequence_at_its_prefix_sum():
    """The workspace holds each sequence's tokens back to back from ``cu_k[i]``, and
    ``cu_k`` is the prefix sum of the lengths; rows past the last token stay untouched."""
    batch = make_prefill_batch([1, 1, 1, 1], [0, 16, 3, 40], num_q_heads=2, num_kv_heads=2,
                               head_size=16, block_size=8, dtype=torch.float32, seed=3)
    _, kc, vc, tables, _, ctx = batch.prefill_args
    layout = gather_layout(4, tables.shape[1], 8, 2, 16, torch.float32)
    workspace = torch.full((layout.nbytes,), 255, dtype=torch.uint8)
    k, v, cu_k = layout.views(workspace, 2, 16, torch.float32)
    prepare_gather(kc, vc, tables, ctx, k, v, cu_k)
    assert cu_k.tolist() == [0, 1, 18, 22, 63]
    for i, n in enumerate(ctx.tolist()):
        start = int(cu_k[i])
        torch.testing.assert_close(k[start:start + n], batch.keys[i], atol=0, rtol=0)
        torch.testing.assert_close(v[start:start + n], batch.values[i], atol=0, rtol=0)
    assert k[int(ctx.sum()):].isnan().all() and v[int(ctx.sum()):].isnan().all()


@pytest.mark.parametrize("kind", ["none", "head"])
def test_fp8_cache_is_widened_and_its_scales_still_apply(kind):
    base = make_prefill_batch([20, 7, 1], [5, 30, 12], num_q_heads=8, num_kv_heads=2,
                              head_size=32, block_size=8, seed=11, pool_layout=True)
    scales = ((None, None) if kind == "none" else
              (per_head_scales(2, "cpu"), per_head_scales(2, "cpu", base=0.015).flip(0)))
    batch = fp8_batch(base, *scales, torch.float16)
    out, lse = run_gathered(batch, k_scale=scales[0], v_scale=scales[1])
    plain = dequantized_batch(batch, *scales)
    ref_out, ref_lse = reference.paged_prefill_gather(*plain.prefill_args, causal=True,
                                                      scale=32 ** -0.5)
    torch.testing.assert_close(out.float(), ref_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-2, rtol=1e-2)


def test_variants_pass_through_to_the_attention():
    batch = make_prefill_batch([9, 30], [20, 3], num_q_heads=4, num_kv_heads=2, head_size=16,
                               block_size=4, dtype=torch.float32, seed=5)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    variant = dict(window_size=(6, 0), softcap=5.0, sinks=sinks)
    out, lse = run_gathered(batch, **variant)
    ref_out, ref_lse = reference.paged_prefill_gather(*batch.prefill_args, causal=True,
                                                      scale=0.25, **variant)
    torch.testing.assert_close(out.float(), ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)


def test_lengths_past_the_table_never_write_past_the_workspace():
    """context_lens past width * block_size (unchecked on the triton path) are copied as
    the table's length: cu_k stays within the rows and the bytes after the workspace stay."""
    batch = make_prefill_batch([1, 1], [15, 7], num_q_heads=2, num_kv_heads=1, head_size=16,
                               block_size=4, dtype=torch.float32, seed=4)
    _, kc, vc, tables, _, _ = batch.prefill_args
    tables = tables[:, :4].contiguous()                       # 16 tokens a sequence
    ctx = torch.tensor([40, 8], dtype=torch.int32)            # the first is past the table
    layout = gather_layout(2, 4, 4, 1, 16, torch.float32)
    guard = 256
    buffer = torch.full((layout.nbytes + guard,), 77, dtype=torch.uint8)
    k, v, cu_k = layout.views(buffer[:layout.nbytes], 1, 16, torch.float32)
    prepare_gather(kc, vc, tables, ctx, k, v, cu_k)
    assert cu_k.tolist() == [0, 16, 24]
    assert buffer[layout.nbytes:].eq(77).all()
    torch.testing.assert_close(k[16:24], batch.keys[1], atol=0, rtol=0)


def test_layout_and_the_automatic_choice():
    layout = gather_layout(8, 544, 16, 8, 128, torch.bfloat16)
    assert layout.rows == 8 * 544 * 16 and layout.v_offset == layout.rows * 2048
    assert layout.nbytes == 2 * layout.rows * 2048 + 4 * 9 <= GATHER_MAX_BYTES
    batch = make_prefill_batch([300], [0], num_q_heads=2, num_kv_heads=1, head_size=128,
                               block_size=16, dtype=torch.float16)
    q, kc, vc, tables, _, _ = batch.prefill_args
    assert not should_gather(q, kc, vc, 1, tables.shape[1], -1)    # CPU: the interpreter
    assert gather_reserve_bytes(torch.device("cpu"), max_num_seqs=8, width=64, block_size=16,
                                num_kv_heads=8, head_size=128, dtype=torch.bfloat16) == 0
    # The shape side: more than 256 queries and 1024 rows (queries x query heads a KV head)
    # a sequence, no window, 16-bit, adjacent heads, a workspace within the bound.
    fits = dict(dtype=torch.bfloat16, heads_adjacent=True, workspace_bytes=1 << 20)
    assert copy_pays(513, 2, 4, -1, **fits)
    assert not copy_pays(512, 2, 4, -1, **fits)                # 256 a sequence: no gain
    assert not copy_pays(2 * 512, 2, 2, -1, **fits)            # 2 heads a KV head: 1024 rows
    assert copy_pays(2 * 513, 2, 2, -1, **fits)
    assert not copy_pays(512, 2, 16, -1, **fits)               # many rows, few queries
    assert not copy_pays(4096, 1, 4, 128, **fits)              # a left window
    assert not copy_pays(4096, 0, 4, -1, **fits)
    assert not copy_pays(4096, 1, 4, -1, **(fits | dict(dtype=torch.float32)))
    assert not copy_pays(4096, 1, 4, -1, **(fits | dict(heads_adjacent=False)))
    assert not copy_pays(4096, 1, 4, -1, **(fits | dict(workspace_bytes=GATHER_MAX_BYTES + 1)))
    pool = torch.zeros(4, 16, 2, 8, 128)
    assert heads_adjacent(pool[:, :, 0]) and not heads_adjacent(pool[..., :64])


def test_forced_copy_refuses_caches_whose_heads_are_not_adjacent():
    batch = make_prefill_batch([3], [5], num_q_heads=2, num_kv_heads=2, head_size=16,
                               block_size=4, dtype=torch.float32)
    q, kc, vc, tables, cu, ctx = batch.prefill_args
    padded = torch.zeros(*kc.shape[:3], 32)
    padded[..., :16] = kc
    split = padded[..., :16]            # a token's heads 32 elements apart, not 16
    shapes = check_paged_prefill_args(q, split, vc, tables, cu, ctx, None, None)
    with pytest.raises(ValueError, match="key_cache: the page copy needs"):
        triton_paged_prefill(q, split, vc, tables, cu, ctx, shapes, causal=True,
                             out=torch.empty_like(q), lse=None, gather=True)
