"""One decoder for Llama 2/3.x, Qwen2/2.5 and Qwen3, told apart by ModelConfig flags.

    embed_tokens -> N x [x + attn(input_layernorm(x)); x + mlp(post_attention_layernorm(x))] -> norm
    -> lm_head (or the embedding, tied)

Differences between the families are flags: ``qkv_bias`` (Qwen2), ``qk_norm`` (Qwen3, per-head
RMSNorm on q and k before rope), ``tie_word_embeddings``, the rope scaling, ``head_size`` not
``hidden_size // num_q_heads`` (Qwen3). Parameter names follow the Hugging Face checkpoints
except for the fused projections (``qkv_proj``, ``gate_up_proj``);
:meth:`CausalLM.checkpoint_targets` maps every checkpoint tensor name onto its rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import Attention, AttentionMetadata, KVCache
from .config import ModelConfig
from .layers import GatedMLP, RMSNorm, RotaryEmbedding

# Checkpoint tensors that carry nothing the model needs (older Llama checkpoints store the rope
# frequencies; the model recomputes them).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device=None):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)
        self.self_attn = Attention(config, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias,
                            dtype=dtype, device=device)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                positions: torch.Tensor, cos_sin_cache: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer, with the residual stream carried beside the activations: the layer's
        output is ``mlp_out + residual``, and that add happens inside the next RMSNorm's kernel
        (``rms_norm(..., residual=)``), as does the add after attention.

        Args:
            hidden: ``[num_tokens, hidden_size]``, the previous layer's MLP output (or the
                embeddings when ``residual`` is None, the first layer).
            residual: None or ``[num_tokens, hidden_size]``, the stream before that output.
            positions, cos_sin_cache: as in :meth:`Attention.forward`.

        Returns:
            ``(mlp_out, residual)``, both ``[num_tokens, hidden_size]``: the layer's output
            (in the unfused form) is ``mlp_out + residual``.
        """
        backend = meta.backend
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden, backend=backend)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, backend=backend)
        hidden = self.self_attn(hidden, positions, cos_sin_cache, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual, backend=backend)
        return self.mlp(hidden, backend=backend), residual


class CausalLM(nn.Module):
    """The decoder and its output head, for inference over the paged KV cache (no autograd).

    Build it with :func:`init_empty_model` (no weight init, no double allocation) and fill it with
    ``loader.load_model``; or call ``CausalLM(config, dtype=..., device=...)`` for a model with
    PyTorch's default init (tests).
    """

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        self.config = config
        self.dtype = dtype = dtype or config.dtype
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype,
                                         device=device)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype=dtype, device=device)
                                    for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.lm_head = (None if config.tie_word_embeddings else
                        nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype,
                                  device=device))
        self.rotary = RotaryEmbedding(config.head_size, config.max_position_embeddings, config.rope,
                                      dtype=dtype, device=device)
        self.requires_grad_(False)
        self.eval()

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        """Run one step's flattened tokens through the decoder, writing their K/V to the caches.

        Args:
            input_ids: int64 ``[num_tokens]``.
            positions: int64 ``[num_tokens]``, each token's position in its sequence
                (``< max_position_embeddings``).
            kv_caches: one ``(key_cache, value_cache)`` per layer, each
                ``[num_blocks, block_size, num_kv_heads, head_size]`` in the model dtype.
            meta: the step's :class:`AttentionMetadata`.

        Returns:
            The final-normed hidden states ``[num_tokens, hidden_size]`` in the model dtype;
            pick the rows to sample from and pass them to :meth:`compute_logits`.
        """
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"kv_caches: expected one (key_cache, value_cache) per layer "
                             f"({len(self.layers)}), got {len(kv_caches)}")
        hidden, residual = self.embed_tokens(input_ids), None
        cos_sin_cache = self.rotary.cos_sin_cache
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(hidden, residual, positions, cos_sin_cache, kv_cache, meta)
        if residual is None:                    # no layers
            return self.norm(hidden, backend=meta.backend)
        return self.norm(hidden, residual, backend=meta.backend)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: ``[n, hidden_size]`` model dtype -> float32 logits ``[n, vocab_size]``."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def checkpoint_targets(self) -> dict[str, torch.Tensor]:
        """Hugging Face checkpoint tensor name -> the parameter (rows) it is copied into.

        The fused projections appear under each of their checkpoint names with a view of their
        rows: ``q_proj``/``k_proj``/``v_proj`` -> rows of ``qkv_proj``, ``gate_proj``/``up_proj``
        -> halves of ``gate_up_proj``. With tied embeddings there is no ``lm_head.weight``.
        """
        c = self.config
        targets = {"model.embed_tokens.weight": self.embed_tokens.weight,
                   "model.norm.weight": self.norm.weight}
        if self.lm_head is not None:
            targets["lm_head.weight"] = self.lm_head.weight
        qkv_rows = {"q_proj": slice(0, c.q_size), "k_proj": slice(c.q_size, c.q_size + c.kv_size),
                    "v_proj": slice(c.q_size + c.kv_size, c.q_size + 2 * c.kv_size)}
        mlp_rows = {"gate_proj": slice(0, c.intermediate_size),
                    "up_proj": slice(c.intermediate_size, 2 * c.intermediate_size)}
        def add_linear(name: str, linear: nn.Linear, rows: slice = slice(None)) -> None:
            # A checkpoint linear (weight, and bias if the model has one) -> rows of ours.
            targets[f"{name}.weight"] = linear.weight[rows]
            if linear.bias is not None:
                targets[f"{name}.bias"] = linear.bias[rows]

        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            for name, rows in qkv_rows.items():
                add_linear(f"{prefix}self_attn.{name}", attn.qkv_proj, rows)
            add_linear(f"{prefix}self_attn.o_proj", attn.o_proj)
            if attn.q_norm is not None:
                targets[f"{prefix}self_attn.q_norm.weight"] = attn.q_norm.weight
                targets[f"{prefix}self_attn.k_norm.weight"] = attn.k_norm.weight
            for name, rows in mlp_rows.items():
                add_linear(f"{prefix}mlp.{name}", mlp.gate_up_proj, rows)
            add_linear(f"{prefix}mlp.down_proj", mlp.down_proj)
            targets[f"{prefix}input_layernorm.weight"] = layer.input_layernorm.weight
            targets[f"{prefix}post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        return targets

    def is_ignored_checkpoint_tensor(self, name: str) -> bool:
        """Whether a checkpoint tensor without a target is expected (not a sign of a wrong model)."""
        if name.endswith(IGNORED_SUFFIXES):
            return True
        # Tied checkpoints sometimes store the head anyway (a copy of the embedding).
        return name == "lm_head.weight" and self.lm_head is None


def init_empty_model(config: ModelConfig, *, dtype: torch.dtype,
                     device: torch.device | str) -> CausalLM:
    """A :class:`CausalLM` whose weights are allocated on ``device`` in ``dtype`` but not
    initialised (filled by the loader): built on the meta device, then materialised once."""
    model = CausalLM(config, dtype=dtype, device="meta")
    model.to_empty(device=device)
    model.rotary.reset_parameters()
    return model
