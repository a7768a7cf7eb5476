"""The Triton paged prefill on a GPU: full shapes, bf16/fp16, every head size and block size,
mixed batches, CUDA-graph capture, 64-bit offsets, seed 003's script, bf16 accuracy.

Run: ``pytest -m gpu tests/ops/test_prefill_gpu.py`` on a CUDA machine (skipped without one).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers.cuda_graphs import capture
from helpers.paged_batch import PagedBatch, make_prefill_batch
from helpers.reference_checks import run_and_compare
from mini_paged_attn.ops import reference
from mini_paged_attn.ops.dispatch import paged_prefill

pytestmark = pytest.mark.gpu

# q_len 0, 1, block_size +- 1, long; cached prefix 0, partial block, many blocks.
Q_LENS = [0, 1, 15, 17, 300, 1000, 1, 64]
PREFIX = [7, 4000, 0, 5, 700, 0, 33, 2048]


def _batch(q_lens=Q_LENS, prefix=PREFIX, *, hq=32, hkv=8, head_size=128, block_size=16,
           dtype=torch.bfloat16, seed=0, seed_layout=True) -> PagedBatch:
    return make_prefill_batch(q_lens, prefix, num_q_heads=hq, num_kv_heads=hkv,
                              head_size=head_size, block_size=block_size, dtype=dtype,
                              seed=seed, pool_layout=seed_layout, device="cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 256])
def test_head_sizes_and_dtypes(dtype, head_size):
    run_and_compare(_batch(head_size=head_size, dtype=dtype, seed=head_size), causal=True,
                    config=None)


@pytest.mark.parametrize("block_size", [1, 2, 16, 64, 128, 256])
def test_block_sizes(block_size):
    run_and_compare(_batch(block_size=block_size, seed=block_size,
                           seed_layout=block_size % 2 == 0), causal=True, config=None)


@pytest.mark.parametrize("hq, hkv", [(32, 32), (32, 4), (40, 8), (32, 1), (64, 2)])
@pytest.mark.parametrize("causal", [True, False])
def test_gqa_ratios_causal_and_not(hq, hkv, causal):
    run_and_compare(_batch(hq=hq, hkv=hkv, seed=hq + hkv), causal=causal, config=None)


def test_fp32():
    run_and_compare(_batch(dtype=torch.float32, head_size=96, seed=4), causal=True, config=None,
                    tol=1e-4)


def test_mixed_batch_prompts_chunk_on_8k_prefix_and_decode_rows():
    q_lens = [1] * 8 + [300, 256, 1, 0]
    prefix = [3000] * 8 + [0, 8192, 9000, 100]
    run_and_compare(_batch(q_lens, prefix, seed=9), causal=True, config=None)


def test_cuda_graph_capture_and_replay_with_new_lengths():
    """The launch path needs no host sync, so it can be captured and replayed on new data."""
    batch = _batch(seed=1)
    out = torch.empty_like(batch.query)
    graph, _ = capture(lambda: paged_prefill(*batch.prefill_args, out=out, backend="triton"))
    batch.query.normal_()
    # Shorter contexts (the tables hold garbage past the old lengths), same q_lens.
    batch.context_lens.add_(torch.tensor([0, -100, 0, -3, -20, 0, -9, -1000], device="cuda",
                                         dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    ref_out, _ = reference.paged_prefill_gather(*batch.prefill_args, causal=True,
                                                scale=batch.query.shape[-1] ** -0.5)
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)


LONG_Q = [512, 300, 1024, 1]      # 459 queries a sequence on average: the copy pays
LONG_PREFIX = [0, 2000, 700, 50]


def _hopper() -> bool:
    return torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.skipif(not torch.cuda.is_available() or not _hopper(), reason="needs Hopper")
@pytest.mark.direct_launch     # asserts the kept copy-and-attend run
def test_long_queries_copy_the_pages_and_repeat():
    """Sequences of long queries on Hopper over blocks too small for the Hopper kernel's
    block copies (under 8 tokens) copy their pages and attend over the copy (the
    tensor-descriptor path); the first call and its repeat match the reference, and a left
    window or short queries keep the block-table loads."""
    from mini_paged_attn.ops.checks import check_paged_prefill_args
    from mini_paged_attn.ops.prefill import triton_paged_prefill
    from mini_paged_attn.ops.prefill_gather import GatheredPrefill
    batch = _batch(LONG_Q, LONG_PREFIX, seed=12, block_size=4)
    out = torch.empty_like(batch.query)
    shapes = check_paged_prefill_args(*batch.prefill_args, None, out)
    run = triton_paged_prefill(*batch.prefill_args, shapes, causal=True, out=out, lse=None)
    assert isinstance(run, GatheredPrefill)
    windowed = triton_paged_prefill(*batch.prefill_args, shapes, causal=True, out=out,
                                    lse=None, window_size=(128, 0))
    assert not isinstance(windowed, GatheredPrefill)
    short = _batch([100, 100], [4000, 10], seed=13, block_size=4)
    shapes = check_paged_prefill_args(*short.prefill_args, None, None)
    assert not isinstance(triton_paged_prefill(*short.prefill_args, shapes, causal=True,
                                               out=torch.empty_like(short.query), lse=None),
                          GatheredPrefill)
    for _ in range(2):      # the second call repeats the prepared copy and attention
        run_and_compare(batch, causal=True, config=None)
        run_and_compare(batch, causal=False, config=None)
    from mini_paged_attn.ops import dispatch
    assert any(isinstance(r, GatheredPrefill) for r in dispatch._PREFILL_RUNS._entries.values())


@pytest.mark.skipif(not torch.cuda.is_available() or not _hopper(), reason="needs Hopper")
def test_long_queries_over_an_fp8_cache_copy_widened_pages():
    from helpers.fp8_batch import dequantized_batch, fp8_batch, per_head_scales
    base = _batch(LONG_Q, LONG_PREFIX, seed=14, dtype=torch.float32)
    ks, vs = per_head_scales(8, "cuda"), per_head_scales(8, "cuda", base=0.015).flip(0)
    batch = fp8_batch(base, ks, vs, torch.bfloat16)
    plain = dequantized_batch(batch, ks, vs)
    ref_out, _ = reference.paged_prefill_gather(*plain.prefill_args, causal=True,
                                                scale=128 ** -0.5)
    for _ in range(2):
        out = paged_prefill(*batch.prefill_args, k_scale=ks, v_scale=vs)
        torch.testing.assert_close(out.float(), ref_out, atol=3e-2, rtol=3e-2)


@pytest.mark.skipif(not torch.cuda.is_available() or not _hopper(), reason="needs Hopper")
def test_long_queries_under_capture_read_the_pages_in_place(monkeypatch):
    """Captured, the call reads the pages in place (a graph would keep the copy's
    workspace) even after eager calls of the same shapes copied them, and the replay on new
    data matches the reference. Blocks of 4 tokens: larger ones go to the Hopper kernel."""
    from mini_paged_attn.ops import prefill, prefill_gather
    decisions = []

    def recording(*args):
        decisions.append(prefill_gather.should_gather(*args))
        return decisions[-1]
    monkeypatch.setattr(prefill, "should_gather", recording)
    batch = _batch(LONG_Q, LONG_PREFIX, seed=15, block_size=4)
    out = torch.empty_like(batch.query)
    graph, _ = capture(lambda: paged_prefill(*batch.prefill_args, out=out, backend="triton"))
    assert decisions == [True, False]        # the eager warm-up copied, the capture did not
    batch.query.normal_()
    batch.context_lens.add_(torch.tensor([0, -700, -3, -40], device="cuda", dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    ref_out, _ = reference.paged_prefill_gather(*batch.prefill_args, causal=True,
                                                scale=128 ** -0.5)
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)


def test_cache_larger_than_2_to_31_elements():
    """Blocks past element 2**31 of the pool: cache offsets must be 64-bit."""
    block_size, hkv, d = 16, 8, 128
    num_blocks = 2 ** 31 // (block_size * hkv * d) + 64
    key_cache = torch.empty(num_blocks, block_size, hkv, d, dtype=torch.bfloat16, device="cuda")
    value_cache = torch.empty_like(key_cache)
    small = _batch([40, 100], [200, 1000], seed=5, seed_layout=False)
    used = small.block_tables.clamp(max=small.key_cache.shape[0] - 1)
    far = num_blocks - 1 - used.long()          # the same blocks, mirrored to the pool's end
    key_cache[far] = small.key_cache[used.long()]
    value_cache[far] = small.value_cache[used.long()]
    tables = far.to(torch.int32)
    batch = PagedBatch(small.query, key_cache, value_cache, tables, small.cu_seqlens_q,
                       small.context_lens)
    run_and_compare(batch, causal=True, config=None)


def test_contiguous_varlen_through_flash_attn_varlen_func():
    from mini_paged_attn import flash_attn_varlen_func
    q_lens, k_lens = [128, 0, 700, 9, 1], [128, 50, 1500, 4, 3000]
    cu_q = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32).cuda()
    cu_k = torch.tensor([0] + torch.tensor(k_lens).cumsum(0).tolist(), dtype=torch.int32).cuda()
    q = torch.randn(sum(q_lens), 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(k_lens), 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    for causal in (True, False):
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens),
                                     softmax_scale=0.1, causal=causal)
        ref, _ = reference.varlen_attention_contiguous(q, k, v, cu_q, cu_k, causal=causal,
                                                       scale=0.1)
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_seed_003_script_on_gpu_in_fp16():
    """Seed 003's script (tests/ops/seed003_varlen_script.py) with its device set to cuda."""
    path = Path(__file__).with_name("seed003_varlen_script.py")
    source = path.read_text(encoding="utf-8").replace('device="cpu"', 'device="cuda"')
    assert 'device="cuda"' in source and "torch.float16" in source
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        exec(compile(source, str(path), "exec"), {"__name__": "__seed003__"})
    assert "测试通过" in stdout.getvalue()


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("seq_lens, heads, head_size, scale", [
    ([128, 256], (16, 16), 32, 0.2),            # seed 003's shapes
    ([1024, 2048, 333], (32, 8), 128, None),
])
def test_bf16_at_least_as_accurate_as_torch_flash_sdpa(seq_lens, heads, head_size, scale):
    """Against a float64 answer, our bf16 output is as close as torch's flash SDPA's."""
    from mini_paged_attn import flash_attn_varlen_func
    from torch.nn.attention import SDPBackend, sdpa_kernel
    hq, hkv = heads
    torch.manual_seed(0)
    cu = torch.tensor([0] + torch.tensor(seq_lens).cumsum(0).tolist(), dtype=torch.int32).cuda()
    q = torch.randn(sum(seq_lens), hq, head_size, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(seq_lens), hkv, head_size, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ours = flash_attn_varlen_func(q, k, v, cu, cu, max(seq_lens), max(seq_lens),
                                  softmax_scale=scale, causal=True)
    exact, flash = [], []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (x[a:b].transpose(0, 1)[None] for x in (q, k, v))   # [1, H, L, D]
        ks, vs = ks.repeat_interleave(hq // hkv, 1), vs.repeat_interleave(hq // hkv, 1)
        with sdpa_kernel(SDPBackend.MATH):
            exact.append(F.scaled_dot_product_attention(qs.double(), ks.double(), vs.double(),
                                                        is_causal=True, scale=scale))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            flash.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale))
    exact = torch.cat([x[0].transpose(0, 1) for x in exact])
    flash = torch.cat([x[0].transpose(0, 1) for x in flash])
    ours_err, flash_err = _rel_err(ours, exact), _rel_err(flash, exact)
    print(f"relative error vs float64: ours {ours_err:.3e}, torch flash SDPA {flash_err:.3e}")
    assert ours_err <= flash_err * 1.02, (ours_err, flash_err)


@pytest.mark.direct_launch     # asserts the kept launch
def test_contiguous_descriptor_loads_repeat_with_new_tensors():
    """flash_attn_varlen_func on bf16 head_size 128 K/V loads tiles through tensor descriptors;
    a repeated call (same shapes, new tensors) reuses the prepared launch, whose descriptors
    must follow the new K/V. Rows past cu_seqlens_k[-1] hold NaN."""
    from mini_paged_attn import flash_attn_varlen_func
    from mini_paged_attn.ops import varlen
    from mini_paged_attn.ops.prefill_plan import tma_usable
    q_lens, k_lens = [128, 0, 700, 9, 1], [128, 50, 1500, 4, 3000]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32,
                               device="cuda") for x in (q_lens, k_lens))
    total_k = sum(k_lens)
    varlen._CONTIGUOUS_RUNS.clear()
    for seed in (0, 1, 2):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        q = torch.randn(sum(q_lens), 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(total_k + 70, 8, 128, device="cuda", dtype=torch.bfloat16,
                            generator=gen) for _ in range(2))
        k[total_k:], v[total_k:] = float("nan"), float("nan")
        assert tma_usable(k, v, 128)
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens),
                                     softmax_scale=0.1, causal=True)
        ref, _ = reference.varlen_attention_contiguous(q, k[:total_k], v[:total_k], cu_q, cu_k,
                                                       causal=True, scale=0.1)
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
        assert len(varlen._CONTIGUOUS_RUNS) == 1


def test_descriptor_launch_prepared_on_aliased_tensors_repeats_on_distinct_ones():
    """A first call with q, k and v one tensor prepares the launch that later calls of the same
    shapes repeat: their descriptors must follow k and v, not whichever argument was k."""
    from mini_paged_attn import flash_attn_varlen_func
    from mini_paged_attn.ops import varlen
    cu = torch.tensor([0, 1024], dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(5)
    x, q, k, v = (torch.randn(1024, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
                  for _ in range(4))
    varlen._CONTIGUOUS_RUNS.clear()
    for args in ((x, x, x), (q, x, x), (q, k, v)):
        out = flash_attn_varlen_func(*args, cu, cu, 1024, 1024, causal=True)
        ref, _ = reference.varlen_attention_contiguous(*args, cu, cu, causal=True,
                                                       scale=128 ** -0.5)
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
