"""Partial rotary (Phi-3 / Phi-4-mini's ``partial_rotary_factor``): ``apply_rotary`` with a
cos/sin table narrower than the head rotates the first ``rotary_dim`` dims of every head and
passes the rest through, in the torch reference and in the Triton kernel (q/k norm and the fused
K/V write included).

The reference is checked against transformers' Phi-3 ``apply_rotary_pos_emb``; the kernel (the
interpreter on CPU, fp32 / fp16) against the reference, with rotary_dim = head_size, 3/4 and 1/2
of it, on strided qkv views whose v part and unused cache slots are NaN-poisoned. The ``gpu``
tests repeat it in bf16 at Phi-4-mini's shape.
"""

from __future__ import annotations

import pytest
import torch

from mini_paged_attn.ops.dispatch import store_kv
from mini_paged_attn.ops.fused import (KVWrite, apply_rotary, apply_rotary_reference,
                                       rms_norm_reference)

# Kernel vs reference: an ulp or two of the dtype (see tests/ops/test_fused_layers.py).
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}
FRACTIONS = (1.0, 0.75, 0.5)
BLOCK_SIZE = 4
NUM_BLOCKS = 7


def _table(max_positions: int, rotary_dim: int, dtype, device="cpu") -> torch.Tensor:
    """``[max_positions, rotary_dim]``: cosines then sines of the rotary_dim / 2 pair angles
    (the frequencies over rotary_dim, as transformers computes them for a partial rotary)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    angles = torch.outer(torch.arange(max_positions).float(), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(device, dtype)


def _qkv(n, hq, hkv, d, dtype, gen, device="cpu"):
    """q, k, v: strided views of one ``[n, hq + 2 hkv, d]`` qkv output, as the model splits it."""
    qkv = (2 * torch.randn(n, hq + 2 * hkv, d, generator=gen)).to(device, dtype)
    return qkv.split([hq, hkv, hkv], dim=1)


def _norm(d, dtype, gen, device="cpu"):
    return ((torch.rand(d, generator=gen) + 0.5).to(device, dtype),
            (torch.rand(d, generator=gen) + 0.5).to(device, dtype), 1e-6)


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("norm", [False, True])
def test_reference_is_transformers_phi3_rotary(fraction, norm):
    """Bit for bit transformers' ``apply_rotary_pos_emb`` (rotate_half on the first rotary_dim
    dims, the rest concatenated back), after the per-head norm when there is one."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(int(fraction * 100) + norm)
    n, hq, hkv, d = 7, 4, 2, 64
    rotary_dim = int(d * fraction)
    q, k, _ = _qkv(n, hq, hkv, d, torch.float32, gen)
    table = _table(50, rotary_dim, torch.float32)
    positions = torch.randint(0, 50, (n,), generator=gen)
    qk_norm = _norm(d, torch.float32, gen) if norm else None
    got_q, got_k = apply_rotary_reference(q, k, positions, table, qk_norm)
    if norm:
        q, k = rms_norm_reference(q, qk_norm[0], 1e-6), rms_norm_reference(k, qk_norm[1], 1e-6)
    cos, sin = table[positions].chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]
    # transformers' layout: [batch, heads, tokens, head_size]
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                          cos, sin)
    assert torch.equal(got_q, want_q[0].transpose(0, 1))
    assert torch.equal(got_k, want_k[0].transpose(0, 1))
    if fraction < 1:     # the pass-through dims are the (normed) input's, untouched
        assert torch.equal(got_q[..., rotary_dim:], q[..., rotary_dim:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("n, hq, hkv, d, norm", [(1, 4, 2, 64, False), (9, 3, 1, 96, True),
                                                   (5, 2, 2, 128, False)])
def test_triton_matches_reference(dtype, fraction, n, hq, hkv, d, norm):
    gen = torch.Generator().manual_seed(n * d + int(fraction * 8))
    rotary_dim = int(d * fraction)
    q, k, v = _qkv(n, hq, hkv, d, dtype, gen)
    v.fill_(float("nan"))
    before = q.clone(), k.clone()
    table = _table(100, rotary_dim, dtype)
    positions = torch.randint(0, 100, (n,), generator=gen)
    qk_norm = _norm(d, dtype, gen) if norm else None
    ref = apply_rotary(q, k, positions, table, qk_norm=qk_norm, backend="torch")
    got = apply_rotary(q, k, positions, table, qk_norm=qk_norm, backend="triton")
    for g, r, src in zip(got, ref, (q, k)):
        assert g.shape == src.shape and g.dtype == dtype and g.is_contiguous()
        assert not g.isnan().any()
        torch.testing.assert_close(g, r, **TOL[dtype])
        if not norm:       # pass-through dims are copied, not recomputed
            assert torch.equal(g[..., rotary_dim:], src[..., rotary_dim:])
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, NaN-poisoned (never written) slots included."""
    return torch.equal(torch.nan_to_num(a, nan=7.0), torch.nan_to_num(b, nan=7.0))


def _store_inputs(n, hq, hkv, d, dtype, gen, device="cpu", num_blocks=NUM_BLOCKS):
    """q, k, v views, distinct shuffled slots (the last row padding, -1) and NaN caches of
    ``num_blocks`` blocks (> n / BLOCK_SIZE)."""
    q, k, v = _qkv(n, hq, hkv, d, dtype, gen, device)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:n].to(device)
    slots[-1] = -1                                   # a padding row writes nothing
    caches = [torch.full((num_blocks, BLOCK_SIZE, hkv, d), float("nan"), dtype=dtype,
                         device=device) for _ in range(2)]
    return q, k, v, slots, caches


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("norm", [False, True])
def test_fused_kv_write_equals_store_kv_of_the_rotated_keys(backend, dtype, fraction, norm):
    """The whole head of k (rotated dims and pass-through) and of v reaches the cache."""
    gen = torch.Generator().manual_seed(int(fraction * 10) + 2 * norm)
    n, hq, hkv, d = 6, 4, 2, 96
    rotary_dim = int(d * fraction)
    q, k, v, slots, caches = _store_inputs(n, hq, hkv, d, dtype, gen)
    table = _table(40, rotary_dim, dtype)
    positions = torch.randint(0, 40, (n,), generator=gen)
    qk_norm = _norm(d, dtype, gen) if norm else None
    want_caches = [c.clone() for c in caches]
    want = apply_rotary(q, k, positions, table, qk_norm=qk_norm, backend=backend)
    store_kv(want[1], v, *want_caches, slots, backend=backend)
    got = apply_rotary(q, k, positions, table, qk_norm=qk_norm, backend=backend,
                       store=KVWrite(v, *caches, slots))
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    for c, w in zip(caches, want_caches):
        assert _same(c, w)
    written = slots[slots >= 0]
    for c in caches:
        flat = c.view(-1, hkv, d)
        assert not flat[written].isnan().any()
        assert int(flat.isnan().all(-1).all(-1).sum()) == NUM_BLOCKS * BLOCK_SIZE - len(written)


def test_bad_tables_are_refused_naming_cos_sin_cache():
    q, k, pos = torch.randn(3, 4, 64), torch.randn(3, 2, 64), torch.arange(3)
    for width in (66, 31, 0):           # wider than the head, odd, empty
        with pytest.raises(ValueError, match="^cos_sin_cache: expected shape"):
            apply_rotary(q, k, pos, torch.randn(10, width))


# ---- GPU: bf16 at Phi-4-mini's shape (24 q heads, 8 kv heads, head 128, 96 rotated) ------------

@pytest.mark.gpu
@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("n", [1, 37, 256])
def test_gpu_bf16_matches_reference(fraction, norm, n):
    dtype, hq, hkv, d = torch.bfloat16, 24, 8, 128
    gen = torch.Generator().manual_seed(n + int(fraction * 4))
    rotary_dim = int(d * fraction)
    q, k, v, slots, caches = _store_inputs(n, hq, hkv, d, dtype, gen, device="cuda",
                                           num_blocks=n // BLOCK_SIZE + 3)
    table = _table(4096, rotary_dim, dtype, device="cuda")
    positions = torch.randint(0, 4096, (n,), generator=gen).cuda()
    qk_norm = _norm(d, dtype, gen, device="cuda") if norm else None
    ref = apply_rotary(q, k, positions, table, qk_norm=qk_norm, backend="torch")
    want_caches = [c.clone() for c in caches]
    store_kv(ref[1], v, *want_caches, slots, backend="torch")
    got = apply_rotary(q, k, positions, table, qk_norm=qk_norm, backend="triton",
                       store=KVWrite(v, *caches, slots))
    for g, r, src in zip(got, ref, (q, k)):
        # FMA contraction on the GPU: up to two ulps of the largest input where the products
        # cancel (see test_fused_layers.test_gpu_real_shapes), the relative bound elsewhere.
        atol = 2 * torch.finfo(dtype).eps * src.float().abs().max().item()
        torch.testing.assert_close(g, r, atol=atol, rtol=1.6e-2)
        if not norm:
            assert torch.equal(g[..., rotary_dim:], src[..., rotary_dim:])
    # The cache holds exactly the kernel's own rotated keys (and the values), whole heads.
    exact = [c.clone() for c in caches]
    store_kv(got[1], v, *exact, slots, backend="torch")
    for c, e, w in zip(caches, exact, want_caches):
        assert _same(c, e)
        assert c.isnan().sum() == w.isnan().sum()
