"""How a family's config.json becomes ModelConfig's fields.

The file is read through transformers' config class of the family's model type
(``transformers.CONFIG_MAPPING``), so a field the file leaves out takes the class's default and
fields are spelt as the installed transformers spells them (4.x ``rope_theta`` +
``rope_scaling``, or 5.x ``rope_parameters``; ``torch_dtype`` or ``dtype``). Then the rules each
:class:`~.family.Family` declares: the attention pattern (which layers slide, over how many
keys), the rope of full and sliding layers (partial rotary included), the activation. Each rule
follows the family's own transformers modeling code.
"""

from __future__ import annotations

from typing import Any

from ..core.args import positive_int
from .family import Family
from .rope import RopeConfig, parse_rope

LAYER_TYPES = ("full_attention", "sliding_attention")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

# Sizes a file may leave out (the config class has a default) but not set to null: transformers
# would fail on them with a TypeError that does not say which file.
_SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
          "vocab_size", "max_position_embeddings")


def config_fields(family: Family, raw: dict[str, Any], source: str) -> dict[str, Any]:
    """``raw`` (a config.json dict of ``family``) over the defaults of transformers' config
    class, as that class's ``to_dict()`` writes it (normalised by the installed version).

    Raises:
        ValueError: a size set to null, ``num_attention_heads`` not a positive int, or a config
            the transformers class refuses (names ``source`` and transformers' reason).
    """
    # The module itself, not transformers' lazy top level, which on some installs imports
    # its auto-model factories (generation, accelerate, ...) for this one mapping.
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for key in _SIZES:
        if key in raw and raw[key] is None:
            raise ValueError(f"{source}: missing field {key!r} (needed for {family.architecture})")
    if "num_attention_heads" in raw:     # transformers divides by it before any check of ours
        positive_int(f"{source}: num_attention_heads (num_q_heads)", raw["num_attention_heads"])
    model_type = family.config_model_type
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"{family.name}: model_type: expected one transformers knows, got "
                         f"{model_type!r} (set hf_model_type to the config class's type)")
    config_class = CONFIG_MAPPING[model_type]
    # Token ids the file does not give stay unset: a class's defaults are some other
    # checkpoint's ids (and draw warnings against a small vocabulary).
    kwargs = {**dict.fromkeys(_TOKEN_IDS),
              **{k: _current_rope_spelling(v) if k in _ROPE_DICTS else v
                 for k, v in raw.items() if k != "model_type"}}
    try:
        hf_config = config_class(**kwargs)
    # transformers refuses bad fields with ValueError, KeyError, TypeError or its strict
    # dataclass errors depending on the field and the version; all say the same thing here.
    except Exception as exc:
        raise ValueError(f"{source}: transformers' {config_class.__name__} refuses this config "
                         f"({type(exc).__name__}: {exc})") from exc
    return hf_config.to_dict()


_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
_ROPE_DICTS = ("rope_scaling", "rope_parameters")
# rope types under their early names (first Phi-3 files: "su"), which transformers 5 refuses
_ROPE_TYPE_NAMES = {"su": "longrope"}


def _current_rope_spelling(params: Any) -> Any:
    """A rope dict with its type under ``rope_type`` and today's name (older files wrote
    ``type``, sometimes beside a null ``rope_type``)."""
    if not isinstance(params, dict) or params.get("rope_type") or "type" not in params:
        return params
    rope_type = params["type"]
    return {**{k: v for k, v in params.items() if k != "type"},
            "rope_type": _ROPE_TYPE_NAMES.get(rope_type, rope_type)}


def activation(fields: dict[str, Any], family: Family, source: str) -> str:
    """The gated MLP's activation, one of :data:`ACTIVATIONS`."""
    act = fields.get(family.activation_field) or fields.get("hidden_act")
    if family.gelu_is_tanh and act == "gelu":
        act = "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        raise ValueError(f"{source}: hidden_act {act!r} is not supported (expected one of "
                         f"{ACTIVATIONS})")
    return act


def attention_pattern(fields: dict[str, Any], family: Family, num_layers: int,
                      source: str) -> tuple[int | None, tuple[str, ...]]:
    """``(sliding_window, layer_types)`` as transformers builds them for ``family`` (its
    ``window`` rule, :mod:`~.family`).

    Raises:
        ValueError: bidirectional attention, layer_types of the wrong length or kind, or a
            family whose layers always include sliding ones (Gemma, gpt-oss) without a window
            (transformers cannot build that model either).
    """
    if fields.get("use_bidirectional_attention"):
        raise ValueError(f"{source}: use_bidirectional_attention=true is not supported "
                         "(causal decoders only)")
    rule = family.window
    window = fields.get("sliding_window") if rule else None
    if family.window_switch and not fields.get("use_sliding_window"):
        window = None                              # the field is there, but off
    if window is None:
        if rule == "pattern":
            raise ValueError(f"{source}: sliding_window: expected a window size "
                             f"({family.name} has sliding layers), got null")
        return None, ("full_attention",) * num_layers
    if rule == "every":
        types = ("sliding_attention",) * num_layers
    elif fields.get("layer_types"):
        types = tuple(fields["layer_types"])
    elif rule == "from_layer":                     # transformers 4.x: no layer_types
        first = int(fields["max_window_layers"])   # layers from here on slide
        types = tuple("sliding_attention" if i >= first else "full_attention"
                      for i in range(num_layers))
    else:                                          # every n-th layer is a full one
        field = family.window_pattern_field
        every = int((fields.get(field) if field else None) or 2)
        types = tuple("full_attention" if (i + 1) % every == 0 else "sliding_attention"
                      for i in range(num_layers))
    if len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"{source}: layer_types: expected {num_layers} entries, each one of "
                         f"{LAYER_TYPES}, got {list(types)}")
    return int(window), types


def parse_ropes(fields: dict[str, Any], family: Family, max_positions: int,
                source: str) -> tuple[RopeConfig, RopeConfig | None]:
    """``(rope, sliding_rope)``: transformers 5 writes ``rope_parameters`` (theta inside; per
    layer type for Gemma 3); 4.x writes ``rope_theta`` + ``rope_scaling`` (Gemma 3 adds
    ``rope_local_base_freq``, the sliding layers' theta, its scaling applying to the full ones).

    ``partial_rotary_factor`` is read where transformers reads it: inside the rope dict, else at
    the top of config.json (older files: Phi-4-mini), the dict's winning when both are there.

    Raises:
        ValueError: a bad rope field, or a partial rotary factor on a family whose transformers
            model rotates the whole head whatever it says (not guessed either way).
    """
    params = dict(fields.get("rope_parameters") or {})
    original = (fields.get("original_max_position_embeddings")
                if family.reads_original_max_positions else None)
    theta = fields.get("rope_theta", 10000.0)

    def parse(layer_params: dict[str, Any], default_theta: float) -> RopeConfig:
        rope = parse_rope(layer_params, default_theta=default_theta,
                          max_position_embeddings=max_positions,
                          original_max_position_embeddings=original,
                          default_partial_rotary_factor=fields.get("partial_rotary_factor"),
                          source=source)
        if rope.partial_rotary_factor != 1.0 and not family.partial_rotary:
            raise ValueError(f"{source}: partial_rotary_factor {rope.partial_rotary_factor} is "
                             f"not supported for {family.name} (transformers' {family.name} "
                             "rotates the whole head)")
        return rope

    local_field = family.sliding_rope_theta_field
    local_theta = fields.get(local_field) if local_field else None
    if any(t in params for t in LAYER_TYPES):
        local = params.get("sliding_attention")
        sliding = parse(local, local_theta or 10000.0) if local else None
        return parse(params.get("full_attention") or {}, theta), sliding
    full = parse({**dict(fields.get("rope_scaling") or {}), **params}, theta)
    if local_field:
        return full, parse({}, local_theta)
    return full, None
