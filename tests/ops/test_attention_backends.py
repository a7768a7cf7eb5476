"""Attention backends: what each refuses and why, how one is chosen, and what they own
(workspaces, warm-up batches) in place of the engine."""

from __future__ import annotations

import pytest
import torch

from mini_paged_attn.ops import prefill_gather, prefill_plan
from mini_paged_attn.ops.attention import (HOPPER, TORCH, TRITON, AttentionLimits,
                                           AttentionSpec, backend_for_call, select_backend)
from mini_paged_attn.ops.attention import hopper_backend, triton_backend
from mini_paged_attn.ops.decode import workspace_size
from mini_paged_attn.ops.kv_quant import FP8_DTYPE

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


def spec(device=CPU, dtype=torch.float16, kv_dtype=None, head_size=128, **kw):
    return AttentionSpec(device, dtype, dtype if kv_dtype is None else kv_dtype, head_size, **kw)


def limits(s=None, **kw):
    args = dict(max_num_seqs=16, max_num_batched_tokens=4096, max_model_len=4096,
                table_width=256, num_q_heads=8, num_kv_heads=2)
    args.update(kw)
    return AttentionLimits(s or spec(), **args)


# ---- the spec's own checks ------------------------------------------------------------------
@pytest.mark.parametrize("kw, field", [
    (dict(dtype=torch.int32), "dtype"),
    (dict(dtype=torch.float32, kv_dtype=torch.float16), "kv_dtype"),
    (dict(head_size=0), "head_size"),
    (dict(block_size=0), "block_size"),
    (dict(window=1), "window"),
])
def test_spec_rejects_bad_fields_by_name(kw, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        spec(**kw)


def test_limits_reject_bad_fields_by_name():
    with pytest.raises(ValueError, match="^max_num_seqs"):
        limits(max_num_seqs=0)


# ---- what each backend refuses ----------------------------------------------------------------
def test_torch_backend_takes_every_spec():
    for s in (spec(), spec(dtype=torch.float32, head_size=512), spec(kv_dtype=FP8_DTYPE),
              spec(window=True, softcap=True, sinks=True)):
        assert TORCH.refusal(s) is None


def test_triton_refuses_a_cpu_outside_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reason = TRITON.refusal(spec())
    assert "runs on cuda devices, not cpu" in reason and "TRITON_INTERPRET=1" in reason
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert TRITON.refusal(spec()) is None


def test_triton_refuses_large_heads_and_a_missing_triton(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "head sizes up to 256, not 512" in TRITON.refusal(spec(head_size=512))
    assert TRITON.refusal(spec(head_size=256, kv_dtype=FP8_DTYPE, window=True, softcap=True,
                               sinks=True)) is None
    monkeypatch.setattr(triton_backend, "triton_available", lambda: False)
    assert TRITON.refusal(spec()) == "triton is not importable"


def test_hopper_refusals_name_the_reason(monkeypatch):
    assert "runs on cuda devices, not cpu" in HOPPER.refusal(spec())
    # Everything below is refused before the device is asked for its generation.
    assert "float16/torch.bfloat16 queries, not torch.float32" in HOPPER.refusal(
        spec(CUDA, dtype=torch.float32))
    assert "head sizes [128], not 64" in HOPPER.refusal(spec(CUDA, head_size=64))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert HOPPER.refusal(spec(CUDA)) == "needs a sm_90 GPU, not sm_80"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(hopper_backend, "hopper_prefill_runs_on", lambda *a, **k: False)
    assert "Gluon" in HOPPER.refusal(spec(CUDA))
    monkeypatch.setattr(hopper_backend, "hopper_prefill_runs_on", lambda *a, **k: True)
    # Variants and an fp8 cache are the Triton kernels' (the backend delegates them).
    assert HOPPER.refusal(spec(CUDA, kv_dtype=FP8_DTYPE, window=True, sinks=True)) is None


# ---- choosing -------------------------------------------------------------------------------
def test_select_backend_on_cpu(monkeypatch):
    assert select_backend(CPU, torch.float16, torch.float16, 64) is TORCH
    assert select_backend(CPU, torch.float16, torch.float16, 64, requested="torch") is TORCH
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_backend(CPU, torch.float32, torch.float32, 64, requested="triton") is TRITON


def test_select_backend_says_why_nothing_fits(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match=r"^backend: .*hopper: runs on cuda devices.*"
                                         r"triton: takes head sizes up to 256, not 512"):
        select_backend(CPU, torch.float16, torch.float16, 512, requested="triton")
    with pytest.raises(ValueError, match="^backend: expected one of"):
        select_backend(CPU, torch.float16, torch.float16, 64, requested="cuda")


def test_select_backend_prefers_hopper_where_it_runs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(hopper_backend, "hopper_prefill_runs_on", lambda *a, **k: True)
    assert select_backend(CUDA, torch.bfloat16, torch.bfloat16, 128,
                          requested="triton") is HOPPER
    assert select_backend(CUDA, torch.bfloat16, torch.bfloat16, 64,
                          requested="triton") is TRITON


def test_backend_for_call():
    assert backend_for_call("auto", CPU, 128, torch.float16) is TORCH
    assert backend_for_call("triton", CPU, 128, torch.float16) is TRITON
    with pytest.raises(ValueError, match="^backend"):
        backend_for_call("gpu", CPU, 128, torch.float16)


# ---- what a backend owns --------------------------------------------------------------------
def test_workspaces():
    lim = limits()
    assert TORCH.decode_workspace(lim) is None and TORCH.workspace_bytes(lim) == 0
    ws = TRITON.decode_workspace(lim)
    assert ws.dtype == torch.float32 and ws.device == CPU
    assert ws.numel() == workspace_size(16, 8, 128, triton_backend.WORKSPACE_SPLITS_PER_SEQ)
    # No page copy off Hopper-class GPUs.
    assert TRITON.workspace_bytes(limits(spec(kv_dtype=FP8_DTYPE))) == 0


def test_triton_warmup_lengths_cross_the_kernel_thresholds():
    q_lens = triton_backend.WARMUP_Q_LENS
    assert 1 in q_lens      # decode rows
    # A short chunk Triton does not specialise (neither 1 nor a multiple of 16).
    assert any(1 < q <= prefill_plan.SHORT_QUERY_AVG and q % 16 for q in q_lens)
    # Prompt tiles and, on Hopper, the Gluon kernel, without the page copy.
    assert any(max(prefill_plan.SHORT_QUERY_AVG, prefill_plan.HOPPER_MIN_AVG_Q_LEN - 1) < q
               <= prefill_gather.GATHER_MIN_Q_LEN for q in q_lens)
    # The page copy for any number of query heads a KV head (group 1 is the hardest).
    assert any(q > prefill_gather.GATHER_MIN_Q_LEN and q > prefill_gather.GATHER_MIN_ROWS
               for q in q_lens)


def test_triton_warmup_shapes_stay_within_the_limits():
    small = TRITON.warmup_shapes(limits(max_num_batched_tokens=64, max_model_len=32))
    assert small and all(b.num_seqs * b.q_len <= 64 and b.q_len <= 32 for b in small)
    full = TRITON.warmup_shapes(limits())
    assert {b.q_len for b in full} == set(triton_backend.WARMUP_Q_LENS)
    # Prompts run both over their new K/V and through the block tables; decode once.
    assert {(b.q_len, b.no_prefix) for b in full if b.num_seqs == 1} == {
        (1, True), *((q, p) for q in triton_backend.WARMUP_Q_LENS[1:] for p in (True, False))}
    assert HOPPER.warmup_shapes(limits()) == full


def test_torch_warmup_is_decode_only():
    assert all(b.q_len == 1 for b in TORCH.warmup_shapes(limits()))


@pytest.mark.gpu
def test_engine_device_picks_its_backend():
    device = torch.device("cuda")
    chosen = select_backend(device, torch.bfloat16, torch.bfloat16, 128)
    expected = HOPPER if prefill_plan.hopper_prefill_runs_on(device, 128,
                                                             torch.bfloat16) else TRITON
    assert chosen is expected
    assert select_backend(device, torch.bfloat16, torch.bfloat16, 64) is TRITON
