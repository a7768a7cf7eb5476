"""Sliding windows, logit soft-capping and attention sinks in the paged attention ops.

Every backend is checked against a dense reference written here, independent of
ops/reference.py: one query row at a time, an explicit list of the keys it may see, float64.
Blocks wholly left of every query's window are poisoned (NaN, or a huge finite value) the way
a freed and reused block would look, so an op that reads one shows it. On CPU the Triton
kernels run through the interpreter (fp16 / fp32, tiny shapes).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.cuda_graphs import capture
from helpers.fp8_batch import dequantized_batch, fp8_batch
from helpers.paged_batch import (PagedBatch, make_decode_batch, make_paged_batch,
                                 make_prefill_batch)
from mini_paged_attn.ops import reference
from mini_paged_attn.ops.decode import workspace_size
from mini_paged_attn.ops.dispatch import paged_decode, paged_prefill
from mini_paged_attn.ops.attention.decode_plan import explain_decode, plan_decode, window_kv_tiles
from mini_paged_attn.ops.varlen import flash_attn_varlen_func

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch", "triton"]
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


# ---- the independent dense reference --------------------------------------------------------

def dense_attention(q, keys, values, *, q_len, scale, causal=True, window=(-1, -1), softcap=0.0,
                    sinks=None):
    """Rows of one sequence, float64: q ``[q_len, Hq, D]``; keys, values ``[k_len, Hkv, D]``.
    Returns out ``[q_len, Hq, D]`` and lse ``[q_len, Hq]`` (log of the denominator, the sink
    included; -inf when a row sees nothing and has no sink)."""
    k_len, hkv = keys.shape[0], keys.shape[1]
    hq = q.shape[1]
    out = torch.zeros(q_len, hq, q.shape[2], dtype=torch.float64)
    lse = torch.full((q_len, hq), -math.inf, dtype=torch.float64)
    left, right = window
    if causal:
        right = 0
    for t in range(q_len):
        p = k_len - q_len + t
        seen = [j for j in range(k_len)
                if (left < 0 or j >= p - left) and (right < 0 or j <= p + right)]
        for h in range(hq):
            kh = h // (hq // hkv)
            logits = [float(q[t, h].double() @ keys[j, kh].double()) * scale for j in seen]
            if softcap > 0:
                logits = [softcap * math.tanh(x / softcap) for x in logits]
            extra = [float(sinks[h])] if sinks is not None else []
            if not logits and not extra:
                continue
            m = max(logits + extra)
            weights = [math.exp(x - m) for x in logits]
            denom = sum(weights) + sum(math.exp(x - m) for x in extra)
            for w, j in zip(weights, seen):
                out[t, h] += w / denom * values[j, kh].double()
            lse[t, h] = m + math.log(denom)
    return out, lse


def expected(batch: PagedBatch, *, scale, **variant):
    """The dense reference over a batch's dense K/V (``batch.keys`` / ``batch.values``)."""
    cu = batch.cu_seqlens_q.tolist()
    outs, lses = [], []
    for i, (k, v) in enumerate(zip(batch.keys, batch.values)):
        o, s = dense_attention(batch.query[cu[i]:cu[i + 1]].cpu(), k.cpu(), v.cpu(),
                               q_len=cu[i + 1] - cu[i], scale=scale, **variant)
        outs.append(o)
        lses.append(s)
    return torch.cat(outs), torch.cat(lses)


def poison_left_of_windows(batch: PagedBatch, left: int, value: float = float("nan")) -> int:
    """Fill every block wholly left of all of a sequence's query windows with ``value`` and
    point half of those table entries at one shared poisoned block (a freed block reused by
    another sequence). Returns the number of poisoned blocks."""
    if left < 0:
        return 0
    bs = batch.key_cache.shape[1]
    cu = batch.cu_seqlens_q.tolist()
    poisoned = 0
    shared = None
    for i, k_len in enumerate(batch.context_lens.tolist()):
        first_pos = k_len - (cu[i + 1] - cu[i])
        for j in range(max(first_pos - left, 0) // bs):
            block = int(batch.block_tables[i, j])
            batch.key_cache[block] = value
            batch.value_cache[block] = value
            if shared is None:
                shared = block
            elif j % 2:
                batch.block_tables[i, j] = shared
            poisoned += 1
    return poisoned


def _check(out, lse, ref_out, ref_lse, dtype):
    tol = TOL[dtype]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double().cpu(), ref_out, atol=tol, rtol=tol)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite)
    torch.testing.assert_close(lse.double().cpu()[finite], ref_lse[finite], atol=tol, rtol=tol)


def _sinks(num_q_heads, on: bool):
    if not on:
        return None
    gen = torch.Generator().manual_seed(7)
    return (torch.randn(num_q_heads, generator=gen) * 2).to(DEVICE)


# ---- decode ---------------------------------------------------------------------------------

# (block_size, lengths): lengths 1 and block_size +- 1, windows ending inside a block.
DECODE_SHAPES = [
    pytest.param(16, [1, 15, 16, 17, 45], id="bs16"),
    pytest.param(5, [1, 4, 5, 6, 23], id="bs5"),
]
# left windows: 0 (the token itself), inside a block, a block's width, >= every context.
WINDOWS = [(-1, -1), (0, -1), (3, -1), (16, 7), (100, -1)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size, lens", DECODE_SHAPES)
@pytest.mark.parametrize("window", WINDOWS)
def test_decode_window(backend, block_size, lens, window):
    batch = make_decode_batch(lens, num_q_heads=4, num_kv_heads=2, head_size=16,
                              block_size=block_size, dtype=torch.float32, seed=3, device=DEVICE)
    poison_left_of_windows(batch, window[0])
    out, lse = paged_decode(*batch.decode_args, return_lse=True, backend=backend,
                            window_size=window)
    _check(out, lse, *expected(batch, scale=0.25, window=window), torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window, softcap, sinks", [
    ((-1, -1), 5.0, False), ((-1, -1), 0.0, True), ((6, -1), 0.0, True), ((6, -1), 5.0, True),
    ((0, 0), 0.0, True)])
def test_decode_softcap_and_sinks(backend, dtype, window, softcap, sinks):
    batch = make_decode_batch([1, 7, 16, 33], num_q_heads=8, num_kv_heads=2, head_size=16,
                              block_size=16, dtype=dtype, seed=4, device=DEVICE)
    # Large logits: without the cap the softmax would be one-hot.
    batch = dataclasses.replace(batch, query=batch.query * 100 if softcap else batch.query)
    poison_left_of_windows(batch, window[0], value=6e4)
    sink = _sinks(8, sinks)
    out, lse = paged_decode(*batch.decode_args, return_lse=True, backend=backend,
                            window_size=window, softcap=softcap, sinks=sink)
    ref = expected(batch, scale=0.25, window=window, softcap=softcap, sinks=sink)
    _check(out, lse, *ref, dtype)


@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("sinks", [False, True])
def test_decode_split_kv_adds_the_sink_once(num_splits, sinks):
    batch = make_decode_batch([0, 1, 40, 70], num_q_heads=4, num_kv_heads=1, head_size=16,
                              block_size=16, dtype=torch.float32, seed=5, device=DEVICE)
    window = (37, -1)
    poison_left_of_windows(batch, window[0])
    sink = _sinks(4, sinks)
    out, lse = paged_decode(*batch.decode_args, return_lse=True, backend="triton",
                            num_splits=num_splits, window_size=window, sinks=sink)
    _check(out, lse, *expected(batch, scale=0.25, window=window, sinks=sink), torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_fp8_cache_with_window(backend):
    plain = make_decode_batch([3, 17, 40], num_q_heads=4, num_kv_heads=2, head_size=16,
                              block_size=16, dtype=torch.float32, seed=6, device=DEVICE)
    k_scale = torch.tensor([0.01, 0.02], device=DEVICE)
    v_scale = torch.tensor(0.015, device=DEVICE)
    batch = fp8_batch(plain, k_scale, v_scale, torch.float16)
    window, sink = (9, -1), _sinks(4, True)
    deq = dequantized_batch(batch, k_scale, v_scale)
    # The dense K/V as attention must read them (before the poisoning rewrites the tables).
    dense_kv = [[cache[deq.block_tables[i, torch.arange(n) // 16].long(), torch.arange(n) % 16]
                 for i, n in enumerate(deq.context_lens.tolist())]
                for cache in (deq.key_cache, deq.value_cache)]
    ref_out, ref_lse = reference.paged_decode_gather(
        *deq.decode_args, scale=0.25, window_size=window, softcap=3.0, sinks=sink)
    poison_left_of_windows(batch, window[0])
    out, lse = paged_decode(*batch.decode_args, return_lse=True, backend=backend,
                            k_scale=k_scale, v_scale=v_scale, window_size=window, softcap=3.0,
                            sinks=sink)
    torch.testing.assert_close(out.float(), ref_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-2, rtol=1e-2)
    # And the reference itself against the dense one on the dequantized values.
    dense = expected(dataclasses.replace(deq, keys=dense_kv[0], values=dense_kv[1]), scale=0.25,
                     window=window, softcap=3.0, sinks=sink)
    _check(ref_out, ref_lse, *dense, torch.float32)


# ---- prefill --------------------------------------------------------------------------------

PREFILL_CASES = [
    # (q_lens, prefix_lens, block_size, causal, window)
    pytest.param([1, 5, 16], [0, 12, 1], 16, True, (4, -1), id="causal-left4"),
    pytest.param([6, 1, 17], [10, 15, 0], 5, True, (0, -1), id="causal-left0-bs5"),
    pytest.param([9, 3], [20, 40], 16, True, (100, -1), id="causal-wide"),
    pytest.param([8, 4], [3, 30], 16, False, (5, 2), id="noncausal-left5-right2"),
    pytest.param([7, 5], [0, 9], 5, False, (-1, 3), id="noncausal-right-only"),
    pytest.param([4, 15], [17, 1], 16, True, (-1, -1), id="causal-full"),
    # Windows wider than a query tile: masked head tiles, unmasked middle tiles, masked tail.
    pytest.param([20, 3], [60, 45], 16, True, (30, -1), id="causal-left30-tiles"),
    pytest.param([19, 2], [50, 33], 5, True, (21, -1), id="causal-left21-bs5"),
    pytest.param([12, 9], [40, 3], 16, False, (25, 18), id="noncausal-left25-right18"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_lens, prefix, block_size, causal, window", PREFILL_CASES)
def test_prefill_window(backend, q_lens, prefix, block_size, causal, window):
    batch = make_prefill_batch(q_lens, prefix, num_q_heads=4, num_kv_heads=2, head_size=16,
                               block_size=block_size, dtype=torch.float32, seed=8,
                               device=DEVICE)
    poison_left_of_windows(batch, window[0])
    out, lse = paged_prefill(*batch.prefill_args, causal=causal, return_lse=True,
                             backend=backend, window_size=window)
    _check(out, lse, *expected(batch, scale=0.25, causal=causal, window=window), torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window, softcap, sinks", [
    ((-1, -1), 4.0, False), ((-1, -1), 0.0, True), ((3, -1), 4.0, True)])
def test_prefill_softcap_and_sinks(backend, dtype, window, softcap, sinks):
    batch = make_prefill_batch([5, 1, 12], [11, 20, 0], num_q_heads=8, num_kv_heads=2,
                               head_size=16, block_size=16, dtype=dtype, seed=9, device=DEVICE)
    batch = dataclasses.replace(batch, query=batch.query * 100 if softcap else batch.query)
    poison_left_of_windows(batch, window[0], value=6e4)
    sink = _sinks(8, sinks)
    out, lse = paged_prefill(*batch.prefill_args, return_lse=True, backend=backend,
                             window_size=window, softcap=softcap, sinks=sink)
    ref = expected(batch, scale=0.25, window=window, softcap=softcap, sinks=sink)
    _check(out, lse, *ref, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_fp8_cache_with_window(backend):
    plain = make_prefill_batch([6, 1], [14, 30], num_q_heads=4, num_kv_heads=2, head_size=16,
                               block_size=16, dtype=torch.float32, seed=10, device=DEVICE)
    k_scale, v_scale = torch.tensor(0.02, device=DEVICE), torch.tensor([0.01, 0.03],
                                                                        device=DEVICE)
    batch = fp8_batch(plain, k_scale, v_scale, torch.float16)
    window, sink = (5, -1), _sinks(4, True)
    deq = dequantized_batch(batch, k_scale, v_scale)
    ref_out, ref_lse = reference.paged_prefill_gather(
        *deq.prefill_args, causal=True, scale=0.25, window_size=window, softcap=2.0, sinks=sink)
    poison_left_of_windows(batch, window[0])
    out, lse = paged_prefill(*batch.prefill_args, return_lse=True, backend=backend,
                             k_scale=k_scale, v_scale=v_scale, window_size=window, softcap=2.0,
                             sinks=sink)
    torch.testing.assert_close(out.float(), ref_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-2, rtol=1e-2)


def test_reference_blockwise_matches_gather_with_variants():
    """The two reference implementations agree, both reading only inside the windows."""
    batch = make_prefill_batch([3, 1, 9], [20, 8, 4], num_q_heads=6, num_kv_heads=3,
                               head_size=16, block_size=5, dtype=torch.float32, seed=11)
    poison_left_of_windows(batch, 6)
    variant = dict(window_size=(6, -1), softcap=3.0, sinks=_sinks(6, True).cpu())
    g = reference.paged_prefill_gather(*batch.prefill_args, causal=True, scale=0.3, **variant)
    b = reference.paged_prefill_blockwise(*batch.prefill_args, causal=True, scale=0.3, **variant)
    torch.testing.assert_close(g, b, atol=1e-5, rtol=1e-5)
    dec = make_decode_batch([1, 12, 26], num_q_heads=6, num_kv_heads=3, head_size=16,
                            block_size=5, dtype=torch.float32, seed=12)
    poison_left_of_windows(dec, 6)
    g = reference.paged_decode_gather(*dec.decode_args, scale=0.3, **variant)
    b = reference.paged_decode_blockwise(*dec.decode_args, scale=0.3, **variant)
    torch.testing.assert_close(g, b, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(g[0]).all()


@settings(max_examples=40, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([1, 3, 4, 16]),
       left=st.integers(-1, 12), right=st.integers(-1, 6), causal=st.booleans(),
       softcap=st.sampled_from([0.0, 0.7, 4.0]), sinks=st.booleans())
def test_reference_matches_dense_on_random_batches(data, block_size, left, right, causal,
                                                   softcap, sinks):
    """The torch backend against the per-row loop on random lengths and windows."""
    num_seqs = data.draw(st.integers(1, 3))
    k_lens = data.draw(st.lists(st.integers(1, 24), min_size=num_seqs, max_size=num_seqs))
    q_lens = [data.draw(st.integers(1, k)) for k in k_lens]
    batch = make_paged_batch(q_lens, k_lens, num_q_heads=4, num_kv_heads=2, head_size=8,
                             block_size=block_size, dtype=torch.float32, seed=sum(k_lens))
    batch = dataclasses.replace(batch, query=batch.query * 3)
    poison_left_of_windows(batch, left)
    sink = _sinks(4, sinks).cpu() if sinks else None
    out, lse = paged_prefill(*batch.prefill_args, causal=causal, scale=0.25, return_lse=True,
                             backend="torch", window_size=(left, right), softcap=softcap,
                             sinks=sink)
    ref = expected(batch, scale=0.25, causal=causal, window=(left, right), softcap=softcap,
                   sinks=sink)
    _check(out, lse, *ref, torch.float32)


# ---- flash_attn_varlen_func ----------------------------------------------------------------

def _contiguous(q_lens, k_lens, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), 4, 16, generator=gen)
    k = torch.randn(sum(k_lens), 2, 16, generator=gen)
    v = torch.randn(sum(k_lens), 2, 16, generator=gen)
    cu = [torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32)
          for x in (q_lens, k_lens)]
    return q, k, v, cu[0], cu[1]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal, window, softcap, sinks", [
    (True, (2, -1), 0.0, False), (False, (3, 1), 0.0, False), (False, (-1, 0), 2.0, True),
    (True, (1, 5), 0.0, True)])
def test_varlen_contiguous_variants(backend, causal, window, softcap, sinks):
    q_lens, k_lens = [5, 7, 1], [9, 4, 6]   # q_len > k_len: causal rows that see nothing
    q, k, v, cu_q, cu_k = _contiguous(q_lens, k_lens, seed=13)
    sink = _sinks(4, sinks)
    out = flash_attn_varlen_func(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cu_q.to(DEVICE),
                                 cu_k.to(DEVICE), max(q_lens), max(k_lens), 0.0, 0.25, causal,
                                 window, softcap, sinks=sink, backend=backend)
    ref = []
    for i in range(3):
        o, _ = dense_attention(q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]],
                               v[cu_k[i]:cu_k[i + 1]], q_len=q_lens[i], scale=0.25,
                               causal=causal, window=window, softcap=softcap,
                               sinks=None if sink is None else sink.cpu())
        ref.append(o)
    torch.testing.assert_close(out.double().cpu(), torch.cat(ref), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_paged_passes_the_variants(backend):
    batch = make_prefill_batch([4, 2], [9, 21], num_q_heads=4, num_kv_heads=2, head_size=16,
                               block_size=16, dtype=torch.float32, seed=14, device=DEVICE)
    poison_left_of_windows(batch, 3)
    cu_k = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    cu_k[1:] = batch.context_lens.cumsum(0)
    sink = _sinks(4, True)
    out = flash_attn_varlen_func(batch.query, batch.key_cache, batch.value_cache,
                                 batch.cu_seqlens_q, cu_k, 4, 23, 0.0, 0.25, True, (3, -1), 1.5,
                                 block_table=batch.block_tables, sinks=sink, backend=backend)
    ref, _ = expected(batch, scale=0.25, window=(3, -1), softcap=1.5, sinks=sink)
    torch.testing.assert_close(out.double().cpu(), ref, atol=1e-4, rtol=1e-4)


# ---- argument checks ------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kwargs, name", [
    (dict(window_size=(-2, 0)), "window_size"), (dict(window_size=(1,)), "window_size"),
    (dict(window_size=(1.0, 0)), "window_size"), (dict(window_size=(True, 0)), "window_size"),
    (dict(window_size=5), "window_size"), (dict(softcap=-1.0), "softcap"),
    (dict(softcap=float("nan")), "softcap"), (dict(softcap=math.inf), "softcap"),
    (dict(softcap="1"), "softcap"),
    (dict(sinks=torch.zeros(3)), "sinks"), (dict(sinks=torch.zeros(4, dtype=torch.float16)),
                                            "sinks"),
    (dict(sinks=torch.zeros(4, 1)), "sinks"), (dict(sinks=[0.0] * 4), "sinks")])
def test_bad_variant_arguments_raise_naming_them(backend, kwargs, name):
    batch = make_prefill_batch([2], [3], num_q_heads=4, num_kv_heads=2, head_size=16,
                               block_size=16, dtype=torch.float32, seed=15, device=DEVICE)
    kwargs = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    out = torch.full_like(batch.query, 7.0)
    with pytest.raises(ValueError, match=name):
        paged_prefill(*batch.prefill_args, out=out, backend=backend, **kwargs)
    assert out.eq(7.0).all()   # nothing written
    dec = make_decode_batch([3], num_q_heads=4, num_kv_heads=2, head_size=16, block_size=16,
                            dtype=torch.float32, seed=15, device=DEVICE)
    with pytest.raises(ValueError, match=name):
        paged_decode(*dec.decode_args, backend=backend, **kwargs)
    with pytest.raises(ValueError, match=name):
        q, k, v, cu_q, cu_k = _contiguous([2], [3], seed=1)
        flash_attn_varlen_func(*(t.to(DEVICE) for t in (q, k, v, cu_q, cu_k)), 2, 3,
                               window_size=kwargs.get("window_size", (-1, -1)),
                               softcap=kwargs.get("softcap", 0.0),
                               sinks=kwargs.get("sinks"), backend=backend)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_sinks_on_another_device_raise():
    batch = make_decode_batch([3], num_q_heads=4, num_kv_heads=2, head_size=16, block_size=16,
                              dtype=torch.float32, seed=15, device="cuda")
    with pytest.raises(ValueError, match="sinks"):
        paged_decode(*batch.decode_args, sinks=torch.zeros(4))


def test_list_window_is_accepted():
    batch = make_decode_batch([9], num_q_heads=4, num_kv_heads=2, head_size=16, block_size=16,
                              dtype=torch.float32, seed=16)
    a = paged_decode(*batch.decode_args, backend="torch", window_size=[2, -1])
    b = paged_decode(*batch.decode_args, backend="torch", window_size=(2, -1))
    assert torch.equal(a, b)


# ---- split-KV planning ----------------------------------------------------------------------

def test_window_kv_tiles_counts_the_tiles_a_window_can_touch():
    assert window_kv_tiles(100, 16) == 7
    assert window_kv_tiles(100, 16, 0) == 1        # one key: one tile
    assert window_kv_tiles(100, 16, 15) == 2       # 16 keys starting mid-tile: two tiles
    assert window_kv_tiles(100, 16, 16) == 2
    assert window_kv_tiles(100, 16, 17) == 3
    assert window_kv_tiles(100, 16, 1000) == 7     # never more than the context's


def test_explain_plans_a_windowed_decode_for_the_window():
    full = explain_decode(1, 32, 8, 128, 131072, dtype=torch.bfloat16, device="cpu")
    windowed = explain_decode(1, 32, 8, 128, 131072, dtype=torch.bfloat16, device="cpu",
                              window_size=(4095, 0))
    # The heuristic counts split tiles: 32 tokens at head_size 128 in bf16.
    assert windowed.heuristic_kv_tiles == window_kv_tiles(131072, 32, 4095)
    assert windowed.heuristic_kv_tiles < full.heuristic_kv_tiles
    # Each of its splits reads no more tiles than a split of the full context does.
    assert (-(-windowed.heuristic_kv_tiles // windowed.num_splits)
            <= -(-full.heuristic_kv_tiles // full.num_splits))
    assert "window of 4096 keys" in str(windowed) and "window" not in str(full)
    with pytest.raises(ValueError, match="window_size"):
        explain_decode(1, 32, 8, 128, 1024, window_size=(-5, 0))


@pytest.mark.parametrize("num_seqs", [1, 4, 32])
@pytest.mark.parametrize("left", [0, 127, 1000, 5000])
def test_windowed_plans_fit_the_shared_workspace(num_seqs, left):
    """A windowed layer shares the step's workspace: its plan keeps within the splits that
    workspace holds, and never has more splits than the window has tiles."""
    for context in (512, 8192, 65536):
        for max_splits in (4, 16, 128):
            plan = plan_decode(num_seqs, 32, 8, 128, context, 16, torch.bfloat16, 132,
                               max_splits=max_splits, window_left=left)
            assert plan.num_splits <= max_splits
            assert plan.num_splits <= window_kv_tiles(context, 32, left)


# ---- GPU: bf16 at model shapes, and the launch cache ----------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 4])
@pytest.mark.parametrize("window, softcap, sinks", [
    ((255, -1), 0.0, False), ((-1, -1), 30.0, False), ((-1, -1), 0.0, True),
    ((100, 0), 50.0, True)])
def test_gpu_bf16_decode(num_splits, window, softcap, sinks):
    batch = make_decode_batch([1, 15, 16, 17, 300, 1000], num_q_heads=32, num_kv_heads=8,
                              head_size=128, block_size=16, dtype=torch.bfloat16, seed=20,
                              device="cuda")
    poison_left_of_windows(batch, window[0])
    sink = _sinks(32, sinks)
    out, lse = paged_decode(*batch.decode_args, return_lse=True, backend="triton",
                            num_splits=num_splits, window_size=window, softcap=softcap,
                            sinks=sink)
    ref_out, ref_lse = reference.paged_decode_gather(
        *batch.decode_args, scale=128 ** -0.5, window_size=window, softcap=softcap, sinks=sink)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("window, softcap, sinks", [
    ((255, -1), 0.0, False), ((-1, -1), 30.0, True), ((64, -1), 50.0, True)])
def test_gpu_bf16_prefill(window, softcap, sinks):
    batch = make_prefill_batch([1, 300, 37, 700], [0, 500, 16, 0], num_q_heads=32,
                               num_kv_heads=8, head_size=128, block_size=16,
                               dtype=torch.bfloat16, seed=21, device="cuda")
    poison_left_of_windows(batch, window[0])
    sink = _sinks(32, sinks)
    out, lse = paged_prefill(*batch.prefill_args, return_lse=True, backend="triton",
                             window_size=window, softcap=softcap, sinks=sink)
    ref_out, ref_lse = reference.paged_prefill_gather(
        *batch.prefill_args, causal=True, scale=128 ** -0.5, window_size=window,
        softcap=softcap, sinks=sink)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_gpu_launch_cache_keys_on_the_variant(op):
    """Same shapes, other options: each call gets its own launch, not the cached one."""
    make = make_decode_batch if op == "decode" else (
        lambda lens, **kw: make_prefill_batch([5] * len(lens), lens, **kw))
    batch = make([40, 90], num_q_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                 dtype=torch.float16, seed=22, device="cuda")
    run = paged_decode if op == "decode" else paged_prefill
    args = batch.decode_args if op == "decode" else batch.prefill_args
    ref = reference.paged_decode_gather if op == "decode" else functools.partial(
        reference.paged_prefill_gather, causal=True)
    sink = _sinks(8, True)
    variants = [dict(), dict(window_size=(7, -1)), dict(window_size=(7, 0)),
                dict(window_size=(9, -1)), dict(softcap=5.0), dict(softcap=6.0),
                dict(sinks=sink), dict(sinks=sink * 2), dict()]
    for variant in variants * 2:   # the second round runs from the launch cache
        out = run(*args, backend="triton", **variant)
        want, _ = ref(*args, scale=64 ** -0.5, **variant)
        torch.testing.assert_close(out.float(), want, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
def test_gpu_cuda_graph_replays_a_windowed_decode():
    """A windowed, soft-capped decode with sinks, captured once (split-KV, workspace given),
    replays correctly as the contexts move: each replay finds its own window's first tile."""
    batch = make_decode_batch([300, 5000, 17], num_q_heads=32, num_kv_heads=8, head_size=128,
                              block_size=16, dtype=torch.bfloat16, seed=23, device="cuda")
    q, kc, vc, bt, cl = batch.decode_args
    window, sink = (255, -1), _sinks(32, True)
    last = [300 - 10, 5000 - 70, 17 - 10]     # the shortest contexts replayed below
    poison_left_of_windows(dataclasses.replace(
        batch, context_lens=torch.tensor(last, dtype=torch.int32, device="cuda")), window[0])
    ws = torch.empty(workspace_size(3, 32, 128), dtype=torch.float32, device="cuda")
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")

    def step():
        _, lse_ = paged_decode(q, kc, vc, bt, cl, out=out, return_lse=True, workspace=ws,
                               window_size=window, softcap=30.0, sinks=sink)
        lse.copy_(lse_)

    graph, _ = capture(step)
    for trial in range(3):
        q.copy_(torch.randn_like(q))
        cl.copy_(torch.tensor([300 - 5 * trial, 5000 - 35 * trial, 17 - 5 * trial],
                              dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = reference.paged_decode_gather(
            q, kc, vc, bt, cl, scale=128 ** -0.5, window_size=window, softcap=30.0, sinks=sink)
        torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=2e-2)
