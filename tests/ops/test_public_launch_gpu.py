"""The public launch path against the direct one on a GPU: with
``MINI_PAGED_ATTN_PUBLIC_LAUNCH=1`` every op launches through ``kernel[grid](...)`` and
prefill runs the Triton kernel; the results must be those of the direct launches (the same
bits where both run the same kernel, the reference's where the direct path runs the Gluon
kernel). Each op runs three times on new tensors of one shape: the second and third calls are
the direct path's prepared repeats.

Run: ``pytest -m gpu tests/ops/test_public_launch_gpu.py`` on a CUDA machine with a tested
Triton (skipped where the direct launch is off: nothing to compare with).
"""

from __future__ import annotations

import pytest
import torch

from helpers.paged_batch import make_decode_batch, make_prefill_batch
from mini_paged_attn import flash_attn_varlen_func
from mini_paged_attn.ops import dispatch, launch, reference, triton_support, varlen
from mini_paged_attn.ops.dispatch import paged_decode, paged_prefill, store_kv
from mini_paged_attn.ops.fused import rms_norm, silu_and_mul

pytestmark = [pytest.mark.gpu, pytest.mark.direct_launch]

SEEDS = (1, 2, 3)


def _forget_launches() -> None:
    for cache in (dispatch._DECODE_RUNS, dispatch._PREFILL_RUNS, dispatch._STORE_RUNS,
                  varlen._CONTIGUOUS_RUNS, launch._LAUNCHES):
        cache.clear()


def _both_paths(monkeypatch, run):
    """``run()`` (a list of tensors) on the direct path, then with the public launch forced;
    both lists, computed from scratch (no launch kept from before)."""
    _forget_launches()
    direct = run()
    torch.cuda.synchronize()
    with monkeypatch.context() as patch:
        patch.setenv(triton_support.PUBLIC_LAUNCH_ENV, "1")
        triton_support.triton_support.cache_clear()
        _forget_launches()
        assert not triton_support.direct_launch_enabled()
        public = run()
        torch.cuda.synchronize()
    triton_support.triton_support.cache_clear()
    _forget_launches()
    assert len(direct) == len(public)
    return direct, public


def _assert_same_bits(direct, public):
    for i, (a, b) in enumerate(zip(direct, public)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"output {i} differs"


@pytest.mark.parametrize("lens", [[4000], [1000] * 64, [300, 17, 0, 2000]])
@pytest.mark.parametrize("return_lse", [False, True])
def test_decode_gives_the_bits_of_the_direct_launch(monkeypatch, lens, return_lse):
    def run():
        outs = []
        for seed in SEEDS:
            batch = make_decode_batch(lens, num_q_heads=32, num_kv_heads=8, head_size=128,
                                      block_size=16, dtype=torch.bfloat16, seed=seed,
                                      pool_layout=True, device="cuda")
            result = paged_decode(*batch.decode_args, return_lse=return_lse)
            outs += list(result) if return_lse else [result]
        return outs
    _assert_same_bits(*_both_paths(monkeypatch, run))


@pytest.mark.parametrize("q_lens, prefix_lens", [
    ([100, 1, 37], [0, 500, 16]),            # short queries: the Triton kernel either way
    ([1, 1, 1, 1], [3000, 20, 700, 64]),     # decode rows through prefill
])
def test_prefill_gives_the_bits_of_the_direct_launch(monkeypatch, q_lens, prefix_lens):
    def run():
        outs = []
        for seed in SEEDS:
            batch = make_prefill_batch(q_lens, prefix_lens, num_q_heads=16, num_kv_heads=4,
                                       head_size=128, block_size=16, dtype=torch.bfloat16,
                                       seed=seed, pool_layout=True, device="cuda")
            outs += list(paged_prefill(*batch.prefill_args, return_lse=True))
        return outs
    _assert_same_bits(*_both_paths(monkeypatch, run))


def test_long_prefill_matches_the_reference_on_both_paths(monkeypatch):
    """Long queries: on an H100 / H200 the direct path runs the Gluon kernel and the public
    one the Triton kernel; both match the reference."""
    batches = [make_prefill_batch([600, 300], [0, 400], num_q_heads=32, num_kv_heads=8,
                                  head_size=128, block_size=16, dtype=torch.bfloat16,
                                  seed=seed, pool_layout=True, device="cuda")
               for seed in SEEDS]

    def run():
        return [paged_prefill(*b.prefill_args) for b in batches]
    direct, public = _both_paths(monkeypatch, run)
    for batch, a, b in zip(batches, direct, public):
        ref, _ = reference.paged_prefill_gather(*batch.prefill_args, causal=True,
                                                scale=128 ** -0.5)
        torch.testing.assert_close(a.float(), ref, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(b.float(), ref, atol=2e-2, rtol=2e-2)


def test_contiguous_varlen_with_descriptors_gives_the_bits_of_the_direct_launch(monkeypatch):
    """Queries long enough for the tensor-descriptor tiles, K/V too short for the Gluon
    kernel: the Triton kernel on both paths, its descriptors over new K/V at each repeat."""
    q_lens, k_lens = [200, 160], [200, 240]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32,
                               device="cuda") for x in (q_lens, k_lens))

    def run():
        outs = []
        for seed in SEEDS:
            gen = torch.Generator(device="cuda").manual_seed(seed)
            q = torch.randn(sum(q_lens), 32, 128, device="cuda", dtype=torch.bfloat16,
                            generator=gen)
            k, v = (torch.randn(sum(k_lens), 8, 128, device="cuda", dtype=torch.bfloat16,
                                generator=gen) for _ in range(2))
            outs.append(flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens),
                                               causal=True))
        return outs
    _assert_same_bits(*_both_paths(monkeypatch, run))


def test_store_kv_and_fused_ops_give_the_bits_of_the_direct_launch(monkeypatch):
    def run():
        outs = []
        for seed in SEEDS:
            gen = torch.Generator(device="cuda").manual_seed(seed)
            pool = torch.full((8, 16, 2, 4, 64), float("nan"), dtype=torch.bfloat16,
                              device="cuda")
            k, v = (torch.randn(5, 4, 64, generator=gen, device="cuda").to(torch.bfloat16)
                    for _ in range(2))
            slots = torch.randperm(128, generator=gen, device="cuda")[:5]
            store_kv(k, v, pool[:, :, 0], pool[:, :, 1], slots)
            x = torch.randn(7, 256, generator=gen, device="cuda").to(torch.bfloat16)
            w = torch.randn(256, generator=gen, device="cuda").to(torch.bfloat16)
            outs += [pool, rms_norm(x, w, 1e-6), silu_and_mul(x)]
        return outs
    _assert_same_bits(*_both_paths(monkeypatch, run))
