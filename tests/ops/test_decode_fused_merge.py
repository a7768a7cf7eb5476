"""Split-KV decode merged inside the decode kernel (``FUSED_MERGE``): the last split of each
(sequence, KV head) to finish merges, counted by int32 counters that every launch leaves at 0.

On CPU the kernels run through the Triton interpreter, one program after another, so the
last-ticket logic runs in a fixed order there; the GPU tests (``-m gpu``) run it with the
programs racing, under CUDA graphs and on two streams.
"""

from __future__ import annotations

import pytest
import torch

from helpers.cuda_graphs import capture
from helpers.paged_batch import make_decode_batch
from helpers.reference_checks import assert_decode_matches_reference
from mini_paged_attn.ops import decode as decode_mod
from mini_paged_attn.ops.attention import decode_plan as explain
from mini_paged_attn.ops.checks import check_paged_decode_args
from mini_paged_attn.ops.decode import triton_paged_decode, workspace_size
from mini_paged_attn.ops.decode_merge import merge_chunk, merge_rows
from mini_paged_attn.ops.dispatch import paged_decode

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _batch(lens, *, hq=4, hkv=2, head_size=32, block_size=16, dtype=torch.float32, seed=0):
    return make_decode_batch(lens, num_q_heads=hq, num_kv_heads=hkv, head_size=head_size,
                             block_size=block_size, dtype=dtype, seed=seed, pool_layout=True,
                             device=DEVICE)


def _fused(batch, num_splits, counters, *, with_lse=True, **kwargs):
    """One fused split launch on NaN-filled outputs (every element must be written)."""
    shapes = check_paged_decode_args(*batch.decode_args, None, None)
    out = torch.full_like(batch.query, float("nan"))
    lse = (torch.full(batch.query.shape[:2], float("nan"), device=DEVICE) if with_lse
           else None)
    triton_paged_decode(*batch.decode_args, shapes, out=out, lse=lse, num_splits=num_splits,
                        fused_merge=True, counters=counters, **kwargs)
    return out, lse


# (num_q_heads, num_kv_heads, head_size, block_size, lengths, dtype, num_splits)
CASES = [
    pytest.param(4, 4, 32, 16, [1, 15, 16, 17, 40], torch.float16, 2, id="mha-bs16-s2"),
    pytest.param(8, 2, 32, 4, [1, 3, 4, 5, 33], torch.float32, 3, id="gqa4-bs4-s3"),
    # Group 5 pads to 8 merge rows.
    pytest.param(10, 2, 128, 8, [7, 9, 70, 128], torch.float32, 7, id="gqa5-d128-s7"),
    # 16 rows x 256 dims: 2 splits a chunk, so 8 splits take 4 chunks, and at 128 tokens
    # (8 tiles of 16) every split has work: a later chunk's max often exceeds the earlier
    # ones', which the online merge must rescale.
    pytest.param(16, 1, 256, 16, [5, 128], torch.float32, 8, id="mqa16-d256-s8-chunks"),
    pytest.param(8, 1, 64, 32, [1, 31, 32, 33, 100], torch.float16, 6, id="mqa8-bs32-s6"),
    pytest.param(6, 3, 48, 16, [1, 15, 17, 64], torch.float16, 5, id="gqa2-d48-s5"),
]


@pytest.mark.parametrize("hq, hkv, head_size, block_size, lens, dtype, num_splits", CASES)
def test_fused_merge_matches_reference(hq, hkv, head_size, block_size, lens, dtype,
                                       num_splits):
    batch = _batch(lens, hq=hq, hkv=hkv, head_size=head_size, block_size=block_size,
                   dtype=dtype, seed=num_splits)
    counters = torch.zeros(len(lens) * hkv, dtype=torch.int32, device=DEVICE)
    out, lse = _fused(batch, num_splits, counters)
    assert_decode_matches_reference(batch, out, lse)
    assert not counters.any(), "the merging program must set its counter back to 0"


def test_counters_and_workspace_are_reused_across_calls():
    # One workspace and one counter buffer for calls of several batches and split counts: each
    # call must find its counters at 0 (else no program, or the wrong one, merges).
    counters = torch.zeros(3 * 2, dtype=torch.int32, device=DEVICE)
    ws = torch.full((workspace_size(3, 4, 32, 6),), float("nan"), device=DEVICE)
    for seed, (lens, splits) in enumerate([([40, 1, 17], 2), ([5, 90], 6), ([33, 33, 2], 4),
                                           ([40, 1, 17], 2)]):
        batch = _batch(lens, seed=seed)
        out, lse = _fused(batch, splits, counters, workspace=ws)
        assert_decode_matches_reference(batch, out, lse)
        assert not counters.any()


def test_fused_and_two_launch_merges_agree():
    batch = _batch([1, 30, 64, 65], hq=8, hkv=2, head_size=64, dtype=torch.float32, seed=3)
    fused, fused_lse = _fused(batch, 4, None)
    shapes = check_paged_decode_args(*batch.decode_args, None, None)
    two = torch.full_like(batch.query, float("nan"))
    two_lse = torch.full(batch.query.shape[:2], float("nan"), device=DEVICE)
    triton_paged_decode(*batch.decode_args, shapes, out=two, lse=two_lse, num_splits=4)
    torch.testing.assert_close(fused, two, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(fused_lse, two_lse, atol=1e-6, rtol=1e-6)


def test_fused_merge_without_lse_and_with_empty_sequences():
    batch = _batch([0, 20, 0], dtype=torch.float16, seed=5)
    out, _ = _fused(batch, 3, None, with_lse=False)
    assert_decode_matches_reference(batch, out, None)
    assert not out[0].any() and not out[2].any()
    _, lse = _fused(batch, 3, None)
    assert torch.isneginf(lse[0]).all() and torch.isneginf(lse[2]).all()


def test_fused_merge_with_window_softcap_and_sinks():
    # Sinks enter split 0 only; the merge must count them once. Compared with the reference.
    batch = _batch([50, 7, 1], hq=4, hkv=2, head_size=32, seed=6)
    gen = torch.Generator().manual_seed(6)
    sinks = torch.randn(4, generator=gen).to(DEVICE)
    kwargs = dict(window_size=(20, -1), softcap=5.0, sinks=sinks)
    out = torch.full_like(batch.query, float("nan"))
    _, lse = paged_decode(*batch.decode_args, out=out, return_lse=True, backend="triton",
                          num_splits=4, **kwargs)
    ref, ref_lse = paged_decode(*batch.decode_args, return_lse=True, backend="torch", **kwargs)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)


def _merge_launches(monkeypatch) -> list:
    """Record every preparation of a separate merge launch."""
    calls = []
    real = decode_mod.prepare_merge

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)
    monkeypatch.setattr(decode_mod, "prepare_merge", spy)
    return calls


def test_the_dispatcher_fuses_calls_without_a_workspace_only(monkeypatch):
    merges = _merge_launches(monkeypatch)
    batch = _batch([60, 20], seed=7)
    ws = torch.full((workspace_size(2, 4, 32, 4),), float("nan"), device=DEVICE)
    out = torch.full_like(batch.query, float("nan"))
    paged_decode(*batch.decode_args, out=out, backend="triton", num_splits=4)
    assert_decode_matches_reference(batch, out, None)
    assert not merges, "a call without a workspace merges in the decode kernel"
    # A caller's workspace (made with torch.empty as documented: here NaN) keeps two launches.
    out.fill_(float("nan"))
    paged_decode(*batch.decode_args, out=out, backend="triton", num_splits=4, workspace=ws)
    assert_decode_matches_reference(batch, out, None)
    assert len(merges) == 1
    # The switch turns the fused merge off.
    monkeypatch.setattr(explain, "FUSED_MERGE", False)
    out.fill_(float("nan"))
    paged_decode(*batch.decode_args, out=out, backend="triton", num_splits=4)
    assert_decode_matches_reference(batch, out, None)
    assert len(merges) == 2


def test_bad_counters_raise_before_launch():
    batch = _batch([9, 3], seed=8)
    shapes = check_paged_decode_args(*batch.decode_args, None, None)
    out = torch.zeros_like(batch.query)
    for bad in (torch.zeros(4, dtype=torch.int64, device=DEVICE),       # dtype
                torch.zeros(3, dtype=torch.int32, device=DEVICE),       # fewer than 2 x 2
                torch.zeros(8, dtype=torch.int32, device=DEVICE)[::2]):  # not contiguous
        with pytest.raises(ValueError, match="counters"):
            triton_paged_decode(*batch.decode_args, shapes, out=out, lse=None, num_splits=2,
                                fused_merge=True, counters=bad)
    assert not out.any()


def test_plan_and_merge_tiles():
    fused = explain.plan_decode(1, 32, 8, 128, 4096, 16, torch.bfloat16, 132, fused_merge=True)
    assert fused.fused_merge and fused.num_splits > 1 and fused.merge_programs == 0
    assert "one launch" in str(fused)
    # An unsplit plan has nothing to merge, whatever is asked.
    assert not explain.plan_decode(256, 32, 8, 128, 4096, 16, torch.bfloat16, 132,
                                   fused_merge=True).fused_merge
    assert merge_rows(1) == 2 and merge_rows(4) == 4 and merge_rows(5) == 8
    # rows x chunk x head values within 64 a thread (4 warps: 8192), capped by the splits
    assert merge_chunk(4, 128, 32, 4) == 16 and merge_chunk(8, 256, 32, 4) == 4
    assert merge_chunk(1, 64, 3, 4) == 4 and merge_chunk(16, 256, 64, 1) == 1
    assert merge_chunk(16, 256, 8, 4) == 2 and merge_chunk(1, 128, 100, 4) == 32


# ---- GPU: programs race for real ------------------------------------------------------------

def _gpu_batch(lens, seed, dtype=torch.bfloat16):
    return make_decode_batch(lens, num_q_heads=32, num_kv_heads=8, head_size=128,
                             block_size=16, dtype=dtype, seed=seed, pool_layout=True,
                             device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[4000], [1, 17, 1000, 4097], [16384]])
def test_gpu_fused_matches_two_launch_many_times(lens):
    batch = _gpu_batch(lens, seed=len(lens))
    out_two = paged_decode(*batch.decode_args, workspace=torch.empty(
        workspace_size(len(lens), 32, 128), device="cuda"))
    assert_decode_matches_reference(batch, out_two, None)
    for _ in range(50):             # repeats take the prepared run and its scratch
        out = paged_decode(*batch.decode_args)
        torch.testing.assert_close(out, out_two, atol=2e-2, rtol=2e-2)
    first = paged_decode(*batch.decode_args)
    assert all(torch.equal(first, paged_decode(*batch.decode_args)) for _ in range(20))


@pytest.mark.gpu
@pytest.mark.direct_launch     # reads the kept run
def test_gpu_repeat_is_one_launch_with_its_own_scratch():
    from mini_paged_attn.ops import dispatch
    dispatch._DECODE_RUNS.clear()
    batch = _gpu_batch([3000], seed=11)
    paged_decode(*batch.decode_args)
    (run,) = dispatch._DECODE_RUNS._entries.values()
    assert run.merge is None and run.counters_offset is not None and run.scratch is not None
    out = paged_decode(*batch.decode_args)
    assert_decode_matches_reference(batch, out, None)
    counters = run.scratch.tensor()[run.counters_offset:].view(torch.int32)
    torch.cuda.synchronize()
    assert not counters.any()


@pytest.mark.gpu
def test_gpu_two_streams_keep_separate_scratch():
    batches = [_gpu_batch([2000, 50], seed=s) for s in (12, 13)]
    want = [paged_decode(*b.decode_args) for b in batches]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()
    outs = [[], []]
    for _ in range(20):
        for i, (b, s) in enumerate(zip(batches, streams)):
            with torch.cuda.stream(s):
                outs[i].append(paged_decode(*b.decode_args))
    torch.cuda.synchronize()
    for i in range(2):
        assert all(torch.equal(o, want[i]) for o in outs[i])


@pytest.mark.gpu
def test_gpu_cuda_graph_without_workspace_replays():
    # Captured without a workspace: the run made under capture allocates its partials and
    # zeroed counters from the graph's pool (the warm-up call compiled the same kernel).
    batch = _gpu_batch([3000, 20], seed=14)
    out = torch.empty_like(batch.query)
    graph, _ = capture(lambda: paged_decode(*batch.decode_args, out=out))
    for seed in (15, 16, 17):
        other = _gpu_batch([3000, 20], seed=seed)
        batch.query.copy_(other.query)
        batch.key_cache.copy_(other.key_cache)
        batch.value_cache.copy_(other.value_cache)
        batch.block_tables.copy_(other.block_tables)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_decode_matches_reference(batch, out, None)
