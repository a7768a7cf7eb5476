"""The reference paged attention ops (ops/reference.py) against dense attention.

Every sequence's K/V are drawn as dense tensors, then written into shuffled physical blocks
(``helpers.paged_batch``). The expected result is float64
``scaled_dot_product_attention`` on those dense tensors, so the test shares no gather code with
the ops. Every cache slot no sequence uses holds NaN, and every table entry past a sequence's
length holds garbage (negative ids, ids past the pool, INT32 extremes): neither may reach a result.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.paged_batch import GARBAGE_IDS, PagedBatch, make_paged_batch
from mini_paged_attn.ops import paged_decode, paged_prefill, reference, store_kv

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The reference ops return float32 computed from the (rounded) inputs, so they match a float64
# computation on the same inputs closely whatever the input dtype.
REF_TOL = dict(atol=2e-5, rtol=2e-5)
# Through dispatch the output is rounded to the query's dtype (half an ulp: 2^-11 for fp16,
# 2^-8 for bf16, relative).
OUT_TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=1e-3, rtol=1e-3),
           torch.bfloat16: dict(atol=8e-3, rtol=8e-3)}
# (num_q_heads, num_kv_heads): MHA, GQA 4, GQA 8 (MQA), an odd group of 5.
HEADS = [(4, 4), (8, 2), (8, 1), (10, 2)]


def make_batch(q_lens, ctx_lens, *, heads, head_size=32, **kwargs) -> PagedBatch:
    """A paged batch with the harshest garbage in its tables; ``heads``: (num_q, num_kv)."""
    return make_paged_batch(q_lens, ctx_lens, num_q_heads=heads[0], num_kv_heads=heads[1],
                            head_size=head_size, garbage=GARBAGE_IDS, **kwargs)


def dense_attention(batch: PagedBatch, *, causal: bool, scale: float):
    """float64 SDPA per sequence on the dense K/V: (out [total_q, Hq, D], lse [total_q, Hq])."""
    outs, lses = [], []
    num_q_heads = batch.query.shape[1]
    for i, (k, v) in enumerate(zip(batch.keys, batch.values)):
        q = batch.query[int(batch.cu_seqlens_q[i]):int(batch.cu_seqlens_q[i + 1])].double()
        q_len, n = q.shape[0], k.shape[0]
        group = num_q_heads // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)  # query head h reads kv head h // group
        v = v.double().repeat_interleave(group, dim=1)
        t = torch.arange(q_len)[:, None]
        p = torch.arange(n)[None, :]
        mask = p <= n - q_len + t if causal else torch.ones(q_len, n, dtype=torch.bool)
        if n == 0:  # no key at all: zeros, lse -inf
            outs.append(torch.zeros_like(q))
            lses.append(torch.full(q.shape[:2], float("-inf"), dtype=torch.float64))
            continue
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                             v.transpose(0, 1), attn_mask=mask, scale=scale)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        lse = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1)
        outs.append(out.transpose(0, 1))
        lses.append(lse.transpose(0, 1))
    return torch.cat(outs).float(), torch.cat(lses).float()


def long_len(block_size: int) -> int:
    return max(3 * block_size + 5, 40)


def decode_lens(block_size: int) -> list[int]:
    return [1, block_size - 1, block_size, block_size + 1, long_len(block_size), 0]


def prefill_mix(block_size: int) -> list[tuple[int, int]]:
    """(q_len, context_len) pairs: the q tokens are the last q_len of context_len."""
    bs, long = block_size, long_len(block_size)
    return [
        (0, 0),            # an empty sequence
        (0, bs + 1),       # cached, nothing queried this step
        (1, 1),            # the first token
        (1, long),         # a decode row
        (bs - 1, bs - 1),  # whole prompts around a block boundary
        (bs + 1, bs + 1),
        (long, long),      # a long whole prompt
        (7, long + 7),     # a chunk on a cached prefix (chunked prefill)
        (bs, 3 * bs),      # a prefix-cache hit ending at a block boundary
    ]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("block_size", [1, 16, 128])
def test_decode_matches_dense(block_size, heads, dtype):
    lens = decode_lens(block_size)
    batch = make_batch([1] * len(lens), lens, block_size=block_size, heads=heads, dtype=dtype,
                       seed=block_size + heads[0] * 7 + heads[1])
    scale = 0.17
    want_out, want_lse = dense_attention(batch, causal=True, scale=scale)
    args = batch.decode_args
    gather_out, gather_lse = reference.paged_decode_gather(*args, scale=scale)
    block_out, block_lse = reference.paged_decode_blockwise(*args, scale=scale)
    for out, lse in ((gather_out, gather_lse), (block_out, block_lse)):
        assert out.dtype == lse.dtype == torch.float32
        torch.testing.assert_close(out, want_out, **REF_TOL)
        torch.testing.assert_close(lse, want_lse, **REF_TOL)
    torch.testing.assert_close(block_out, gather_out, **REF_TOL)
    # The context-length-0 sequence (last): zeros and lse -inf, exactly.
    assert torch.equal(gather_out[-1], torch.zeros_like(gather_out[-1]))
    assert torch.equal(block_out[-1], torch.zeros_like(block_out[-1]))
    assert torch.isneginf(gather_lse[-1]).all() and torch.isneginf(block_lse[-1]).all()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("block_size", [1, 16, 128])
def test_prefill_matches_dense(block_size, heads, dtype, causal):
    q_lens, ctx = zip(*prefill_mix(block_size))
    batch = make_batch(q_lens, ctx, block_size=block_size, heads=heads, dtype=dtype,
                       seed=3 * block_size + heads[0] + 11 * heads[1])
    scale = 0.21
    want_out, want_lse = dense_attention(batch, causal=causal, scale=scale)
    args = batch.prefill_args
    gather_out, gather_lse = reference.paged_prefill_gather(*args, causal=causal, scale=scale)
    block_out, block_lse = reference.paged_prefill_blockwise(*args, causal=causal, scale=scale)
    for out, lse in ((gather_out, gather_lse), (block_out, block_lse)):
        assert out.shape == batch.query.shape and lse.shape == batch.query.shape[:2]
        torch.testing.assert_close(out, want_out, **REF_TOL)
        torch.testing.assert_close(lse, want_lse, **REF_TOL)
    torch.testing.assert_close(block_out, gather_out, **REF_TOL)


def test_causal_mask_is_bottom_right():
    """A chunk's first query row sees the prefix and itself, not the chunk's later tokens."""
    batch = make_batch([3], [8], block_size=4, heads=(2, 2), seed=5)
    out, _ = reference.paged_prefill_gather(
        batch.query, batch.key_cache, batch.value_cache, batch.block_tables,
        batch.cu_seqlens_q, batch.context_lens, causal=True, scale=0.5)
    # Row 0 is position 5: changing keys at positions 6 and 7 must not change it.
    k2 = batch.key_cache.clone()
    row = batch.block_tables[0, 1]  # positions 4..7
    k2[row, 2:] = 100.0
    out2, _ = reference.paged_prefill_gather(
        batch.query, k2, batch.value_cache, batch.block_tables, batch.cu_seqlens_q,
        batch.context_lens, causal=True, scale=0.5)
    assert torch.equal(out[0], out2[0])
    assert not torch.allclose(out[2], out2[2])  # the last row sees position 7


@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_unused_memory_never_reaches_the_result(op):
    """Same batch with NaN, then +inf, then huge values in every unused slot: bitwise equal."""
    results = []
    for unused in (float("nan"), float("inf"), 3e4):
        if op == "decode":
            lens = decode_lens(16)
            b = make_batch([1] * len(lens), lens, block_size=16, heads=(8, 2), seed=9,
                           unused=unused)
            args = b.decode_args
            pairs = [reference.paged_decode_gather(*args, scale=0.3),
                     reference.paged_decode_blockwise(*args, scale=0.3)]
        else:
            q_lens, ctx = zip(*prefill_mix(16))
            b = make_batch(q_lens, ctx, block_size=16, heads=(8, 2), seed=9, unused=unused)
            args = b.prefill_args
            pairs = [reference.paged_prefill_gather(*args, causal=True, scale=0.3),
                     reference.paged_prefill_blockwise(*args, causal=True, scale=0.3)]
        for out, _ in pairs:
            assert not out.isnan().any()
        results.append(pairs)
    for other in results[1:]:
        for (out, lse), (out0, lse0) in zip(other, results[0]):
            assert torch.equal(out, out0) and torch.equal(lse, lse0)


@pytest.mark.parametrize("pool_layout", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dispatch_torch_backend(dtype, pool_layout):
    """paged_decode / paged_prefill: out= and return_lse, default scale, the query's dtype,
    the manager's strided views of the pool without a copy."""
    lens = decode_lens(16)
    b = make_batch([1] * len(lens), lens, block_size=16, heads=(10, 2), dtype=dtype, seed=1,
                   pool_layout=pool_layout)
    assert b.key_cache.is_contiguous() is not pool_layout
    scale = 32 ** -0.5
    want_out, want_lse = dense_attention(b, causal=True, scale=scale)
    out = torch.full_like(b.query, float("nan"))
    got, lse = paged_decode(*b.decode_args, out=out, return_lse=True, backend="torch")
    assert got is out and out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), want_out, **OUT_TOL[dtype])
    torch.testing.assert_close(lse, want_lse, **REF_TOL)

    q_lens, ctx = zip(*prefill_mix(16))
    b = make_batch(q_lens, ctx, block_size=16, heads=(10, 2), dtype=dtype, seed=2,
                   pool_layout=pool_layout)
    want_out, _ = dense_attention(b, causal=True, scale=scale)
    got = paged_prefill(*b.prefill_args, backend="torch")
    assert got.dtype == dtype and got.shape == b.query.shape
    torch.testing.assert_close(got.float(), want_out, **OUT_TOL[dtype])


def test_decode_is_prefill_with_one_query_per_sequence():
    lens = decode_lens(16)[:-1]  # prefill needs q_len <= context_len
    b = make_batch([1] * len(lens), lens, block_size=16, heads=(8, 2), seed=4)
    decode = paged_decode(*b.decode_args, backend="torch")
    for causal in (True, False):
        prefill = paged_prefill(*b.prefill_args, causal=causal, backend="torch")
        torch.testing.assert_close(prefill, decode, atol=1e-6, rtol=1e-6)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits, so NaN compares equal to itself."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_writes_only_the_named_slots(dtype):
    num_blocks, block_size, num_kv_heads, head_size = 6, 4, 2, 8
    gen = torch.Generator().manual_seed(0)
    pool = torch.full((num_blocks, block_size, 2, num_kv_heads, head_size), float("nan"),
                      dtype=dtype)
    key_cache, value_cache = pool[:, :, 0], pool[:, :, 1]  # strided views, written in place
    before = pool.clone()
    slots = torch.tensor([13, -1, 0, 23, 5, -1, 6], dtype=torch.int64)
    key = torch.randn(len(slots), num_kv_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(len(slots), num_kv_heads, head_size, generator=gen).to(dtype)
    store_kv(key, value, key_cache, value_cache, slots.to(torch.int32), backend="torch")
    expected = before.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // block_size, slot % block_size, 0] = key[t]
            expected[slot // block_size, slot % block_size, 1] = value[t]
    assert torch.equal(bits(pool), bits(expected))


def test_store_kv_then_attention():
    """K/V written with store_kv through a block table, read back by paged attention."""
    ref = make_batch([5, 1], [9, 6], block_size=4, heads=(4, 2), seed=8)
    key_cache = torch.full_like(ref.key_cache, float("nan"))
    value_cache = torch.full_like(ref.value_cache, float("nan"))
    for i, (k, v) in enumerate(zip(ref.keys, ref.values)):
        pos = torch.arange(k.shape[0])
        slots = ref.block_tables[i, pos // 4].long() * 4 + pos % 4
        store_kv(k, v, key_cache, value_cache, slots, backend="torch")
    out = paged_prefill(ref.query, key_cache, value_cache, ref.block_tables, ref.cu_seqlens_q,
                        ref.context_lens, backend="torch")
    want, _ = dense_attention(ref, causal=True, scale=32 ** -0.5)
    torch.testing.assert_close(out, want, **REF_TOL)


def test_empty_batch():
    b = make_batch([], [], block_size=4, heads=(4, 2))
    out, lse = paged_decode(*b.decode_args, return_lse=True, backend="torch")
    assert out.shape == (0, 4, 32) and lse.shape == (0, 4)
    out = paged_prefill(*b.prefill_args, backend="torch")
    assert out.shape == (0, 4, 32)
