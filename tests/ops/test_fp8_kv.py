"""The fp8 (e4m3) KV cache: quantization, the references, the Triton kernels, the checks.

On CPU the kernels run through the Triton interpreter, with fp16 / fp32 queries. It loads and
converts e4m3 correctly (finite values; NaN bytes read as +-480 there, but unused slots are
masked before that could matter). The store kernel rounds to e4m3 itself before converting,
so it writes the same bytes under the interpreter (whose own float32 -> e4m3 conversion
rounds wrongly at binade boundaries) as on a GPU, NaN inputs aside (the interpreter converts a
float32 NaN to 384); test_fp8_kv_gpu.py checks the GPU's bytes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.fp8_batch import dequantized_batch, fp8_batch, per_head_scales
from helpers.paged_batch import make_decode_batch, make_prefill_batch
from mini_paged_attn.ops import reference
from mini_paged_attn.ops.dispatch import paged_decode, paged_prefill, store_kv
from mini_paged_attn.ops.kv_quant import FP8_DTYPE, dequantize, kv_cache_torch_dtype, quantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Max |kernel - reference on the dequantized cache| by query dtype.
TOL = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def _scales(kind: str, num_kv_heads: int):
    if kind == "none":
        return None, None
    if kind == "tensor":
        return (torch.tensor(0.02, device=DEVICE), torch.tensor(0.03, device=DEVICE))
    return (per_head_scales(num_kv_heads, DEVICE),
            per_head_scales(num_kv_heads, DEVICE, base=0.015).flip(0))


# ---- quantization ---------------------------------------------------------------------------

def test_quantize_divides_rounds_to_nearest_even_and_saturates():
    x = torch.tensor([[[0.0, 1.0, 1.0625, 1.1875, 460.0, -1000.0, float("nan")]]])
    q = quantize(x, torch.tensor(1.0))
    assert q.dtype == FP8_DTYPE
    # 1.0625 ties between 1.0 and 1.125 -> even (1.0); 1.1875 ties -> 1.25; past 448 saturates.
    got = q.float()[0, 0]
    assert got[:6].tolist() == [0.0, 1.0, 1.0, 1.25, 448.0, -448.0]
    assert torch.isnan(got[6]) and q.view(torch.uint8)[0, 0, 6] in (0x7F, 0xFF)
    per_head = torch.tensor([2.0, 0.5])
    y = torch.ones(3, 2, 4)
    assert dequantize(quantize(y, per_head), per_head).eq(1.0).all()
    assert quantize(y, per_head).float()[:, 1].eq(2.0).all()


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.floats(-1.0, 1.0, width=32), min_size=1, max_size=16),
       scale_exp=st.floats(-12.0, 4.0))
def test_quantize_error_is_at_most_half_an_e4m3_step(values, scale_exp):
    """Within range, ``stored * scale`` is within half an e4m3 step of the input: 2^-4 of it
    (3 mantissa bits), or 2^-10 * scale among the subnormals (step 2^-9)."""
    scale = torch.tensor(2.0 ** scale_exp)
    x = torch.tensor(values).view(-1, 1, 1) * 448 * scale
    err = (dequantize(quantize(x, scale), scale) - x).abs()
    assert (err <= torch.maximum(x.abs() * 2 ** -4, 2 ** -10 * scale) * (1 + 1e-6)).all()


def test_kv_cache_dtype_names():
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) == FP8_DTYPE
    assert kv_cache_torch_dtype("fp8_e4m3", torch.float16) == FP8_DTYPE
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_cache_torch_dtype("fp8_e5m2", torch.float16)


# ---- the references -------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["none", "tensor", "head"])
def test_references_read_stored_times_scale(kind):
    """Both references over an fp8 cache equal the plain reference over ``stored * scale``."""
    base = make_prefill_batch([3, 1, 6], [5, 9, 0], num_q_heads=6, num_kv_heads=3,
                              head_size=16, block_size=4, seed=3, pool_layout=True,
                              device=DEVICE)
    ks, vs = _scales(kind, 3)
    batch = fp8_batch(base, ks, vs, torch.float32)
    plain = dequantized_batch(batch, ks, vs)
    expected = reference.paged_prefill_gather(*plain.prefill_args, causal=True, scale=0.25)
    for fn in (reference.paged_prefill_gather, reference.paged_prefill_blockwise):
        out, lse = fn(*batch.prefill_args, causal=True, scale=0.25, k_scale=ks, v_scale=vs)
        assert not out.isnan().any()
        torch.testing.assert_close(out, expected[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, expected[1], atol=1e-5, rtol=1e-5)
    dec = make_decode_batch([7, 0, 13], num_q_heads=6, num_kv_heads=3, head_size=16,
                            block_size=4, seed=4, device=DEVICE)
    dec8 = fp8_batch(dec, ks, vs, torch.float32)
    expected = reference.paged_decode_gather(*dequantized_batch(dec8, ks, vs).decode_args,
                                             scale=0.25)
    for fn in (reference.paged_decode_gather, reference.paged_decode_blockwise):
        out, lse = fn(*dec8.decode_args, scale=0.25, k_scale=ks, v_scale=vs)
        torch.testing.assert_close(out, expected[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, expected[1], atol=1e-5, rtol=1e-5)


# ---- Triton decode and prefill against the reference ----------------------------------------

def _dequantized_reference_decode(batch, ks, vs):
    plain = dequantized_batch(batch, ks, vs)
    return reference.paged_decode_gather(*plain.decode_args, scale=batch.query.shape[-1] ** -0.5)


@pytest.mark.parametrize("kind", ["none", "tensor", "head"])
@pytest.mark.parametrize("hq, hkv, head_size, block_size, lens, qdtype, pool_layout, splits", [
    pytest.param(4, 2, 64, 16, [1, 15, 17, 50], torch.float16, False, None, id="gqa2-bs16"),
    pytest.param(8, 2, 80, 4, [3, 33, 0], torch.float32, True, 3, id="gqa4-d80-bs4-split3"),
    pytest.param(8, 1, 32, 32, [31, 70], torch.float16, True, 1, id="mqa-bs32-unsplit"),
])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_matches_reference_on_dequantized_values(kind, hq, hkv, head_size, block_size,
                                                        lens, qdtype, pool_layout, splits,
                                                        backend):
    base = make_decode_batch(lens, num_q_heads=hq, num_kv_heads=hkv, head_size=head_size,
                             block_size=block_size, seed=hq + head_size,
                             pool_layout=pool_layout, device=DEVICE)
    ks, vs = _scales(kind, hkv)
    batch = fp8_batch(base, ks, vs, qdtype)
    out = torch.full_like(batch.query, float("nan"))
    kwargs = {} if backend == "torch" else {"num_splits": splits}
    _, lse = paged_decode(*batch.decode_args, out=out, return_lse=True, backend=backend,
                          k_scale=ks, v_scale=vs, **kwargs)
    ref_out, ref_lse = _dequantized_reference_decode(batch, ks, vs)
    assert out.dtype == qdtype
    torch.testing.assert_close(out.float(), ref_out, atol=TOL[qdtype], rtol=TOL[qdtype])
    torch.testing.assert_close(lse, ref_lse, atol=TOL[qdtype], rtol=TOL[qdtype])


@pytest.mark.parametrize("kind", ["none", "tensor", "head"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prefill_matches_reference_on_dequantized_values(kind, causal, backend):
    base = make_prefill_batch([1, 20, 7, 1], [0, 5, 30, 12], num_q_heads=8, num_kv_heads=2,
                              head_size=64, block_size=8, seed=11, pool_layout=True,
                              device=DEVICE)
    ks, vs = _scales(kind, 2)
    batch = fp8_batch(base, ks, vs, torch.float16)
    out = torch.full_like(batch.query, float("nan"))
    _, lse = paged_prefill(*batch.prefill_args, causal=causal, out=out, return_lse=True,
                           backend=backend, k_scale=ks, v_scale=vs)
    plain = dequantized_batch(batch, ks, vs)
    ref_out, ref_lse = reference.paged_prefill_gather(*plain.prefill_args, causal=causal,
                                                      scale=64 ** -0.5)
    torch.testing.assert_close(out.float(), ref_out, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-2, rtol=1e-2)


def test_scales_change_the_result():
    """A given scale is used, not ignored (a kernel reading 1.0 would pass the tests above
    only if every scale were 1)."""
    base = make_decode_batch([20], num_q_heads=4, num_kv_heads=2, head_size=32, block_size=16,
                             device=DEVICE)
    ks, vs = _scales("head", 2)
    batch = fp8_batch(base, ks, vs, torch.float16)
    scaled = paged_decode(*batch.decode_args, backend="triton", k_scale=ks, v_scale=vs)
    unscaled = paged_decode(*batch.decode_args, backend="triton")
    assert (scaled.float() - unscaled.float()).abs().max() > 0.1
    ref = reference.paged_decode_gather(*batch.decode_args, scale=32 ** -0.5)[0]
    torch.testing.assert_close(unscaled.float(), ref, atol=1e-2, rtol=1e-2)


# ---- store_kv --------------------------------------------------------------------------------

def _fp8_pool(num_blocks, block_size, num_kv_heads, head_size, pool_layout):
    pool = torch.full((num_blocks, block_size, 2, num_kv_heads, head_size), float("nan"),
                      device=DEVICE).to(FP8_DTYPE)
    if pool_layout:
        return pool[:, :, 0], pool[:, :, 1]
    return pool[:, :, 0].contiguous(), pool[:, :, 1].contiguous()


def _every_rounding_case() -> torch.Tensor:
    """float32: every finite e4m3 value, the midpoints between neighbours (ties) and the
    float32 values just beside them, signed zeros, tiny values and values past 448."""
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).float()
    vals = vals[~vals.isnan()].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    beside = [torch.nextafter(mids, torch.full_like(mids, d)) for d in (1e9, -1e9)]
    edges = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 449.0, 464.0, -500.0, 1e6])
    return torch.cat([vals, mids, *beside, edges])


@pytest.mark.parametrize("kind", ["none", "tensor", "head"])
@pytest.mark.parametrize("kdtype, pool_layout", [(torch.float16, True), (torch.float32, False),
                                                 (torch.bfloat16, True)])
def test_store_kv_triton_matches_torch(kind, kdtype, pool_layout):
    """The Triton store writes the bytes of the torch reference (division, clamp, rounding to
    nearest even), slots -1 skipped, nothing else touched."""
    gen = torch.Generator().manual_seed(7)
    hkv, d, bs, n = 3, 32, 4, 7
    ks, vs = _scales(kind, hkv)
    key = (torch.randn(n, hkv, d, generator=gen) * 5).to(DEVICE, kdtype)
    value = (torch.randn(n, hkv, d, generator=gen) * 5).to(DEVICE, kdtype)
    slots = torch.tensor([5, -1, 0, 11, 2, -1, 9], device=DEVICE)
    caches = {}
    for backend in ("torch", "triton"):
        kc, vc = _fp8_pool(4, bs, hkv, d, pool_layout)
        store_kv(key, value, kc, vc, slots, backend=backend, k_scale=ks, v_scale=vs)
        caches[backend] = (kc, vc)
    for t, x in zip(caches["torch"], caches["triton"]):
        assert torch.equal(t.view(torch.uint8), x.view(torch.uint8))
    kc = caches["triton"][0].reshape(-1, hkv, d)
    keep = slots >= 0
    assert torch.equal(kc[slots[keep]].view(torch.uint8),
                       quantize(key[keep], ks).view(torch.uint8))
    unwritten = torch.ones(16, dtype=torch.bool, device=DEVICE)
    unwritten[slots[keep]] = False
    assert kc.float()[unwritten].isnan().all()


def test_store_kv_triton_rounds_every_case_like_torch():
    x = _every_rounding_case()
    d = 64
    x = torch.cat([x, torch.zeros(-x.numel() % d)]).view(-1, 1, d).to(DEVICE)
    n = x.shape[0]
    written = {}
    for backend in ("torch", "triton"):
        kc, vc = _fp8_pool(n, 1, 1, d, False)
        store_kv(x, x, kc, vc, torch.arange(n, device=DEVICE), backend=backend)
        written[backend] = kc.view(torch.uint8)
    bad = written["torch"] != written["triton"]
    assert not bad.any(), x.view(-1)[bad.view(-1)][:8].tolist()


def test_store_kv_reference_rounds_like_torch():
    key = torch.randn(5, 2, 16) * 50
    kc = torch.zeros(2, 4, 2, 16, dtype=FP8_DTYPE)
    vc = torch.zeros_like(kc)
    ks = torch.tensor([0.5, 3.0])
    store_kv(key, key, kc, vc, torch.arange(5), backend="torch", k_scale=ks)
    expected = (key / ks[:, None]).clamp(-448, 448).to(FP8_DTYPE)
    assert torch.equal(kc.reshape(8, 2, 16)[:5].view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(vc.reshape(8, 2, 16)[:5].view(torch.uint8),
                       key.clamp(-448, 448).to(FP8_DTYPE).view(torch.uint8))


# ---- bad input ---------------------------------------------------------------------------------

def _small_fp8_decode():
    base = make_decode_batch([5, 9], num_q_heads=4, num_kv_heads=2, head_size=16, block_size=4)
    return fp8_batch(base, None, None, torch.float16)


@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
@pytest.mark.parametrize("bad, match", [
    (torch.ones(3), r"shape \[\] or \[2\]"),
    (torch.ones(2, 1), r"shape \[\] or \[2\]"),
    (torch.ones(2, dtype=torch.float16), "float32"),
    (0.5, "float32 tensor or None"),
])
@pytest.mark.parametrize("op", ["decode", "prefill", "store"])
def test_bad_scales_raise_naming_the_argument(name, bad, match, op):
    batch = _small_fp8_decode()
    before = batch.key_cache.clone(), batch.value_cache.clone()
    kwargs = {name: bad}
    with pytest.raises(ValueError, match=f"^{name}: .*{match}"):
        if op == "decode":
            paged_decode(*batch.decode_args, **kwargs)
        elif op == "prefill":
            paged_prefill(*batch.prefill_args, **kwargs)
        else:
            kv = torch.ones(2, 2, 16)
            store_kv(kv, kv, batch.key_cache, batch.value_cache, torch.tensor([0, 1]), **kwargs)
    assert torch.equal(batch.key_cache.view(torch.uint8), before[0].view(torch.uint8))
    assert torch.equal(batch.value_cache.view(torch.uint8), before[1].view(torch.uint8))


def test_scales_with_a_16_bit_cache_raise():
    batch = make_decode_batch([5], num_q_heads=2, num_kv_heads=2, head_size=16, block_size=4,
                              dtype=torch.float16)
    with pytest.raises(ValueError, match="^k_scale: expected None for a torch.float16 cache"):
        paged_decode(*batch.decode_args, k_scale=torch.tensor(1.0))
    before = batch.key_cache.clone()
    kv = torch.ones(1, 2, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="^v_scale: "):
        store_kv(kv, kv, batch.key_cache, batch.value_cache, torch.tensor([0]),
                 v_scale=torch.tensor(1.0))
    assert torch.equal(batch.key_cache.view(torch.int16), before.view(torch.int16))  # NaN


def test_mixed_cache_dtypes_raise():
    batch = _small_fp8_decode()
    with pytest.raises(ValueError, match="^value_cache: "):
        paged_decode(batch.query, batch.key_cache, batch.value_cache.half(), batch.block_tables,
                     batch.context_lens)
    with pytest.raises(ValueError, match="^key_cache: "):
        paged_decode(batch.query, batch.key_cache.to(torch.float8_e5m2), batch.value_cache,
                     batch.block_tables, batch.context_lens)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device (a scale on the CPU)")
def test_scale_on_another_device_raises():
    batch = fp8_batch(make_decode_batch([5], num_q_heads=2, num_kv_heads=2, head_size=16,
                                        block_size=4, device="cuda"), None, None, torch.float16)
    with pytest.raises(ValueError, match="^k_scale: expected a tensor on cuda"):
        paged_decode(*batch.decode_args, k_scale=torch.tensor(1.0))


@pytest.mark.parametrize("num_seqs", [1, 256])
def test_fp8_cache_plans_its_own_tiles_and_fp16_dots(num_seqs):
    from mini_paged_attn.ops.attention.decode_plan import FP8_TILES, plan_decode

    args = (num_seqs, 32, 8, 128, 16384, 16, torch.bfloat16, 132)
    fp8 = plan_decode(*args, kv_dtype=FP8_DTYPE)
    bf16 = plan_decode(*args)
    assert fp8.tiles == FP8_TILES != bf16.tiles
    assert fp8.fp16_dots and not bf16.fp16_dots
    assert "float8_e4m3fn cache" in str(fp8)
    # fp32 queries over an fp8 cache keep fp32 dots (fp16 would round them).
    assert not plan_decode(*args[:6], torch.float32, 132, kv_dtype=FP8_DTYPE).fp16_dots


@pytest.mark.parametrize("num_seqs, context, splits, reason", [
    (32, 2048, 2, "fp8 short"),       # 32 tiles of 64 (the "fp8 programs" rule gave 4)
    (128, 2048, 2, "fp8 short"),      # enough programs, but short ones
    (256, 1000, 2, "fp8 short"),
    (256, 2049, 1, "enough programs"),
    (64, 4096, 1, "enough programs"),
    (256, 64, 1, "enough programs"),   # one tile: nothing to split
])
def test_fp8_launches_of_short_sequences_split_in_two(num_seqs, context, splits, reason):
    """Sequences of at most FP8_SHORT_TILES unsplit tiles split in exactly 2 (the unsplit
    tiles), where the other rules would leave them unsplit or split them more; a workspace
    with room for one split keeps them unsplit."""
    from mini_paged_attn.ops.attention.decode_plan import FP8_SHORT_TILES, FP8_TILES, plan_decode

    assert FP8_SHORT_TILES * FP8_TILES.block_n == 2048
    plan = plan_decode(num_seqs, 16, 8, 128, context, 16, torch.bfloat16, 132,
                       kv_dtype=FP8_DTYPE)
    assert (plan.num_splits, plan.tiles, plan.split_reason) == (splits, FP8_TILES, reason)
    if reason == "fp8 short":
        assert "split in 2" in str(plan)
        one = plan_decode(num_seqs, 16, 8, 128, context, 16, torch.bfloat16, 132,
                          max_splits=1, kv_dtype=FP8_DTYPE)
        assert one.num_splits == 1
    # 16-bit caches keep their own rule.
    assert plan_decode(num_seqs, 16, 8, 128, context, 16, torch.bfloat16, 132).num_splits == 1


@pytest.mark.parametrize("num_seqs, splits, reason", [
    (32, 4, "fp8 programs"),      # 256 programs, 1.9 a SM: toward 8 a SM, as if not short
    (64, 2, "fp8 short"),         # 512, 3.9 a SM: still in two
    (98, 2, "fp8 short"),         # 784, 5.9 a SM: the last count that splits
    (99, 1, "enough programs"),   # 792, 6.0 a SM: the order evens them out
    (256, 1, "enough programs"),
])
def test_fp8_short_sequences_taken_longest_first(num_seqs, splits, reason):
    """A launch that takes its sequences longest first keeps short fp8 programs whole from
    FP8_ORDERED_UNSPLIT programs a SM, splits them in two between FP8_SPLIT_BELOW and that,
    and below FP8_SPLIT_BELOW splits toward FP8_PROGRAMS_PER_SM."""
    from mini_paged_attn.ops.decode_tiles import fp8_occupancy_tiles
    from mini_paged_attn.ops.attention.decode_plan import (FP8_ORDERED_UNSPLIT, FP8_SPLIT_BELOW, FP8_TILES,
                                             explain_decode, plan_decode)

    assert FP8_SPLIT_BELOW * 132 <= 8 * 64 and 8 * 98 < FP8_ORDERED_UNSPLIT * 132 <= 8 * 99
    plan = plan_decode(num_seqs, 16, 8, 128, 2048, 16, torch.bfloat16, 132,
                       kv_dtype=FP8_DTYPE, ordered=True)
    assert (plan.num_splits, plan.tiles.block_n, plan.split_reason) == (
        splits, FP8_TILES.block_n, reason)
    assert plan.tiles == fp8_occupancy_tiles(plan.programs, 132)
    assert plan.ordered
    # The same batch unordered still splits in two.
    assert plan_decode(num_seqs, 16, 8, 128, 2048, 16, torch.bfloat16, 132,
                       kv_dtype=FP8_DTYPE).split_reason == "fp8 short"
    explained = explain_decode(num_seqs, 16, 8, 128, 2048, 16, torch.bfloat16, "cpu",
                               kv_cache_dtype=FP8_DTYPE, ordered=True)
    assert explained.num_splits == splits
    if reason == "enough programs":
        assert "longest first" in str(plan)
        # Long sequences are whole in either order: the explanation does not credit it.
        long = plan_decode(num_seqs, 16, 8, 128, 4096, 16, torch.bfloat16, 132,
                           kv_dtype=FP8_DTYPE, ordered=True)
        assert long.num_splits == 1 and "longest first" not in str(long)


def test_explain_decode_checks_ordered():
    from mini_paged_attn.ops.attention.decode_plan import explain_decode

    with pytest.raises(ValueError, match="^ordered: expected a bool"):
        explain_decode(8, 16, 8, 128, 2048, ordered=1)


@pytest.mark.parametrize("num_seqs, context, ordered, splits", [
    (32, 65536, False, 1),    # 256 programs, 1.9 a SM: long sequences stay whole
    (30, 4096, True, 1),
    (48, 4096, False, 1),
    (27, 64, False, 1),       # 216, one tile each: nothing to split
    (32, 2048, True, 4),      # short ones, longest first: toward 8 a SM
])
def test_fp8_launches_with_few_programs_per_sm(num_seqs, context, ordered, splits):
    """Below FP8_SPLIT_BELOW programs a SM, only short sequences taken longest first split
    (toward FP8_PROGRAMS_PER_SM); longer ones stay whole where the 16-bit rule leaves them
    so. A forced num_splits=1 keeps the 64-token tiles."""
    from mini_paged_attn.ops.attention.decode_plan import FP8_SPLIT_BELOW, FP8_TILES, plan_decode

    assert num_seqs * 8 < FP8_SPLIT_BELOW * 132
    plan = plan_decode(num_seqs, 32, 8, 128, context, 16, torch.bfloat16, 132,
                       kv_dtype=FP8_DTYPE, ordered=ordered)
    assert (plan.num_splits, plan.tiles.block_n) == (splits, FP8_TILES.block_n)
    assert (plan.split_reason == "fp8 programs") == (splits > 1)
    if splits > 1:
        assert "taken longest first, are under" in str(plan)
    forced = plan_decode(num_seqs, 32, 8, 128, context, 16, torch.bfloat16, 132, 1,
                         kv_dtype=FP8_DTYPE)
    assert (forced.num_splits, forced.tiles.block_n) == (1, FP8_TILES.block_n)


@pytest.mark.parametrize("programs, per_sm", [
    (0, 4), (100, 4), (512, 4),     # one wave: the default's, fullest
    (640, 5),                       # 1.2 waves of 4 an SM; one full wave of 5
    (768, 6),                       # 1.45 waves of 4; one of 6
    (1280, 5),                      # 2.4 waves of 4; 1.9 of 5
    (2048, 4),                      # 3.9 waves of 4 (and of 8: the first of equals)
])
def test_fp8_occupancy_fills_the_last_wave(programs, per_sm):
    """Among tiles that compute the same result, the fp8 plan takes the registers and stages
    whose programs fill their last wave best."""
    from mini_paged_attn.ops.decode_tiles import FP8_OCCUPANCY, FP8_TILES, fp8_occupancy_tiles
    chosen = fp8_occupancy_tiles(programs, 132)
    assert dict(FP8_OCCUPANCY)[chosen] == per_sm
    assert FP8_OCCUPANCY[0] == (FP8_TILES, 4)
    assert {(t.block_n, t.num_warps) for t, _ in FP8_OCCUPANCY} == {(64, 2)}


def test_fp8_plan_takes_the_occupancy_variant_only_where_measured():
    """80 sequences x 8 KV heads plan 5 programs an SM (and say so); 16-bit caches, fp32
    queries, other head sizes and forced tiles keep their tiles."""
    from mini_paged_attn.ops.attention.decode_plan import FP8_TILES, DecodeTiles, plan_decode
    args = (80, 32, 8, 128, 4096, 16, torch.bfloat16, 132)
    plan = plan_decode(*args, kv_dtype=FP8_DTYPE)
    assert (plan.tiles.maxnreg, plan.num_splits) == (168, 1)
    assert "5 programs an SM" in str(plan) and "at most 168 registers" in str(plan)
    assert plan_decode(*args).tiles.maxnreg is None
    assert plan_decode(*args[:6], torch.float32, 132, kv_dtype=FP8_DTYPE).tiles == FP8_TILES
    assert plan_decode(80, 32, 8, 64, 4096, 16, torch.bfloat16, 132,
                       kv_dtype=FP8_DTYPE).tiles == FP8_TILES
    forced = DecodeTiles(64, 2, 6)
    assert plan_decode(*args, tiles=forced, kv_dtype=FP8_DTYPE).tiles is forced


@pytest.mark.parametrize("maxnreg", [16, 256, 128.0, True])
def test_decode_tiles_check_maxnreg(maxnreg):
    from mini_paged_attn.ops.attention.decode_plan import DecodeTiles
    with pytest.raises(ValueError, match="^maxnreg: expected None or an int in 32..255"):
        DecodeTiles(64, 2, 6, maxnreg=maxnreg)


def test_fp8_v_is_read_as_pairs_only_where_it_can_be():
    """int16 pairs of dims need inline PTX (a GPU), an unpadded head size and an even layout."""
    from mini_paged_attn.ops.decode_tiles import fp8_v_conversion
    assert fp8_v_conversion(128, 128, True) == "pairs"
    assert fp8_v_conversion(128, 128, False) == "cast"          # the interpreter
    assert fp8_v_conversion(80, 128, True) == "cast"            # padded head size
    assert fp8_v_conversion(64, 64, True, even_layout=False) == "cast"
