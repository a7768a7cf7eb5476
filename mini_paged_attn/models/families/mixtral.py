"""Mixtral: the Mistral decoder with an expert block on every layer (softmax then top-k,
renormalised), its checkpoint under ``block_sparse_moe`` with experts ``w1`` / ``w3`` / ``w2``."""

from __future__ import annotations

from typing import Any

from ..family import Family
from ..moe_config import ExpertNames, MoeConfig, need_field, refuse_quantized
from ..moe_decoder import MoeForCausalLM


def read_moe(fields: dict[str, Any], num_layers: int, source: str) -> MoeConfig:
    """The expert config of a Mixtral config (the family's defaults filled in)."""
    refuse_quantized(fields, source)
    return MoeConfig("softmax_topk",
                     need_field(fields, "mixtral", source, "num_local_experts", "num_experts"),
                     need_field(fields, "mixtral", source, "num_experts_per_tok"),
                     need_field(fields, "mixtral", source, "intermediate_size"),
                     tuple(range(num_layers)),
                     expert_names=ExpertNames("block_sparse_moe", "gate", "w1", "w3", "w2"))


FAMILY = Family(name="mixtral", architecture="MixtralForCausalLM", model_type="mixtral",
                model_class=MoeForCausalLM, window="every", moe=read_moe,
                defaults={"max_position_embeddings": 131072, "num_key_value_heads": 8,
                          "rms_norm_eps": 1e-5, "rope_theta": 1e6, "num_experts_per_tok": 2})
