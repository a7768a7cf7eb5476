"""The mixture-of-experts op (ops/moe.py): the routing plan, the Triton grouped GEMMs against
the torch reference, and the reference against a token-by-token formula.

On CPU the kernels run through the Triton interpreter (fp32 and fp16, tiny shapes); the ``gpu``
tests repeat them in bf16 at a Qwen3-30B-A3B-like layer and under a CUDA graph. The reference
is checked against transformers' expert modules in tests/models/test_moe_parity.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.cuda_graphs import capture

from mini_paged_attn.ops.moe import MoeActivation, fused_moe, fused_moe_reference
from mini_paged_attn.ops.moe_triton import MoeTiles, moe_routing_plan, triton_fused_moe

# The Triton cases run compiled on a GPU, else through the interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# fp16: the kernel rounds the activation and each expert's output once (the reference rounds
# the projections too), a few ulps of outputs of magnitude ~10.
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.float16: dict(atol=3e-2, rtol=1e-2)}
CPU_DTYPES = (torch.float32, torch.float16)
CLAMPED = MoeActivation("clamped_swiglu", interleaved=True)


def _problem(num_tokens, num_experts, top_k, hidden, inter, dtype, *, seed, device=None,
             bias=False, experts_used=None):
    """Random MoE inputs; ``experts_used`` restricts routing to those experts (the others get
    no token and their weights are NaN: a kernel that read them would spread NaN)."""
    gen = torch.Generator().manual_seed(seed)
    device = device or DEVICE

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(shape, generator=gen)).to(device, dtype)

    used = torch.tensor(experts_used if experts_used is not None else range(num_experts))
    # Distinct experts per token, as top-k gives.
    choice = torch.stack([used[torch.randperm(len(used), generator=gen)[:top_k]]
                          for _ in range(num_tokens)]) if num_tokens else torch.zeros(0, top_k)
    ids = choice.to(device, torch.int32).reshape(num_tokens, top_k)
    weights = torch.rand(num_tokens, top_k, generator=gen).to(device)
    args = dict(hidden=randn(num_tokens, hidden), w13=randn(num_experts, 2 * inter, hidden,
                                                              scale=hidden ** -0.5),
                w2=randn(num_experts, hidden, inter, scale=inter ** -0.5 * 4),
                topk_weights=weights, topk_ids=ids)
    if bias:
        args.update(w13_bias=randn(num_experts, 2 * inter), w2_bias=randn(num_experts, hidden))
    unused = sorted(set(range(num_experts)) - set(used.tolist()))
    for name in ("w13", "w2", "w13_bias", "w2_bias"):
        if name in args and unused:
            args[name][unused] = float("nan")
    return args


def _token_by_token(hidden, w13, w2, topk_weights, topk_ids, activation, w13_bias=None,
                    w2_bias=None):
    """The formula of fused_moe's docstring, one token and one expert at a time, float64."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate_up = w13[e].double() @ hidden[t].double()
            if w13_bias is not None:
                gate_up = gate_up + w13_bias[e].double()
            if activation.interleaved:
                gate, up = gate_up[0::2], gate_up[1::2]
            else:
                gate, up = gate_up.chunk(2)
            if activation.kind == "silu":
                act = F.silu(gate) * up
            else:
                gate, up = gate.clamp(max=activation.limit), up.clamp(-activation.limit,
                                                                     activation.limit)
                act = (up + 1) * gate * torch.sigmoid(activation.alpha * gate)
            down = w2[e].double() @ act
            if w2_bias is not None:
                down = down + w2_bias[e].double()
            out[t] += float(topk_weights[t, j]) * down
    return out


# ---- the routing plan ---------------------------------------------------------------------------

@pytest.mark.parametrize("num_tokens, num_experts, top_k, block_m",
                         [(1, 4, 2, 16), (20, 8, 2, 16), (9, 4, 3, 32), (40, 4, 1, 16)])
def test_routing_plan_groups_pairs_by_expert_in_padded_tiles(num_tokens, num_experts, top_k,
                                                             block_m):
    ids = _problem(num_tokens, num_experts, top_k, 16, 16, torch.float32, seed=num_tokens,
                   experts_used=[0, 2, 3] if num_experts == 4 and top_k < 3 else None)["topk_ids"]
    plan = moe_routing_plan(ids, num_experts, block_m)
    flat = ids.reshape(-1).tolist()
    num_pairs = len(flat)
    pairs = plan.sorted_pairs.tolist()
    assert len(pairs) == plan.num_blocks * block_m
    seen = []
    for b, expert in enumerate(plan.block_expert.tolist()):
        tile = pairs[b * block_m:(b + 1) * block_m]
        real = [p for p in tile if p != num_pairs]
        if expert == num_experts:                       # past the last group: padding only
            assert not real
            continue
        assert real and all(flat[p] == expert for p in real)
        assert tile[:len(real)] == real                 # padding only at a group's end
        seen += real
    assert sorted(seen) == list(range(num_pairs))       # every pair exactly once
    for e in range(num_experts):                        # within an expert, in pair order
        mine = [p for p in seen if flat[p] == e]
        assert mine == sorted(mine)


# ---- reference ----------------------------------------------------------------------------------

@pytest.mark.parametrize("activation, bias", [(MoeActivation(), False), (CLAMPED, True),
                                              (MoeActivation(interleaved=True), True)])
def test_reference_matches_the_formula_token_by_token(activation, bias):
    args = _problem(6, 4, 2, 16, 8, torch.float32, seed=3, bias=bias)
    got = fused_moe(**args, activation=activation, backend="torch")
    want = _token_by_token(**args, activation=activation)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_clamped_swiglu_clamps_gate_above_and_up_both_ways():
    act = MoeActivation("clamped_swiglu", limit=1.0, alpha=2.0)
    gate = torch.tensor([[-3.0, 0.5, 5.0]])
    up = torch.tensor([[-4.0, 0.25, 9.0]])
    want = torch.tensor([[(-1.0 + 1) * -3.0 * torch.sigmoid(torch.tensor(-6.0)).item(),
                          1.25 * 0.5 * torch.sigmoid(torch.tensor(1.0)).item(),
                          2.0 * 1.0 * torch.sigmoid(torch.tensor(2.0)).item()]])
    torch.testing.assert_close(act.apply(gate, up), want)


# ---- Triton against the reference (interpreter) -----------------------------------------------

@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("num_tokens, num_experts, hidden, inter, experts_used", [
    (1, 4, 32, 16, None),             # a single decode token
    (5, 8, 48, 24, [1, 6]),           # most experts without a token; sizes not tile multiples
    (20, 8, 32, 16, None),
    (17, 4, 16, 32, [0, 3]),
])
@pytest.mark.parametrize("activation, bias", [(MoeActivation(), False), (CLAMPED, True)],
                         ids=["swiglu", "clamped-bias"])
def test_triton_matches_reference(dtype, num_tokens, num_experts, hidden, inter, experts_used,
                                  activation, bias):
    args = _problem(num_tokens, num_experts, 2, hidden, inter, dtype, seed=num_tokens + hidden,
                    bias=bias, experts_used=experts_used)
    want = fused_moe(**args, activation=activation, backend="torch")
    got = fused_moe(**args, activation=activation, backend="triton")
    assert got.shape == (num_tokens, hidden) and got.dtype == dtype
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("tiles", [MoeTiles(16, 16, 16), MoeTiles(32, 32, 16)])
def test_triton_tiles_and_top1(tiles):
    """Other tile shapes (more padding per expert, several n and k tiles), k = 1 and 3, biases
    with either row order."""
    for top_k, activation in ((1, MoeActivation()), (3, MoeActivation(interleaved=True))):
        args = _problem(11, 4, top_k, 40, 24, torch.float32, seed=top_k, bias=True)
        want = fused_moe_reference(**args, activation=activation)
        got = triton_fused_moe(args["hidden"], args["w13"], args["w2"], args["topk_weights"],
                               args["topk_ids"], activation, args["w13_bias"], args["w2_bias"],
                               tiles=tiles)
        torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_no_tokens_gives_an_empty_output():
    args = _problem(0, 4, 2, 16, 16, torch.float32, seed=0)
    for backend in ("torch", "triton"):
        assert fused_moe(**args, backend=backend).shape == (0, 16)


# ---- argument checks ----------------------------------------------------------------------------

@pytest.mark.parametrize("change, name", [
    (lambda a: a.update(w13=a["w13"][:, :-1]), "w13"),
    (lambda a: a.update(w2=a["w2"].transpose(1, 2)), "w2"),
    (lambda a: a.update(topk_ids=a["topk_ids"].long()), "topk_ids"),
    (lambda a: a.update(topk_weights=a["topk_weights"][:, :1]), "topk_weights"),
    (lambda a: a.update(topk_weights=a["topk_weights"].half()), "topk_weights"),
    (lambda a: a.update(w2_bias=torch.zeros(4, 3)), "w2_bias"),
    (lambda a: a.update(hidden=a["hidden"].half()), "w13"),
])
def test_bad_arguments_name_the_argument(change, name):
    args = _problem(3, 4, 2, 16, 8, torch.float32, seed=1)
    change(args)
    with pytest.raises(ValueError, match=name):
        fused_moe(**args)


def test_bad_activation_is_refused():
    with pytest.raises(ValueError, match="activation.kind"):
        MoeActivation("gelu")
    with pytest.raises(ValueError, match="activation.limit"):
        MoeActivation("clamped_swiglu", limit=0)


# ---- GPU ----------------------------------------------------------------------------------------

class _no_tf32:
    """float32 matmuls in full precision inside the block (the exact result)."""

    def __enter__(self):
        self.saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.saved


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 16, 300])
@pytest.mark.parametrize("activation, bias", [(MoeActivation(), False), (CLAMPED, True)],
                         ids=["swiglu", "clamped-bias"])
def test_gpu_bf16_error_is_within_the_references_bf16_noise(num_tokens, activation, bias):
    """bf16 cannot match float32 exactly; the kernels (float32 accumulation, two roundings per
    pair) must be as close to the float32 result as the bf16 reference is (outputs reach ~50,
    where a bf16 ulp is 0.25, so a fixed tolerance says little)."""
    args = _problem(num_tokens, 128, 8, 2048, 768, torch.bfloat16, seed=num_tokens,
                    device="cuda", bias=bias)
    exact_args = {k: v.float() if v.dtype == torch.bfloat16 else v for k, v in args.items()}
    with _no_tf32():
        exact = fused_moe(**exact_args, activation=activation, backend="torch")
    ref = fused_moe(**args, activation=activation, backend="torch")
    got = fused_moe(**args, activation=activation, backend="triton")
    noise = (ref.float() - exact).abs().max().item()
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert (got.float() - exact).abs().max().item() <= 1.5 * noise


@pytest.mark.gpu
def test_gpu_cuda_graph_replays_with_new_routing():
    """Captured once, replayed after the routing changed (other experts, some with no token):
    the same bits as an eager call on the new inputs."""
    args = _problem(8, 16, 2, 256, 128, torch.bfloat16, seed=5, device="cuda")
    graph, out = capture(lambda: fused_moe(**args))
    new = _problem(8, 16, 2, 256, 128, torch.bfloat16, seed=6, device="cuda",
                   experts_used=[3, 9, 12])
    for name in ("hidden", "topk_ids", "topk_weights"):
        args[name].copy_(new[name])
    graph.replay()
    torch.testing.assert_close(out, fused_moe(**args), atol=0, rtol=0)
