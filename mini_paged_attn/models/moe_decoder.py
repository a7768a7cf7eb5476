"""Qwen3-MoE, Mixtral and gpt-oss: the Llama decoder with an expert block in its sparse layers.

What differs from the dense decoder: a layer listed in ``config.moe.sparse_layers`` holds a
:class:`~.moe.SparseMoeBlock` where the others hold a ``GatedMLP`` (Qwen3-MoE's
``mlp_only_layers`` / ``decoder_sparse_step``; every layer for Mixtral and gpt-oss), with its
checkpoint names (:meth:`~.moe.SparseMoeBlock.checkpoint_shards`). gpt-oss adds attention sink
logits on every layer (checkpoint ``self_attn.sinks``, split by query head under tensor
parallelism); its alternating sliding window, yarn rope and attention biases are config flags
the dense decoder reads already.
"""

from __future__ import annotations

import torch

from ..distributed.group import TPGroup
from ..distributed.sharding import ShardLayout
from .attention import Attention
from .checkpoint import CheckpointParts, Shard
from .config import ModelConfig
from .llama import CausalLM, DecoderLayer, attention_variant
from .moe import SparseMoeBlock


class MoeDecoderLayer(DecoderLayer):
    """:class:`~.llama.DecoderLayer` whose feed-forward is an expert block in sparse layers, and
    whose attention has sinks for gpt-oss."""

    def __init__(self, config: ModelConfig, layer: int, *, dtype: torch.dtype, device,
                 tp: TPGroup, layout: ShardLayout):
        super().__init__(config, layer, dtype=dtype, device=device, tp=tp, layout=layout)
        if config.family_spec.attention_sinks:
            self.self_attn = Attention(config, dtype=dtype, device=device, tp=tp, layout=layout,
                                       sinks=True, **attention_variant(config, layer))
        if config.moe is not None and config.moe.is_sparse(layer):
            self.mlp = SparseMoeBlock(config.hidden_size, config.moe, dtype=dtype,
                                      device=device, tp=tp)

    def checkpoint_shards(self, prefix: str, parts: CheckpointParts) -> dict[str, Shard]:
        """This layer's checkpoint tensors (``prefix`` is ``model.layers.{i}.``)."""
        if not isinstance(self.mlp, SparseMoeBlock):
            shards = super().checkpoint_shards(prefix, parts)
        else:
            shards = {**parts.attention(f"{prefix}self_attn.", self.self_attn),
                      **self.mlp.checkpoint_shards(prefix),
                      **parts.norms(prefix, self, self.NORMS)}
        sinks = self.self_attn.sinks
        if sinks is not None:
            lay = parts.layout
            shards[f"{prefix}self_attn.sinks"] = (sinks, parts.part(lay.q_head_start,
                                                                    lay.num_q_heads))
        return shards


class MoeForCausalLM(CausalLM):
    """The decoder of the mixture-of-experts families (see the module docstring)."""

    layer_class = MoeDecoderLayer


__all__ = ["MoeDecoderLayer", "MoeForCausalLM"]
