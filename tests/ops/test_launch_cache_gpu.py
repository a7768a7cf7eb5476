"""The ops' prepared launches on a GPU: a repeated call skips checks and planning, and still
computes the right thing for its own tensors; anything that differs takes the full path.

Run: ``pytest -m gpu tests/ops/test_launch_cache_gpu.py`` on a CUDA machine.
"""

from __future__ import annotations

import pytest
import torch

from helpers.paged_batch import make_decode_batch, make_prefill_batch
from helpers.reference_checks import assert_decode_matches_reference
from mini_paged_attn.ops import dispatch, reference
from mini_paged_attn.ops.dispatch import paged_decode, paged_prefill, store_kv

pytestmark = pytest.mark.gpu


def _decode_batch(lens, seed):
    return make_decode_batch(lens, num_q_heads=32, num_kv_heads=8, head_size=128, block_size=16,
                             dtype=torch.bfloat16, seed=seed, pool_layout=True, device="cuda")


def _forbid_full_path(monkeypatch, name):
    def fail(*args, **kwargs):
        raise AssertionError(f"{name} ran: the call did not take its prepared launch")
    monkeypatch.setattr(dispatch, name, fail)


# Batch 1 x 4k splits (one launch, merged in the kernel); 64 sequences do not.
@pytest.mark.direct_launch     # asserts that the prepared launch repeated
@pytest.mark.parametrize("lens", [[4000], [1000] * 64])
def test_decode_repeat_uses_the_prepared_launch(monkeypatch, lens):
    first = _decode_batch(lens, seed=1)
    assert_decode_matches_reference(first, paged_decode(*first.decode_args), None)
    second = _decode_batch(lens, seed=2)      # same shapes, other values and pointers
    with monkeypatch.context() as patch:
        _forbid_full_path(patch, "check_paged_decode_args")
        assert_decode_matches_reference(second, paged_decode(*second.decode_args), None)
    out = torch.full_like(second.query, float("nan"))
    # return_lse and out: a new key, so the full path
    _, lse = paged_decode(*second.decode_args, out=out, return_lse=True)
    assert_decode_matches_reference(second, out, lse)
    with monkeypatch.context() as patch:
        _forbid_full_path(patch, "check_paged_decode_args")
        out.fill_(float("nan"))
        _, lse = paged_decode(*second.decode_args, out=out, return_lse=True)
        assert_decode_matches_reference(second, out, lse)


def test_decode_misaligned_pointer_takes_the_full_path():
    batch = _decode_batch([300, 17], seed=3)
    paged_decode(*batch.decode_args)
    # The same shapes and strides, but the query starts 2 bytes into its storage.
    storage = torch.randn(batch.query.numel() + 1, device="cuda").to(torch.bfloat16)
    query = storage[1:].view_as(batch.query)
    assert query.data_ptr() % 16 != 0
    batch.query = query
    assert_decode_matches_reference(batch, paged_decode(*batch.decode_args), None)


def test_decode_bad_argument_after_a_cached_call_still_raises():
    batch = _decode_batch([100], seed=4)
    paged_decode(*batch.decode_args)
    with pytest.raises(ValueError, match="context_lens"):
        paged_decode(*batch.decode_args[:4], batch.context_lens.to(torch.int64))
    with pytest.raises(ValueError, match="scale"):
        paged_decode(*batch.decode_args, scale=-1.0)


@pytest.mark.direct_launch     # asserts that the prepared launch repeated
def test_prefill_repeat_uses_the_prepared_launch(monkeypatch):
    def batch(seed):
        return make_prefill_batch([100, 1, 37], [0, 500, 16], num_q_heads=16, num_kv_heads=4,
                                  head_size=128, block_size=16, dtype=torch.bfloat16,
                                  seed=seed, pool_layout=True, device="cuda")
    paged_prefill(*batch(5).prefill_args)
    second = batch(6)
    _forbid_full_path(monkeypatch, "check_paged_prefill_args")
    out = paged_prefill(*second.prefill_args)
    ref, _ = reference.paged_prefill_gather(*second.prefill_args, causal=True, scale=128 ** -0.5)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.direct_launch     # asserts that the prepared launch repeated
def test_prefill_repeats_over_other_caches_and_back(monkeypatch):
    """Long queries: on Hopper the kernel reads the caches through tensor descriptors, whose
    encodings the prepared launch keeps per pointer; a repeat over other caches, then over the
    first ones again, must attend over each call's own caches."""
    def batch(seed):
        return make_prefill_batch([200, 150], [0, 300], num_q_heads=16, num_kv_heads=4,
                                  head_size=128, block_size=16, dtype=torch.bfloat16,
                                  seed=seed, pool_layout=True, device="cuda")
    first, second = batch(8), batch(9)
    paged_prefill(*first.prefill_args)
    _forbid_full_path(monkeypatch, "check_paged_prefill_args")
    for current in (second, first, second):
        out = paged_prefill(*current.prefill_args)
        ref, _ = reference.paged_prefill_gather(*current.prefill_args, causal=True,
                                                scale=128 ** -0.5)
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.direct_launch     # asserts that the prepared launch repeated
def test_store_kv_repeat_uses_the_prepared_launch(monkeypatch):
    gen = torch.Generator(device="cuda").manual_seed(7)
    pool = torch.zeros(8, 16, 2, 4, 64, dtype=torch.bfloat16, device="cuda")
    kc, vc = pool[:, :, 0], pool[:, :, 1]

    def tokens():
        k = torch.randn(5, 4, 64, generator=gen, device="cuda").to(torch.bfloat16)
        v = torch.randn(5, 4, 64, generator=gen, device="cuda").to(torch.bfloat16)
        slots = torch.randperm(128, generator=gen, device="cuda")[:5]
        return k, v, slots

    store_kv(*tokens()[:2], kc, vc, tokens()[2])
    k, v, slots = tokens()
    _forbid_full_path(monkeypatch, "check_tensor")
    store_kv(k, v, kc, vc, slots)
    flat_k, flat_v = kc.reshape(-1, 4, 64), vc.reshape(-1, 4, 64)
    torch.testing.assert_close(flat_k[slots], k, atol=0, rtol=0)
    torch.testing.assert_close(flat_v[slots], v, atol=0, rtol=0)


def test_fused_ops_repeat_their_launches_with_new_tensors():
    from mini_paged_attn.ops.fused import silu_and_mul, silu_and_mul_reference
    gen = torch.Generator(device="cuda").manual_seed(8)
    for _ in range(3):      # the first launch prepares, the others repeat it
        x = torch.randn(7, 2 * 96, generator=gen, device="cuda").to(torch.bfloat16)
        torch.testing.assert_close(silu_and_mul(x), silu_and_mul_reference(x), atol=1e-2,
                                   rtol=1e-2)
    # The same shapes, but the input starts 2 bytes into its storage: the JIT specialises anew.
    storage = torch.randn(7 * 2 * 96 + 1, generator=gen, device="cuda").to(torch.bfloat16)
    x = storage[1:].view(7, 2 * 96)
    assert x.data_ptr() % 16 != 0
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_reference(x), atol=1e-2, rtol=1e-2)
