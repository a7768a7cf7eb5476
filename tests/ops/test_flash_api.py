"""FlashAttention's batched and packed functions (ops/flash_api.py) against a float64
reference written from the definition, both backends."""

from __future__ import annotations

import pytest
import torch

from helpers.flash_reference import attend, attend_varlen
from mini_paged_attn.ops.flash_api import (flash_attn_func, flash_attn_kvpacked_func,
                                           flash_attn_qkvpacked_func,
                                           flash_attn_varlen_kvpacked_func,
                                           flash_attn_varlen_qkvpacked_func)

TOL = {torch.float32: dict(atol=3e-5, rtol=3e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}
BACKENDS = ["torch", "triton"]


def randn(*shape, dtype=torch.float32, gen):
    return torch.randn(*shape, generator=gen).to(dtype)


def batched_reference(q, k, v, **options):
    """Per batch row: out ``[b, sq, h, d]``, lse ``[b, h, sq]`` (float64)."""
    pairs = [attend(q[b], k[b], v[b], **options) for b in range(q.shape[0])]
    return torch.stack([o for o, _ in pairs]), torch.stack([l for _, l in pairs])


def check(out, lse, want, want_lse, dtype):
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.is_contiguous()
    torch.testing.assert_close(out.float(), want.float(), **TOL[dtype])
    seen = ~torch.isinf(want_lse)
    assert torch.equal(lse[~seen], want_lse[~seen].float())
    torch.testing.assert_close(lse[seen], want_lse[seen].float(), **TOL[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sq, sk, heads, causal, dtype", [
    (17, 17, (4, 2), True, torch.float32),      # a prompt, page + 1
    (1, 15, (4, 1), True, torch.float16),       # one query (MQA)
    (5, 3, (2, 2), True, torch.float32),        # q longer: rows that see no key
    (16, 9, (6, 2), False, torch.float16),
])
def test_flash_attn_func_matches_reference(sq, sk, heads, causal, dtype, backend):
    gen = torch.Generator().manual_seed(sq * 31 + sk)
    q = randn(2, sq, heads[0], 16, dtype=dtype, gen=gen)
    k, v = (randn(2, sk, heads[1], 16, dtype=dtype, gen=gen) for _ in range(2))
    out, lse, s_dmask = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True,
                                        backend=backend)
    assert s_dmask is None and out.shape == q.shape and lse.shape == (2, heads[0], sq)
    want, want_lse = batched_reference(q, k, v, causal=causal)
    check(out, lse, want, want_lse, dtype)
    plain = flash_attn_func(q, k, v, causal=causal, backend=backend)
    torch.testing.assert_close(plain, out, atol=0, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_batched_functions(backend):
    gen = torch.Generator().manual_seed(1)
    qkv = randn(2, 9, 3, 4, 16, gen=gen)
    out, lse, _ = flash_attn_qkvpacked_func(qkv, softmax_scale=0.5, causal=True,
                                            window_size=(3, 0), softcap=4.0,
                                            return_attn_probs=True, backend=backend)
    want, want_lse = batched_reference(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], scale=0.5,
                                       causal=True, window=(3, 0), softcap=4.0)
    check(out, lse, want, want_lse, torch.float32)
    q, kv = randn(2, 4, 6, 16, gen=gen), randn(2, 11, 2, 2, 16, gen=gen)
    out = flash_attn_kvpacked_func(q, kv, causal=True, backend=backend)
    want, _ = batched_reference(q, kv[:, :, 0], kv[:, :, 1], causal=True)
    torch.testing.assert_close(out, want.float(), **TOL[torch.float32])


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_varlen_functions(backend):
    gen = torch.Generator().manual_seed(2)
    lens = [1, 15, 17]
    cu = torch.tensor([0, 1, 16, 33], dtype=torch.int32)
    qkv = randn(33, 3, 4, 16, dtype=torch.float16, gen=gen)
    out, lse, _ = flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), causal=True,
                                                   return_attn_probs=True, backend=backend)
    want, want_lse = attend_varlen(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, cu, causal=True)
    assert lse.shape == (4, 33)
    torch.testing.assert_close(out.float(), want.float(), **TOL[torch.float16])
    torch.testing.assert_close(lse, want_lse.float(), **TOL[torch.float16])
    q = randn(6, 4, 16, dtype=torch.float16, gen=gen)
    kv = randn(33, 2, 2, 16, dtype=torch.float16, gen=gen)
    cu_q = torch.tensor([0, 1, 3, 6], dtype=torch.int32)
    out = flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu, 3, 17, causal=False,
                                          backend=backend)
    want, _ = attend_varlen(q, kv[:, 0], kv[:, 1], cu_q, cu)
    torch.testing.assert_close(out.float(), want.float(), **TOL[torch.float16])


def test_bad_arguments_name_the_argument():
    gen = torch.Generator().manual_seed(3)
    q, k = randn(2, 4, 4, 16, gen=gen), randn(2, 4, 2, 16, gen=gen)
    with pytest.raises(ValueError, match="^q: expected"):
        flash_attn_func(q[0], k, k)
    with pytest.raises(ValueError, match="^k: expected"):
        flash_attn_func(q, k[:1], k)
    with pytest.raises(ValueError, match="^v: expected"):
        flash_attn_func(q, k, k[:, :3])
    with pytest.raises(ValueError, match="^v: expected"):
        flash_attn_func(q, k, k.half())
    with pytest.raises(ValueError, match="^qkv: expected"):
        flash_attn_qkvpacked_func(randn(2, 4, 2, 4, 16, gen=gen))
    with pytest.raises(ValueError, match="^kv: expected"):
        flash_attn_varlen_kvpacked_func(q[0], randn(4, 3, 2, 16, gen=gen), None, None, 4, 4)


@pytest.mark.parametrize("option, kwargs", [
    ("dropout_p", dict(dropout_p=0.1)), ("alibi_slopes", dict(alibi_slopes=torch.ones(4)))])
def test_backward_only_options_raise_not_implemented(option, kwargs):
    gen = torch.Generator().manual_seed(4)
    qkv = randn(1, 3, 3, 4, 16, gen=gen)
    with pytest.raises(NotImplementedError, match=option):
        flash_attn_qkvpacked_func(qkv, **kwargs)
