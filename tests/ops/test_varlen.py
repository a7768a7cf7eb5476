"""flash_attn_varlen_func: FlashAttention's varlen API on contiguous and paged K/V (torch path)."""

from __future__ import annotations

import pathlib
import runpy

import pytest
import torch
import torch.nn.functional as F

from helpers.paged_batch import paginate
from mini_paged_attn import flash_attn_varlen_func

SEED_SCRIPT = pathlib.Path(__file__).with_name("seed003_varlen_script.py")
OUT_TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=1e-3, rtol=1e-3),
           torch.bfloat16: dict(atol=8e-3, rtol=8e-3)}


def cumulative(lens):
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()],
                        dtype=torch.int32)


def make_varlen(q_lens, k_lens, *, heads=(8, 2), head_size=16, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    q = torch.randn(sum(q_lens), hq, head_size, generator=gen).to(dtype)
    k = torch.randn(sum(k_lens), hkv, head_size, generator=gen).to(dtype)
    v = torch.randn(sum(k_lens), hkv, head_size, generator=gen).to(dtype)
    return q, k, v, cumulative(q_lens), cumulative(k_lens)


def dense(q, k, v, q_lens, k_lens, *, causal, scale):
    """float64 SDPA per sequence; causal aligned bottom-right; rows with no key give 0."""
    outs, qs, ks = [], 0, 0
    group = q.shape[1] // k.shape[1]
    for lq, lk in zip(q_lens, k_lens):
        qi = q[qs:qs + lq].double().transpose(0, 1)
        ki = k[ks:ks + lk].double().repeat_interleave(group, dim=1).transpose(0, 1)
        vi = v[ks:ks + lk].double().repeat_interleave(group, dim=1).transpose(0, 1)
        t, p = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
        mask = (p <= lk - lq + t) if causal else torch.ones(lq, lk, dtype=torch.bool)
        out = torch.zeros(lq, q.shape[1], q.shape[2], dtype=torch.float64)
        seen = mask.any(dim=1)
        if seen.any():
            o = F.scaled_dot_product_attention(qi[:, seen], ki, vi, attn_mask=mask[seen],
                                               scale=scale)
            out[seen] = o.transpose(0, 1)
        outs.append(out)
        qs, ks = qs + lq, ks + lk
    return torch.cat(outs).float()


# (q_len, k_len): equal (a prompt), q shorter (chunk on a prefix, decode), q longer (rows that see
# no key under causal), empty q, empty k.
MIX = [(5, 5), (3, 11), (1, 17), (9, 4), (0, 6), (2, 0), (16, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (10, 2)])
def test_contiguous_matches_dense(heads, causal, dtype):
    q_lens, k_lens = zip(*MIX)
    q, k, v, cu_q, cu_k = make_varlen(q_lens, k_lens, heads=heads, dtype=dtype, seed=heads[0])
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens),
                                 softmax_scale=0.3, causal=causal, backend="torch")
    assert out.shape == q.shape and out.dtype == dtype
    want = dense(q, k, v, q_lens, k_lens, causal=causal, scale=0.3)
    torch.testing.assert_close(out.float(), want, **OUT_TOL[dtype])
    if causal:  # sequence (9, 4): its first 5 rows see no key and are exactly 0
        start = sum(q_lens[:3])
        assert torch.equal(out[start:start + 5], torch.zeros_like(out[start:start + 5]))


def test_default_scale_and_all_positional_arguments():
    q_lens, k_lens = [4, 7], [4, 9]
    q, k, v, cu_q, cu_k = make_varlen(q_lens, k_lens, head_size=16)
    # FlashAttention's positional order: ..., dropout_p, softmax_scale, causal, window_size,
    # softcap, alibi_slopes, deterministic, return_attn_probs, block_table.
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 9, 0.0, None, True, (-1, -1), 0.0, None,
                                 True, False, None)
    want = dense(q, k, v, q_lens, k_lens, causal=True, scale=16 ** -0.5)
    torch.testing.assert_close(out, want, **OUT_TOL[torch.float32])


def test_strided_last_dim_is_copied_like_flash_attention():
    q_lens, k_lens = [4, 2], [6, 2]
    q, k, v, cu_q, cu_k = make_varlen(q_lens, k_lens)
    strided = [torch.stack([x, x], dim=-1)[..., 0] for x in (q, k, v)]  # stride 2 in head_size
    assert all(x.stride(-1) == 2 for x in strided)
    out = flash_attn_varlen_func(*strided, cu_q, cu_k, 4, 6, causal=True, backend="torch")
    want = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 6, causal=True, backend="torch")
    assert torch.equal(out, want)


def to_paged(k, v, k_lens, block_size, seed=0):
    """Contiguous varlen K/V -> shuffled paged caches (NaN elsewhere) and a block table."""
    return paginate(list(k.split(k_lens)), list(v.split(k_lens)), block_size,
                    head_shape=tuple(k.shape[1:]), dtype=k.dtype,
                    gen=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block_size", [1, 16])
def test_paged_kv_matches_contiguous(block_size, causal):
    # Paged K/V runs paged_prefill: the queries are the last q_len of each sequence's keys.
    q_lens, k_lens = [5, 1, 0, 17, 3], [5, 20, 4, 17, 33]
    q, k, v, cu_q, cu_k = make_varlen(q_lens, k_lens, heads=(10, 2), dtype=torch.float16)
    key_cache, value_cache, table = to_paged(k, v, k_lens, block_size)
    paged = flash_attn_varlen_func(q, key_cache, value_cache, cu_q, cu_k, 17, 33, causal=causal,
                                   block_table=table, backend="torch")
    contiguous = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 33, causal=causal,
                                        backend="torch")
    assert paged.dtype == torch.float16
    torch.testing.assert_close(paged, contiguous, atol=1e-3, rtol=1e-3)


def test_seed_003_script_passes(capsys):
    """Seed 003's own test script, with only the changes its header lists."""
    runpy.run_path(str(SEED_SCRIPT), run_name="__main__")  # asserts inside; raises on mismatch
    assert "测试通过" in capsys.readouterr().out


@pytest.mark.parametrize("option, kwargs", [
    ("dropout_p", dict(dropout_p=0.1)),
    ("alibi_slopes", dict(alibi_slopes=torch.ones(8))),
])
def test_unimplemented_options_raise_naming_the_option(option, kwargs):
    q, k, v, cu_q, cu_k = make_varlen([3], [3])
    with pytest.raises(NotImplementedError, match=option):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, **kwargs)


def test_bad_arguments_raise_value_error_naming_them():
    q, k, v, cu_q, cu_k = make_varlen([3, 4], [5, 4])
    good = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=4,
                max_seqlen_k=5)
    bad = [
        ("cu_seqlens_k", dict(cu_seqlens_k=cu_k.long())),
        ("cu_seqlens_q", dict(cu_seqlens_q=cu_q.long())),
        ("cu_seqlens_k", dict(cu_seqlens_k=cu_k[:2])),
        ("cu_seqlens_q", dict(cu_seqlens_q=torch.tensor([0, 4, 3], dtype=torch.int32))),
        ("cu_seqlens_q", dict(cu_seqlens_q=torch.tensor([0, 3, 6], dtype=torch.int32))),
        ("cu_seqlens_k", dict(cu_seqlens_k=torch.tensor([0, 5, 10], dtype=torch.int32))),
        ("max_seqlen_q", dict(max_seqlen_q=3)),
        ("max_seqlen_k", dict(max_seqlen_k=4)),
        ("max_seqlen_k", dict(max_seqlen_k=-1)),
        ("q", dict(q=q[:, :7])),  # 7 query heads over 2 kv heads
        ("k", dict(k=k[..., :8], v=v[..., :8])),
        ("v", dict(v=v[:3])),
        ("v", dict(v=v.half())),
        ("q", dict(q=q[0])),
        ("softmax_scale", dict(softmax_scale=-1.0)),
        ("causal", dict(causal=1)),
        ("dropout_p", dict(dropout_p=-0.5)),
        ("backend", dict(backend="cuda")),
    ]
    flash_attn_varlen_func(**good)  # the unchanged call works
    for name, change in bad:
        with pytest.raises(ValueError, match=f"^{name}:"):
            flash_attn_varlen_func(**{**good, **change})
