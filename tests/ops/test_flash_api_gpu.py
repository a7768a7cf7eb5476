"""FlashAttention's drop-ins on a GPU in bf16: the varlen lse (the Hopper kernel's shapes
too), flash_attn_func, flash_attn_with_kvcache on non-paged and 256-token paged caches.

Run: ``pytest -m gpu tests/ops/test_flash_api_gpu.py`` on a CUDA machine (skipped without one).
"""

from __future__ import annotations

import pytest
import torch

from helpers.flash_reference import attend, attend_varlen, rotate
from mini_paged_attn.ops import (flash_attn_func, flash_attn_varlen_func,
                                 flash_attn_with_kvcache)

pytestmark = pytest.mark.gpu

BF16 = dict(atol=2e-2, rtol=2e-2)


def randn(*shape, gen):
    return torch.randn(*shape, generator=gen).to(torch.bfloat16).cuda()


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_lse_bf16(causal):
    # Head size 128 and prompts of 200+: the shapes the Hopper kernel takes on sm_90.
    gen = torch.Generator().manual_seed(0)
    q_lens, k_lens = [200, 1, 17, 300], [200, 300, 17, 300]
    cu_q = torch.tensor([0, 200, 201, 218, 518], dtype=torch.int32).cuda()
    cu_k = torch.tensor([0, 200, 500, 517, 817], dtype=torch.int32).cuda()
    q, k, v = randn(518, 8, 128, gen=gen), randn(817, 2, 128, gen=gen), randn(817, 2, 128, gen=gen)
    out, lse, s_dmask = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens),
                                               causal=causal, return_attn_probs=True)
    want, want_lse = attend_varlen(q.cpu(), k.cpu(), v.cpu(), cu_q.cpu(), cu_k.cpu(),
                                   causal=causal)
    assert s_dmask is None and lse.shape == (8, 518) and lse.is_contiguous()
    torch.testing.assert_close(out.float().cpu(), want.float(), **BF16)
    torch.testing.assert_close(lse.cpu(), want_lse.float(), atol=1e-2, rtol=1e-3)


def test_flash_attn_func_bf16():
    gen = torch.Generator().manual_seed(1)
    q, k, v = randn(2, 129, 8, 64, gen=gen), randn(2, 257, 2, 64, gen=gen), randn(2, 257, 2, 64, gen=gen)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    for b in range(2):
        want, want_lse = attend(q[b].cpu(), k[b].cpu(), v[b].cpu(), causal=True)
        torch.testing.assert_close(out[b].float().cpu(), want.float(), **BF16)
        torch.testing.assert_close(lse[b].cpu(), want_lse.float(), atol=1e-2, rtol=1e-3)


@pytest.mark.parametrize("paged, seqlen_q, num_splits", [
    (False, 1, 0), (False, 1, 1), (False, 4, 0), (True, 1, 0), (True, 3, 0)])
def test_kvcache_bf16(paged, seqlen_q, num_splits):
    gen = torch.Generator().manual_seed(2)
    batch, width, hk, d, page = 3, 1024, 2, 128, 256
    lens = torch.tensor([255, 0, 700], dtype=torch.int32)
    k_cache, v_cache = randn(batch, width, hk, d, gen=gen), randn(batch, width, hk, d, gen=gen)
    q = randn(batch, seqlen_q, 8, d, gen=gen)
    k_new, v_new = randn(batch, seqlen_q, hk, d, gen=gen), randn(batch, seqlen_q, hk, d, gen=gen)
    freqs = torch.rand(32, generator=gen) * 0.5
    angles = torch.arange(width)[:, None] * freqs[None, :]
    cos, sin = torch.cos(angles).to(torch.bfloat16).cuda(), torch.sin(angles).to(torch.bfloat16).cuda()
    # The reference on the host, before the call writes into the caches.
    wants = []
    for b in range(batch):
        start = int(lens[b])
        pos = torch.arange(start, start + seqlen_q)
        kb = rotate(k_new[b].cpu(), cos.cpu()[pos], sin.cpu()[pos], False)
        qb = rotate(q[b].cpu(), cos.cpu()[pos], sin.cpu()[pos], False)
        keys = torch.cat([k_cache[b, :start].cpu(), kb])
        values = torch.cat([v_cache[b, :start].cpu(), v_new[b].cpu()])
        wants.append(attend(qb, keys, values, causal=True))
    args = dict(cache_seqlens=lens.cuda(), causal=True, rotary_interleaved=False,
                num_splits=num_splits, return_softmax_lse=True)
    if paged:
        perm = torch.randperm(batch * width // page, generator=gen).cuda()
        k_pool = torch.empty_like(k_cache.view(-1, page, hk, d))
        v_pool = torch.empty_like(k_pool)
        k_pool[perm] = k_cache.reshape(-1, page, hk, d)
        v_pool[perm] = v_cache.reshape(-1, page, hk, d)
        table = perm.view(batch, -1).to(torch.int32)
        out, lse = flash_attn_with_kvcache(q, k_pool, v_pool, k_new, v_new, cos, sin,
                                           block_table=table, **args)
        written = k_pool[perm].view(batch, width, hk, d)
    else:
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cos, sin, **args)
        written = k_cache
    for b, (want, want_lse) in enumerate(wants):
        torch.testing.assert_close(out[b].float().cpu(), want.float(), **BF16)
        torch.testing.assert_close(lse[b].cpu(), want_lse.float(), atol=2e-2, rtol=1e-2)
        start = int(lens[b])
        assert not torch.isnan(written[b, start:start + seqlen_q]).any()
