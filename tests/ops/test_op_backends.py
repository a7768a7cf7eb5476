"""Which backend object runs ``flash_attn_varlen_func`` and ``store_kv``, what each refuses
for them and why (the ops' results themselves are specified in test_varlen.py and
test_store_kv.py)."""

from __future__ import annotations

import pytest
import torch

from mini_paged_attn.ops import flash_attn_varlen_func, prefill, store_kv
from mini_paged_attn.ops.attention import (HOPPER, TORCH, TRITON, AttentionSpec, TritonBackend,
                                           backend_for_call, select)
from mini_paged_attn.ops.dispatch import check_store_kv

CPU = torch.device("cpu")


def varlen_inputs(seed=0, dtype=torch.float32, head_size=16):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(7, 4, head_size, generator=gen, dtype=dtype)
    k = torch.randn(9, 2, head_size, generator=gen, dtype=dtype)
    v = torch.randn(9, 2, head_size, generator=gen, dtype=dtype)
    cu_q = torch.tensor([0, 3, 7], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 9], dtype=torch.int32)
    return q, k, v, cu_q, cu_k


def store_inputs(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(5, 2, 8, generator=gen, dtype=dtype)
    value = torch.randn(5, 2, 8, generator=gen, dtype=dtype)
    key_cache = torch.full((4, 4, 2, 8), float("nan"), dtype=dtype)
    value_cache = torch.full((4, 4, 2, 8), float("nan"), dtype=dtype)
    slots = torch.tensor([13, 2, -1, 7, 0], dtype=torch.int32)
    return key, value, key_cache, value_cache, slots


class Spy:
    """Records the calls of one backend method, then runs it."""

    def __init__(self, monkeypatch, cls, name):
        self.calls = []
        original = getattr(cls, name)

        def spy(backend, *args, **kwargs):
            self.calls.append(backend)
            return original(backend, *args, **kwargs)

        monkeypatch.setattr(cls, name, spy)


# ---- the choice -----------------------------------------------------------------------------
@pytest.mark.parametrize("backend, expected", [("torch", TORCH), ("auto", TORCH),
                                               ("triton", TRITON)])
def test_varlen_runs_the_backend_the_call_picks(monkeypatch, backend, expected):
    spies = {b: Spy(monkeypatch, type(b), "varlen") for b in (TORCH, TRITON)}
    flash_attn_varlen_func(*varlen_inputs(), 4, 5, causal=True, backend=backend)
    assert spies[expected].calls == [expected]
    assert sum(len(s.calls) for s in spies.values()) == 1


@pytest.mark.parametrize("backend, expected", [("torch", TORCH), ("auto", TORCH),
                                               ("triton", TRITON)])
def test_store_kv_runs_the_backend_the_call_picks(monkeypatch, backend, expected):
    spies = {b: Spy(monkeypatch, type(b), "store_kv") for b in (TORCH, TRITON)}
    store_kv(*store_inputs(), backend=backend)
    assert spies[expected].calls == [expected]
    assert sum(len(s.calls) for s in spies.values()) == 1


def test_varlen_takes_the_hopper_backend_where_its_gate_holds(monkeypatch):
    """The Hopper backend is the call's where the Gluon gate holds (faked here: the CPU runs
    its launch through the Triton kernel, the Gluon kernel's own plan saying no)."""
    monkeypatch.setattr(select, "hopper_prefill_runs_on", lambda *a, **k: True)
    hopper = Spy(monkeypatch, type(HOPPER), "varlen")
    flash_attn_varlen_func(*varlen_inputs(), 4, 5, causal=True, backend="triton")
    assert hopper.calls == [HOPPER]


def test_store_kv_never_asks_the_hopper_gate(monkeypatch):
    """The Hopper backend's writes are Triton's: a store_kv call is never its."""
    def gate(*args, **kwargs):
        raise AssertionError("store_kv asked the Gluon prefill's gate")

    monkeypatch.setattr(select, "hopper_prefill_runs_on", gate)
    assert backend_for_call("triton", CPU, 8, torch.float32, prefill=False) is TRITON
    store_kv(*store_inputs(), backend="triton")


def test_the_triton_backend_keeps_varlen_off_the_hopper_plan(monkeypatch):
    """Off sm_90 the Triton backend launches without asking the Gluon kernel's per-call plan;
    only the Hopper backend's calls do."""
    asked = []
    real = prefill.hopper_prefill_usable
    monkeypatch.setattr(prefill, "hopper_prefill_usable",
                        lambda *a, **k: asked.append(1) or real(*a, **k))
    flash_attn_varlen_func(*varlen_inputs(), 4, 5, causal=True, backend="triton")
    assert asked == []
    monkeypatch.setattr(select, "hopper_prefill_runs_on", lambda *a, **k: True)
    flash_attn_varlen_func(*varlen_inputs(), 4, 5, causal=True, backend="triton")
    assert asked == [1]


def test_backends_give_the_same_results():
    args = varlen_inputs(seed=3)
    ref = flash_attn_varlen_func(*args, 4, 5, causal=True, backend="torch")
    out = flash_attn_varlen_func(*args, 4, 5, causal=True, backend="triton")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    caches = {}
    for backend in ("torch", "triton"):
        key, value, key_cache, value_cache, slots = store_inputs(seed=4)
        store_kv(key, value, key_cache, value_cache, slots, backend=backend)
        caches[backend] = (key_cache, value_cache)
    for a, b in zip(caches["torch"], caches["triton"]):
        torch.testing.assert_close(a, b, equal_nan=True, atol=0, rtol=0)


# ---- what each backend refuses, and why -------------------------------------------------------
def test_triton_refuses_a_cpu_outside_the_interpreter_before_writing(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    message = r"^backend: triton runs on cuda devices, not cpu \(.*TRITON_INTERPRET=1\)"
    with pytest.raises(ValueError, match=message):
        flash_attn_varlen_func(*varlen_inputs(), 4, 5, backend="triton")
    key, value, key_cache, value_cache, slots = store_inputs()
    with pytest.raises(ValueError, match=message):
        store_kv(key, value, key_cache, value_cache, slots, backend="triton")
    assert key_cache.isnan().all() and value_cache.isnan().all()
    with pytest.raises(ValueError, match=message):
        check_store_kv(key, value, key_cache, value_cache, slots, None, None, "triton")
    # The reference runs anywhere.
    flash_attn_varlen_func(*varlen_inputs(), 4, 5, backend="auto")
    store_kv(key, value, key_cache, value_cache, slots, backend="auto")


def test_call_refusals_are_declared_per_backend(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = AttentionSpec(CPU, torch.float16, torch.float16, 512)
    assert TORCH.call_refusal(cpu) is None
    assert "runs on cuda devices, not cpu" in TRITON.call_refusal(cpu)
    assert "runs on cuda devices, not cpu" in HOPPER.call_refusal(cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # The varlen, prefill and store kernels take any head size; the decode launcher checks
    # its own bound (and the engine's choice, :meth:`refusal`, declares it).
    assert TRITON.call_refusal(cpu) is None
    assert "head sizes up to 256" in TRITON.refusal(cpu)


def test_triton_store_kv_refuses_a_strided_last_dim_the_reference_takes():
    _, value, key_cache, value_cache, slots = store_inputs()
    strided = torch.randn(5, 2, 16)[..., ::2]
    store_kv(strided, value, key_cache, value_cache, slots, backend="torch")
    with pytest.raises(ValueError, match=r"^key: expected a contiguous last dimension"):
        store_kv(strided, value, key_cache, value_cache, slots, backend="triton")


def test_only_the_reference_reads_slots_on_the_host():
    key, value, key_cache, value_cache, _ = store_inputs()
    past = torch.tensor([0, 1, 2, 3, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^slot_mapping: .*slot_mapping\[4\]=16"):
        check_store_kv(key, value, key_cache, value_cache, past, None, None, "torch")
    assert check_store_kv(key, value, key_cache, value_cache, past, None, None,
                          "triton") == "triton"
    # The kernel skips a slot past the pool rather than writing out of bounds.
    store_kv(key, value, key_cache, value_cache, past, backend="triton")
    assert not key_cache[0].isnan().any() and key_cache[1:].isnan().all()


def test_only_the_reference_reads_varlen_lengths_on_the_host():
    q, k, v, cu_q, cu_k = varlen_inputs()
    with pytest.raises(ValueError, match="^max_seqlen_k"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 4, backend="torch")
    # The kernel reads no length on the host (max_seqlen_k is a launch bound it never needs).
    flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 4, backend="triton")


def test_paged_varlen_checks_lengths_through_the_backend(monkeypatch):
    q, _, _, cu_q, cu_k = varlen_inputs()
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(8, 4, 2, 16, generator=gen)
    table = torch.tensor([[3, 0, 7], [5, 1, 6]], dtype=torch.int32)
    checks = Spy(monkeypatch, type(TORCH), "check_varlen_lengths")
    ref = flash_attn_varlen_func(q, cache, cache, cu_q, cu_k, 4, 5, causal=True,
                                 block_table=table, backend="torch")
    assert checks.calls == [TORCH]
    with pytest.raises(ValueError, match="^max_seqlen_k"):
        flash_attn_varlen_func(q, cache, cache, cu_q, cu_k, 4, 4, causal=True,
                               block_table=table, backend="torch")
    out = flash_attn_varlen_func(q, cache, cache, cu_q, cu_k, 4, 4, causal=True,
                                 block_table=table, backend="triton")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert checks.calls == [TORCH, TORCH]



@pytest.mark.gpu
def test_device_varlen_and_store_kv_backends(monkeypatch):
    """On the device: varlen's backend is Hopper exactly where the Gluon gate holds and gives
    the reference's result; a store_kv call is Triton's."""
    from mini_paged_attn.ops import dispatch, prefill_plan, varlen
    from mini_paged_attn.ops.launch import LaunchCache
    # Fresh launch caches: a repeat of an earlier test's shapes would skip the choice.
    monkeypatch.setattr(varlen, "_CONTIGUOUS_RUNS", LaunchCache())
    monkeypatch.setattr(dispatch, "_STORE_RUNS", LaunchCache())
    cuda = torch.device("cuda")
    gate = prefill_plan.hopper_prefill_runs_on(cuda, 128, torch.bfloat16)
    expected = HOPPER if gate else TRITON
    assert backend_for_call("auto", cuda, 128, torch.bfloat16) is expected
    assert backend_for_call("auto", cuda, 128, torch.bfloat16, prefill=False) is TRITON
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(512, 8, 128, generator=gen).to(cuda, torch.bfloat16)
               for _ in range(3))
    cu = torch.tensor([0, 256, 512], dtype=torch.int32, device=cuda)
    chosen = Spy(monkeypatch, type(expected), "varlen")
    out = flash_attn_varlen_func(q, k, v, cu, cu, 256, 256, causal=True)
    assert chosen.calls == [expected]
    ref = flash_attn_varlen_func(q, k, v, cu, cu, 256, 256, causal=True, backend="torch")
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    stores = Spy(monkeypatch, TritonBackend, "store_kv")
    key, value, key_cache, value_cache, slots = (t.to(cuda) for t in store_inputs())
    store_kv(key, value, key_cache, value_cache, slots)
    assert stores.calls == [TRITON]
