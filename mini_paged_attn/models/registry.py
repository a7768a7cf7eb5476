"""Which model class serves each family, and the empty model the loader fills.

Every family is a :class:`~.llama.CausalLM`: the Llama decoder as it is (Llama, Mistral, Qwen2,
Qwen3), with fused checkpoint names (Phi-3), with Gemma's layers (Gemma 2 and 3), or with
expert blocks (Qwen3-MoE, Mixtral, gpt-oss: ``moe_decoder.py``).
"""

from __future__ import annotations

import torch

from ..distributed.group import TPGroup
from .config import SUPPORTED_ARCHITECTURES, ModelConfig
from .gemma import GemmaForCausalLM
from .llama import CausalLM, Phi3ForCausalLM
from .moe_decoder import MoeForCausalLM

# family (ModelConfig.family) -> model class
MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "llama": CausalLM,
    "mistral": CausalLM,
    "qwen2": CausalLM,
    "qwen3": CausalLM,
    "phi3": Phi3ForCausalLM,
    "gemma2": GemmaForCausalLM,
    "gemma3": GemmaForCausalLM,
    "qwen3_moe": MoeForCausalLM,
    "mixtral": MoeForCausalLM,
    "gpt_oss": MoeForCausalLM,
}
assert set(MODEL_CLASSES) == set(SUPPORTED_ARCHITECTURES.values())
assert all(family in cls.families for family, cls in MODEL_CLASSES.items())


def model_class(config: ModelConfig) -> type[CausalLM]:
    """The :class:`CausalLM` subclass of ``config``'s family."""
    return MODEL_CLASSES[config.family]


def build_model(config: ModelConfig, *, dtype: torch.dtype | None = None,
                device: torch.device | str | None = None, tp: TPGroup | None = None) -> CausalLM:
    """``config``'s model with PyTorch's default init (tests; see :func:`init_empty_model`)."""
    return model_class(config)(config, dtype=dtype, device=device, tp=tp)


def init_empty_model(config: ModelConfig, *, dtype: torch.dtype, device: torch.device | str,
                     tp: TPGroup | None = None) -> CausalLM:
    """``config``'s model (``tp``'s shard of it) whose weights are allocated on ``device`` in
    ``dtype`` but not initialised (filled by the loader): built on the meta device, then
    materialised once. The vocabulary padding rows of the last rank are zeroed (no checkpoint
    tensor fills them)."""
    model = build_model(config, dtype=dtype, device="meta", tp=tp)
    model.to_empty(device=device)
    model.reset_rotary()
    valid = model.layout.vocab_valid
    with torch.no_grad():
        for table in (model.embed_tokens, model.lm_head):
            if table is not None:
                table.weight[valid:].zero_()
    return model


__all__ = ["MODEL_CLASSES", "build_model", "init_empty_model", "model_class"]
