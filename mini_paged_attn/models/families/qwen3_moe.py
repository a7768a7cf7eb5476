"""Qwen3-MoE: Qwen3's attention, an expert block in the sparse layers (``mlp_only_layers``,
``decoder_sparse_step``), the window (with ``use_sliding_window``) on every layer.

Its experts: ``num_experts`` (transformers 5 saves ``num_local_experts``) of
``moe_intermediate_size``, softmax then top-k, renormalised with ``norm_topk_prob``.
"""

from __future__ import annotations

from typing import Any

from ...core.args import positive_int
from ..family import Family
from ..moe_config import ExpertNames, MoeConfig, need_field, refuse_quantized
from ..moe_decoder import MoeForCausalLM


def read_moe(fields: dict[str, Any], num_layers: int, source: str) -> MoeConfig:
    """The expert config of a Qwen3-MoE config (the family's defaults filled in)."""
    refuse_quantized(fields, source)
    num_experts = need_field(fields, "qwen3_moe", source, "num_experts", "num_local_experts")
    step = positive_int(f"{source}: decoder_sparse_step", fields.get("decoder_sparse_step", 1))
    dense = set(fields.get("mlp_only_layers") or [])
    sparse = tuple(i for i in range(num_layers)
                   if i not in dense and num_experts > 0 and (i + 1) % step == 0)
    return MoeConfig("softmax_topk", num_experts,
                     need_field(fields, "qwen3_moe", source, "num_experts_per_tok"),
                     need_field(fields, "qwen3_moe", source, "moe_intermediate_size"), sparse,
                     renormalize=bool(fields.get("norm_topk_prob", False)),
                     expert_names=ExpertNames("mlp", "gate", "gate_proj", "up_proj", "down_proj"))


FAMILY = Family(name="qwen3_moe", architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe",
                model_class=MoeForCausalLM, window="every", window_switch=True, qk_norm=True,
                moe=read_moe,
                defaults={"max_position_embeddings": 32768, "num_key_value_heads": 4,
                          "sliding_window": 4096, "use_sliding_window": False,
                          "decoder_sparse_step": 1, "num_experts_per_tok": 8,
                          "norm_topk_prob": False})
