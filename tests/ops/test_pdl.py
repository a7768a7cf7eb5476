"""Programmatic dependent launch on CPU: which launches ask for it, and what a kernel compiled
with it for sm_90 does first. The launches themselves run on CUDA only:
tests/ops/test_pdl_gpu.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from mini_paged_attn.ops import pdl
from mini_paged_attn.ops.launch import launch


class _Kernel:
    """Stands in for a ``@triton.jit`` kernel: records the options of each launch."""

    def __init__(self, arg_names, calls):
        self.arg_names, self.calls = arg_names, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append(kwargs)


def test_cpu_tensors_launch_plainly():
    assert pdl.pdl_options(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}


def test_launch_adds_pdl_only_to_kernels_that_declare_it():
    calls = []
    t = torch.zeros(2)
    launch(_Kernel(["x_ptr", "BLOCK", "PDL"], calls), (1,), (t,), {"BLOCK": 4})
    launch(_Kernel(["x_ptr", "BLOCK"], calls), (1,), (t,), {"BLOCK": 4})
    assert calls == [{"BLOCK": 4, "PDL": False, "launch_pdl": False}, {"BLOCK": 4}]


def test_a_triton_without_grid_dependency_control_gets_no_launch_option(monkeypatch):
    monkeypatch.setattr(pdl, "HAS_GRID_DEPENDENCY_CONTROL", False)
    monkeypatch.setattr(pdl, "pdl_supported", lambda index: True)   # never asked
    assert pdl.pdl_options(torch.device("cuda", 0)) == {"PDL": False}


# Compiled for sm_90 without a GPU, outside the interpreter (under it @triton.jit kernels
# cannot be compiled): the PTX of each kernel, with and without PDL, and once more with the
# griddepcontrol functions gone (sm_89: a new compile, not a cached one).
_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mini_paged_attn.ops import fused_triton as f
CASES = {
    "silu": (f._silu_and_mul_kernel, {"x_ptr": "*bf16", "out_ptr": "*bf16", "stride_x": "i32",
                                      "stride_out": "i32"}, {"INTER": 64, "BLOCK": 64}),
    "rms_norm": (f._rms_norm_kernel, {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16",
                                      "out_ptr": "*bf16", "res_out_ptr": "*bf16", "heads": "i32",
                                      "stride_x_token": "i32", "stride_x_head": "i32",
                                      "stride_res": "i32", "stride_res_out": "i32",
                                      "eps": "fp32"},
                 {"DIM": 64, "BLOCK": 64, "HAS_RESIDUAL": True}),
}
for name, (fn, signature, constexprs) in CASES.items():
    for flag in (True, False):
        consts = dict(constexprs, PDL=flag)
        sig = dict(signature, **{k: "constexpr" for k in consts})
        kernel = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32))
        open(f"{OUT}/{name}_{flag}.ptx", "w").write(kernel.asm["ptx"])
# As with a Triton that has no griddepcontrol: the kernels still compile without PDL.
from mini_paged_attn.ops import pdl
pdl.gdc_wait = pdl.gdc_launch_dependents = None
fn, signature, constexprs = CASES["silu"]
consts = dict(constexprs, PDL=False)
kernel = triton.compile(ASTSource(fn, dict(signature, **{k: "constexpr" for k in consts}),
                                  consts), target=GPUTarget("cuda", 89, 32))
open(f"{OUT}/silu_no_gdc.ptx", "w").write(kernel.asm["ptx"])
"""


@pytest.fixture(scope="module")
def sm90_ptx(tmp_path_factory):
    out = tmp_path_factory.mktemp("ptx")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", f"OUT = {str(out)!r}\n" + _COMPILE], env=env,
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        pytest.fail(done.stderr[-2000:])
    return {p.stem: p.read_text() for p in out.glob("*.ptx")}


@pytest.mark.parametrize("name", ["silu", "rms_norm"])
def test_a_pdl_kernel_waits_before_it_touches_memory(sm90_ptx, name):
    ptx = sm90_ptx[f"{name}_True"]
    wait = ptx.index("griddepcontrol.wait")
    trigger = ptx.index("griddepcontrol.launch_dependents")
    first_access = min(ptx.index(op) for op in ("ld.global", "st.global") if op in ptx)
    assert wait < trigger < first_access
    assert "griddepcontrol" not in sm90_ptx[f"{name}_False"]


def test_kernels_compile_without_grid_dependency_control(sm90_ptx):
    assert "ld.global" in sm90_ptx["silu_no_gdc"]
    assert "griddepcontrol" not in sm90_ptx["silu_no_gdc"]
