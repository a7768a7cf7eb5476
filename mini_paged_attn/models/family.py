"""Family: everything one model family differs in, declared in one place.

Each family is one module of ``models/families/`` holding a ``FAMILY = Family(...)`` (and, for
an MoE family, the function that reads its expert config); ``registry.py`` lists those modules.
What a family does not declare it shares with the others: the defaults of the config fields
``config_families.SHARED_DEFAULTS`` holds, and the shared decoder unless ``model_class`` says
otherwise. A family's ``defaults`` are those of transformers' config class of its model type,
for the fields the library reads (``tests/models/test_config_defaults.py`` holds them to the
installed transformers); transformers itself is not imported to read a config.

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

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .moe_config import MoeConfig

WINDOW_RULES = ("every", "from_layer", "pattern")
QKV_BIAS_RULES = ("attention_bias", "always")
# Token ids come from the checkpoint's files alone: a config class's default ids belong to some
# other checkpoint's tokenizer, so no family declares them.
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")

# (config fields with the family's defaults, num_layers, source) -> the family's MoeConfig
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
        defaults: config.json fields a file of this family may leave out, where the family's
            transformers config class defaults them otherwise than
            ``config_families.SHARED_DEFAULTS``. The rope as 4.x files spell it: ``rope_theta``
            (and ``sliding_rope_theta_field``), a default rope dict as ``rope_parameters``
            (theta outside it). Sizes that shape the weights (hidden, intermediate, heads,
            layers, vocabulary, experts) have none: a file gives them.
        hf_model_type: the transformers ``model_type`` whose config class ``defaults``
            follows (the tests compare them); None: ``model_type``'s own.
        rope_types: the rope types its transformers config class accepts (Phi-3: default and
            longrope); None: any of ``rope.ROPE_TYPES``.
        own_tokenizer_class: the tokenizer class transformers 5's ``AutoTokenizer`` gives
            this family's checkpoints whatever class tokenizer_config.json names (Qwen2:
            "Qwen2Tokenizer", which rebuilds the tokenizer from tokenizer.json's vocabulary with
            its own normaliser and pre-tokeniser), so its tokenizers always load through
            ``AutoTokenizer`` (``hf_tokenizer.py``); None: the class the file names.
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
    defaults: Mapping[str, Any] = field(default_factory=dict, hash=False)
    hf_model_type: str | None = None
    rope_types: tuple[str, ...] | None = None
    own_tokenizer_class: str | None = None
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
        for attr in ("name", "architecture", "model_type"):
            if not isinstance(getattr(self, attr), str) or not getattr(self, attr):
                raise ValueError(f"{attr}: expected a non-empty string, "
                                 f"got {getattr(self, attr)!r}")
        if self.window is not None and self.window not in WINDOW_RULES:
            raise ValueError(f"window: expected None or one of {WINDOW_RULES}, "
                             f"got {self.window!r}")
        if self.qkv_bias not in QKV_BIAS_RULES:
            raise ValueError(f"qkv_bias: expected one of {QKV_BIAS_RULES}, got {self.qkv_bias!r}")
        if not isinstance(self.defaults, Mapping) or not all(
                isinstance(k, str) for k in self.defaults):
            raise ValueError(f"defaults: expected a mapping of config field names, "
                             f"got {self.defaults!r}")
        ids = sorted(set(self.defaults) & set(TOKEN_ID_FIELDS))
        if ids:
            raise ValueError(f"defaults: expected no token ids (they come from the checkpoint's "
                             f"files), got {ids}")
        if self.rope_types is not None and (
                not isinstance(self.rope_types, tuple) or not self.rope_types
                or not all(isinstance(t, str) for t in self.rope_types)):
            raise ValueError(f"rope_types: expected None or a non-empty tuple of rope type "
                             f"names, got {self.rope_types!r}")
        # One family's defaults are shared by every config read: not to be changed through one.
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))

    @property
    def config_model_type(self) -> str:
        """The transformers ``model_type`` whose config class ``defaults`` follows."""
        return self.hf_model_type or self.model_type


__all__ = ["QKV_BIAS_RULES", "TOKEN_ID_FIELDS", "WINDOW_RULES", "Family", "MoeReader"]
