"""The Triton version gate (:mod:`mini_paged_attn.ops.triton_support`): which versions and
switch values turn the direct launch and the Gluon prefill on, that the answer is logged
once, and that the launch layer and the Hopper kernel's selection obey it."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from helpers.paged_batch import make_decode_batch, make_prefill_batch
from mini_paged_attn.ops import launch as launch_module
from mini_paged_attn.ops import triton_support as ts
from mini_paged_attn.ops.dispatch import paged_decode, paged_prefill, store_kv
from mini_paged_attn.ops.fused import apply_rotary


@pytest.fixture
def fresh_gate(monkeypatch):
    """The gate re-read under the test's environment, and re-read again afterwards."""
    monkeypatch.delenv(ts.PUBLIC_LAUNCH_ENV, raising=False)
    ts.triton_support.cache_clear()
    yield monkeypatch
    ts.triton_support.cache_clear()


@pytest.mark.parametrize("version, expected", [
    ("3.6.0", "3.6"), ("3.9.0", "3.9"), ("3.6", "3.6"), ("3.10.1", "3.10"),
    ("3.6.0+git1a2b3c", "3.6"), ("3.7.0rc1", "3.7"), ("3.6rc1", "3.6")])
def test_major_minor(version, expected):
    assert ts.major_minor(version) == expected


@pytest.mark.parametrize("version", ["3", "", "x.6.0", "3.x"])
def test_a_bad_version_string_raises(version):
    with pytest.raises(ValueError, match="version: expected a version like"):
        ts.major_minor(version)


@pytest.mark.parametrize("version, switch, direct", [
    ("3.6.0", None, True), ("3.6.1", "0", True), ("3.6.0", "", True),
    ("3.6.0", "1", False), ("3.6.0", "TRUE", False), ("3.6.0", " on ", False),
    ("3.9.0", None, False), ("3.5.1", None, False), ("4.6.0", None, False),
    (None, None, False)])
def test_the_decision(version, switch, direct):
    for gluon in (False, True):
        support = ts.support_for(version, switch, gluon)
        assert support.direct_launch is direct
        assert support.gluon_prefill is (direct and gluon)


def test_a_bad_switch_value_names_the_variable():
    with pytest.raises(ValueError, match=f"{ts.PUBLIC_LAUNCH_ENV}: expected 1 or 0.*'maybe'"):
        ts.support_for("3.6.0", "maybe", True)


def test_the_log_line_names_the_version_and_why():
    untested = ts.support_for("3.9.0", None, True).describe()
    assert "3.9.0" in untested and "3.6" in untested and "kernel[grid]" in untested
    forced = ts.support_for("3.6.0", "1", True).describe()
    assert "3.6.0" in forced and ts.PUBLIC_LAUNCH_ENV in forced and "no Gluon" in forced


def test_the_process_reads_the_switch_once_and_logs_once(fresh_gate, caplog):
    fresh_gate.setenv(ts.PUBLIC_LAUNCH_ENV, "1")
    with caplog.at_level(logging.INFO, logger=ts.__name__):
        assert not ts.direct_launch_enabled()
        assert not ts.gluon_prefill_enabled()
        fresh_gate.setenv(ts.PUBLIC_LAUNCH_ENV, "0")      # kept: read once a process
        assert not ts.direct_launch_enabled()
    lines = [r for r in caplog.records if r.name == ts.__name__]
    assert len(lines) == 1 and ts.PUBLIC_LAUNCH_ENV in lines[0].getMessage()
    import triton
    assert triton.__version__ in lines[0].getMessage()


def test_the_installed_triton_decides_when_the_switch_is_off(fresh_gate):
    import triton
    tested = ts.major_minor(triton.__version__) in ts.TESTED_TRITON_VERSIONS
    assert ts.direct_launch_enabled() is tested
    assert ts.triton_support().version == triton.__version__


class _FakeJit:
    """A ``@triton.jit`` kernel's launch interface whose launch returns a compiled kernel
    (as on a GPU) that records whether the direct path read its internals."""

    arg_names = ["x", "n"]

    def __init__(self):
        self.launches = 0
        self.compiled = SimpleNamespace(packed_metadata=(), internals_read=False)

        def init_handles():
            self.compiled.internals_read = True
            raise RuntimeError("past the gate")
        self.compiled._init_handles = init_handles

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.launches += 1
            return self.compiled
        return run


def test_a_prepared_launch_reads_no_internals_when_the_gate_is_off(fresh_gate):
    fresh_gate.setenv(ts.PUBLIC_LAUNCH_ENV, "1")
    jit = _FakeJit()
    prepared = launch_module.PreparedLaunch(jit, (1,), (torch.zeros(4), 4), {})
    assert jit.launches == 1 and not prepared.ready and not jit.compiled.internals_read
    assert prepared((torch.zeros(4),)) is False          # never repeated: the JIT again
    # The gate on: the same launch goes on to the compiled kernel's internals.
    fresh_gate.setattr(launch_module, "direct_launch_enabled", lambda: True)
    with pytest.raises(RuntimeError, match="past the gate"):
        launch_module.PreparedLaunch(jit, (1,), (torch.zeros(4), 4), {})
    assert jit.compiled.internals_read


def test_launch_takes_the_public_call_when_the_gate_is_off(fresh_gate):
    fresh_gate.setenv(ts.PUBLIC_LAUNCH_ENV, "1")
    fresh_gate.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    fresh_gate.setattr(torch.Tensor, "get_device", lambda self: 0)

    def no_prepared(*args, **kwargs):
        raise AssertionError("a PreparedLaunch was made with the gate off")
    fresh_gate.setattr(launch_module, "PreparedLaunch", no_prepared)
    jit = _FakeJit()
    before = len(launch_module._LAUNCHES)
    for _ in range(3):
        launch_module.launch(jit, (1,), (torch.zeros(4), 4), {})
    assert jit.launches == 3 and len(launch_module._LAUNCHES) == before


def test_the_hopper_kernel_is_chosen_only_where_the_gate_allows(fresh_gate):
    from mini_paged_attn.ops import prefill_plan
    fresh_gate.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda", 0)
    expected = ts.triton_support().gluon_prefill       # the installed Triton, switch off
    assert prefill_plan.hopper_prefill_runs_on(cuda, 128, torch.bfloat16, 16) is expected
    fresh_gate.setenv(ts.PUBLIC_LAUNCH_ENV, "1")
    ts.triton_support.cache_clear()
    assert not prefill_plan.hopper_prefill_runs_on(cuda, 128, torch.bfloat16, 16)
    assert not prefill_plan.hopper_prefill_runs_on(cuda, 128, torch.bfloat16, None)


def _run_ops(seed: int) -> list[torch.Tensor]:
    """store_kv, a decode, a prefill and a fused rotary write on the triton backend (the
    interpreter), twice each (a repeat is where a direct launch would differ)."""
    kwargs = dict(num_q_heads=4, num_kv_heads=2, head_size=16, block_size=4,
                  dtype=torch.float32, seed=seed)
    decode = make_decode_batch([9, 1], **kwargs)
    prefill = make_prefill_batch([5, 3], [2, 0], **kwargs)
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(3, 2, 16, generator=gen) for _ in range(2))
    slots = torch.tensor([0, 7, -1], dtype=torch.int32)
    q = torch.randn(3, 4, 16, generator=gen)
    table = torch.randn(32, 16, generator=gen)
    positions = torch.tensor([0, 5, 31])
    outs = []
    for _ in range(2):
        kc, vc = torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16)
        store_kv(k, v, kc, vc, slots, backend="triton")
        outs += [kc, vc]
        outs.append(paged_decode(*decode.decode_args, backend="triton"))
        outs.append(paged_prefill(*prefill.prefill_args, backend="triton"))
        outs += list(apply_rotary(q, k, positions, table, backend="triton"))
    return outs


def test_ops_give_the_same_results_with_the_switch_on(fresh_gate):
    plain = _run_ops(seed=3)
    fresh_gate.setenv(ts.PUBLIC_LAUNCH_ENV, "1")
    ts.triton_support.cache_clear()
    public = _run_ops(seed=3)
    assert len(plain) == len(public)
    for a, b in zip(plain, public):
        assert torch.equal(a, b)
