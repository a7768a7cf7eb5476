"""apply_rotary(..., store=KVWrite(...)): the rotated keys and the values written into the
paged KV cache by the rotary kernel, bit for bit what ``store_kv`` of the rotated keys writes.

On CPU the kernels run through the Triton interpreter (fp32, fp16, and fp8 caches); the
``gpu`` test repeats it in bf16 at a real shape.
"""

from __future__ import annotations

import pytest
import torch

from mini_paged_attn.ops.dispatch import store_kv
from mini_paged_attn.ops.fused import KVWrite, apply_rotary
from mini_paged_attn.ops.kv_quant import FP8_DTYPE

BLOCK_SIZE = 4
NUM_BLOCKS = 9


def _inputs(n, hq, hkv, d, dtype, cache_dtype, gen, device="cpu"):
    qkv = (2 * torch.randn(n, hq + 2 * hkv, d, generator=gen)).to(device, dtype)
    q, k, v = qkv.split([hq, hkv, hkv], dim=1)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    angles = torch.outer(torch.arange(64).float(), inv_freq)
    table = torch.cat([angles.cos(), angles.sin()], dim=-1).to(device, dtype)
    positions = torch.randint(0, 64, (n,), generator=gen).to(device)
    # Distinct shuffled slots; the last token is padding (-1) when there are several.
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:n].to(device)
    if n > 1:
        slots[-1] = -1
    caches = [torch.full((NUM_BLOCKS, BLOCK_SIZE, hkv, d), float("nan"), device=device)
              .to(cache_dtype) for _ in range(2)]
    return q, k, v, positions, table, slots, caches


def _scales(kind, hkv, device="cpu"):
    if kind is None:
        return None, None
    if kind == "tensor":
        return (torch.tensor(0.5, device=device), torch.tensor(2.0, device=device))
    return (torch.linspace(0.25, 1.5, hkv, device=device),
            torch.linspace(2.0, 0.5, hkv, device=device))


def _unfused(q, k, v, positions, table, slots, caches, scales, qk_norm, backend):
    q_rot, k_rot = apply_rotary(q, k, positions, table, qk_norm=qk_norm, backend=backend)
    store_kv(k_rot, v, *caches, slots, k_scale=scales[0], v_scale=scales[1], backend=backend)
    return q_rot, k_rot


def _same(a, b):
    """Equal bits, NaN-poisoned (never written) slots included."""
    if a.dtype == FP8_DTYPE:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(torch.nan_to_num(a, nan=7.0), torch.nan_to_num(b, nan=7.0))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype, cache_dtype, scale_kind", [
    (torch.float32, torch.float32, None), (torch.float16, torch.float16, None),
    (torch.float16, FP8_DTYPE, None), (torch.float16, FP8_DTYPE, "tensor"),
    (torch.float32, FP8_DTYPE, "head"),
])
@pytest.mark.parametrize("n, hq, hkv, d, norm", [(1, 4, 2, 64, False), (6, 4, 2, 128, True),
                                                   (5, 3, 3, 96, False)])
def test_fused_write_equals_store_kv_of_the_rotated_keys(backend, dtype, cache_dtype, scale_kind,
                                                         n, hq, hkv, d, norm):
    gen = torch.Generator().manual_seed(n * d + hkv)
    q, k, v, positions, table, slots, caches = _inputs(n, hq, hkv, d, dtype, cache_dtype, gen)
    qk_norm = (torch.rand(d, generator=gen).to(dtype) + 0.5,
               torch.rand(d, generator=gen).to(dtype) + 0.5, 1e-6) if norm else None
    scales = _scales(scale_kind, hkv)
    want_caches = [c.clone() for c in caches]
    want = _unfused(q, k, v, positions, table, slots, want_caches, scales, qk_norm, backend)
    got = apply_rotary(q, k, positions, table, qk_norm=qk_norm, backend=backend,
                       store=KVWrite(v, *caches, slots, *scales))
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    for c, w in zip(caches, want_caches):
        assert _same(c, w)
    # Written slots hold numbers, the padding token and the other slots nothing.
    written = slots[slots >= 0]
    flat = [c.view(-1, hkv, d).float() for c in caches]
    assert all(not f[written].isnan().any() for f in flat)
    assert all(int(f.isnan().all(-1).all(-1).sum()) == NUM_BLOCKS * BLOCK_SIZE - len(written)
               for f in flat)


def test_triton_skips_slots_past_the_pool_and_takes_int32_slots():
    """A launch reads no values on the host, so a slot past the pool is skipped (the torch
    backend raises, see below); int32 slot_mapping works like int64."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, positions, table, slots, caches = _inputs(4, 4, 2, 64, torch.float16,
                                                       torch.float16, gen)
    slots = slots.to(torch.int32)
    slots[1] = NUM_BLOCKS * BLOCK_SIZE          # one past the pool
    want_caches = [c.clone() for c in caches]
    ok = slots.clone()
    ok[1] = -1
    _unfused(q, k, v, positions, table, ok, want_caches, (None, None), None, "triton")
    apply_rotary(q, k, positions, table, backend="triton", store=KVWrite(v, *caches, slots))
    for c, w in zip(caches, want_caches):
        assert _same(c, w)
    with pytest.raises(ValueError, match="^slot_mapping: expected slots in"):
        apply_rotary(q, k, positions, table, backend="torch", store=KVWrite(v, *caches, slots))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_store_arguments_raise_before_anything_is_written(backend):
    gen = torch.Generator().manual_seed(0)
    q, k, v, positions, table, slots, caches = _inputs(3, 4, 2, 64, torch.float16,
                                                       torch.float16, gen)
    before = [c.clone() for c in caches]
    bad = {
        "value": KVWrite(v[:, :1], *caches, slots),
        "value_cache": KVWrite(v, caches[0], caches[1][:, :, :1], slots),
        "slot_mapping": KVWrite(v, *caches, slots[:2]),
        "k_scale": KVWrite(v, *caches, slots, torch.ones(2)),      # scales on a 16-bit cache
    }
    for name, store in bad.items():
        with pytest.raises(ValueError, match=f"^{name}"):
            apply_rotary(q, k, positions, table, backend=backend, store=store)
    with pytest.raises(ValueError, match="^store: expected None or a KVWrite"):
        apply_rotary(q, k, positions, table, backend=backend, store=(v, *caches, slots))
    for c, b in zip(caches, before):
        assert _same(c, b)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8_DTYPE])
def test_gpu_fused_write_equals_store_kv(cache_dtype):
    gen = torch.Generator().manual_seed(1)
    q, k, v, positions, table, slots, caches = _inputs(
        32, 16, 8, 128, torch.bfloat16, cache_dtype, gen, device="cuda")
    qk_norm = (torch.rand(128, device="cuda").bfloat16() + 0.5,
               torch.rand(128, device="cuda").bfloat16() + 0.5, 1e-6)
    want_caches = [c.clone() for c in caches]
    want = _unfused(q, k, v, positions, table, slots, want_caches, (None, None), qk_norm,
                    "triton")
    got = apply_rotary(q, k, positions, table, qk_norm=qk_norm, store=KVWrite(v, *caches, slots))
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    for c, w in zip(caches, want_caches):
        assert _same(c, w)
