"""How a family's config.json becomes ModelConfig's fields.

A field the file leaves out takes the default its family declares (``Family.defaults`` over
:data:`SHARED_DEFAULTS`): its transformers config class's default, for the fields read here,
so that a file reads as transformers reads it without importing transformers (whose config
classes import its auto-model stack: seconds at start-up). The two spellings of the rope
(transformers 4.x ``rope_theta`` + ``rope_scaling``, 5.x ``rope_parameters`` with theta inside)
become the 5.x one, as transformers 5's config classes normalise them; ``torch_dtype`` becomes
``dtype``. Then the rules each :class:`~.family.Family` declares: the attention pattern (which
layers slide, over how many keys), the rope of full and sliding layers (partial rotary
included), the activation. Each rule follows the family's own transformers modeling code.
"""

from __future__ import annotations

import copy
from types import MappingProxyType
from typing import Any

from ..core.args import is_number, positive_int
from .family import Family
from .rope import RopeConfig, parse_rope

LAYER_TYPES = ("full_attention", "sliding_attention")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

# The defaults most families' transformers config classes share; a family declares the others.
SHARED_DEFAULTS = MappingProxyType({"hidden_act": "silu", "rms_norm_eps": 1e-6,
                                    "rope_theta": 10000.0})

# Sizes that must be positive ints where given, and that a file may not set to null.
_SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
          "vocab_size", "max_position_embeddings")
# Fields that may be null (the family's rule then applies) but otherwise must be of a kind.
_OPTIONAL_SIZES = ("num_key_value_heads", "head_dim")
_OPTIONAL_NUMBERS = ("rms_norm_eps", "query_pre_attn_scalar", "attn_logit_softcapping",
                     "final_logit_softcapping")


def config_fields(family: Family, raw: dict[str, Any], source: str) -> dict[str, Any]:
    """``raw`` (a config.json dict of ``family``) over the family's defaults, the rope as
    ``rope_parameters`` (theta inside; one dict per layer type for a family with a sliding
    rope) and the dtype as ``dtype``. Token ids are the file's alone.

    Raises:
        ValueError: a size set to null or not a positive int, a number field or a rope field
            of the wrong kind (names ``source`` and the field).
    """
    for key in _SIZES:
        if key in raw and raw[key] is None:
            raise ValueError(f"{source}: missing field {key!r} (needed for {family.architecture})")
    for key in _SIZES + _OPTIONAL_SIZES:
        if raw.get(key) is not None:
            name = "num_attention_heads (num_q_heads)" if key == "num_attention_heads" else key
            positive_int(f"{source}: {name}", raw[key])
    for key in _OPTIONAL_NUMBERS:
        if raw.get(key) is not None and not is_number(raw[key]):
            raise ValueError(f"{source}: {key}: expected a number, got {raw[key]!r}")
    fields = {**SHARED_DEFAULTS, **family.defaults,
              **{k: v for k, v in raw.items() if k != "model_type"}}
    fields["rope_parameters"] = _rope_parameters(fields, family, raw, source)
    for key in ("rope_theta", "rope_scaling", family.sliding_rope_theta_field):
        fields.pop(key, None)
    dtype = fields.pop("torch_dtype", None)
    fields["dtype"] = fields.get("dtype") or dtype
    return fields


def _rope_parameters(fields: dict[str, Any], family: Family, raw: dict[str, Any],
                     source: str) -> dict[str, Any]:
    """The rope as transformers 5 spells it, each layer dict with its ``rope_theta``.

    As transformers' classes merge them: a 4.x ``rope_scaling`` wins over ``rope_parameters``
    (the file's, else the family's default dict); theta set inside a dict wins over the
    top-level ``rope_theta``. A family with a sliding rope (Gemma 3) has one dict per layer
    type: ``rope_scaling`` applies to the full layers, and the sliding layers' theta is
    ``sliding_rope_theta_field``.
    """
    for key in ("rope_scaling", "rope_parameters"):
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise ValueError(f"{source}: {key}: expected a dict or null, got {raw[key]!r}")
    scaling, given = raw.get("rope_scaling"), fields.get("rope_parameters")
    local_field = family.sliding_rope_theta_field
    if local_field:
        given = given or {}
        params = {t: copy.deepcopy(given.get(t) or {"rope_type": "default"}) for t in LAYER_TYPES}
        params["full_attention"].update(scaling or {})
        thetas = {"full_attention": fields.get("rope_theta"),
                  "sliding_attention": fields.get(local_field)}
    else:
        params = copy.deepcopy(scaling or given or {})
        thetas = dict.fromkeys(LAYER_TYPES, fields.get("rope_theta"))
    if any(t in params for t in LAYER_TYPES):       # one dict per layer type
        params["full_attention"] = params.get("full_attention") or {"rope_type": "default"}
        layers = [(t, params[t]) for t in LAYER_TYPES if params.get(t) is not None]
    else:
        layers = [("full_attention", params)]
    for layer_type, layer in layers:
        if not isinstance(layer, dict):     # a bad field of a file: ValueError, as the others
            raise ValueError(  # noqa: TRY004
                f"{source}: rope_parameters[{layer_type!r}]: expected a dict, got {layer!r}")
        layer.setdefault("rope_theta", thetas[layer_type])
        if not is_number(layer["rope_theta"]):
            raise ValueError(f"{source}: rope_theta: expected a number, got "
                             f"{layer['rope_theta']!r}")
    return params


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
    """``(rope, sliding_rope)`` of :func:`config_fields`' ``rope_parameters``: one dict, or
    one per layer type (Gemma 3; the sliding one, when there, rotates the sliding layers).

    ``partial_rotary_factor`` is read where transformers reads it: inside the rope dict, else at
    the top of config.json (older files: Phi-4-mini), the dict's winning when both are there.

    Raises:
        ValueError: a bad rope field, a rope type the family's transformers class refuses, or a
            partial rotary factor on a family whose transformers model rotates the whole head
            whatever it says (not guessed either way).
    """
    params = fields["rope_parameters"]
    original = (fields.get("original_max_position_embeddings")
                if family.reads_original_max_positions else None)

    def parse(layer_params: dict[str, Any]) -> RopeConfig:
        rope = parse_rope(layer_params, default_theta=layer_params["rope_theta"],
                          max_position_embeddings=max_positions,
                          original_max_position_embeddings=original,
                          default_partial_rotary_factor=fields.get("partial_rotary_factor"),
                          source=source)
        if family.rope_types is not None and rope.rope_type not in family.rope_types:
            raise ValueError(f"{source}: rope type {rope.rope_type!r} is not supported for "
                             f"{family.name} (expected one of {family.rope_types})")
        if rope.partial_rotary_factor != 1.0 and not family.partial_rotary:
            raise ValueError(f"{source}: partial_rotary_factor {rope.partial_rotary_factor} is "
                             f"not supported for {family.name} (transformers' {family.name} "
                             "rotates the whole head)")
        return rope

    if any(t in params for t in LAYER_TYPES):
        local = params.get("sliding_attention")
        return parse(params["full_attention"]), (parse(local) if local else None)
    return parse(params), None
