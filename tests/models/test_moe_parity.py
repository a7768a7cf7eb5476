"""Mixture-of-experts families against transformers, token for token (fp32, CPU).

Tiny random checkpoints written by transformers' ``save_pretrained``: Qwen3-MoE (a dense layer
from ``mlp_only_layers`` before the sparse ones, top-k weights not renormalised; and
renormalised with ``decoder_sparse_step=2``; and with ``use_sliding_window``, a window shorter
than the prompts on every layer), Mixtral (``block_sparse_moe.experts.N.w1/w2/w3``,
sharded, every layer sliding), gpt-oss (attention sinks, a sliding window shorter than the
prompts on every other layer, yarn rope, attention and expert biases, fused interleaved
experts, the clamped SwiGLU). Also: the routing functions against transformers' routers, the
checkpoint names, and the whole model's Triton path against its torch path.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.model_parity import (assert_prefill_then_decode_match,
                                  assert_triton_backend_matches_torch, load_with_reference)
from helpers.tiny_models import TINY_WINDOW

from mini_paged_attn.models.config import ModelConfig
from mini_paged_attn.models.loader import load_model
from mini_paged_attn.models.moe import SparseMoeBlock, softmax_topk, topk_softmax

VARIANTS = {
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe-norm-step2": ("qwen3_moe", {"norm_topk_prob": True, "decoder_sparse_step": 2,
                                           "mlp_only_layers": []}),
    # Windowed on every layer (the family has no max_window_layers), shorter than the prompts.
    "qwen3_moe-window": ("qwen3_moe", {"use_sliding_window": True, "sliding_window": TINY_WINDOW}),
    "mixtral-sharded-window": ("mixtral", {"max_shard_size": "100KB",
                                           "sliding_window": TINY_WINDOW}),
    "gpt_oss": ("gpt_oss", {}),
}
ATOL = 1e-4
BLOCK_SIZE = 4
PROMPT_LENS = (1, 3, BLOCK_SIZE + 1, 11)


@pytest.fixture(scope="module", params=list(VARIANTS))
def models(request, tiny_model_factory):
    arch, kwargs = VARIANTS[request.param]
    return load_with_reference(tiny_model_factory(arch, **kwargs))


def test_prefill_then_decode_match_transformers(models):
    assert_prefill_then_decode_match(*models, PROMPT_LENS, block_size=BLOCK_SIZE, atol=ATOL)


def test_sparse_layers_follow_the_config(models):
    model, config, hf = models
    for ours, theirs in zip(model.layers, hf.model.layers):
        sparse = isinstance(ours.mlp, SparseMoeBlock)
        assert sparse == (not hasattr(theirs.mlp, "gate_proj"))
    assert any(isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_triton_backend_matches_torch_backend(tiny_model_factory, arch):
    """The whole model through the Triton kernels (the interpreter on CPU; the GPU when there
    is one): experts, and for gpt-oss sinks and a window shorter than the prompt, over strided
    pool views, a mixed prefill step and a padded decode step."""
    assert_triton_backend_matches_torch(tiny_model_factory(arch), list(range(3, 14)),
                                        block_size=BLOCK_SIZE)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_the_model_names_exactly_the_checkpoints_tensors(tiny_model_factory, arch):
    """Every tensor transformers saved has a target holding exactly its values (gpt-oss's
    fused experts through transposed views), and no target is left without one."""
    from safetensors.torch import load_file

    model_dir = tiny_model_factory(arch)
    model, _ = load_model(model_dir)
    checkpoint = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        checkpoint.update(load_file(path))
    targets = model.checkpoint_targets()
    assert set(targets) == {n for n in checkpoint if not model.is_ignored_checkpoint_tensor(n)}
    for name, target in targets.items():
        torch.testing.assert_close(target, checkpoint[name], atol=0, rtol=0, msg=name)


# ---- routing against transformers' routers ------------------------------------------------------

@pytest.mark.parametrize("renormalize", [False, True])
def test_softmax_topk_matches_qwen3_moe_router(renormalize):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3,
                         norm_topk_prob=renormalize)
    router = Qwen3MoeTopKRouter(cfg)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 16, generator=gen))
        x = torch.randn(10, 16, generator=gen)
        logits, want_w, want_ids = router(x)
    weights, ids = softmax_topk(logits, 3, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_w.float())


def test_topk_softmax_matches_gpt_oss_router():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    router = GptOssTopKRouter(GptOssConfig(hidden_size=16, num_local_experts=8,
                                           num_experts_per_tok=2))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 16, generator=gen))
        router.bias.copy_(torch.randn(8, generator=gen))
        x = torch.randn(10, 16, generator=gen)
        logits, want_w, want_ids = router(x)
    weights, ids = topk_softmax(logits, 2)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_w.float())


# ---- config --------------------------------------------------------------------------------------

def _raw(model_dir):
    return json.loads((model_dir / "config.json").read_text())


def test_config_reads_the_moe_fields(tiny_model_factory):
    qwen = ModelConfig.from_dict(_raw(tiny_model_factory("qwen3_moe")))
    assert qwen.family == "qwen3_moe" and qwen.qk_norm
    assert (qwen.moe.num_experts, qwen.moe.top_k, qwen.moe.intermediate_size) == (8, 2, 32)
    assert qwen.moe.sparse_layers == (1, 2) and not qwen.moe.renormalize
    raw = _raw(tiny_model_factory("qwen3_moe"))
    raw.update(num_hidden_layers=4, mlp_only_layers=[3], decoder_sparse_step=2, norm_topk_prob=True)
    stepped = ModelConfig.from_dict(raw).moe
    assert stepped.sparse_layers == (1,) and stepped.renormalize
    mixtral = ModelConfig.from_dict(_raw(tiny_model_factory("mixtral")))
    assert mixtral.moe.sparse_layers == (0, 1) and mixtral.moe.renormalize
    assert not mixtral.qk_norm
    oss = ModelConfig.from_dict(_raw(tiny_model_factory("gpt_oss")))
    assert oss.moe.router == "topk_softmax" and oss.moe.router_bias and oss.moe.expert_bias
    assert oss.moe.activation.kind == "clamped_swiglu" and oss.moe.activation.interleaved
    assert oss.layer_types == ("sliding_attention", "full_attention")
    assert oss.sliding_window == TINY_WINDOW
    assert oss.qkv_bias and oss.o_bias and oss.rope.rope_type == "yarn"


def test_mxfp4_checkpoint_is_refused_by_name(tiny_model_factory):
    raw = _raw(tiny_model_factory("gpt_oss"))
    raw["quantization_config"] = {"quant_method": "mxfp4"}
    with pytest.raises(ValueError, match="mxfp4"):
        ModelConfig.from_dict(raw)


def test_top_k_above_num_experts_is_refused(tiny_model_factory):
    raw = _raw(tiny_model_factory("mixtral"))
    raw["num_experts_per_tok"] = 9
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_dict(raw)
