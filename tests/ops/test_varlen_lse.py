"""flash_attn_varlen_func(return_attn_probs=True): (out, softmax_lse, None), FlashAttention's
varlen layout of the lse, on contiguous and paged K/V and both backends."""

from __future__ import annotations

import pytest
import torch

from helpers.flash_reference import attend_varlen
from helpers.paged_batch import paginate
from mini_paged_attn import flash_attn_varlen_func

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}
BACKENDS = ["torch", "triton"]
# (q_len, k_len): a prompt, a chunk over a prefix, a decode row, q longer than k (causal rows
# that see no key), no query, no key, a page +- 1 (pages of 16).
MIX = [(5, 5), (3, 11), (1, 17), (9, 4), (0, 6), (2, 0), (15, 15), (1, 16), (17, 17)]


def cumulative(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def make(mix, heads, dtype, seed, head_size=16):
    gen = torch.Generator().manual_seed(seed)
    q_lens, k_lens = zip(*mix)
    q = torch.randn(sum(q_lens), heads[0], head_size, generator=gen).to(dtype)
    k = torch.randn(sum(k_lens), heads[1], head_size, generator=gen).to(dtype)
    v = torch.randn(sum(k_lens), heads[1], head_size, generator=gen).to(dtype)
    return q, k, v, cumulative(q_lens), cumulative(k_lens), list(q_lens), list(k_lens)


def check_lse(lse, want_lse, tol):
    assert lse.dtype == torch.float32 and lse.is_contiguous()
    assert lse.shape == want_lse.shape
    empty = torch.isinf(want_lse)
    assert torch.equal(lse[empty], want_lse[empty].float())   # -inf: log 0
    torch.testing.assert_close(lse[~empty], want_lse[~empty].float(), **tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads, causal, dtype", [
    ((4, 4), True, torch.float32), ((6, 2), False, torch.float32),
    ((4, 1), True, torch.float16), ((6, 2), True, torch.float16)])
def test_contiguous_lse_matches_reference(heads, causal, dtype, backend):
    q, k, v, cu_q, cu_k, q_lens, k_lens = make(MIX, heads, dtype, seed=heads[0])
    result = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens),
                                    softmax_scale=0.4, causal=causal, return_attn_probs=True,
                                    backend=backend)
    assert isinstance(result, tuple) and len(result) == 3
    out, lse, s_dmask = result
    assert s_dmask is None          # FlashAttention returns S_dmask only under dropout
    want, want_lse = attend_varlen(q, k, v, cu_q, cu_k, scale=0.4, causal=causal)
    assert lse.shape == (heads[0], q.shape[0])
    torch.testing.assert_close(out.float(), want.float(), **TOL[dtype])
    check_lse(lse, want_lse, TOL[torch.float32])
    # The default call's out is the same as the lse call's.
    plain = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens),
                                   softmax_scale=0.4, causal=causal, backend=backend)
    torch.testing.assert_close(plain, out, atol=0, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lse_with_window_and_softcap(backend):
    q, k, v, cu_q, cu_k, q_lens, k_lens = make(MIX, (4, 2), torch.float32, seed=3)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 17, causal=True,
                                         window_size=(3, 0), softcap=2.0,
                                         return_attn_probs=True, backend=backend)
    want, want_lse = attend_varlen(q, k, v, cu_q, cu_k, causal=True, window=(3, 0),
                                   softcap=2.0)
    torch.testing.assert_close(out, want.float(), **TOL[torch.float32])
    check_lse(lse, want_lse, TOL[torch.float32])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [1, 16])
def test_paged_lse_matches_reference(block_size, backend):
    # Paged K/V: the queries are the last q_len of each sequence's keys (q_len <= k_len).
    mix = [(5, 5), (1, 20), (0, 4), (15, 17), (3, 33), (1, 16)]
    q, k, v, cu_q, cu_k, q_lens, k_lens = make(mix, (6, 2), torch.float16, seed=5)
    key_cache, value_cache, table = paginate(
        list(k.split(k_lens)), list(v.split(k_lens)), block_size, head_shape=(2, 16),
        dtype=torch.float16, gen=torch.Generator().manual_seed(1))
    out, lse, s_dmask = flash_attn_varlen_func(
        q, key_cache, value_cache, cu_q, cu_k, 15, 33, causal=True, block_table=table,
        return_attn_probs=True, backend=backend)
    assert s_dmask is None
    want, want_lse = attend_varlen(q, k, v, cu_q, cu_k, causal=True)
    torch.testing.assert_close(out.float(), want.float(), **TOL[torch.float16])
    check_lse(lse, want_lse, TOL[torch.float32])


def test_return_attn_probs_must_be_a_bool():
    q, k, v, cu_q, cu_k, _, _ = make([(3, 3)], (2, 2), torch.float32, seed=0)
    with pytest.raises(ValueError, match="return_attn_probs"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, return_attn_probs="yes")
