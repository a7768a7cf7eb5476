"""gpt-oss: sliding and full layers alternating, attention sinks, yarn rope, attention biases;
an expert block on every layer (top-k of the logits then softmax, biased router and experts,
the clamped SwiGLU over interleaved gate/up columns, fused expert tensors)."""

from __future__ import annotations

from typing import Any

from ...ops.moe import MoeActivation
from ..family import Family
from ..moe_config import MoeConfig, need_field, refuse_quantized
from ..moe_decoder import MoeForCausalLM

# The published checkpoints are MXFP4; what to load instead.
QUANTIZED_HINT = ("for gpt-oss use a checkpoint dequantized to bf16, e.g. with transformers' "
                  "Mxfp4Config(dequantize=True) and save_pretrained")


def read_moe(fields: dict[str, Any], num_layers: int, source: str) -> MoeConfig:
    """The expert config of a gpt-oss config (the family's defaults filled in)."""
    refuse_quantized(fields, source, QUANTIZED_HINT)
    activation = MoeActivation("clamped_swiglu", interleaved=True,
                               alpha=float(need_field(fields, "gpt_oss", source, "swiglu_alpha")),
                               limit=float(need_field(fields, "gpt_oss", source, "swiglu_limit")))
    return MoeConfig("topk_softmax",
                     need_field(fields, "gpt_oss", source, "num_local_experts", "num_experts"),
                     need_field(fields, "gpt_oss", source, "num_experts_per_tok"),
                     need_field(fields, "gpt_oss", source, "intermediate_size"),
                     tuple(range(num_layers)), renormalize=False, router_bias=True,
                     expert_bias=True, activation=activation)


FAMILY = Family(name="gpt_oss", architecture="GptOssForCausalLM", model_type="gpt_oss",
                model_class=MoeForCausalLM, window="pattern", attention_sinks=True, moe=read_moe,
                defaults={"max_position_embeddings": 131072, "num_key_value_heads": 8,
                          "head_dim": 64, "rms_norm_eps": 1e-5, "attention_bias": True,
                          "sliding_window": 128, "rope_theta": 150000.0,
                          "rope_parameters": {"rope_type": "yarn", "factor": 32.0,
                                              "beta_fast": 32.0, "beta_slow": 1.0,
                                              "truncate": False,
                                              "original_max_position_embeddings": 4096},
                          "num_experts_per_tok": 4, "swiglu_alpha": 1.702,
                          "swiglu_limit": 7.0})
