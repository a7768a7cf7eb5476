"""The Triton paged decode on a GPU: full shapes, bf16, CUDA graphs, batch invariance, big pools.

Run: ``pytest -m gpu tests/ops/test_decode_gpu.py`` on a CUDA machine (skipped without one).
"""

from __future__ import annotations

import pytest
import torch

from helpers.cuda_graphs import capture
from helpers.paged_batch import PagedBatch, make_decode_batch
from helpers.reference_checks import assert_decode_matches_reference
from mini_paged_attn.ops import reference
from mini_paged_attn.ops.decode import workspace_size
from mini_paged_attn.ops.dispatch import paged_decode
from mini_paged_attn.ops.attention.decode_plan import MAX_SPLITS

pytestmark = pytest.mark.gpu

LENS = [1, 15, 16, 17, 255, 1000, 4097, 2048]


def _batch(lens=LENS, *, hq=32, hkv=8, head_size=128, block_size=16, dtype=torch.bfloat16,
           seed=0, seed_layout=True):
    return make_decode_batch(lens, num_q_heads=hq, num_kv_heads=hkv, head_size=head_size,
                             block_size=block_size, dtype=dtype, seed=seed,
                             pool_layout=seed_layout, device="cuda")


def _run(batch, **kwargs):
    out = torch.full_like(batch.query, float("nan"))
    _, lse = paged_decode(*batch.decode_args, out=out, return_lse=True, **kwargs)
    return out, lse


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
def test_head_sizes_and_dtypes(dtype, head_size):
    batch = _batch(head_size=head_size, dtype=dtype, seed=head_size)
    for num_splits in (None, 1):
        assert_decode_matches_reference(batch, *_run(batch, num_splits=num_splits))


@pytest.mark.parametrize("block_size", [1, 2, 8, 32, 64, 128, 256])
def test_block_sizes(block_size):
    batch = _batch(block_size=block_size, seed=block_size, seed_layout=block_size % 2 == 0)
    for num_splits in (None, 1):
        assert_decode_matches_reference(batch, *_run(batch, num_splits=num_splits))


@pytest.mark.parametrize("hq, hkv", [(32, 32), (32, 4), (40, 8), (32, 1), (64, 2)])
def test_gqa_ratios(hq, hkv):
    batch = _batch(hq=hq, hkv=hkv, seed=hq + hkv)
    for num_splits in (None, 1):
        assert_decode_matches_reference(batch, *_run(batch, num_splits=num_splits))


def test_fp32():
    batch = _batch(dtype=torch.float32, head_size=96, seed=4)
    assert_decode_matches_reference(batch, *_run(batch))


def test_forced_splits_agree():
    batch = _batch(seed=9)
    base_out, base_lse = _run(batch, num_splits=1)
    for s in (2, 3, 8, 33, MAX_SPLITS):
        out, lse = _run(batch, num_splits=s)
        assert_decode_matches_reference(batch, out, lse)
        torch.testing.assert_close(out, base_out, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse, base_lse, atol=1e-3, rtol=1e-3)


def test_num_splits_1_is_batch_invariant():
    """A sequence's output is bitwise the same alone and inside a batch of others."""
    lens = [4097, 3, 777, 16, 12000, 64] * 8
    batch = _batch(lens, seed=21)
    out = paged_decode(*batch.decode_args, num_splits=1)
    q, kc, vc, bt, cl = batch.decode_args
    for i in (0, 4, 13, 46):
        alone = paged_decode(q[i:i + 1], kc, vc, bt[i:i + 1], cl[i:i + 1], num_splits=1)
        assert torch.equal(alone, out[i:i + 1]), f"sequence {i} differs alone vs in the batch"
    again = paged_decode(*batch.decode_args, num_splits=1)
    assert torch.equal(again, out)   # deterministic


def test_cuda_graph_capture_and_replay():
    """Capture one decode step (split-KV path, workspace given), then replay it on new data."""
    batch = _batch([300, 5000, 17], seed=31)    # 3 seqs x 8 kv heads: the heuristic splits
    q, kc, vc, bt, cl = batch.decode_args
    ws = torch.empty(workspace_size(q.shape[0], q.shape[1], q.shape[2]), dtype=torch.float32,
                     device="cuda")
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device="cuda")

    def step():
        _, lse_ = paged_decode(q, kc, vc, bt, cl, out=out, return_lse=True, workspace=ws)
        lse.copy_(lse_)

    graph, _ = capture(step)

    for trial in range(3):
        q.copy_(torch.randn_like(q))
        cl.copy_(torch.tensor([300 - trial, 5000 - 7 * trial, 17 - 5 * trial], dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_decode_matches_reference(PagedBatch.decode(q, kc, vc, bt, cl), out, lse)


def test_seq_order_under_a_cuda_graph():
    """A captured split launch that takes its sequences in the order a tensor holds: replays
    with new lengths and a new order give the unordered launch's results, bit for bit."""
    lens = [300, 5000, 17, 2048, 1]
    batch = _batch(lens, seed=33)
    q, kc, vc, bt, cl = batch.decode_args
    ws = torch.empty(workspace_size(q.shape[0], q.shape[1], q.shape[2]), dtype=torch.float32,
                     device="cuda")
    order = torch.arange(len(lens), dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    graph, _ = capture(lambda: paged_decode(q, kc, vc, bt, cl, out=out, workspace=ws,
                                            seq_order=order))
    gen = torch.Generator().manual_seed(2)
    for trial in range(3):
        # Shorter than written (the pool is NaN past each sequence's tokens).
        cl.copy_(torch.tensor([300 - trial, 5000 - 7 * trial, 17 - 5 * trial, 2048 - trial, 1],
                              dtype=torch.int32))
        longest_first = torch.argsort(cl, descending=True).cpu()
        new_order = (longest_first, longest_first.flip(0), torch.randperm(5, generator=gen))[trial]
        order.copy_(new_order.to(torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        expected = paged_decode(q, kc, vc, bt, cl, workspace=ws)
        assert torch.equal(out, expected)
        assert_decode_matches_reference(PagedBatch.decode(q, kc, vc, bt, cl), out, None)


def test_pool_over_2_pow_31_elements():
    """Blocks past element 2^31 of a seed-layout pool are addressed correctly (64-bit offsets)."""
    block_size, hkv, d = 16, 8, 128
    per_block = block_size * 2 * hkv * d
    num_blocks = (2 ** 31) // per_block + 4096            # ~2.2e9 fp16 elements, 4.4 GB
    try:
        pool = torch.empty((num_blocks, block_size, 2, hkv, d), dtype=torch.float16,
                           device="cuda")
    except torch.OutOfMemoryError:
        pytest.skip("not enough GPU memory for a 4.4 GB pool")
    lens = [40, 3000]
    needed = [-(-n // block_size) for n in lens]
    top = torch.arange(num_blocks - sum(needed), num_blocks, device="cuda")
    top = top[torch.randperm(top.numel(), device="cuda")].to(torch.int32)
    tables = torch.zeros(len(lens), max(needed), dtype=torch.int32, device="cuda")
    tables[0, :needed[0]], tables[1] = top[:needed[0]], top[needed[0]:]
    pool[top.long()] = torch.randn((top.numel(), block_size, 2, hkv, d), device="cuda").half()
    assert int(top.min()) * per_block > 2 ** 31        # every used block lies past 2^31
    query = torch.randn(len(lens), 32, d, device="cuda", dtype=torch.float16)
    batch = PagedBatch.decode(query, pool[:, :, 0], pool[:, :, 1], tables,
                              torch.tensor(lens, dtype=torch.int32, device="cuda"))
    for num_splits in (None, 1):
        assert_decode_matches_reference(batch, *_run(batch, num_splits=num_splits))
    del pool


def test_store_kv_then_decode_matches_reference():
    """A decode step as the engine runs it: write the new token's K/V, then attend."""
    batch = _batch([100, 33], seed=41, seed_layout=True)
    q, kc, vc, bt, cl = batch.decode_args
    new_k = torch.randn(2, 8, 128, device="cuda", dtype=torch.bfloat16)
    new_v = torch.randn_like(new_k)
    pos = cl.long()                                   # the new token's position
    slots = bt.long().gather(1, (pos // 16)[:, None])[:, 0] * 16 + pos % 16
    from mini_paged_attn.ops.dispatch import store_kv
    store_kv(new_k, new_v, kc, vc, slots)
    cl += 1
    out, lse = _run(batch)
    ref_out, _ = reference.paged_decode_gather(*batch.decode_args, scale=128 ** -0.5)
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
