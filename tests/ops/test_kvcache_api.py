"""flash_attn_with_kvcache against a float64 reference written from FlashAttention's
definition: rotary at each row's cache position, the in-place append, attention over
``cache_seqlens - cache_leftpad + seqlen_new`` keys (bottom-right causal), on non-paged and
paged caches (shuffled blocks, NaN in every slot no row uses), both backends."""

from __future__ import annotations

import math

import pytest
import torch

from helpers.flash_reference import attend, rotate
from mini_paged_attn.ops.kvcache_api import flash_attn_with_kvcache

TOL = {torch.float32: dict(atol=3e-5, rtol=3e-5), torch.float16: dict(atol=3e-3, rtol=3e-3)}
BACKENDS = ["torch", "triton"]
NAN = float("nan")


def rotary_table(seqlen_ro, rotary_dim, dtype, gen):
    freqs = torch.rand(rotary_dim // 2, generator=gen) * 0.5 + 0.01
    angles = torch.arange(seqlen_ro)[:, None] * freqs[None, :]
    return torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)


def make_case(*, batch=3, batch_cache=None, seqlen_q=1, seqlen_new=1, heads=(4, 2), d=16,
              width=40, seqlens=(5, 0, 17), leftpad=None, dtype=torch.float32, seed=0,
              rotary_dim=None):
    """Dense logical caches ``[batch_cache, width, hk, d]`` (NaN past each row's tokens),
    q, the new k / v and a rotary table."""
    gen = torch.Generator().manual_seed(seed)
    batch_cache = batch_cache or batch
    hq, hk = heads
    k_cache = torch.randn(batch_cache, width, hk, d, generator=gen).to(dtype)
    v_cache = torch.randn(batch_cache, width, hk, d, generator=gen).to(dtype)
    q = torch.randn(batch, seqlen_q, hq, d, generator=gen).to(dtype)
    k = torch.randn(batch, seqlen_new, hk, d, generator=gen).to(dtype) if seqlen_new else None
    v = torch.randn(batch, seqlen_new, hk, d, generator=gen).to(dtype) if seqlen_new else None
    cos, sin = rotary_table(width, rotary_dim or d, dtype, gen)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cos=cos, sin=sin,
                seqlens=torch.tensor(seqlens, dtype=torch.int32),
                leftpad=None if leftpad is None else torch.tensor(leftpad, dtype=torch.int32))


def poison(cache, rows, ends, leftpad=None):
    """NaN in every slot of ``cache`` outside ``[leftpad, end)`` of the rows in use and in
    every row no batch row uses."""
    out = torch.full_like(cache, NAN)
    for b, (row, end) in enumerate(zip(rows.tolist(), ends.tolist())):
        start = 0 if leftpad is None else int(leftpad[b])
        out[row, start:end] = cache[row, start:end]
    return out


def reference(case, rows, *, causal, window=(-1, -1), softcap=0.0, scale=None, rotary=False,
              interleaved=True):
    """(out ``[batch, seqlen_q, hq, d]``, lse ``[batch, hq, seqlen_q]``, the caches after
    the append), float64 attention."""
    q, k, v = case["q"], case["k"], case["v"]
    k_cache, v_cache = case["k_cache"].clone(), case["v_cache"].clone()
    batch, seqlen_q = q.shape[:2]
    new = 0 if k is None else k.shape[1]
    outs, lses = [], []
    for b in range(batch):
        start = int(case["seqlens"][b])
        qb = q[b]
        if k is not None:
            kb = k[b]
            if rotary:
                local = causal or window != (-1, -1)
                pos_k = torch.arange(start, start + new)
                pos_q = torch.arange(start, start + seqlen_q) if local else \
                    torch.full((seqlen_q,), start)
                kb = rotate(kb, case["cos"][pos_k], case["sin"][pos_k], interleaved)
                qb = rotate(qb, case["cos"][pos_q], case["sin"][pos_q], interleaved)
            k_cache[rows[b], start:start + new] = kb
            v_cache[rows[b], start:start + new] = v[b]
        first = 0 if case["leftpad"] is None else int(case["leftpad"][b])
        keys = k_cache[rows[b], first:start + new]
        values = v_cache[rows[b], first:start + new]
        o, l = attend(qb, keys, values, scale=scale, causal=causal, window=window,
                      softcap=softcap)
        outs.append(o)
        lses.append(l)
    return torch.stack(outs), torch.stack(lses), k_cache, v_cache


def check(out, lse, want, want_lse, dtype):
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.is_contiguous()
    torch.testing.assert_close(out.float(), want.float(), **TOL[dtype])
    torch.testing.assert_close(lse, want_lse.float(), **TOL[dtype])


def same(a, b):
    """Equal, NaN included (the caches' unused slots must keep their NaN)."""
    torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True)


def check_cache(got, want, before):
    """``got`` equals ``before`` wherever ``want`` does (untouched slots, NaN included) and
    is close to ``want`` where the append wrote (rotary rounds differently in float64)."""
    kept = (want == before) | (want.isnan() & before.isnan())
    same(got[kept], before[kept])
    torch.testing.assert_close(got[~kept], want[~kept].to(got.dtype), **TOL[got.dtype])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, heads, interleaved", [
    (torch.float32, (4, 2), True), (torch.float16, (4, 1), False), (torch.float32, (2, 2), False)])
def test_decode_append_rotary_batch_idx(dtype, heads, interleaved, backend):
    # One query and one new token a row; rows 0, 3, 1 of a 4-row cache; lengths 0, 15, 16.
    case = make_case(batch=3, batch_cache=4, heads=heads, seqlens=(15, 0, 16), width=24,
                     dtype=dtype, seed=1)
    rows = torch.tensor([0, 3, 1], dtype=torch.int32)
    ends = case["seqlens"] + 1
    for name in ("k_cache", "v_cache"):
        case[name] = poison(case[name], rows, case["seqlens"])
    want, want_lse, want_k, want_v = reference(case, rows, causal=True, rotary=True,
                                               interleaved=interleaved)
    k_cache, v_cache = case["k_cache"].clone(), case["v_cache"].clone()
    out, lse = flash_attn_with_kvcache(
        case["q"], k_cache, v_cache, case["k"], case["v"], case["cos"], case["sin"],
        cache_seqlens=case["seqlens"], cache_batch_idx=rows, causal=True,
        rotary_interleaved=interleaved, return_softmax_lse=True, backend=backend)
    assert out.shape == case["q"].shape and lse.shape == (3, heads[0], 1)
    check(out, lse, want, want_lse, dtype)
    # The new token written, every other slot untouched (NaN too).
    check_cache(k_cache, want_k, case["k_cache"])
    check_cache(v_cache, want_v, case["v_cache"])
    assert not torch.isnan(out).any() and bool(ends.min() > 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal, window, interleaved", [
    (True, (-1, -1), True), (False, (-1, -1), False), (False, (4, 1), True)])
def test_several_queries_with_leftpad(causal, window, interleaved, backend):
    # Three queries and three new tokens a row; keys start at cache_leftpad.
    case = make_case(batch=3, seqlen_q=3, seqlen_new=3, heads=(6, 2), seqlens=(9, 2, 14),
                     leftpad=(4, 0, 13), width=20, seed=2, rotary_dim=8)
    rows = torch.arange(3, dtype=torch.int32)
    for name in ("k_cache", "v_cache"):
        case[name] = poison(case[name], rows, case["seqlens"], case["leftpad"])
    want, want_lse, want_k, want_v = reference(case, rows, causal=causal, window=window,
                                               rotary=True, interleaved=interleaved,
                                               softcap=3.0, scale=0.3)
    k_cache, v_cache = case["k_cache"].clone(), case["v_cache"].clone()
    out, lse = flash_attn_with_kvcache(
        case["q"], k_cache, v_cache, case["k"], case["v"], case["cos"], case["sin"],
        cache_seqlens=case["seqlens"], cache_leftpad=case["leftpad"], softmax_scale=0.3,
        causal=causal, window_size=window, softcap=3.0, rotary_interleaved=interleaved,
        return_softmax_lse=True, backend=backend)
    check(out, lse, want, want_lse, torch.float32)
    check_cache(k_cache, want_k, case["k_cache"])
    check_cache(v_cache, want_v, case["v_cache"])


def to_pages(cache, page, gen, spare=3):
    """A dense ``[batch, width, hk, d]`` cache as shuffled pages ``[num_blocks, page, hk,
    d]`` and its block table; the spare blocks hold NaN."""
    batch, width = cache.shape[:2]
    per_row = math.ceil(width / page)
    num_blocks = batch * per_row + spare
    pool = torch.full((num_blocks, page, *cache.shape[2:]), NAN, dtype=cache.dtype)
    perm = torch.randperm(num_blocks, generator=gen)[:batch * per_row].view(batch, per_row)
    padded = torch.full((batch, per_row * page, *cache.shape[2:]), NAN, dtype=cache.dtype)
    padded[:, :width] = cache
    pool[perm.flatten()] = padded.view(batch * per_row, page, *cache.shape[2:])
    return pool, perm.to(torch.int32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seqlen_q, dtype", [(1, torch.float16), (2, torch.float32)])
def test_paged_cache_append(seqlen_q, dtype, backend):
    # Pages of 16; rows end at a page - 1, a page, a page + 1 after the append.
    page, new = 16, 2
    case = make_case(batch=3, seqlen_q=seqlen_q, seqlen_new=new, heads=(4, 2), width=48,
                     seqlens=(13, 14, 15), dtype=dtype, seed=3)
    rows = torch.arange(3, dtype=torch.int32)
    for name in ("k_cache", "v_cache"):
        case[name] = poison(case[name], rows, case["seqlens"])
    interleaved = seqlen_q == 1
    want, want_lse, want_k, want_v = reference(case, rows, causal=True, rotary=True,
                                               interleaved=interleaved)
    # One seed for all four: the same shuffled blocks.
    (k_pool, table), (v_pool, _), (want_k_pool, _), (want_v_pool, _) = (
        to_pages(c, page, torch.Generator().manual_seed(7))
        for c in (case["k_cache"], case["v_cache"], want_k, want_v))
    before = k_pool.clone()
    out, lse = flash_attn_with_kvcache(
        case["q"], k_pool, v_pool, case["k"], case["v"], case["cos"], case["sin"],
        cache_seqlens=case["seqlens"], block_table=table, causal=True,
        rotary_interleaved=interleaved, return_softmax_lse=True, backend=backend)
    check(out, lse, want, want_lse, dtype)
    check_cache(k_pool, want_k_pool, before)
    same(v_pool, want_v_pool)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_new_tokens_and_full_cache(backend):
    # No k / v: attention over the cache as it is; cache_seqlens an int, then None (full).
    case = make_case(batch=2, seqlen_q=2, seqlen_new=0, seqlens=(6, 6), width=6, seed=4)
    rows = torch.arange(2)
    want, want_lse, _, _ = reference(case, rows, causal=False)
    for seqlens in (6, None):
        out, lse = flash_attn_with_kvcache(case["q"], case["k_cache"], case["v_cache"],
                                           cache_seqlens=seqlens, return_softmax_lse=True,
                                           backend=backend)
        check(out, lse, want, want_lse, torch.float32)


def test_num_splits_one_and_heuristic_agree():
    case = make_case(batch=2, seqlen_new=0, seqlens=(37, 20), width=40, seed=5)
    outs = [flash_attn_with_kvcache(case["q"], case["k_cache"], case["v_cache"],
                                    cache_seqlens=case["seqlens"], num_splits=n,
                                    backend="triton") for n in (0, 1, 3)]
    want, _, _, _ = reference(case, torch.arange(2), causal=True)
    for out in outs:
        torch.testing.assert_close(out, want.float(), **TOL[torch.float32])


def _bad_calls(case):
    """(name in the message, keyword arguments) of calls that must fail before writing."""
    q, k, v = case["q"], case["k"], case["v"]
    return [
        ("q", dict(q=q[0])),
        ("k_cache", dict(k_cache=case["k_cache"].double())),
        ("v_cache", dict(v_cache=case["v_cache"][:, :-1])),
        ("k", dict(k=k[:, :, :1])),
        ("k", dict(k=k.to("meta"))),                       # another device
        ("v", dict(v=None)),
        ("cache_seqlens", dict(cache_seqlens=case["seqlens"].long())),
        ("cache_seqlens", dict(cache_seqlens=None)),
        ("cache_batch_idx", dict(cache_batch_idx=torch.zeros(2, dtype=torch.int32))),
        ("cache_leftpad", dict(cache_leftpad=torch.zeros(3))),
        ("rotary_sin", dict(rotary_cos=case["cos"])),
        ("rotary_cos", dict(rotary_cos=case["cos"][:4], rotary_sin=case["sin"][:4])),
        ("block_table", dict(block_table=torch.zeros(3, 2, dtype=torch.int64))),
        ("cache_batch_idx", dict(block_table=torch.zeros(3, 2, dtype=torch.int32),
                                 cache_batch_idx=torch.zeros(3, dtype=torch.int32))),
        ("window_size", dict(window_size=(-2, 0))),
        ("softcap", dict(softcap=-1.0)),
        ("num_splits", dict(num_splits=-1)),
        ("causal", dict(causal="yes")),
    ]


@pytest.mark.parametrize("index", range(18))
def test_bad_arguments_raise_before_anything_is_written(index):
    case = make_case(seqlens=(5, 0, 17), seed=6)
    name, bad = _bad_calls(case)[index]
    args = dict(q=case["q"], k_cache=case["k_cache"].clone(), v_cache=case["v_cache"].clone(),
                k=case["k"], v=case["v"], cache_seqlens=case["seqlens"], backend="triton")
    args.update(bad)
    before = (args["k_cache"].clone(), args["v_cache"].clone())
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        flash_attn_with_kvcache(**args)
    same(args["k_cache"], before[0])
    same(args["v_cache"], before[1])


@pytest.mark.parametrize("name, bad", [
    ("cache_seqlens", dict(cache_seqlens=torch.tensor([5, 0, 40], dtype=torch.int32))),
    ("cache_leftpad", dict(cache_leftpad=torch.tensor([6, 0, 0], dtype=torch.int32))),
    ("cache_batch_idx", dict(cache_batch_idx=torch.tensor([0, 1, 3], dtype=torch.int32))),
    ("cache_seqlens", dict(q=torch.zeros(3, 3, 4, 16))),   # 1 key for 3 queries in row 1
])
def test_torch_backend_checks_values_before_writing(name, bad):
    case = make_case(seqlens=(5, 0, 17), seed=6)
    args = dict(q=case["q"], k_cache=case["k_cache"].clone(), v_cache=case["v_cache"].clone(),
                k=case["k"], v=case["v"], cache_seqlens=case["seqlens"], backend="torch")
    args.update(bad)
    before = args["k_cache"].clone()
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        flash_attn_with_kvcache(**args)
    same(args["k_cache"], before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_inputs_are_copied(backend):
    case = make_case(seqlens=(5, 0, 17), seed=8)
    strided = {n: torch.stack([case[n], case[n]], dim=-1)[..., 0] for n in ("q", "k", "v")}
    assert strided["q"].stride(-1) == 2
    outs = []
    for inputs in (strided, case):
        k_cache, v_cache = case["k_cache"].clone(), case["v_cache"].clone()
        outs.append(flash_attn_with_kvcache(inputs["q"], k_cache, v_cache, inputs["k"],
                                            inputs["v"], cache_seqlens=case["seqlens"],
                                            causal=True, backend=backend))
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)


def test_alibi_raises_not_implemented():
    case = make_case(seed=0)
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        flash_attn_with_kvcache(case["q"], case["k_cache"], case["v_cache"],
                                cache_seqlens=3, alibi_slopes=torch.ones(4))
