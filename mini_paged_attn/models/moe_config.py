"""MoeConfig: the mixture-of-experts part of a model's config.json (Qwen3-MoE, Mixtral, gpt-oss).

Read from the fields transformers 4.4x through 5.x write: ``num_experts`` (Qwen3-MoE; 5.x
saves it as ``num_local_experts``) or ``num_local_experts``, ``num_experts_per_tok``, the
expert size (``moe_intermediate_size`` for Qwen3-MoE, ``intermediate_size`` otherwise), and
which layers are sparse (Qwen3-MoE's ``mlp_only_layers`` and ``decoder_sparse_step``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.args import positive_int
from ..ops.moe import MoeActivation
from .checkpoint import quantized_checkpoint_error

# family -> how its router turns logits into top-k weights
ROUTERS = {
    "qwen3_moe": "softmax_topk",     # softmax over all experts, then top-k (renormalised or not)
    "mixtral": "softmax_topk",       # the same, always renormalised
    "gpt_oss": "topk_softmax",       # top-k of the logits, softmax over those k
}
MOE_FAMILIES = tuple(ROUTERS)


@dataclass(frozen=True)
class MoeConfig:
    """The sparse feed-forward of an MoE model.

    Attributes:
        family: "qwen3_moe" | "mixtral" | "gpt_oss": the router and the checkpoint names.
        num_experts, top_k: experts per layer, experts per token.
        intermediate_size: one expert's intermediate size (the whole model's, before
            tensor-parallel splitting).
        sparse_layers: indices of the layers whose MLP is the expert block (the others keep a
            dense ``GatedMLP`` of the model's ``intermediate_size``).
        renormalize: divide the top-k softmax weights by their sum.
        router_bias, expert_bias: the router and the experts' projections have biases (gpt-oss).
        activation: the experts' gated activation and w13 row order.
    """
    family: str
    num_experts: int
    top_k: int
    intermediate_size: int
    sparse_layers: tuple[int, ...]
    renormalize: bool = True
    router_bias: bool = False
    expert_bias: bool = False
    activation: MoeActivation = MoeActivation()

    def __post_init__(self):
        if self.family not in ROUTERS:
            raise ValueError(f"moe family: expected one of {MOE_FAMILIES}, got {self.family!r}")
        for name in ("num_experts", "top_k", "intermediate_size"):
            object.__setattr__(self, name, positive_int(name, getattr(self, name)))
        if self.top_k > self.num_experts:
            raise ValueError(f"num_experts_per_tok: expected <= num_experts={self.num_experts}, "
                             f"got {self.top_k}")
        if any(i < 0 for i in self.sparse_layers):
            raise ValueError(f"sparse_layers: expected layer indices >= 0, "
                             f"got {self.sparse_layers}")

    @property
    def router(self) -> str:
        """"softmax_topk" | "topk_softmax"."""
        return ROUTERS[self.family]

    def is_sparse(self, layer_idx: int) -> bool:
        return layer_idx in self.sparse_layers


def parse_moe_config(raw: dict[str, Any], family: str, num_layers: int,
                     source: str = "config.json") -> MoeConfig | None:
    """The MoeConfig of a config.json dict of ``family`` (None for a dense family).

    Raises:
        ValueError: a missing or bad field, or an MXFP4-quantised gpt-oss checkpoint (named).
    """
    if family not in ROUTERS:
        return None
    quant = raw.get("quantization_config")
    if quant:      # None or {}: nothing is quantized
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        raise ValueError(quantized_checkpoint_error(
            source, method, "for gpt-oss use a checkpoint dequantized to bf16, e.g. with "
            "transformers' Mxfp4Config(dequantize=True) and save_pretrained"))

    def need(*keys: str):
        for key in keys:
            if raw.get(key) is not None:
                return raw[key]
        raise ValueError(f"{source}: missing field {keys[0]!r} (needed for {family})")

    num_experts = need("num_experts", "num_local_experts")
    top_k = need("num_experts_per_tok")
    if family == "qwen3_moe":
        inter = need("moe_intermediate_size")
        step = positive_int(f"{source}: decoder_sparse_step", raw.get("decoder_sparse_step", 1))
        dense = set(raw.get("mlp_only_layers") or [])
        sparse = tuple(i for i in range(num_layers)
                       if i not in dense and num_experts > 0 and (i + 1) % step == 0)
        return MoeConfig(family, num_experts, top_k, inter, sparse,
                         renormalize=bool(raw.get("norm_topk_prob", False)))
    inter = need("intermediate_size")
    if family == "mixtral":
        return MoeConfig(family, num_experts, top_k, inter, tuple(range(num_layers)))
    activation = MoeActivation("clamped_swiglu", interleaved=True,
                               alpha=float(raw.get("swiglu_alpha", 1.702)),
                               limit=float(raw.get("swiglu_limit", 7.0)))
    return MoeConfig(family, num_experts, top_k, inter, tuple(range(num_layers)),
                     renormalize=False, router_bias=True, expert_bias=True,
                     activation=activation)


__all__ = ["MoeConfig", "MOE_FAMILIES", "parse_moe_config"]
