"""The Triton paged decode kernels (ops/decode.py) and their plan (ops/explain.py).

On CPU the kernels run through the Triton interpreter with small shapes and fp16/fp32 (bf16
``tl.dot`` is broken there); the interpreter tiles hold 16 KV tokens, so block sizes 1 and 4
take the per-token table lookup and 16, 32, 64 the one-lookup-per-tile path. On a GPU the same
tests run natively; test_decode_gpu.py adds full shapes, bf16, CUDA graphs and big pools.
"""

from __future__ import annotations

import logging

import pytest
import torch
import triton

from helpers.paged_batch import make_decode_batch
from helpers.reference_checks import assert_decode_matches_reference
from mini_paged_attn.ops.checks import check_paged_decode_args
from mini_paged_attn.ops.decode import triton_paged_decode, workspace_size
from mini_paged_attn.ops.dispatch import paged_decode
from mini_paged_attn.ops.attention.decode_plan import (FUSED_MERGE, DecodeTiles, default_tiles,
                                         explain_decode, plan_decode)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (num_q_heads, num_kv_heads, head_size, block_size, lengths, dtype, seed_layout)
CASES = [
    pytest.param(4, 4, 64, 16, [1, 15, 16, 17, 50], torch.float16, False, id="mha-d64-bs16"),
    pytest.param(8, 2, 80, 1, [1, 5, 33], torch.float32, True, id="gqa4-d80-bs1-seedlayout"),
    pytest.param(8, 1, 96, 64, [1, 63, 65, 130], torch.float16, False, id="mqa8-d96-bs64"),
    pytest.param(10, 2, 128, 4, [3, 4, 5, 40], torch.float32, True, id="gqa5-d128-bs4"),
    pytest.param(16, 2, 32, 32, [31, 33, 100], torch.float16, True, id="gqa8-d32-bs32"),
]


def _run(batch, *, num_splits=None, workspace=None, scale=None):
    out = torch.full_like(batch.query, float("nan"))   # every element must be written
    _, lse = paged_decode(*batch.decode_args, scale=scale, out=out, return_lse=True,
                          backend="triton", num_splits=num_splits, workspace=workspace)
    return out, lse


@pytest.mark.parametrize("hq, hkv, head_size, block_size, lens, dtype, seed_layout", CASES)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_matches_reference(hq, hkv, head_size, block_size, lens, dtype, seed_layout, num_splits):
    batch = make_decode_batch(lens, num_q_heads=hq, num_kv_heads=hkv, head_size=head_size,
                              block_size=block_size, dtype=dtype, seed=len(lens) + head_size,
                              pool_layout=seed_layout, device=DEVICE)
    out, lse = _run(batch, num_splits=num_splits)
    assert_decode_matches_reference(batch, out, lse)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_value_cache_with_strides_of_its_own(num_splits):
    # K and V caches usually share one layout; the kernel takes each cache's own strides.
    import dataclasses
    batch = make_decode_batch([37, 1, 20], num_q_heads=4, num_kv_heads=2, head_size=16,
                              block_size=4, dtype=torch.float16, seed=9, device=DEVICE)
    vc = batch.value_cache
    head_major = torch.empty(vc.shape[0], vc.shape[2], vc.shape[1], vc.shape[3],
                             dtype=vc.dtype, device=vc.device).transpose(1, 2)
    head_major.copy_(vc)
    assert head_major.stride() != batch.key_cache.stride()
    batch = dataclasses.replace(batch, value_cache=head_major)
    out, lse = _run(batch, num_splits=num_splits)
    assert_decode_matches_reference(batch, out, lse)


def test_auto_plan_splits_small_batches():
    # 2 seqs x 2 kv heads on 132 assumed SMs: the heuristic splits (the interpreter tiles).
    plan = plan_decode(2, 8, 2, 64, 40 * 16, 16, torch.float16, 132, on_gpu=False)
    assert plan.num_splits > 1 and plan.split_reason == "heuristic"


def test_forced_splits_agree_with_each_other():
    batch = make_decode_batch([97, 40, 1], num_q_heads=4, num_kv_heads=2, head_size=64,
                              block_size=8, dtype=torch.float32, seed=7, device=DEVICE)
    results = [_run(batch, num_splits=s) for s in (1, 2, 4, 7, 16)]
    for out, lse in results:
        assert_decode_matches_reference(batch, out, lse)
        torch.testing.assert_close(out, results[0][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, results[0][1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_empty_sequence_gives_zeros_and_minus_inf(num_splits):
    batch = make_decode_batch([0, 20, 0], num_q_heads=4, num_kv_heads=2, head_size=64,
                              block_size=16, dtype=torch.float16, seed=3, device=DEVICE)
    out, lse = _run(batch, num_splits=num_splits)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], out[0])
    assert torch.isinf(lse[[0, 2]]).all() and (lse[[0, 2]] < 0).all()
    assert_decode_matches_reference(batch, out, lse)


def test_empty_batch_launches_nothing():
    batch = make_decode_batch([5], num_q_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                              dtype=torch.float16, seed=4, device=DEVICE)
    q, kc, vc, bt, cl = batch.decode_args
    out, lse = paged_decode(q[:0], kc, vc, bt[:0], cl[:0], backend="triton", return_lse=True)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)


def test_custom_scale():
    batch = make_decode_batch([30, 9], num_q_heads=4, num_kv_heads=2, head_size=64,
                              block_size=16, dtype=torch.float32, seed=11, device=DEVICE)
    out, lse = _run(batch, num_splits=2, scale=0.3)
    assert_decode_matches_reference(batch, out, lse, scale=0.3)


def test_num_splits_1_is_batch_invariant():
    batch = make_decode_batch([50, 17, 33], num_q_heads=8, num_kv_heads=2, head_size=64,
                              block_size=16, dtype=torch.float16, seed=5, device=DEVICE)
    out_batch, _ = _run(batch, num_splits=1)
    for i in range(3):
        q, kc, vc, bt, cl = batch.decode_args
        alone = paged_decode(q[i:i + 1], kc, vc, bt[i:i + 1], cl[i:i + 1], backend="triton",
                             num_splits=1)
        assert torch.equal(alone, out_batch[i:i + 1])


@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_seq_order_changes_the_grid_order_not_the_results(num_splits):
    """Programs that take the sequences in another order (longest first, or a shuffle)
    compute every sequence exactly as in order: same output and lse, bit for bit, and the
    reference's; NaN-poisoned unused slots and an empty sequence included."""
    lens = [17, 0, 130, 1, 15, 16, 64]
    batch = make_decode_batch(lens, num_q_heads=8, num_kv_heads=2, head_size=32, block_size=16,
                              dtype=torch.float16, seed=11, pool_layout=True, device=DEVICE)
    out, lse = _run(batch, num_splits=num_splits)
    lens_t = torch.tensor(lens)
    for order in (torch.argsort(lens_t, descending=True, stable=True),
                  torch.randperm(len(lens), generator=torch.Generator().manual_seed(3))):
        ordered = torch.full_like(batch.query, float("nan"))
        _, ordered_lse = paged_decode(*batch.decode_args, out=ordered, return_lse=True,
                                      backend="triton", num_splits=num_splits,
                                      seq_order=order.to(torch.int32).to(DEVICE))
        assert torch.equal(ordered, out) and torch.equal(ordered_lse, lse)
        assert_decode_matches_reference(batch, ordered, ordered_lse)


def test_workspace_is_used_and_checked():
    batch = make_decode_batch([60, 20], num_q_heads=4, num_kv_heads=2, head_size=64,
                              block_size=16, dtype=torch.float16, seed=13, device=DEVICE)
    ws = torch.empty(workspace_size(2, 4, 64, 4), dtype=torch.float32, device=DEVICE)
    out, lse = _run(batch, num_splits=4, workspace=ws)
    assert_decode_matches_reference(batch, out, lse)
    out_auto, lse_auto = _run(batch, workspace=ws)   # heuristic capped to the 4 splits it holds
    assert_decode_matches_reference(batch, out_auto, lse_auto)
    out = torch.zeros_like(batch.query)
    with pytest.raises(ValueError, match="workspace"):
        paged_decode(*batch.decode_args, out=out, backend="triton", num_splits=5, workspace=ws)
    with pytest.raises(ValueError, match="workspace"):
        paged_decode(*batch.decode_args, out=out, backend="triton", workspace=ws.half())
    assert not out.any()  # nothing written on error


@pytest.mark.parametrize("bad", ["head_size", "num_splits"])
def test_unsupported_input_raises_before_launch(bad):
    head_size, block_size, num_splits = 64, 16, 2
    if bad == "head_size":
        head_size = 512
    else:
        num_splits = 0
    batch = make_decode_batch([5], num_q_heads=2, num_kv_heads=1, head_size=head_size,
                              block_size=block_size, dtype=torch.float16, seed=1, device=DEVICE)
    out = torch.zeros_like(batch.query)
    with pytest.raises(ValueError, match=bad):
        paged_decode(*batch.decode_args, out=out, backend="triton", num_splits=num_splits)
    assert not out.any()


def test_tile_override_spans_and_splits_blocks():
    # BLOCK_N 32 over block_size 16 (two lookups per tile) and over block_size 64 (part of one).
    for block_size in (16, 64):
        batch = make_decode_batch([70, 3], num_q_heads=4, num_kv_heads=4, head_size=64,
                                  block_size=block_size, dtype=torch.float16, seed=block_size, device=DEVICE)
        shapes = check_paged_decode_args(*batch.decode_args, None, None)
        out = torch.full_like(batch.query, float("nan"))
        lse = torch.full(batch.query.shape[:2], float("nan"), device=DEVICE)
        triton_paged_decode(*batch.decode_args, shapes, out=out, lse=lse, num_splits=2,
                            tiles=DecodeTiles(block_n=32, num_warps=4, num_stages=1))
        assert_decode_matches_reference(batch, out, lse)


def test_explain_decode_says_what_runs_and_why():
    small = explain_decode(1, 32, 8, 128, 4096, device="cpu")
    assert small.num_splits > 1 and small.programs == 8 * small.num_splits
    assert small.efficiency > small.efficiency_unsplit
    text = str(small)
    assert "split-KV" in text and f"{small.num_splits} splits" in text and "132 SMs" in text
    # Eager calls merge in the decode kernel (FUSED_MERGE) or in 32 merge programs.
    for fused, merge_programs, says in ((True, 0, "one launch"), (False, 32, "+ merge")):
        plan = plan_decode(1, 32, 8, 128, 4096, 16, torch.bfloat16, 132, fused_merge=fused)
        assert plan.num_splits == small.num_splits and plan.fused_merge is fused
        assert plan.merge_programs == merge_programs and says in str(plan)
    assert small.fused_merge is FUSED_MERGE
    # The heuristic counts split tiles (32 tokens), whatever tiles the launch then uses.
    few = explain_decode(17, 32, 8, 128, 48, device="cpu")
    assert few.num_splits == 1 and few.heuristic_kv_tiles == 2
    assert "over 2 kv tiles chose 1 split;" in str(few)
    big = explain_decode(256, 32, 8, 128, 4096, device="cpu")
    assert big.num_splits == 1 and big.merge_programs == 0 and "no split" in str(big)
    # Unsplit tiles never depend on the batch: the precondition of batch invariance.
    unsplit = {plan_decode(n, 32, 8, 128, 4096, 16, torch.bfloat16, 132, num_splits=1).tiles
               for n in (1, 3, 256)}
    assert unsplit == {big.tiles} and small.block_h == 16
    with pytest.raises(ValueError, match="num_q_heads"):
        explain_decode(1, 30, 8, 128, 4096)


@pytest.mark.parametrize("head_size, dtype, block_size, split, expected", [
    (128, torch.bfloat16, 16, False, DecodeTiles(128, 4, 3)),   # 32 KB K tiles
    (128, torch.float16, 1, False, DecodeTiles(128, 8, 3)),     # per-token lookups: 8 warps
    (128, torch.bfloat16, 128, False, DecodeTiles(64, 4, 3)),   # big blocks: 16 KB tiles
    (64, torch.bfloat16, 16, False, DecodeTiles(256, 4, 3)),
    (256, torch.bfloat16, 16, False, DecodeTiles(64, 4, 3)),
    (256, torch.float32, 128, False, DecodeTiles(16, 4, 3)),
    (8, torch.float16, 16, False, DecodeTiles(256, 4, 3)),      # capped, not 2048
    (128, torch.bfloat16, 16, True, DecodeTiles(32, 4, 5)),     # split launches: short tiles
    (64, torch.float16, 16, True, DecodeTiles(128, 4, 3)),
])
def test_gpu_tiles_as_measured(head_size, dtype, block_size, split, expected):
    assert default_tiles(head_size, dtype, True, split, block_size=block_size) == expected


def test_gpu_tiles_stay_bounded_and_follow_the_block_size():
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for head_size in range(1, 257):
            padded = max(16, triton.next_power_of_2(head_size))
            for block_size in (1, 2, 16, 64, 128, 256):
                for split in (False, True):
                    t = default_tiles(head_size, dtype, True, split, block_size=block_size)
                    # What the kernel holds of one K tile: at most 32 KB, at most 256 tokens.
                    assert 16 <= t.block_n <= 256
                    assert t.block_n * padded * dtype.itemsize <= 32768
            # The planner passes the cache's block size on (tiles differ at 1 and 128).
            plans = {bs: plan_decode(256, 32, 8, head_size, 4096, bs, dtype, 132).tiles
                     for bs in (1, 16, 128)}
            assert plans == {bs: default_tiles(head_size, dtype, True, False, block_size=bs)
                             for bs in (1, 16, 128)}


def test_explain_flag_logs_the_plan(caplog):
    batch = make_decode_batch([20], num_q_heads=4, num_kv_heads=2, head_size=64,
                              block_size=16, dtype=torch.float16, seed=2, device=DEVICE)
    with caplog.at_level(logging.INFO, logger="mini_paged_attn.ops.decode"):
        paged_decode(*batch.decode_args, backend="triton", num_splits=2, explain=True)
    assert "num_splits=2 was forced" in caplog.text and "kernel:" in caplog.text

