"""One decoder for Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3 and Phi-3, told apart by ModelConfig
flags; the base class of the other families' models (Gemma: ``gemma.py``, MoE:
``moe_decoder.py``). Which family uses which class: ``models/families/``.

    embed_tokens -> N x [x + attn(input_layernorm(x)); x + mlp(post_attention_layernorm(x))] -> norm
    -> lm_head (or the embedding, tied)

Differences between the families are flags: ``qkv_bias`` (Qwen2), ``qk_norm`` (Qwen3, per-head
RMSNorm on q and k before rope), ``tie_word_embeddings``, the rope scaling, ``head_size`` not
``hidden_size // num_q_heads`` (Qwen3), sliding-window layers (Mistral, Phi-3, Qwen with
``use_sliding_window``), Phi-3's fused checkpoint tensors. Parameter names follow the Hugging
Face checkpoints except for the fused projections (``qkv_proj``, ``gate_up_proj``);
:meth:`CausalLM.checkpoint_shards` maps every checkpoint tensor name onto its rows, and under
tensor parallelism onto the part of the checkpoint tensor this rank holds (see
``distributed.sharding``).
"""

from __future__ import annotations

import torch
from torch import nn

from ..distributed.group import TPGroup
from ..distributed.sharding import ShardLayout
from .attention import Attention, AttentionMetadata, KVCache
from .checkpoint import CheckpointParts, Shard
from .config import ModelConfig
from .layers import GatedMLP, RMSNorm, RotaryEmbedding
from .parallel_layers import VocabParallelEmbedding, parallel_logits

# Checkpoint tensors that carry nothing the model needs (older Llama checkpoints store the rope
# frequencies; the model recomputes them).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def attention_variant(config: ModelConfig, layer: int) -> dict:
    """The :class:`Attention` keyword arguments of layer ``layer`` beyond plain causal attention:
    its sliding window (the last ``sliding_window`` keys, itself included:
    ``window_size=(sliding_window - 1, 0)``) and the score soft-cap; empty when neither applies."""
    kwargs = {}
    window = config.layer_window(layer)
    if window is not None:
        kwargs["window_size"] = (window - 1, 0)
    if config.attn_logit_softcap:
        kwargs["softcap"] = config.attn_logit_softcap
    return kwargs


def build_mlp(config: ModelConfig, *, dtype: torch.dtype, device, tp: TPGroup,
              layout: ShardLayout) -> nn.Module:
    """The feed-forward block of a decoder layer (this rank's shard of it)."""
    return GatedMLP(config.hidden_size, layout.intermediate_size, bias=config.mlp_bias,
                    dtype=dtype, device=device, tp=tp, act=config.hidden_act)


class DecoderLayer(nn.Module):
    """Pre-norm layer: ``x + attn(input_layernorm(x))``, then
    ``x + mlp(post_attention_layernorm(x))``.

    Whether it slides, and which rope table it reads (``sliding_rope``), is fixed here from the
    config (``config.layer_window(layer)``, ``config.layer_uses_sliding_rope(layer)``).
    """

    NORMS = ("input_layernorm", "post_attention_layernorm")

    def __init__(self, config: ModelConfig, layer: int, *, dtype: torch.dtype, device,
                 tp: TPGroup, layout: ShardLayout):
        super().__init__()
        eps = config.rms_norm_eps
        self.sliding_rope = config.layer_uses_sliding_rope(layer)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)
        self.self_attn = Attention(config, dtype=dtype, device=device, tp=tp, layout=layout,
                                   **attention_variant(config, layer))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)
        self.mlp = build_mlp(config, dtype=dtype, device=device, tp=tp, layout=layout)

    def checkpoint_shards(self, prefix: str, parts: CheckpointParts) -> dict[str, Shard]:
        """This layer's checkpoint tensors (``prefix`` is ``model.layers.{i}.``)."""
        return {**parts.attention(f"{prefix}self_attn.", self.self_attn),
                **parts.gated_mlp(f"{prefix}mlp.", self.mlp),
                **parts.norms(prefix, self, self.NORMS)}

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
        return self.mlp(hidden, backend=backend, workspace=meta.linear_workspace), residual


class CausalLM(nn.Module):
    """The decoder and its output head, for inference over the paged KV cache (no autograd).

    Build it with :func:`~.registry.init_empty_model` (no weight init, no double allocation, the
    family's class) and fill it with ``loader.load_model``; or call
    ``CausalLM(config, dtype=..., device=...)`` for a model with PyTorch's default init (tests).

    ``tp``: this process's rank of the tensor-parallel group (default: alone); the model then
    holds this rank's shard (``self.layout``) and its forward all-reduces inside the layers.

    Families whose layers differ in shape subclass it and set ``layer_class`` / ``norm_class``
    (Gemma); a family's ``Family.model_class`` names the class that builds it.
    """

    layer_class: type[nn.Module] = DecoderLayer
    norm_class: type[nn.Module] = RMSNorm

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, tp: TPGroup | None = None):
        super().__init__()
        expected = config.family_spec.model_class
        if type(self) is not expected:
            raise ValueError(f"config: a {config.family} config is built by "
                             f"{expected.__name__}, not {type(self).__name__} "
                             "(registry.build_model picks the class)")
        self.config = config
        self.dtype = dtype = dtype or config.dtype
        self.tp = tp = tp or TPGroup.single(device or "cpu")
        self.layout = layout = ShardLayout.of(config, tp.rank, tp.world_size)
        self.embed_tokens = VocabParallelEmbedding(layout.vocab_rows, config.hidden_size,
                                                   vocab_start=layout.vocab_start, tp=tp,
                                                   dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            self.layer_class(config, i, dtype=dtype, device=device, tp=tp, layout=layout)
            for i in range(config.num_layers))
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps, dtype=dtype,
                                    device=device)
        self.lm_head = (None if config.tie_word_embeddings else
                        nn.Linear(config.hidden_size, layout.vocab_rows, bias=False, dtype=dtype,
                                  device=device))
        self.rotary = RotaryEmbedding(config.head_size, config.max_position_embeddings, config.rope,
                                      dtype=dtype, device=device)
        self.sliding_rotary = (
            None if config.sliding_rope is None else
            RotaryEmbedding(config.head_size, config.max_position_embeddings, config.sliding_rope,
                            dtype=dtype, device=device))
        self.requires_grad_(False)
        self.eval()

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """int64 ``[num_tokens]`` -> ``[num_tokens, hidden_size]``, the first layer's input."""
        return self.embed_tokens(input_ids)

    def reset_rotary(self) -> None:
        """Recompute the rope tables on their current device (after ``to_empty``)."""
        for rotary in (self.rotary, self.sliding_rotary):
            if rotary is not None:
                rotary.reset_parameters()

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
        hidden, residual = self.embed(input_ids), None
        # layer.sliding_rope -> its rope table (a sliding one only when the config has one)
        tables = {False: self.rotary.cos_sin_cache}
        if self.sliding_rotary is not None:
            tables[True] = self.sliding_rotary.cos_sin_cache
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(hidden, residual, positions, tables[layer.sliding_rope],
                                     kv_cache, meta)
        if residual is None:                    # no layers
            return self.norm(hidden, backend=meta.backend)
        return self.norm(hidden, residual, backend=meta.backend)[0]

    def compute_logits(self, hidden: torch.Tensor, *,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """hidden: ``[n, hidden_size]`` model dtype -> logits ``[n, vocab_size]`` (on every
        rank: a collective under tensor parallelism); soft-capped to ``(-cap, cap)`` when the
        config has a ``final_logit_softcap`` (Gemma 2).

        ``dtype``: float32 (default), or the model dtype for a reader that widens the values
        itself (the one-pass sampler). Soft-capped logits are float32 either way: the tanh
        would flatten the top logits onto a few model-dtype values."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        cap = self.config.final_logit_softcap
        logits = parallel_logits(hidden, weight, self.config.vocab_size, self.tp,
                                 dtype=torch.float32 if cap else dtype)
        return torch.tanh(logits / cap) * cap if cap else logits

    def checkpoint_targets(self) -> dict[str, torch.Tensor]:
        """Hugging Face checkpoint tensor name -> the parameter (rows) it is copied into
        (see :meth:`checkpoint_shards` for the part of the tensor under tensor parallelism)."""
        return {name: target for name, (target, _) in self.checkpoint_shards().items()}

    def checkpoint_shards(self) -> dict[str, Shard]:
        """Hugging Face checkpoint tensor name -> ``(rows, part)``: the parameter rows it fills
        and the index of the checkpoint tensor that fills them (None: all of it, e.g. always
        with one rank; a list: those parts concatenated).

        The fused projections appear under each of their checkpoint names with a view of their
        rows: ``q_proj``/``k_proj``/``v_proj`` -> rows of ``qkv_proj``, ``gate_proj``/``up_proj``
        -> halves of ``gate_up_proj`` (Phi-3: under its fused names). With tied embeddings there
        is no ``lm_head.weight``. Under tensor parallelism the parts are this rank's heads' rows
        of q/k/v (its KV head, replicated, when ranks outnumber KV heads), its rows of gate/up,
        its input columns of o_proj/down_proj (their biases whole) and its vocabulary rows.
        """
        lay = self.layout
        fused = self.config.family_spec.fused_checkpoint
        parts = CheckpointParts(self.config, lay, fused=fused)
        vocab_rows = slice(0, lay.vocab_valid)
        vocab = parts.part(lay.vocab_start, lay.vocab_valid)
        shards: dict[str, Shard] = {
            "model.embed_tokens.weight": (self.embed_tokens.weight[vocab_rows], vocab),
            "model.norm.weight": (self.norm.weight, None)}
        if self.lm_head is not None:
            shards["lm_head.weight"] = (self.lm_head.weight[vocab_rows], vocab)
        for i, layer in enumerate(self.layers):
            shards.update(layer.checkpoint_shards(f"model.layers.{i}.", parts))
        return shards

    def is_ignored_checkpoint_tensor(self, name: str) -> bool:
        """Whether a checkpoint tensor without a target is expected (not a sign of a wrong model)."""
        if name.endswith(IGNORED_SUFFIXES):
            return True
        # Tied checkpoints sometimes store the head anyway (a copy of the embedding).
        return name == "lm_head.weight" and self.lm_head is None
