"""One decoder for Llama 2/3.x, Qwen2/2.5 and Qwen3, told apart by ModelConfig flags.

    embed_tokens -> N x [x + attn(input_layernorm(x)); x + mlp(post_attention_layernorm(x))] -> norm
    -> lm_head (or the embedding, tied)

Differences between the families are flags: ``qkv_bias`` (Qwen2), ``qk_norm`` (Qwen3, per-head
RMSNorm on q and k before rope), ``tie_word_embeddings``, the rope scaling, ``head_size`` not
``hidden_size // num_q_heads`` (Qwen3). Parameter names follow the Hugging Face checkpoints
except for the fused projections (``qkv_proj``, ``gate_up_proj``);
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
from .config import ModelConfig
from .layers import RMSNorm, RotaryEmbedding
from .moe import SparseMoeBlock, make_mlp
from .parallel_layers import VocabParallelEmbedding, parallel_logits

# Where a checkpoint tensor goes: the parameter rows it fills, and the index of the part of the
# checkpoint tensor that fills them (None: the whole tensor).
Shard = tuple[torch.Tensor, tuple[slice, ...] | None]

# Checkpoint tensors that carry nothing the model needs (older Llama checkpoints store the rope
# frequencies; the model recomputes them).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device, tp: TPGroup,
                 layout: ShardLayout, layer_idx: int = 0):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)
        # gpt-oss: sink logits on every layer, a sliding window on its sliding layers (HF's
        # window of W keys, the query's own included, is FlashAttention's left = W - 1).
        window = config.layer_window(layer_idx) if config.family == "gpt_oss" else None
        self.self_attn = Attention(config, dtype=dtype, device=device, tp=tp, layout=layout,
                                   window_size=(-1, -1) if window is None else (window - 1, 0),
                                   sinks=config.family == "gpt_oss")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)
        # A GatedMLP, or in a sparse layer of an MoE family its expert block.
        self.mlp = make_mlp(config, layer_idx, layout.intermediate_size, dtype=dtype,
                            device=device, tp=tp)

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

    ``tp``: this process's rank of the tensor-parallel group (default: alone); the model then
    holds this rank's shard (``self.layout``) and its forward all-reduces inside the layers.
    """

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, tp: TPGroup | None = None):
        super().__init__()
        if (config.family not in ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gpt_oss")
                or (config.sliding_window is not None and config.family != "gpt_oss")):
            raise ValueError(f"config: the {config.architecture} decoder (sliding window "
                             f"{config.sliding_window}) is not implemented yet")
        self.config = config
        self.dtype = dtype = dtype or config.dtype
        self.tp = tp = tp or TPGroup.single(device or "cpu")
        self.layout = layout = ShardLayout.of(config, tp.rank, tp.world_size)
        self.embed_tokens = VocabParallelEmbedding(layout.vocab_rows, config.hidden_size,
                                                   vocab_start=layout.vocab_start, tp=tp,
                                                   dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(config, dtype=dtype, device=device, tp=tp, layout=layout, layer_idx=i)
            for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.lm_head = (None if config.tie_word_embeddings else
                        nn.Linear(config.hidden_size, layout.vocab_rows, bias=False, dtype=dtype,
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
        """hidden: ``[n, hidden_size]`` model dtype -> float32 logits ``[n, vocab_size]``
        (on every rank: a collective under tensor parallelism)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return parallel_logits(hidden, weight, self.config.vocab_size, self.tp)

    def checkpoint_targets(self) -> dict[str, torch.Tensor]:
        """Hugging Face checkpoint tensor name -> the parameter (rows) it is copied into
        (see :meth:`checkpoint_shards` for the part of the tensor under tensor parallelism)."""
        return {name: target for name, (target, _) in self.checkpoint_shards().items()}

    def checkpoint_shards(self) -> dict[str, Shard]:
        """Hugging Face checkpoint tensor name -> ``(rows, part)``: the parameter rows it fills
        and the index of the checkpoint tensor that fills them (None: all of it, e.g. always
        with one rank).

        The fused projections appear under each of their checkpoint names with a view of their
        rows: ``q_proj``/``k_proj``/``v_proj`` -> rows of ``qkv_proj``, ``gate_proj``/``up_proj``
        -> halves of ``gate_up_proj``. With tied embeddings there is no ``lm_head.weight``.
        Under tensor parallelism the parts are this rank's heads' rows of q/k/v (its KV head,
        replicated, when ranks outnumber KV heads), its rows of gate/up, its input columns of
        o_proj/down_proj (their biases whole) and its vocabulary rows.
        """
        c, lay = self.config, self.layout
        hs, split = c.head_size, lay.sharded

        def part(start: int, size: int, dim: int = 0) -> tuple[slice, ...] | None:
            # The checkpoint index of `size` rows (dim 0) or columns (dim 1) from `start`.
            if not split:
                return None
            return (slice(None),) * dim + (slice(start, start + size),)

        vocab_rows = slice(0, lay.vocab_valid)
        vocab = part(lay.vocab_start, lay.vocab_valid)
        shards: dict[str, Shard] = {
            "model.embed_tokens.weight": (self.embed_tokens.weight[vocab_rows], vocab),
            "model.norm.weight": (self.norm.weight, None)}
        if self.lm_head is not None:
            shards["lm_head.weight"] = (self.lm_head.weight[vocab_rows], vocab)
        q, kv, inter = lay.num_q_heads * hs, lay.num_kv_heads * hs, lay.intermediate_size
        q_part = part(lay.q_head_start * hs, q)
        kv_part = part(lay.kv_head_start * hs, kv)
        inter_part = part(lay.intermediate_start, inter)
        column_parts = {"o_proj": part(lay.q_head_start * hs, q, dim=1),
                        "down_proj": part(lay.intermediate_start, inter, dim=1)}
        qkv_rows = {"q_proj": (slice(0, q), q_part), "k_proj": (slice(q, q + kv), kv_part),
                    "v_proj": (slice(q + kv, q + 2 * kv), kv_part)}
        mlp_rows = {"gate_proj": (slice(0, inter), inter_part),
                    "up_proj": (slice(inter, 2 * inter), inter_part)}

        def add_linear(name: str, linear: nn.Linear, rows: slice = slice(None),
                       rows_part: tuple[slice, ...] | None = None) -> None:
            # A column-parallel checkpoint linear (weight, and bias if any) -> rows of ours.
            shards[f"{name}.weight"] = (linear.weight[rows], rows_part)
            if linear.bias is not None:
                shards[f"{name}.bias"] = (linear.bias[rows], rows_part)

        def add_row_parallel(name: str, linear: nn.Linear, kind: str) -> None:
            # Input columns are split; the bias is added once, after the all-reduce: whole.
            shards[f"{name}.weight"] = (linear.weight, column_parts[kind])
            if linear.bias is not None:
                shards[f"{name}.bias"] = (linear.bias, None)

        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            for name, (rows, rows_part) in qkv_rows.items():
                add_linear(f"{prefix}self_attn.{name}", attn.qkv_proj, rows, rows_part)
            add_row_parallel(f"{prefix}self_attn.o_proj", attn.o_proj, "o_proj")
            if attn.sinks is not None:
                shards[f"{prefix}self_attn.sinks"] = (attn.sinks, part(lay.q_head_start,
                                                                       lay.num_q_heads))
            if attn.q_norm is not None:
                shards[f"{prefix}self_attn.q_norm.weight"] = (attn.q_norm.weight, None)
                shards[f"{prefix}self_attn.k_norm.weight"] = (attn.k_norm.weight, None)
            if isinstance(mlp, SparseMoeBlock):
                shards.update(mlp.checkpoint_shards(prefix))
            else:
                for name, (rows, rows_part) in mlp_rows.items():
                    add_linear(f"{prefix}mlp.{name}", mlp.gate_up_proj, rows, rows_part)
                add_row_parallel(f"{prefix}mlp.down_proj", mlp.down_proj, "down_proj")
            shards[f"{prefix}input_layernorm.weight"] = (layer.input_layernorm.weight, None)
            shards[f"{prefix}post_attention_layernorm.weight"] = (
                layer.post_attention_layernorm.weight, None)
        return shards

    def is_ignored_checkpoint_tensor(self, name: str) -> bool:
        """Whether a checkpoint tensor without a target is expected (not a sign of a wrong model)."""
        if name.endswith(IGNORED_SUFFIXES):
            return True
        # Tied checkpoints sometimes store the head anyway (a copy of the embedding).
        return name == "lm_head.weight" and self.lm_head is None


def init_empty_model(config: ModelConfig, *, dtype: torch.dtype, device: torch.device | str,
                     tp: TPGroup | None = None) -> CausalLM:
    """A :class:`CausalLM` (``tp``'s shard of it) whose weights are allocated on ``device`` in
    ``dtype`` but not initialised (filled by the loader): built on the meta device, then
    materialised once. The vocabulary padding rows of the last rank are zeroed (no checkpoint
    tensor fills them)."""
    model = CausalLM(config, dtype=dtype, device="meta", tp=tp)
    model.to_empty(device=device)
    model.rotary.reset_parameters()
    valid = model.layout.vocab_valid
    with torch.no_grad():
        for table in (model.embed_tokens, model.lm_head):
            if table is not None:
                table.weight[valid:].zero_()
    return model
