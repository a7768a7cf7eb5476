"""Family: everything one model family differs in, declared in one place.

Each family is one module of ``models/families/`` holding a ``FAMILY = Family(...)`` (and, for
an MoE family, the function that reads its expert config); ``registry.py`` lists those modules.
What a family does not declare it shares with the others: the config's common fields are read
through transformers' config class of the family's ``model_type`` (its defaults included), and
the model is the shared decoder unless ``model_class`` says otherwise.

The window rules follow each family's transformers modeling code, once the window is on:

- ``"every"``: the window applies to every layer (the family has no per-layer pattern; a
  ``layer_types`` or ``max_window_layers`` in the file is ignored, as transformers does).
- ``"from_layer"``: ``layer_types`` if the config has them, else the layers from
  ``max_window_layers`` on (Qwen2, Qwen3).
- ``"pattern"``: ``layer_types`` if the config has them, else every n-th layer is a full one
  (n from ``window_pattern_field`` when the family names one, else 2); the family always has
  sliding layers, so a config without a window is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .moe_config import MoeConfig

WINDOW_RULES = ("every", "from_layer", "pattern")
QKV_BIAS_RULES = ("attention_bias", "always")

# (config fields with transformers' defaults, num_layers, source) -> the family's MoeConfig
MoeReader = Callable[[dict[str, Any], int, str], "MoeConfig"]


@dataclass(frozen=True)
class Family:
    """One model family: how its config.json is recognised and read, and which model serves it.

    Attributes:
        name: ``ModelConfig.family`` ("llama", "gemma3", ...).
        architecture: the ``architectures`` entry of its config.json ("LlamaForCausalLM").
        model_type: the ``model_type`` of its config.json (recognises files without
            ``architectures``).
        model_class: the :class:`~.llama.CausalLM` (sub)class that builds it.
        hf_model_type: the transformers ``model_type`` whose config class reads the file
            (its defaults fill what the file leaves out); None: ``model_type``'s own.
        window: None (no sliding window) or one of :data:`WINDOW_RULES` (module docstring).
        window_switch: the window is on only with ``use_sliding_window: true`` (Qwen).
        window_pattern_field: the field giving the "pattern" rule's n (Gemma 3's
            ``sliding_window_pattern``).
        partial_rotary: its transformers model rotates only ``partial_rotary_factor`` of each
            head when the config says so (elsewhere a factor below 1 is refused).
        reads_original_max_positions: the top-level ``original_max_position_embeddings`` feeds
            the rope (Phi-3's longrope).
        sliding_rope_theta_field: the field holding the sliding layers' own rope base in
            transformers 4.x files (Gemma 3's ``rope_local_base_freq``); None: one rope.
        activation_field: the field naming the gated MLP's activation.
        gelu_is_tanh: "gelu" there means the tanh approximation (Gemma computes it whatever
            the spelling).
        qkv_bias: "attention_bias" (q/k/v/o biases follow ``attention_bias``) or "always"
            (q/k/v always biased, o never: Qwen2).
        qk_norm: per-head RMSNorm on q and k before rope.
        query_pre_attn_scalar: attention is scaled by ``query_pre_attn_scalar ** -0.5``.
        fused_checkpoint: the checkpoint stores ``qkv_proj`` and ``gate_up_proj`` fused (Phi-3).
        attention_sinks: every attention layer has per-head sink logits (gpt-oss).
        moe: reads the family's :class:`~.moe_config.MoeConfig`; None for a dense family.
    """
    name: str
    architecture: str
    model_type: str
    model_class: type
    hf_model_type: str | None = None
    window: str | None = None
    window_switch: bool = False
    window_pattern_field: str | None = None
    partial_rotary: bool = False
    reads_original_max_positions: bool = False
    sliding_rope_theta_field: str | None = None
    activation_field: str = "hidden_act"
    gelu_is_tanh: bool = False
    qkv_bias: str = "attention_bias"
    qk_norm: bool = False
    query_pre_attn_scalar: bool = False
    fused_checkpoint: bool = False
    attention_sinks: bool = False
    moe: MoeReader | None = None

    def __post_init__(self):
        for field in ("name", "architecture", "model_type"):
            if not isinstance(getattr(self, field), str) or not getattr(self, field):
                raise ValueError(f"{field}: expected a non-empty string, "
                                 f"got {getattr(self, field)!r}")
        if self.window is not None and self.window not in WINDOW_RULES:
            raise ValueError(f"window: expected None or one of {WINDOW_RULES}, "
                             f"got {self.window!r}")
        if self.qkv_bias not in QKV_BIAS_RULES:
            raise ValueError(f"qkv_bias: expected one of {QKV_BIAS_RULES}, got {self.qkv_bias!r}")

    @property
    def config_model_type(self) -> str:
        """The transformers ``model_type`` whose config class reads this family's files."""
        return self.hf_model_type or self.model_type


__all__ = ["QKV_BIAS_RULES", "WINDOW_RULES", "Family", "MoeReader"]
