"""The Triton prefill kernel (ops/prefill.py) against the torch reference.

On CPU this runs through the Triton interpreter (small shapes, fp16/fp32; bf16 ``tl.dot`` is
broken there), with small tiles so that every code path is hit: unmasked and masked K/V tiles,
K/V tiles smaller and larger than a cache block, GQA groups split over several tiles.
"""

from __future__ import annotations

import math

import pytest
import torch

from helpers.paged_batch import PagedBatch, make_prefill_batch
from helpers.reference_checks import TOL, run_and_compare
from mini_paged_attn.ops import reference
from mini_paged_attn.ops.dispatch import paged_prefill
from mini_paged_attn.ops.prefill import triton_varlen_contiguous
from mini_paged_attn.ops.prefill_plan import PrefillConfig

SMALL = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)


def prefill_args(q_lens, prefix_lens, **kw):
    return make_prefill_batch(q_lens, prefix_lens, **kw).prefill_args


def check_against_reference(batch, *, causal, config=SMALL, scale=None):
    run_and_compare(PagedBatch(*batch), causal=causal, config=config, scale=scale)


# q_len 0, 1 (decode rows), block_size - 1, block_size + 1, longer; cached prefix 0, a partial
# block, many blocks.
def lengths(block_size):
    q_lens = [0, 1, block_size - 1 or 2, block_size + 1, 37, 1, 20]
    prefix = [5, 0, 0, block_size // 2 + 1, 3 * block_size + 2, 70, 9 * block_size]
    return q_lens, prefix


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", [(2, 2), (4, 1), (8, 2), (10, 2)],
                         ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_batch_matches_reference(dtype, heads, causal):
    q_lens, prefix = lengths(8)
    batch = prefill_args(q_lens, prefix, num_q_heads=heads[0], num_kv_heads=heads[1],
                         head_size=32, block_size=8, dtype=dtype, seed=sum(heads))
    check_against_reference(batch, causal=causal)


@pytest.mark.parametrize("block_size,block_n", [(1, 16), (4, 16), (16, 16), (64, 16), (2, 32)])
def test_block_sizes_smaller_and_larger_than_kv_tile(block_size, block_n):
    q_lens, prefix = lengths(block_size)
    batch = prefill_args(q_lens, prefix, num_q_heads=4, num_kv_heads=2, head_size=16,
                         block_size=block_size, dtype=torch.float16, seed=block_size)
    check_against_reference(batch, causal=True,
                            config=PrefillConfig(block_m=16, block_n=block_n, num_stages=1))


@pytest.mark.parametrize("head_size", [16, 24, 40, 64])
def test_head_sizes_padded_to_power_of_two(head_size):
    batch = prefill_args([3, 17], [11, 0], num_q_heads=4, num_kv_heads=1,
                         head_size=head_size, block_size=4, dtype=torch.float32, seed=head_size)
    check_against_reference(batch, causal=True, scale=0.2, config=None)


def test_gqa_group_larger_than_tile_is_split_over_head_chunks():
    # 32 query heads on one KV head with 16-row tiles: two head chunks per token tile.
    batch = prefill_args([5, 1, 12], [0, 30, 7], num_q_heads=32, num_kv_heads=1,
                         head_size=16, block_size=4, dtype=torch.float16, seed=3)
    check_against_reference(batch, causal=True)


def test_seed_layout_strided_views_and_wide_tiles():
    batch = prefill_args([40, 1, 0, 33], [0, 50, 8, 16], num_q_heads=8, num_kv_heads=2,
                         head_size=32, block_size=16, dtype=torch.float16, seed=7,
                         pool_layout=True)
    assert not batch[1].is_contiguous()
    check_against_reference(batch, causal=True,
                            config=PrefillConfig(block_m=32, block_n=32, num_stages=1))


def test_value_cache_with_strides_of_its_own():
    # K and V caches usually share one layout (one set of row offsets serves both); a value
    # cache stored head-major takes the kernel's separate V offsets.
    q, kc, vc, *rest = prefill_args([9, 1, 20], [7, 30, 0], num_q_heads=4, num_kv_heads=2,
                                    head_size=16, block_size=4, dtype=torch.float16, seed=9)
    head_major = torch.empty(vc.shape[0], vc.shape[2], vc.shape[1], vc.shape[3],
                             dtype=vc.dtype).transpose(1, 2)
    head_major.copy_(vc)
    assert head_major.stride() != kc.stride()
    check_against_reference((q, kc, head_major, *rest), causal=True)


@pytest.mark.parametrize("num_seqs", [63, 64, 70], ids=lambda n: f"{n}seqs")
def test_batches_past_the_vector_sequence_lookup(num_seqs):
    # Up to 63 sequences a program finds its own by one vector load, from 64 by a binary
    # search: both, on paged and contiguous K/V, with q_len 0 and 1 rows among longer ones.
    q_lens = [(0, 1, 3, 17)[i % 4] for i in range(num_seqs)]
    prefix = [(5, 0, 20, 2)[i % 4] for i in range(num_seqs)]
    batch = prefill_args(q_lens, prefix, num_q_heads=4, num_kv_heads=2, head_size=16,
                         block_size=8, dtype=torch.float16, seed=num_seqs)
    check_against_reference(batch, causal=True)
    k_lens = [q + p for q, p in zip(q_lens, prefix)]
    q, k, v, cu_q, cu_k = _contiguous_batch(q_lens, k_lens, heads=(4, 2), head_size=16,
                                            extra_rows=3, seed=num_seqs)
    out = torch.full_like(q, float("nan"))
    triton_varlen_contiguous(q, k, v, cu_q, cu_k, 0, 0, causal=True, scale=0.25, out=out,
                             config=SMALL)
    ref, _ = reference.varlen_attention_contiguous(q, k, v, cu_q, cu_k, causal=True,
                                                   scale=0.25)
    torch.testing.assert_close(out.float(), ref, atol=TOL[torch.float16],
                               rtol=TOL[torch.float16])


def test_all_empty_and_single_sequences():
    batch = prefill_args([0, 0], [4, 0], num_q_heads=2, num_kv_heads=1, head_size=16,
                         block_size=4, dtype=torch.float32, seed=1)
    out = paged_prefill(*batch, backend="triton")
    assert out.shape == (0, 2, 16)
    batch = prefill_args([1], [0], num_q_heads=2, num_kv_heads=1, head_size=16,
                         block_size=4, dtype=torch.float32, seed=2)
    check_against_reference(batch, causal=True, config=None)


def test_bad_input_raises_before_launch():
    query, key_cache, value_cache, tables, cu, ctx = prefill_args(
        [3], [2], num_q_heads=2, num_kv_heads=1, head_size=16, block_size=4,
        dtype=torch.float32, seed=4)
    out = torch.zeros_like(query)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_prefill(query, key_cache, value_cache, tables, cu.long(), ctx, out=out,
                      backend="triton")
    assert (out == 0).all()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_contiguous_varlen_matches_reference(causal, dtype):
    # q_len > k_len (rows that see no key under causal), q_len 0, k_len 0 with q_len 0.
    q_lens, k_lens = [3, 0, 17, 1, 9, 0, 20], [3, 5, 40, 1, 4, 0, 20]
    gen = torch.Generator().manual_seed(11)
    cu_q = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(k_lens).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), 6, 40, generator=gen).to(dtype)
    k = torch.randn(int(cu_k[-1]), 2, 40, generator=gen).to(dtype)
    v = torch.randn(int(cu_k[-1]), 2, 40, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"))
    triton_varlen_contiguous(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), causal=causal,
                             scale=0.3, out=out, lse=lse, config=SMALL)
    ref_out, ref_lse = reference.varlen_attention_contiguous(q, k, v, cu_q, cu_k,
                                                             causal=causal, scale=0.3)
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=tol)
    if causal:  # rows 0..4 of sequence 4 (q_len 9 over 4 keys) see nothing
        rows = slice(int(cu_q[4]), int(cu_q[4]) + 5)
        assert (out[rows] == 0).all() and (lse[rows] == -math.inf).all()


def test_default_config_and_kv_tile_larger_than_sequence():
    # The default interpreter config, and a KV tile much longer than every sequence.
    batch = prefill_args([2, 5], [1, 3], num_q_heads=4, num_kv_heads=4, head_size=16,
                         block_size=2, dtype=torch.float32, seed=5)
    check_against_reference(batch, causal=False, config=None)
    check_against_reference(batch, causal=True,
                            config=PrefillConfig(block_m=64, block_n=64, num_stages=1))


@pytest.mark.parametrize("heads, block_m", [((8, 2), 64), ((16, 2), 32), ((3, 3), 32)],
                         ids=["gqa4-m64", "gqa8-m32", "mha-m32"])
def test_short_sequences_take_the_small_tile(heads, block_m):
    # q_len * group <= 16 runs a 16-row tile instead of block_m rows; longer ones the big tile.
    q_lens = [1, 2, 4, 5, 1, 3, 6, 40]
    prefix = [60, 0, 17, 3, 1, 32, 0, 8]
    batch = prefill_args(q_lens, prefix, num_q_heads=heads[0], num_kv_heads=heads[1],
                         head_size=32, block_size=8, dtype=torch.float16, seed=block_m)
    check_against_reference(batch, causal=True,
                            config=PrefillConfig(block_m=block_m, block_n=16, num_stages=1))


@pytest.fixture
def shared_memory(monkeypatch):
    """Set the shared memory a program may use on "cuda" (an H100 by default)."""
    from mini_paged_attn.ops import prefill_plan

    def set_bytes(n: int) -> None:
        monkeypatch.setattr(prefill_plan, "max_shared_memory", lambda device: n)
    set_bytes(232_448)
    return set_bytes


def test_default_config_by_head_size_and_batch_shape(shared_memory):
    from mini_paged_attn.ops.prefill_plan import default_config
    cuda = torch.device("cuda")
    prompts = default_config(128, torch.bfloat16, cuda, avg_q_len=4096)
    decode_heavy = default_config(128, torch.bfloat16, cuda, avg_q_len=65)
    assert (prompts.block_m, prompts.block_n, prompts.num_stages) == (128, 128, 5)
    shared_memory(166_912)          # an A100's: three K/V tile pairs would not fit
    assert default_config(128, torch.bfloat16, cuda, avg_q_len=4096).num_stages == 3
    assert default_config(128, torch.bfloat16, cuda, 4096, contiguous=True).num_stages == 2
    assert (decode_heavy.block_m, decode_heavy.block_n) == (64, 64)
    assert default_config(256, torch.float16, cuda, 4096).num_stages == 2
    assert default_config(128, torch.float16, torch.device("cpu")).block_m == 16
    with pytest.raises(ValueError, match="block_n"):
        PrefillConfig(block_n=48)


# ---- contiguous K/V through tensor descriptors ------------------------------------------------

TMA_SMALL = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, tma=True)


def _contiguous_batch(q_lens, k_lens, *, heads=(6, 2), head_size=32, extra_rows=0, seed=11):
    """fp16 q, k, v; ``extra_rows`` K/V rows past cu_seqlens_k[-1], NaN (nobody's keys)."""
    gen = torch.Generator().manual_seed(seed)
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32)
                  for x in (q_lens, k_lens))
    q = torch.randn(int(cu_q[-1]), heads[0], head_size, generator=gen).half()
    k, v = (torch.randn(int(cu_k[-1]) + extra_rows, heads[1], head_size, generator=gen).half()
            for _ in range(2))
    k[int(cu_k[-1]):] = float("nan")
    v[int(cu_k[-1]):] = float("nan")
    return q, k, v, cu_q, cu_k


@pytest.fixture
def descriptors_made(monkeypatch):
    """How many tensor descriptors the prefill launcher builds (two per descriptor launch)."""
    from mini_paged_attn.ops import prefill
    made = []

    def counting(*args, **kwargs):
        made.append(args)
        return real(*args, **kwargs)
    real = prefill.TensorDescriptor
    monkeypatch.setattr(prefill, "TensorDescriptor", counting)
    return made


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window, softcap, sinks", [
    ((-1, -1), 0.0, False), ((6, 2), 0.0, False), ((-1, -1), 3.0, True)])
def test_contiguous_varlen_through_tensor_descriptors(causal, window, softcap, sinks,
                                                      descriptors_made):
    # Tiles run past a sequence's keys into the next one's and, at the end, into NaN rows
    # that belong to no sequence: neither may reach the output. q_len > k_len (rows that see
    # no key under causal), q_len 0, k_len 0.
    q_lens, k_lens = [3, 0, 17, 1, 9, 0, 20], [3, 5, 40, 1, 4, 0, 21]
    q, k, v, cu_q, cu_k = _contiguous_batch(q_lens, k_lens, extra_rows=9)
    sink = torch.linspace(-1.0, 2.0, q.shape[1]) if sinks else None
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"))
    triton_varlen_contiguous(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), causal=causal,
                             scale=0.3, out=out, lse=lse, config=TMA_SMALL, window_size=window,
                             softcap=softcap, sinks=sink)
    assert len(descriptors_made) == 2
    total_k = int(cu_k[-1])
    ref_out, ref_lse = reference.varlen_attention_contiguous(
        q, k[:total_k], v[:total_k], cu_q, cu_k, causal=causal, scale=0.3,
        window_size=window, softcap=softcap, sinks=sink)
    torch.testing.assert_close(out.float(), ref_out, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)


def test_descriptors_only_where_the_layout_allows(descriptors_made):
    from mini_paged_attn.ops.prefill_plan import tma_usable
    q, k, v, cu_q, cu_k = _contiguous_batch([5, 8], [9, 8], heads=(4, 2), head_size=32)
    assert tma_usable(k, v, 16)
    padded = torch.randn(k.shape[0], 2, 64).half()
    buffer = torch.randn(k.numel() + 1).half()
    # A fused qkv row holds the heads side by side: usable with any row stride.
    assert tma_usable(torch.randn(k.shape[0], 6, 32).half()[:, 2:4], v, 16)
    refused = {
        "heads apart": (padded[:, :, :32], v),                 # head stride 64, not 32
        "misaligned": (buffer[1:].view(k.shape), v),           # base 2 bytes past alignment
        "fp32": (k.float(), v.float()),
        "head_size 40": (torch.randn(17, 2, 40).half(),) * 2,
        "no rows": (k[:0], v[:0]),
    }
    for name, (kk, vv) in refused.items():
        assert not tma_usable(kk, vv, 16), name
    # The refused layouts run the pointer loads and give the same result.
    kk = padded[:, :, :32]
    kk.copy_(k)
    out = torch.empty_like(q)
    triton_varlen_contiguous(q, kk, v, cu_q, cu_k, 8, 9, causal=True, scale=0.3, out=out,
                             config=TMA_SMALL)
    assert descriptors_made == []
    ref, _ = reference.varlen_attention_contiguous(q, k, v, cu_q, cu_k, causal=True, scale=0.3)
    torch.testing.assert_close(out.float(), ref, atol=1e-3, rtol=1e-3)


def test_default_config_loads_contiguous_head_128_through_descriptors(shared_memory):
    from mini_paged_attn.ops.prefill_plan import default_config
    cuda = torch.device("cuda")
    assert default_config(128, torch.bfloat16, cuda, 4096, contiguous=True).tma
    assert default_config(128, torch.bfloat16, cuda, 4096, contiguous=True).num_stages == 3
    assert not default_config(128, torch.bfloat16, cuda, 4096).tma        # paged
    assert not default_config(64, torch.bfloat16, cuda, 4096, contiguous=True).tma
    with pytest.raises(ValueError, match="tma"):
        PrefillConfig(tma=1)
