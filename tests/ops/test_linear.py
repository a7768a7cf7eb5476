"""ops.linear: the Triton projection kernel against ``F.linear`` (and SwiGLU's product).

On CPU the kernel runs through the Triton interpreter (fp32 and fp16); the ``gpu`` tests in
test_linear_gpu.py repeat it in bf16 at real model shapes and under CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mini_paged_attn.ops.projection import (MAX_TRITON_ROWS, SplitKWorkspace, linear,
                                        linear_reference, plan_linear)

# A sum over K in another order: a few ulps of the dtype at the output's scale.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def _poisoned(rows, cols, used_rows, used_cols, *, dtype, gen, scale=1.0):
    """A ``[used_rows, used_cols]`` view of a NaN-filled ``[rows, cols]`` buffer holding
    random values there: a kernel reading past the view's rows or columns reads NaN."""
    buf = torch.full((rows, cols), float("nan"), dtype=dtype)
    buf[:used_rows, :used_cols] = (scale * torch.randn(used_rows, used_cols, generator=gen)).to(dtype)
    return buf[:used_rows, :used_cols]


# (rows, out_features, in_features, gated, bias, split): block_size-like edges (1, 17, 64),
# output columns off the 64-column tile (80, 96), K off the 128-column step (200).
CASES = [(1, 64, 128, False, False, False), (17, 96, 512, False, True, True),
         (64, 80, 200, False, False, False), (3, 64, 512, False, False, True),
         (1, 64, 512, True, False, True), (17, 80, 128, True, True, False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("rows,n,k,gated,bias,split", CASES)
def test_kernel_matches_reference(dtype, rows, n, k, gated, bias, split):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    weight_rows = 2 * n if gated else n
    x = _poisoned(rows + 3, k + 8, rows, k, dtype=dtype, gen=gen)
    weight = _poisoned(weight_rows + 5, k + 8, weight_rows, k, dtype=dtype, gen=gen,
                       scale=k ** -0.5)
    b = torch.randn(weight_rows, generator=gen).to(dtype) if bias else None
    workspace = SplitKWorkspace("cpu", partials=1 << 16, counters=64) if split else None
    if workspace is not None:
        workspace.partials.fill_(float("nan"))         # every partial is written before read
        assert plan_linear(rows, n, k, gated=gated, workspace=workspace).split_k > 1
    activation = "silu" if gated else None
    ref = linear_reference(x, weight, b, activation)
    out = linear(x, weight, b, activation=activation, workspace=workspace, backend="triton")
    assert out.shape == (rows, n) and out.dtype == dtype
    torch.testing.assert_close(out, ref, **TOL[dtype])
    if workspace is not None:
        assert not workspace.counters.any()             # the launch leaves its tickets at 0


def test_split_results_do_not_depend_on_the_finishing_order():
    # The last program adds every split in split order: the same call gives the same bits.
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 512, generator=gen)
    weight = torch.randn(64, 512, generator=gen)
    workspace = SplitKWorkspace("cpu", partials=1 << 16, counters=64)
    first = linear(x, weight, workspace=workspace, backend="triton")
    assert torch.equal(first, linear(x, weight, workspace=workspace, backend="triton"))


def test_empty_inputs():
    x = torch.randn(0, 128)
    assert linear(x, torch.randn(64, 128), backend="triton").shape == (0, 64)
    out = linear(torch.randn(4, 0), torch.randn(64, 0), torch.ones(64), backend="triton")
    assert torch.equal(out, torch.ones(4, 64))
    # No K: the gated product of the bias halves alone.
    bias = torch.randn(128, generator=torch.Generator().manual_seed(1))
    out = linear(torch.randn(3, 0), torch.randn(128, 0), bias, activation="silu",
                 backend="triton")
    torch.testing.assert_close(out, (F.silu(bias[:64]) * bias[64:]).expand(3, 64))


def test_auto_and_torch_run_f_linear_on_cpu():
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(4, 32, generator=gen), torch.randn(64, 32, generator=gen)
    for backend in ("auto", "torch"):
        assert torch.equal(linear(x, weight, backend=backend), F.linear(x, weight))
    gated = linear(x, weight, activation="silu", backend="auto")
    gate, up = F.linear(x, weight).chunk(2, dim=-1)
    assert torch.equal(gated, F.silu(gate) * up)


def test_plan_at_qwen3_decode_shapes():
    # Measured on an H100 (docs/performance-notes.md): split only the layers
    # with few output tiles, more at a few rows.
    ws = SplitKWorkspace("cpu")
    shapes = {"qkv": (4096, 1024, False), "o": (1024, 2048, False),
              "gate_up": (3072, 1024, True), "down": (1024, 3072, False)}
    splits = {rows: {name: plan_linear(rows, n, k, gated=g, workspace=ws).split_k
                     for name, (n, k, g) in shapes.items()} for rows in (1, 128)}
    assert splits[1] == {"qkv": 1, "o": 4, "gate_up": 2, "down": 4}
    assert splits[128] == {"qkv": 1, "o": 2, "gate_up": 1, "down": 2}
    for rows in (1, 16, 17, 128, 129, MAX_TRITON_ROWS):
        for n, k, g in shapes.values():
            plan = plan_linear(rows, n, k, gated=g)
            assert plan.split_k == 1                    # no workspace, no split
            assert plan.block_m >= min(rows, 16) and plan.block_m in (16, 32, 64, 128)


def test_plan_fits_the_workspace():
    small = SplitKWorkspace("cpu", partials=2 * 16 * 64 * 16, counters=64)
    assert plan_linear(1, 1024, 2048, workspace=small).split_k == 2
    assert plan_linear(1, 1024, 2048, workspace=SplitKWorkspace("cpu", counters=8)).split_k == 1


@pytest.mark.parametrize("call,match", [
    (lambda x, w: linear(x[0], w), "x: expected a 2-D tensor"),
    (lambda x, w: linear(x, w.half()), "weight: expected dtype torch.float32"),
    (lambda x, w: linear(x, w[:, :16]), r"weight: expected \[out_features, 32\]"),
    (lambda x, w: linear(x, w, activation="gelu"), "activation: expected one of"),
    (lambda x, w: linear(x, w[:63], activation="silu"), "weight: expected an even number"),
    (lambda x, w: linear(x, w, torch.zeros(3)), r"bias: expected shape \(64,\)"),
    (lambda x, w: linear(x, w, torch.zeros(128)[::2]), "bias: expected .*contiguous"),
    (lambda x, w: linear(x, torch.randn(32, 64).t()), "weight: expected .*contiguous"),
    (lambda x, w: linear(x.t().contiguous().t(), w, backend="torch"),
     "x: expected .*contiguous"),
    (lambda x, w: SplitKWorkspace("cpu", partials=0), "partials: expected a positive int"),
    (lambda x, w: SplitKWorkspace("cpu", counters=2.5), "counters: expected a positive int"),
    (lambda x, w: linear(x, w, workspace=torch.zeros(8)), "workspace: expected None or a"),
    (lambda x, w: linear(x, w, backend="cuda"), "backend: expected one of"),
    (lambda x, w: linear(x, w.requires_grad_(), backend="triton"), "backend: expected 'auto'"),
])
def test_bad_arguments_raise(call, match):
    x, w = torch.randn(4, 32), torch.randn(64, 32)
    with pytest.raises(ValueError, match=match):
        call(x, w)


def test_plan_pipeline_fits_shared_memory():
    # float32 (the "triton" backend's IEEE path) halves the stages the shared memory holds.
    from mini_paged_attn.ops.projection import SHARED_MEMORY_BUDGET
    for rows, gated, itemsize in ((64, True, 2), (256, True, 2), (64, True, 4), (256, False, 4)):
        plan = plan_linear(rows, 3072, 1024, gated=gated, itemsize=itemsize)
        stage = ((2 if gated else 1) * plan.block_n + plan.block_m) * plan.block_k * itemsize
        assert 1 <= plan.stages and plan.stages * stage <= SHARED_MEMORY_BUDGET
    assert plan_linear(64, 3072, 1024, gated=True, itemsize=4).stages == 2
