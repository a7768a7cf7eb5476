"""The fp8 (e4m3) KV cache on a GPU: the Triton kernels at full shapes with bf16 / fp16
queries, store_kv's rounding (exactly torch's), the repeated-launch fast path and CUDA graphs
with scales.

Run: ``pytest -m gpu tests/ops/test_fp8_kv_gpu.py`` on a CUDA machine (skipped without one).
"""

from __future__ import annotations

import pytest
import torch

from helpers.cuda_graphs import capture
from helpers.fp8_batch import dequantized_batch, fp8_batch, per_head_scales
from helpers.paged_batch import make_decode_batch, make_prefill_batch
from mini_paged_attn.ops import reference
from mini_paged_attn.ops.decode import workspace_size
from mini_paged_attn.ops.dispatch import paged_decode, paged_prefill, store_kv
from mini_paged_attn.ops.kv_quant import FP8_DTYPE, quantize

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
LENS = [1, 15, 16, 17, 255, 1000, 4097, 2048]
TOL = {torch.float16: 1e-2, torch.bfloat16: 2e-2}


def _scales(kind: str, hkv: int):
    if kind == "none":
        return None, None
    if kind == "tensor":
        return torch.tensor(0.02, device=DEVICE), torch.tensor(0.03, device=DEVICE)
    return per_head_scales(hkv, DEVICE), per_head_scales(hkv, DEVICE, base=0.015).flip(0)


def _decode_batch(lens=LENS, *, hq=32, hkv=8, head_size=128, block_size=16, seed=0,
                  kind="head", qdtype=torch.bfloat16, pool_layout=True):
    base = make_decode_batch(lens, num_q_heads=hq, num_kv_heads=hkv, head_size=head_size,
                             block_size=block_size, seed=seed, pool_layout=pool_layout,
                             device=DEVICE)
    ks, vs = _scales(kind, hkv)
    return fp8_batch(base, ks, vs, qdtype), ks, vs


def _assert_decode_close(batch, ks, vs, out, lse):
    plain = dequantized_batch(batch, ks, vs)
    ref_out, ref_lse = reference.paged_decode_gather(*plain.decode_args,
                                                     scale=batch.query.shape[-1] ** -0.5)
    # Errors scale with the output's magnitude: P @ V runs in the query's 16-bit dtype, and
    # without a v_scale the stored values reach e4m3's 448.
    tol = TOL[batch.query.dtype]
    atol = tol * max(1.0, ref_out.abs().max().item())
    assert out.dtype == batch.query.dtype
    torch.testing.assert_close(out.float(), ref_out, atol=atol, rtol=tol)
    if lse is not None:
        torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=tol)


def _decode(batch, ks, vs, **kwargs):
    out = torch.full_like(batch.query, float("nan"))
    _, lse = paged_decode(*batch.decode_args, out=out, return_lse=True, k_scale=ks,
                          v_scale=vs, **kwargs)
    return out, lse


@pytest.mark.parametrize("kind", ["none", "tensor", "head"])
@pytest.mark.parametrize("qdtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_size", [64, 80, 128, 256])
def test_decode_matches_reference(kind, qdtype, head_size):
    batch, ks, vs = _decode_batch(head_size=head_size, kind=kind, qdtype=qdtype,
                                  seed=head_size)
    for num_splits in (None, 1, 7):
        _assert_decode_close(batch, ks, vs, *_decode(batch, ks, vs, num_splits=num_splits))


@pytest.mark.parametrize("num_splits", [None, 1, 2, 7])
def test_decode_longest_first_equals_batch_order(num_splits):
    """``seq_order`` moves the fp8 programs, not the results (split and unsplit tiles)."""
    batch, ks, vs = _decode_batch(hq=16, hkv=8, seed=5)
    out, lse = _decode(batch, ks, vs, num_splits=num_splits)
    lens = batch.decode_args[4]
    order = torch.argsort(lens, descending=True).to(torch.int32)
    ordered, ordered_lse = _decode(batch, ks, vs, num_splits=num_splits, seq_order=order)
    assert torch.equal(ordered, out) and torch.equal(ordered_lse, lse)
    _assert_decode_close(batch, ks, vs, ordered, ordered_lse)


def test_occupancy_variants_give_the_same_bits():
    """The fp8 tiles with fewer registers or stages (FP8_OCCUPANCY) move how many programs
    share an SM, never a result; so a sequence decodes to the same bits alone and inside a
    batch whose size picks another variant (80 sequences x 8 KV heads: 168 registers)."""
    from mini_paged_attn.ops.checks import check_paged_decode_args
    from mini_paged_attn.ops.decode import triton_paged_decode
    from mini_paged_attn.ops.decode_tiles import FP8_OCCUPANCY, FP8_TILES, fp8_occupancy_tiles

    lens = [(37 * i) % 1500 + 1 for i in range(80)]
    batch, ks, vs = _decode_batch(lens, seed=17)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if sms == 132:      # H100 / H200: the batch plans another variant than a sequence alone
        assert fp8_occupancy_tiles(80 * 8, sms) != fp8_occupancy_tiles(8, sms) == FP8_TILES
    args = batch.decode_args
    outs = []
    for tiles, _ in FP8_OCCUPANCY:
        out = torch.full_like(batch.query, float("nan"))
        lse = torch.full(batch.query.shape[:2], float("nan"), device=DEVICE)
        shapes = check_paged_decode_args(*args, None, out)
        triton_paged_decode(*args, shapes, out=out, lse=lse, num_splits=1, tiles=tiles,
                            k_scale=ks, v_scale=vs)
        outs.append((out, lse))
    for out, lse in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(lse, outs[0][1])
    _assert_decode_close(batch, ks, vs, *outs[0])
    batched, _ = _decode(batch, ks, vs, num_splits=1)
    q, kc, vc, bt, cl = args
    for i in (0, 41, 79):
        alone = paged_decode(q[i:i + 1], kc, vc, bt[i:i + 1], cl[i:i + 1], num_splits=1,
                             k_scale=ks, v_scale=vs)
        assert torch.equal(alone, batched[i:i + 1])


@pytest.mark.parametrize("block_size, hq, hkv", [(1, 32, 8), (32, 32, 32), (64, 32, 1),
                                                 (24, 40, 8)])
def test_decode_block_sizes_and_groups(block_size, hq, hkv):
    batch, ks, vs = _decode_batch(block_size=block_size, hq=hq, hkv=hkv, seed=block_size,
                                  pool_layout=block_size % 2 == 0)
    _assert_decode_close(batch, ks, vs, *_decode(batch, ks, vs))


@pytest.mark.parametrize("kind", ["none", "tensor", "head"])
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_matches_reference(kind, causal):
    base = make_prefill_batch([1, 300, 1000, 1, 64], [0, 2000, 50, 4000, 3], num_q_heads=32,
                              num_kv_heads=8, head_size=128, block_size=16, seed=5,
                              pool_layout=True, device=DEVICE)
    ks, vs = _scales(kind, 8)
    batch = fp8_batch(base, ks, vs, torch.bfloat16)
    out = torch.full_like(batch.query, float("nan"))
    _, lse = paged_prefill(*batch.prefill_args, causal=causal, out=out, return_lse=True,
                           k_scale=ks, v_scale=vs)
    plain = dequantized_batch(batch, ks, vs)
    ref_out, ref_lse = reference.paged_prefill_gather(*plain.prefill_args, causal=causal,
                                                      scale=128 ** -0.5)
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kind", ["none", "tensor", "head"])
@pytest.mark.parametrize("kdtype", [torch.bfloat16, torch.float16, torch.float32])
def test_store_kv_rounds_exactly_like_torch(kind, kdtype):
    """Random K/V (many rounding cases, ties and binade edges among them, values past 448):
    the Triton store writes the same bytes as the torch reference."""
    gen = torch.Generator().manual_seed(3)
    hkv, d, bs, n = 8, 128, 16, 500
    ks, vs = _scales(kind, hkv)
    key = (torch.randn(n, hkv, d, generator=gen) * 8).to(DEVICE, kdtype)
    value = (torch.randn(n, hkv, d, generator=gen) * 8).to(DEVICE, kdtype)
    edges = torch.tensor([127.7, 128.0, 1.0625, 1.1875, 449.0, 464.0, -1e5, 2 ** -10])
    key[0, 0, :edges.numel()] = edges.to(DEVICE, kdtype) * (1 if ks is None else 0.02)
    slots = torch.randperm(64 * bs, generator=gen)[:n].to(DEVICE)
    slots[::7] = -1
    written = {}
    for backend in ("torch", "triton"):
        pool = torch.zeros(64, bs, 2, hkv, d, dtype=FP8_DTYPE, device=DEVICE)
        store_kv(key, value, pool[:, :, 0], pool[:, :, 1], slots, backend=backend,
                 k_scale=ks, v_scale=vs)
        written[backend] = pool.view(torch.uint8)
    mismatch = written["torch"] != written["triton"]
    assert not mismatch.any(), f"{int(mismatch.sum())} bytes differ"
    expected = quantize(key[slots >= 0], ks)
    flat = written["triton"][:, :, 0].reshape(-1, hkv, d)
    assert torch.equal(flat[slots[slots >= 0]], expected.view(torch.uint8))


def test_fast_path_uses_each_calls_scales():
    """Repeated same-shaped calls take the prepared launch; new scale tensors (or none) must
    still be the ones read."""
    batch, ks, vs = _decode_batch([700, 33, 2000], seed=7)
    first = _decode(batch, ks, vs)
    _assert_decode_close(batch, ks, vs, *first)
    ks2, vs2 = ks * 2, vs * 0.5
    _assert_decode_close(batch, ks2, vs2, *_decode(batch, ks2, vs2))
    _assert_decode_close(batch, ks2[0], None, *_decode(batch, ks2[0], None))
    _assert_decode_close(batch, None, None, *_decode(batch, None, None))
    again = _decode(batch, ks, vs)
    assert torch.equal(again[0], first[0])


def test_cuda_graph_replay_reads_the_scales_tensors():
    """A captured decode step reads the scale tensors at replay: updating them in place
    changes the result (the engine may calibrate scales without recapturing)."""
    batch, ks, vs = _decode_batch([300, 5000, 17], seed=31)
    q, kc, vc, bt, cl = batch.decode_args
    ws = torch.empty(workspace_size(q.shape[0], q.shape[1], q.shape[2]), dtype=torch.float32,
                     device=DEVICE)
    out = torch.empty_like(q)

    def step():
        paged_decode(q, kc, vc, bt, cl, out=out, workspace=ws, k_scale=ks, v_scale=vs)

    graph, _ = capture(step)
    for factor in (1.0, 1.5, 0.25):
        ks.mul_(factor)
        vs.mul_(factor)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_decode_close(batch, ks, vs, out, None)


def test_store_then_decode_as_the_engine_does():
    """Write the new tokens' K/V into the fp8 cache (per-head scales), then attend."""
    batch, ks, vs = _decode_batch([100, 33], seed=41)
    q, kc, vc, bt, cl = batch.decode_args
    new_k = torch.randn(2, 8, 128, device=DEVICE, dtype=torch.bfloat16)
    new_v = torch.randn_like(new_k)
    pos = cl.long()
    slots = bt.long().gather(1, (pos // 16)[:, None])[:, 0] * 16 + pos % 16
    store_kv(new_k, new_v, kc, vc, slots, k_scale=ks, v_scale=vs)
    cl += 1
    _assert_decode_close(batch, ks, vs, *_decode(batch, ks, vs))
    stored = kc[slots // 16, slots % 16]                             # [2, hkv, d]
    torch.testing.assert_close(stored.float() * ks[:, None], new_k.float(), atol=0.3,
                               rtol=0.07)


def _forbid(monkeypatch, name):
    from mini_paged_attn.ops import dispatch

    def fail(*args, **kwargs):
        raise AssertionError(f"{name} ran: the call did not take its prepared launch")
    monkeypatch.setattr(dispatch, name, fail)


@pytest.mark.direct_launch
@pytest.mark.parametrize("lens", [[4000], [1000] * 64])     # split and unsplit launches
def test_decode_repeat_with_other_scales_takes_the_prepared_launch(monkeypatch, lens):
    batch, ks, vs = _decode_batch(lens, seed=8)
    _assert_decode_close(batch, ks, vs, *_decode(batch, ks, vs))
    ks2, vs2 = ks * 1.5, vs * 0.75                 # same shapes, other values and pointers
    with monkeypatch.context() as patch:
        _forbid(patch, "check_paged_decode_args")
        _assert_decode_close(batch, ks2, vs2, *_decode(batch, ks2, vs2))
    # One scale for all heads: another key, the full path, and still right.
    _assert_decode_close(batch, ks2[0], vs2[0], *_decode(batch, ks2[0], vs2[0]))


@pytest.mark.direct_launch
def test_prefill_and_store_repeat_with_other_scales_take_the_prepared_launch(monkeypatch):
    base = make_prefill_batch([100, 1, 37], [0, 500, 16], num_q_heads=16, num_kv_heads=4,
                              head_size=128, block_size=16, seed=9, pool_layout=True,
                              device=DEVICE)
    ks, vs = _scales("head", 4)
    batch = fp8_batch(base, ks, vs, torch.bfloat16)
    paged_prefill(*batch.prefill_args, k_scale=ks, v_scale=vs)
    ks2, vs2 = ks * 2, vs * 0.5
    with monkeypatch.context() as patch:
        _forbid(patch, "check_paged_prefill_args")
        out = paged_prefill(*batch.prefill_args, k_scale=ks2, v_scale=vs2)
    plain = dequantized_batch(batch, ks2, vs2)
    ref, _ = reference.paged_prefill_gather(*plain.prefill_args, causal=True, scale=128 ** -0.5)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)

    key = torch.randn(5, 4, 128, device=DEVICE, dtype=torch.bfloat16)
    slots = torch.arange(5, device=DEVICE)
    store_kv(key, key, batch.key_cache, batch.value_cache, slots, k_scale=ks, v_scale=vs)
    with monkeypatch.context() as patch:
        _forbid(patch, "check_tensor")
        store_kv(key, key, batch.key_cache, batch.value_cache, slots, k_scale=ks2, v_scale=vs2)
    flat = batch.key_cache.reshape(-1, 4, 128)
    assert torch.equal(flat[slots].view(torch.uint8), quantize(key, ks2).view(torch.uint8))
