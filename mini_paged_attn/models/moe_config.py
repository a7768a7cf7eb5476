"""MoeConfig: the mixture-of-experts part of a model's config (Qwen3-MoE, Mixtral, gpt-oss).

Each MoE family's module (``models/families/``) reads its own fields into a MoeConfig with the
helpers here: the router, the expert count and size, which layers are sparse, and the
checkpoint's expert tensor names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.args import positive_int
from ..ops.moe import MoeActivation
from .checkpoint import quantized_checkpoint_error

# how a router turns logits into top-k weights
ROUTERS = (
    "softmax_topk",    # softmax over all experts, then top-k (renormalised or not)
    "topk_softmax",    # top-k of the logits, softmax over those k
)


@dataclass(frozen=True)
class ExpertNames:
    """A checkpoint that stores every expert on its own, under ``model.layers.{i}.``:
    ``{module}.{router}.weight`` and ``{module}.experts.{e}.{gate|up|down}.weight``."""
    module: str
    router: str
    gate: str
    up: str
    down: str


@dataclass(frozen=True)
class MoeConfig:
    """The sparse feed-forward of an MoE model.

    Attributes:
        router: one of :data:`ROUTERS`.
        num_experts, top_k: experts per layer, experts per token.
        intermediate_size: one expert's intermediate size (the whole model's, before
            tensor-parallel splitting).
        sparse_layers: indices of the layers whose MLP is the expert block (the others keep a
            dense ``GatedMLP`` of the model's ``intermediate_size``).
        renormalize: divide the top-k softmax weights by their sum.
        router_bias, expert_bias: the router and the experts' projections have biases (gpt-oss).
        activation: the experts' gated activation and w13 row order.
        expert_names: the per-expert checkpoint names; None: gpt-oss's fused expert tensors
            (``moe.SparseMoeBlock.checkpoint_shards``).
    """
    router: str
    num_experts: int
    top_k: int
    intermediate_size: int
    sparse_layers: tuple[int, ...]
    renormalize: bool = True
    router_bias: bool = False
    expert_bias: bool = False
    activation: MoeActivation = MoeActivation()
    expert_names: ExpertNames | None = None

    def __post_init__(self):
        if self.router not in ROUTERS:
            raise ValueError(f"router: expected one of {ROUTERS}, got {self.router!r}")
        for name in ("num_experts", "top_k", "intermediate_size"):
            object.__setattr__(self, name, positive_int(name, getattr(self, name)))
        if self.top_k > self.num_experts:
            raise ValueError(f"num_experts_per_tok: expected <= num_experts={self.num_experts}, "
                             f"got {self.top_k}")
        if any(i < 0 for i in self.sparse_layers):
            raise ValueError(f"sparse_layers: expected layer indices >= 0, "
                             f"got {self.sparse_layers}")

    def is_sparse(self, layer_idx: int) -> bool:
        return layer_idx in self.sparse_layers


def refuse_quantized(fields: dict[str, Any], source: str, hint: str = "") -> None:
    """Raise for a config with a ``quantization_config`` (None or {}: nothing is quantized);
    ``hint`` says what to use instead.

    Raises:
        ValueError: the one-line refusal of ``checkpoint.quantized_checkpoint_error``.
    """
    quant = fields.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        raise ValueError(quantized_checkpoint_error(source, method, hint))


def need_field(fields: dict[str, Any], family: str, source: str, *keys: str) -> Any:
    """The first of ``keys`` set in ``fields`` (spellings of one field across versions).

    Raises:
        ValueError: none is set (names the first).
    """
    for key in keys:
        if fields.get(key) is not None:
            return fields[key]
    raise ValueError(f"{source}: missing field {keys[0]!r} (needed for {family})")


__all__ = ["ROUTERS", "ExpertNames", "MoeConfig", "need_field", "refuse_quantized"]
