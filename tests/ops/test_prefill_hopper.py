"""The Hopper prefill kernel (Gluon, :mod:`mini_paged_attn.ops.prefill_hopper`).

Gluon does not run in the Triton interpreter: on any machine the kernel is compiled for sm_90
(in a subprocess without ``TRITON_INTERPRET``); on an H100 / H200 the GPU tests check it
against the torch reference through ``flash_attn_varlen_func`` and assert that it, not the
Triton kernel, ran. Run them with ``pytest -m gpu tests/ops/test_prefill_hopper.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from mini_paged_attn.ops import reference

COMPILE = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from mini_paged_attn.ops import prefill_hopper as ph

    kernel = ph._prefill_hopper_kernel
    names = list(kernel.arg_names)
    for dtype, name in ((gl.bfloat16, "bf16"), (gl.float16, "fp16")):
        def desc(rows):
            layout = gl.NVMMASharedLayout.get_default_for([rows, 128], dtype)
            return f"tensordesc<{name}[{rows}, 128],{layout!r}>"
        # (causal, lse, one sequence, paged block size or None)
        for causal, lse, one, block in ((True, False, False, None), (False, True, True, 16)):
            box = min(block or 128, 128)
            sig = {n: f"*{name}" for n in names[:11]}
            sig.update(lse_ptr="*fp32", cu_seqlens_q="*i32", cu_seqlens_k="*i32",
                       block_tables_ptr="*i32", q_desc=desc(64), k_desc=desc(box),
                       v_desc=desc(box), o_desc=desc(64), num_seqs="i32", qk_scale="fp32",
                       stride_out="i32", stride_lse_tok="i32", stride_lse_head="i32",
                       stride_table="i32")
            sig.update({n: "constexpr" for n in names if n not in sig})
            constexprs = dict(NUM_Q_HEADS=32, GROUP=4, CAUSAL=causal, WRITE_LSE=lse,
                              ONE_SEQ=one, PAGED=block is not None, BOX=box,
                              BLOCK_SIZE=block or 1)
            src = GluonASTSource(kernel, sig, {(names.index(k),): v
                                               for k, v in constexprs.items()})
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                      options=dict(num_warps=4, maxnreg=ph.MAXNREG))
            print(name, causal, lse, len(compiled.asm["cubin"]), compiled.metadata.shared)
""")


@pytest.mark.tested_triton     # Gluon changes with every Triton release
def test_kernel_compiles_for_sm90_without_a_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.split("\n")[:-1]
    assert len(lines) == 4, done.stdout
    for line in lines:
        *_, cubin_bytes, shared = line.split()
        assert int(cubin_bytes) > 0
        assert int(shared) <= 227 * 1024          # one program fits an SM's shared memory


def test_block_sizes_the_kernel_copies_and_where_it_runs():
    from mini_paged_attn.ops.prefill_plan import hopper_copies_blocks_of, hopper_prefill_runs_on
    assert [b for b in range(1, 600) if hopper_copies_blocks_of(b)] == [
        8, 16, 32, 64, 128, 256, 384, 512]
    assert not hopper_prefill_runs_on(torch.device("cpu"), 128, torch.bfloat16, 16)


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")


def _hopper_runs(monkeypatch) -> list[int]:
    """Counts the Hopper kernel's launches through the library (the prepared repeats of a
    launch bypass it)."""
    from mini_paged_attn.ops import prefill_hopper
    calls = []
    launch = prefill_hopper.hopper_launch

    def counted(*args, **kwargs):
        calls.append(1)
        return launch(*args, **kwargs)
    monkeypatch.setattr(prefill_hopper, "hopper_launch", counted)
    return calls


def _inputs(q_lens, k_lens, hq, hkv, dtype, seed, spare=0):
    """q ``[sum(q_lens) + spare, hq, 128]``, k / v ``[sum(k_lens) + spare, hkv, 128]``; the
    ``spare`` rows past the last sequence hold NaN."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(sum(q_lens) + spare, hq, 128, device="cuda", dtype=dtype, generator=gen)
    k, v = (torch.randn(sum(k_lens) + spare, hkv, 128, device="cuda", dtype=dtype,
                        generator=gen) for _ in range(2))
    for t, total in ((q, sum(q_lens)), (k, sum(k_lens)), (v, sum(k_lens))):
        t[total:] = float("nan")
    return q, k, v


CASES = {
    # q_len = k_len: 1, 127 / 128 / 129 (one tile +- 1), long
    "prompts": ([1000, 129, 128, 127, 1, 300], None),
    # chunks on cached prefixes (q_len < k_len), one a partial tile past a full prefix
    "chunks": ([200, 300, 129], [1000, 700, 129 + 256]),
    # more queries than keys: causal rows that see no key give 0; no keys at all
    "no_keys": ([300, 256, 200], [100, 0, 700]),
    "one_sequence": ([1500], None),
    # two search loads
    "many_sequences": ([130 + i % 7 for i in range(150)], [330 + i % 7 for i in range(150)]),
}


@pytest.mark.gpu
@pytest.mark.direct_launch
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype, heads", [(torch.bfloat16, (32, 8)), (torch.float16, (8, 1)),
                                          (torch.bfloat16, (16, 16))])
def test_matches_reference(monkeypatch, case, causal, dtype, heads):
    from mini_paged_attn import flash_attn_varlen_func
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel runs on sm_90")
    q_lens, k_lens = CASES[case]
    k_lens = k_lens or q_lens
    q, k, v = _inputs(q_lens, k_lens, *heads, dtype, seed=len(case), spare=70)
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    runs = _hopper_runs(monkeypatch)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens),
                                 softmax_scale=0.1, causal=causal)
    assert runs, "the Triton kernel ran instead"
    total_q, total_k = sum(q_lens), sum(k_lens)
    ref, _ = reference.varlen_attention_contiguous(q[:total_q], k[:total_k], v[:total_k],
                                                   cu_q, cu_k, causal=causal, scale=0.1)
    torch.testing.assert_close(out[:total_q].float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.direct_launch
def test_lse_and_repeats_with_new_tensors(monkeypatch):
    """The log-sum-exp (masked stores for every row), and a repeated call of the same shapes
    on new tensors: the prepared launch re-points all four descriptors."""
    from mini_paged_attn.ops.prefill import triton_varlen_contiguous
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel runs on sm_90")
    q_lens, k_lens = [700, 129, 300], [700, 600, 300]
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    runs = _hopper_runs(monkeypatch)
    launch = None
    for seed in (0, 1):
        q, k, v = _inputs(q_lens, k_lens, 32, 8, torch.bfloat16, seed)
        out = torch.full_like(q, float("nan"))
        lse = torch.full(q.shape[:2], float("nan"), device="cuda")
        tensors = (q, k, v, k, k, out, lse, cu_k, cu_q, cu_k, q)
        if launch is None:
            launch = triton_varlen_contiguous(q, k, v, cu_q, cu_k, 0, 0, causal=True,
                                              scale=0.1, out=out, lse=lse)
            assert launch is not None and runs == [1]
        else:
            assert launch(tensors)
        ref, ref_lse = reference.varlen_attention_contiguous(q, k, v, cu_q, cu_k, causal=True,
                                                             scale=0.1)
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
def test_short_queries_head_size_64_and_variants_keep_the_triton_kernel(monkeypatch):
    from mini_paged_attn import flash_attn_varlen_func
    runs = _hopper_runs(monkeypatch)
    short = _cu([64, 100])                         # average below HOPPER_MIN_AVG_Q_LEN
    q, k, v = _inputs([64, 100], [64, 100], 32, 8, torch.bfloat16, 0)
    flash_attn_varlen_func(q, k, v, short, short, 100, 100, causal=True)
    cu = _cu([512])
    q, k, v = _inputs([512], [512], 32, 8, torch.bfloat16, 1)
    flash_attn_varlen_func(q, k, v, cu, cu, 512, 512, causal=True, window_size=(128, 0))
    flash_attn_varlen_func(q, k, v, cu, cu, 512, 512, causal=True, softcap=30.0)
    flash_attn_varlen_func(q[..., :64].contiguous(), k[..., :64].contiguous(),
                           v[..., :64].contiguous(), cu, cu, 512, 512, causal=True)
    assert not runs


@pytest.mark.gpu
@pytest.mark.direct_launch
@pytest.mark.parametrize("block_size", [8, 16, 128, 256])
@pytest.mark.parametrize("causal", [True, False])
def test_paged_kv_by_one_copy_a_block(monkeypatch, block_size, causal):
    """Paged K/V: the loader copies each block's rows into the tile (one box a block, or a
    128-row box of a larger block); shuffled blocks, unused ones NaN. Prefixes of 0, a
    partial block, many blocks; a q_len of 0 and of 1."""
    from helpers.paged_batch import make_prefill_batch
    from helpers.reference_checks import run_and_compare
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernel runs on sm_90")
    batch = make_prefill_batch([300, 0, 129, 1, 700], [0, 5, 1000, 3, 2048], num_q_heads=32,
                               num_kv_heads=8, head_size=128, block_size=block_size,
                               dtype=torch.bfloat16, seed=block_size, device="cuda")
    runs = _hopper_runs(monkeypatch)
    run_and_compare(batch, causal=causal, config=None)
    assert runs, "the Triton kernel ran instead"
