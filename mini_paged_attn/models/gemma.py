"""Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's layer shape.

    embed_tokens * sqrt(hidden) -> N x [x + post_attn_norm(attn(input_norm(x)));
                                        x + post_ffw_norm(mlp(pre_ffw_norm(x)))] -> norm -> lm_head

What differs from Llama: four norms per layer, each ``(1 + w) * x / rms(x)`` computed in
float32 (:class:`GemmaRMSNorm`); embeddings scaled by ``sqrt(hidden_size)`` rounded to the model
dtype; a GeGLU MLP (tanh GELU); attention scaled by ``query_pre_attn_scalar ** -0.5``;
alternating sliding and full layers (every other one for Gemma 2, five of six for Gemma 3);
attention-score and final-logit soft-caps (Gemma 2); per-head q/k norms and a separate rope
base for the sliding layers (Gemma 3). Checkpoint names are Llama's plus
``pre_feedforward_layernorm`` / ``post_feedforward_layernorm``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..distributed.group import TPGroup
from ..distributed.sharding import ShardLayout
from ..ops.fused import KVWrite, apply_rotary
from .attention import Attention, AttentionMetadata, KVCache, attend
from .checkpoint import CheckpointParts, Shard
from .config import ModelConfig
from .llama import CausalLM, attention_variant, build_mlp


class GemmaRMSNorm(nn.Module):
    """``(1 + weight) * x / sqrt(mean(x^2) + eps)`` over the last dim, all in float32, rounded
    to x's dtype once at the end (Llama's rounds before the weight)."""

    def __init__(self, size: int, eps: float, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(size, dtype=dtype, device=device))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, *,
                backend: str = "auto"):
        """x: ``[..., size]`` float -> same shape and dtype. With ``residual`` (x's shape):
        normalise ``x + residual`` (rounded to x's dtype) and return ``(normed, x + residual)``,
        as :class:`~.layers.RMSNorm` does. ``backend`` is accepted for that interface; the
        arithmetic is torch's."""
        if residual is None:
            return self._norm(x)
        summed = x + residual
        return self._norm(summed), summed


class GemmaAttention(Attention):
    """:class:`Attention` with Gemma's scale, window and soft-cap, and Gemma 3's (1 + w) q/k
    norms applied before rope."""

    def __init__(self, config: ModelConfig, layer: int, *, dtype: torch.dtype, device,
                 tp: TPGroup, layout: ShardLayout):
        super().__init__(config, dtype=dtype, device=device, tp=tp, layout=layout,
                         **attention_variant(config, layer))
        self.scale = config.attn_scale
        if config.qk_norm:
            self.q_norm = GemmaRMSNorm(config.head_size, config.rms_norm_eps, dtype=dtype,
                                       device=device)
            self.k_norm = GemmaRMSNorm(config.head_size, config.rms_norm_eps, dtype=dtype,
                                       device=device)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """As :meth:`Attention.forward`: hidden ``[num_tokens, hidden_size]`` -> same shape."""
        num_tokens = hidden.shape[0]
        q, k, v = self.project_qkv(hidden, meta)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, positions, cos_sin_cache, backend=meta.backend,
                            store=KVWrite(v, *kv_cache, meta.slot_mapping))
        out = attend(q, k, v, kv_cache, meta, self.scale, window_size=self.window_size,
                     softcap=self.softcap)
        return self.o_proj(out.view(num_tokens, self.num_q_heads * self.head_size),
                           **meta.projection_args)


class GemmaDecoderLayer(nn.Module):
    """Sandwich-norm layer: each sublayer's input and output are normed before the residual add.

    Same interface as :class:`~.llama.DecoderLayer`: the residual stream travels beside the
    activations, and the add after each sublayer happens inside the next norm.
    """

    NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
             "post_feedforward_layernorm")

    def __init__(self, config: ModelConfig, layer: int, *, dtype: torch.dtype, device,
                 tp: TPGroup, layout: ShardLayout):
        super().__init__()
        self.sliding_rope = config.layer_uses_sliding_rope(layer)
        for name in self.NORMS:
            setattr(self, name, GemmaRMSNorm(config.hidden_size, config.rms_norm_eps,
                                             dtype=dtype, device=device))
        self.self_attn = GemmaAttention(config, layer, dtype=dtype, device=device, tp=tp,
                                        layout=layout)
        self.mlp = build_mlp(config, dtype=dtype, device=device, tp=tp, layout=layout)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                positions: torch.Tensor, cos_sin_cache: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """See :meth:`~.llama.DecoderLayer.forward`: returns ``(post_ffw_normed_mlp_out,
        residual)``, the layer's output being their sum."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(
            self.self_attn(hidden, positions, cos_sin_cache, kv_cache, meta))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        mlp_out = self.mlp(hidden, backend=meta.backend, workspace=meta.linear_workspace)
        return self.post_feedforward_layernorm(mlp_out), residual

    def checkpoint_shards(self, prefix: str, parts: CheckpointParts) -> dict[str, Shard]:
        """This layer's checkpoint tensors (``prefix`` is ``model.layers.{i}.``)."""
        return {**parts.attention(f"{prefix}self_attn.", self.self_attn),
                **parts.gated_mlp(f"{prefix}mlp.", self.mlp),
                **parts.norms(prefix, self, self.NORMS)}


class GemmaForCausalLM(CausalLM):
    """Gemma 2 / Gemma 3 text decoder (see the module docstring)."""

    layer_class = GemmaDecoderLayer
    norm_class = GemmaRMSNorm

    def __init__(self, config: ModelConfig, **kwargs):
        super().__init__(config, **kwargs)
        # sqrt(hidden_size) rounded to the model dtype, as the checkpoints were trained with.
        self.embed_scale = float(torch.tensor(config.hidden_size ** 0.5, dtype=self.dtype))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """int64 ``[num_tokens]`` -> ``[num_tokens, hidden_size]`` in the model dtype: the
        embeddings times ``sqrt(hidden_size)`` (see ``embed_scale``)."""
        return self.embed_tokens(input_ids) * self.embed_scale


__all__ = ["GemmaAttention", "GemmaDecoderLayer", "GemmaForCausalLM", "GemmaRMSNorm"]
