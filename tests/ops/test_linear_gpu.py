"""ops.linear on a GPU: the Triton kernel in bf16 at Qwen3-0.6B's projections and a decode
step's row counts, against cuBLAS (``F.linear``), eagerly and replayed from a CUDA graph.

Run: ``pytest -m gpu tests/ops/test_linear_gpu.py`` on a CUDA machine.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.cuda_graphs import capture
from mini_paged_attn.ops.fused import rms_norm
from mini_paged_attn.ops.projection import MAX_TRITON_ROWS, SplitKWorkspace, linear, plan_linear

pytestmark = pytest.mark.gpu

# (out_features, in_features, gated): qkv, o, gate_up, down.
SHAPES = {"qkv": (4096, 1024, False), "o": (1024, 2048, False), "gate_up": (3072, 1024, True),
          "down": (1024, 3072, False)}


def _weight(rows, cols, gen, dtype=torch.bfloat16):
    return (torch.randn(rows, cols, device="cuda", generator=gen) / cols ** 0.5).to(dtype)


def _reference(x, weight, gated):
    # cuBLAS in float32 over the same bf16 inputs, rounded as the op rounds.
    y = F.linear(x.float(), weight.float()).to(x.dtype)
    if not gated:
        return y
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("rows", [1, 16, 33, 128, 200, MAX_TRITON_ROWS])
def test_projection_matches_cublas(name, rows):
    n, k, gated = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(rows + n)
    x = torch.randn(rows, k, device="cuda", generator=gen).bfloat16()
    weight = _weight(2 * n if gated else n, k, gen)
    workspace = SplitKWorkspace("cuda")
    out = linear(x, weight, activation="silu" if gated else None, workspace=workspace)
    # One bf16 rounding apart (sum order), two where the product rounds again.
    torch.testing.assert_close(out, _reference(x, weight, gated), atol=2e-2, rtol=1.6e-2)
    assert not workspace.counters.any()


def test_fp16_with_bias():
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(24, 896, device="cuda", generator=gen).half()
    weight = _weight(1152, 896, gen, torch.float16)
    bias = torch.randn(1152, device="cuda", generator=gen).half()
    out = linear(x, weight, bias, workspace=SplitKWorkspace("cuda"))
    torch.testing.assert_close(out, F.linear(x, weight, bias), atol=4e-3, rtol=4e-3)


def test_rows_past_the_limit_take_cublas():
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(MAX_TRITON_ROWS + 1, 1024, device="cuda", generator=gen).bfloat16()
    weight = _weight(1024, 1024, gen)
    assert torch.equal(linear(x, weight), F.linear(x, weight))


def test_graph_replays_give_the_eager_bits():
    # A chain as in a decode step (RMSNorm, projections, split and gated), each launch a
    # programmatic dependent of the one before: replays on new inputs match eager calls.
    gen = torch.Generator(device="cuda").manual_seed(3)
    weights = {name: _weight(2 * n if g else n, k, gen) for name, (n, k, g) in SHAPES.items()}
    norm = torch.ones(1024, device="cuda").bfloat16()
    workspace = SplitKWorkspace("cuda")
    assert plan_linear(8, 1024, 2048, workspace=workspace).split_k > 1
    x = torch.empty(8, 1024, device="cuda").bfloat16()

    def chain():
        h = linear(rms_norm(x, norm, 1e-6), weights["qkv"], workspace=workspace)
        h = linear(h[:, :2048].contiguous(), weights["o"], workspace=workspace)
        h = linear(rms_norm(h, norm, 1e-6), weights["gate_up"], activation="silu",
                   workspace=workspace)
        return linear(h, weights["down"], workspace=workspace)

    x.copy_(torch.randn(8, 1024, device="cuda", generator=gen))
    graph, out = capture(chain)
    for seed in (4, 5):
        x.copy_(torch.randn(8, 1024, device="cuda", generator=gen.manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        eager = chain()
        assert torch.isfinite(eager.float()).all()
        assert torch.equal(out, eager)
    assert not workspace.counters.any()


def test_auto_leaves_autograd_to_torch():
    # The kernel has no backward: while autograd records, "auto" takes F.linear.
    gen = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(4, 1024, device="cuda", generator=gen).bfloat16()
    weight = _weight(1024, 1024, gen).requires_grad_()
    out = linear(x, weight)
    assert out.grad_fn is not None
    out.float().sum().backward()
    assert weight.grad is not None
    with torch.no_grad():
        assert torch.equal(linear(x, weight), linear(x, weight, backend="triton"))
