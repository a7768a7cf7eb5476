"""The fused decoder ops (ops/fused.py): each Triton kernel against its torch reference.

On CPU the kernels run through the Triton interpreter (fp32 and fp16; bf16 is broken there);
the ``gpu`` tests repeat them natively in bf16 at real model shapes and under a CUDA graph.
The torch references themselves are checked against transformers in tests/models.
"""

from __future__ import annotations

import pytest
import torch
from helpers.cuda_graphs import capture
from helpers.tiny_models import tiny_model_factory  # noqa: F401  (the session fixture)

from mini_paged_attn.ops.fused import (apply_rotary, apply_rotary_reference, rms_norm,
                                       rms_norm_reference, silu_and_mul)

# The kernels differ from the reference only in the float32 sum order and the hardware's
# rsqrt/exp, so by an ulp of the dtype before the last rounding: two ulps at most (an fp16 ulp
# is <= 2**-10 relative, a bf16 ulp <= 2**-7).
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1e-3, rtol=1.6e-2)}
CPU_DTYPES = (torch.float32, torch.float16)


def _randn(*shape, dtype, gen, device="cpu", scale=1.0):
    return (scale * torch.randn(shape, generator=gen)).to(device, dtype)


def _qkv_views(n, hq, hkv, d, dtype, gen, device="cpu"):
    """q, k, v as the model splits them: strided views of one ``[n, hq + 2 hkv, d]`` qkv output.
    v is NaN-poisoned: the kernels must not read it."""
    qkv = _randn(n, hq + 2 * hkv, d, dtype=dtype, gen=gen, device=device, scale=2.0)
    qkv[:, hq + hkv:] = float("nan")
    return qkv.split([hq, hkv, hkv], dim=1)


def _both(fn, *args, **kwargs):
    return fn(*args, backend="torch", **kwargs), fn(*args, backend="triton", **kwargs)


# ---- rms_norm ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("n, dim", [(1, 896), (37, 1000), (37, 64), (1, 128)])
def test_rms_norm_matches_reference(dtype, n, dim):
    gen = torch.Generator().manual_seed(n * dim)
    x = _randn(n, dim, dtype=dtype, gen=gen, scale=3.0)
    weight = _randn(dim, dtype=dtype, gen=gen)
    ref, got = _both(rms_norm, x, weight, 1e-6)
    assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got, ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("n, dim", [(1, 896), (37, 1000)])
def test_fused_add_rms_norm_matches_reference(dtype, n, dim):
    gen = torch.Generator().manual_seed(7 * n + dim)
    x, residual = (_randn(n, dim, dtype=dtype, gen=gen) for _ in range(2))
    weight = _randn(dim, dtype=dtype, gen=gen)
    before = x.clone(), residual.clone()
    (ref, ref_sum), (got, got_sum) = _both(rms_norm, x, weight, 1e-5, residual=residual)
    assert torch.equal(got_sum, x + residual)          # the same rounding: exact
    torch.testing.assert_close(ref_sum, got_sum, atol=0, rtol=0)
    torch.testing.assert_close(got, ref, **TOL[dtype])
    torch.testing.assert_close(got, rms_norm_reference(x + residual, weight, 1e-5), **TOL[dtype])
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])   # inputs untouched


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("n, hq, hkv, d", [(1, 14, 2, 64), (37, 4, 2, 128), (37, 3, 1, 64)])
def test_per_head_rms_norm_on_qkv_views(dtype, n, hq, hkv, d):
    """Qwen3's q/k norm reads the strided q and k views of the qkv output in place."""
    gen = torch.Generator().manual_seed(n + hq + d)
    q, k, _ = _qkv_views(n, hq, hkv, d, dtype, gen)
    assert n == 1 or not q.is_contiguous()
    weight = _randn(d, dtype=dtype, gen=gen)
    for t in (q, k):
        ref, got = _both(rms_norm, t, weight, 1e-6)
        assert got.shape == t.shape and got.is_contiguous()
        assert not got.isnan().any()
        torch.testing.assert_close(got, ref, **TOL[dtype])


@pytest.mark.parametrize("shape", [(96,), (2, 3, 5, 96), (0, 96)])
def test_rms_norm_other_ranks_and_empty(shape):
    gen = torch.Generator().manual_seed(len(shape))
    x = _randn(*shape, dtype=torch.float32, gen=gen)
    weight = _randn(96, dtype=torch.float32, gen=gen)
    ref, got = _both(rms_norm, x, weight, 1e-6)
    assert got.shape == x.shape
    torch.testing.assert_close(got, ref, **TOL[torch.float32])


def test_rms_norm_rejects_bad_arguments():
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(31), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(32, dtype=torch.float16), 1e-6)
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, torch.ones(32), -1.0)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, torch.ones(32), 1e-6, residual=torch.randn(4, 16))
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x.view(4, 2, 16), torch.ones(16), 1e-6, residual=torch.randn(4, 2, 16))
    with pytest.raises(ValueError, match="x"):
        rms_norm(torch.randn(32, 4).t(), torch.ones(32), 1e-6, backend="triton")
    with pytest.raises(ValueError, match="backend"):
        rms_norm(x, torch.ones(32), 1e-6, backend="cuda")


# ---- apply_rotary -----------------------------------------------------------------------------

def _cache(max_positions, d, dtype, gen, device="cpu"):
    """A cos/sin table with the real layout (cosines then sines of the pair angles)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    angles = torch.outer(torch.arange(max_positions).float(), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(device, dtype)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("n, hq, hkv, d, pos_dtype", [
    (1, 14, 2, 64, torch.int64), (37, 4, 2, 128, torch.int32), (37, 3, 3, 64, torch.int64),
    (5, 2, 1, 96, torch.int64),
])
def test_rotary_matches_reference_on_qkv_views(dtype, n, hq, hkv, d, pos_dtype):
    gen = torch.Generator().manual_seed(3 * n + d)
    q, k, _ = _qkv_views(n, hq, hkv, d, dtype, gen)
    before = q.clone(), k.clone()
    cache = _cache(300, d, dtype, gen)
    positions = torch.randint(0, 300, (n,), generator=gen).to(pos_dtype)
    (ref_q, ref_k), (got_q, got_k) = _both(apply_rotary, q, k, positions, cache)
    for got, ref, src in ((got_q, ref_q, q), (got_k, ref_k, k)):
        assert got.shape == src.shape and got.dtype == dtype and got.is_contiguous()
        assert not got.isnan().any()
        torch.testing.assert_close(got, ref, **TOL[dtype])
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("n, hq, hkv, d", [(1, 14, 2, 64), (37, 4, 2, 128), (37, 3, 1, 96)])
def test_rotary_with_qk_norm_matches_norm_then_rotary(dtype, n, hq, hkv, d):
    """Qwen3: the per-head q/k RMSNorm fused into the rotary kernel."""
    gen = torch.Generator().manual_seed(5 * n + d)
    q, k, _ = _qkv_views(n, hq, hkv, d, dtype, gen)
    qk_norm = (_randn(d, dtype=dtype, gen=gen), _randn(d, dtype=dtype, gen=gen), 1e-6)
    cache = _cache(64, d, dtype, gen)
    positions = torch.randint(0, 64, (n,), generator=gen)
    (ref_q, ref_k), (got_q, got_k) = _both(apply_rotary, q, k, positions, cache, qk_norm=qk_norm)
    unfused = apply_rotary_reference(rms_norm_reference(q, qk_norm[0], 1e-6),
                                     rms_norm_reference(k, qk_norm[1], 1e-6), positions, cache)
    assert torch.equal(ref_q, unfused[0]) and torch.equal(ref_k, unfused[1])
    for got, ref in ((got_q, ref_q), (got_k, ref_k)):
        assert not got.isnan().any()
        torch.testing.assert_close(got, ref, **TOL[dtype])


def test_rotary_position_zero_is_identity_and_contiguous_inputs_work():
    gen = torch.Generator().manual_seed(0)
    q = _randn(6, 4, 64, dtype=torch.float32, gen=gen)
    k = _randn(6, 2, 64, dtype=torch.float32, gen=gen)
    cache = _cache(16, 64, torch.float32, gen)
    got_q, got_k = apply_rotary(q, k, torch.zeros(6, dtype=torch.int64), cache, backend="triton")
    torch.testing.assert_close(got_q, q, atol=0, rtol=0)
    torch.testing.assert_close(got_k, k, atol=0, rtol=0)
    positions = torch.arange(6)
    ref, got = _both(apply_rotary, q, k, positions, cache)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, **TOL[torch.float32])
    # The reference is the rotation by each position's angles (not just self-consistency).
    angle = positions[:, None].float() * (1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64)))
    x1, x2 = q[..., :32], q[..., 32:]
    c, s = angle.cos()[:, None], angle.sin()[:, None]
    torch.testing.assert_close(ref[0], torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1),
                               atol=1e-5, rtol=1e-5)


def test_rotary_reference_matches_rotate_half_of_layers():
    from mini_paged_attn.models.layers import apply_rotary as layers_apply_rotary
    gen = torch.Generator().manual_seed(1)
    q, k, _ = _qkv_views(5, 4, 2, 64, torch.float32, gen)
    cache, positions = _cache(20, 64, torch.float32, gen), torch.arange(5) * 3
    cos, sin = cache[positions].chunk(2, dim=-1)
    got_q, got_k = apply_rotary_reference(q, k, positions, cache)
    assert torch.equal(got_q, layers_apply_rotary(q, cos, sin))
    assert torch.equal(got_k, layers_apply_rotary(k, cos, sin))


def test_rotary_rejects_bad_arguments():
    q, k, cache = torch.randn(3, 4, 64), torch.randn(3, 2, 64), torch.randn(10, 64)
    pos = torch.arange(3)
    with pytest.raises(ValueError, match="head_size"):
        apply_rotary(torch.randn(3, 4, 63), torch.randn(3, 2, 63), pos, torch.randn(10, 63))
    with pytest.raises(ValueError, match="k"):
        apply_rotary(q, torch.randn(3, 2, 32), pos, cache)
    with pytest.raises(ValueError, match="positions"):
        apply_rotary(q, k, torch.arange(4), cache)
    with pytest.raises(ValueError, match="positions"):
        apply_rotary(q, k, pos.float(), cache)
    with pytest.raises(ValueError, match="^positions: expected a contiguous"):
        apply_rotary(q, k, torch.arange(6)[::2], cache)     # the kernel reads stride 1
    with pytest.raises(ValueError, match="cos_sin_cache"):
        apply_rotary(q, k, pos, torch.randn(10, 66))       # wider than the head
    with pytest.raises(ValueError, match="cos_sin_cache"):
        apply_rotary(q, k, pos, torch.randn(10, 30)[:, :29])   # odd: no rotary pairs
    with pytest.raises(ValueError, match="cos_sin_cache"):
        apply_rotary(q, k, pos, cache.half())
    with pytest.raises(ValueError, match="qk_norm"):
        apply_rotary(q, k, pos, cache, qk_norm=(torch.ones(64), torch.ones(64)))
    with pytest.raises(ValueError, match="k_weight"):
        apply_rotary(q, k, pos, cache, qk_norm=(torch.ones(64), torch.ones(32), 1e-6))
    with pytest.raises(ValueError, match="eps"):
        apply_rotary(q, k, pos, cache, qk_norm=(torch.ones(64), torch.ones(64), None))


# ---- silu_and_mul -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("n, inter", [(1, 64), (37, 1000), (3, 2304)])
def test_silu_and_mul_matches_reference(dtype, n, inter):
    gen = torch.Generator().manual_seed(n + inter)
    x = _randn(n, 2 * inter, dtype=dtype, gen=gen, scale=4.0)
    ref, got = _both(silu_and_mul, x)
    assert got.shape == (n, inter) and got.dtype == dtype
    torch.testing.assert_close(got, ref, **TOL[dtype])
    gate, up = x.float()[:, :inter], x.float()[:, inter:]      # the gate half comes first
    torch.testing.assert_close(got.float(), torch.sigmoid(gate) * gate * up,
                               atol=TOL[dtype]["atol"] * 10, rtol=TOL[dtype]["rtol"] * 5)


def test_silu_and_mul_rejects_bad_arguments():
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="2-D"):
        silu_and_mul(torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match="contiguous"):
        silu_and_mul(torch.randn(8, 4).t(), backend="triton")


# ---- the model on CPU: bit-identical to the unfused layer ------------------------------------

def _unfused_forward(model, ids, positions, kv_caches, meta):
    """The decoder as written before the fused ops: every add, norm and rope step in eager torch."""
    from mini_paged_attn.models.attention import paged_attention
    from mini_paged_attn.models.layers import apply_rotary as rotate

    def norm(x, module):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + module.eps)
        return module.weight * x32.to(x.dtype)

    hidden = model.embed_tokens(ids)
    cos, sin = model.rotary(positions)
    for layer, kv_cache in zip(model.layers, kv_caches):
        attn, n = layer.self_attn, ids.shape[0]
        qkv = attn.qkv_proj(norm(hidden, layer.input_layernorm)).view(n, -1, attn.head_size)
        q, k, v = qkv.split([attn.num_q_heads, attn.num_kv_heads, attn.num_kv_heads], dim=1)
        if attn.q_norm is not None:
            q, k = norm(q, attn.q_norm), norm(k, attn.k_norm)
        out = paged_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, kv_cache, meta,
                              attn.scale)
        hidden = hidden + attn.o_proj(out.view(n, -1))
        gate, up = layer.mlp.gate_up_proj(norm(hidden, layer.post_attention_layernorm)).chunk(2, -1)
        hidden = hidden + layer.mlp.down_proj(torch.nn.functional.silu(gate) * up)
    return norm(hidden, model.norm)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_model_on_cpu_is_bit_identical_to_unfused_layers(tiny_model_factory, arch, dtype):
    """On CPU the model runs the torch references: the same bits as the eager layer (and so the
    transformers parity of tests/models holds unchanged), bf16 rounding of the residual included."""
    from helpers.paged_batch import PagedBatchBuilder

    from mini_paged_attn.models.loader import load_model

    model, config = load_model(tiny_model_factory(arch), dtype=dtype)
    results = []
    for forward in (model, lambda *a: _unfused_forward(model, *a)):
        batch = PagedBatchBuilder(config, block_size=4, dtype=dtype)
        ids, pos, meta = batch.step({0: list(range(3, 14)), 1: [5, 6, 7]})
        prefill = forward(ids, pos, batch.kv_caches, meta)
        ids, pos, meta = batch.step({0: [8], 1: [9]})
        results.append((prefill, forward(ids, pos, batch.kv_caches, meta)))
    for got, want in zip(*results):
        assert got.dtype == dtype and torch.equal(got, want)


# ---- GPU: bf16, real shapes, CUDA graph --------------------------------------------------------

MODEL_SHAPES = [  # (hidden, num_q_heads, num_kv_heads, head_size, intermediate)
    (896, 14, 2, 64, 4864),      # Qwen2.5-0.5B
    (1024, 16, 8, 128, 3072),    # Qwen3-0.6B
    (4096, 32, 8, 128, 14336),   # Llama-3-8B
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 37, 256])
@pytest.mark.parametrize("hidden, hq, hkv, d, inter", MODEL_SHAPES)
def test_gpu_real_shapes(dtype, n, hidden, hq, hkv, d, inter):
    gen = torch.Generator().manual_seed(n + hidden)
    x, residual = (_randn(n, hidden, dtype=dtype, gen=gen, device="cuda") for _ in range(2))
    weight = _randn(hidden, dtype=dtype, gen=gen, device="cuda")
    (ref, ref_sum), (got, got_sum) = _both(rms_norm, x, weight, 1e-6, residual=residual)
    assert torch.equal(got_sum, ref_sum)
    torch.testing.assert_close(got, ref, **TOL[dtype])
    ref, got = _both(rms_norm, x, weight, 1e-6)
    torch.testing.assert_close(got, ref, **TOL[dtype])

    q, k, _ = _qkv_views(n, hq, hkv, d, dtype, gen, device="cuda")
    head_w = _randn(d, dtype=dtype, gen=gen, device="cuda")
    for t in (q, k):
        ref, got = _both(rms_norm, t, head_w, 1e-6)
        torch.testing.assert_close(got, ref, **TOL[dtype])
    cache = _cache(4096, d, dtype, gen, device="cuda")
    positions = torch.randint(0, 4096, (n,), generator=gen).cuda()
    for qk_norm in (None, (head_w, head_w.flip(0), 1e-6)):
        (ref_q, ref_k), (got_q, got_k) = _both(apply_rotary, q, k, positions, cache,
                                               qk_norm=qk_norm)
        # Rotary outputs are differences of products (x*cos - y*sin). On the GPU the compiler
        # contracts them into FMAs, so where the two products cancel, kernel and reference
        # differ by one rounding of the *products*, not of the result: seen on an H100 in bf16,
        # 1 ulp at magnitude 1 (0.0078) on outputs near 0 (relative error inf). Bound that by
        # two ulps of the largest input, and keep the relative bound for everything else.
        for got_t, ref_t, inp in ((got_q, ref_q, q), (got_k, ref_k, k)):
            atol = 2 * torch.finfo(dtype).eps * inp.float().abs().max().item()
            torch.testing.assert_close(got_t, ref_t, atol=atol, rtol=TOL[dtype]["rtol"])

    gate_up = _randn(n, 2 * inter, dtype=dtype, gen=gen, device="cuda", scale=3.0)
    ref, got = _both(silu_and_mul, gate_up)
    torch.testing.assert_close(got, ref, **TOL[dtype])


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_and_replay():
    """The three ops capture into one CUDA graph and replay on new inputs."""
    dtype, n, hidden, hq, hkv, d, inter = torch.bfloat16, 8, 1024, 16, 8, 128, 3072
    gen = torch.Generator().manual_seed(0)
    x, residual = (_randn(n, hidden, dtype=dtype, gen=gen, device="cuda") for _ in range(2))
    weight = _randn(hidden, dtype=dtype, gen=gen, device="cuda")
    qkv = _randn(n, hq + 2 * hkv, d, dtype=dtype, gen=gen, device="cuda")
    cache = _cache(512, d, dtype, gen, device="cuda")
    positions = torch.randint(0, 512, (n,), generator=gen).cuda()
    gate_up = _randn(n, 2 * inter, dtype=dtype, gen=gen, device="cuda")

    def step():
        normed, summed = rms_norm(x, weight, 1e-6, residual=residual)
        q, k, _ = qkv.split([hq, hkv, hkv], dim=1)
        return normed, summed, *apply_rotary(q, k, positions, cache), silu_and_mul(gate_up)

    graph, outs = capture(step)
    for t in (x, residual, qkv, gate_up):   # new inputs in the captured buffers
        t.copy_(torch.randn(t.shape, generator=gen).to("cuda", dtype))
    positions.copy_(torch.randint(0, 512, (n,), generator=gen).cuda())
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(outs, step()):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
