"""How each family's config.json spells what the families differ in: the attention pattern
(which layers slide, over how many keys), the rope of full and sliding layers (partial rotary
included), the activation, and transformers' class defaults for the fields a file leaves out.
Each rule follows the family's own transformers 5 modeling code."""

from __future__ import annotations

from typing import Any

from .rope import RopeConfig, parse_rope

LAYER_TYPES = ("full_attention", "sliding_attention")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
GEMMA_FAMILIES = ("gemma2", "gemma3")

# transformers' class defaults for fields a family's config.json may leave out
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": 4096},
    "qwen2": {"sliding_window": 4096},      # used only with use_sliding_window
    "qwen3": {"sliding_window": 4096},
    "qwen3_moe": {"sliding_window": 4096},
    "phi3": {"rms_norm_eps": 1e-5},
    "mixtral": {"rms_norm_eps": 1e-5},
    "gpt_oss": {"rms_norm_eps": 1e-5, "sliding_window": 128},
    "gemma2": {"tie_word_embeddings": True, "head_dim": 256, "query_pre_attn_scalar": 256,
               "sliding_window": 4096, "final_logit_softcapping": 30.0,
               "attn_logit_softcapping": 50.0, "hidden_activation": "gelu_pytorch_tanh"},
    "gemma3": {"tie_word_embeddings": True, "head_dim": 256, "query_pre_attn_scalar": 256,
               "sliding_window": 4096, "hidden_activation": "gelu_pytorch_tanh",
               "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
               "sliding_window_pattern": 6},
}


def activation(raw: dict[str, Any], family: str, source: str) -> str:
    """The gated MLP's activation, one of :data:`ACTIVATIONS`."""
    if family in GEMMA_FAMILIES:
        # Gemma configs name it hidden_activation (hidden_act is a leftover of Gemma 1); both
        # families compute the tanh approximation whatever the spelling.
        act = raw.get("hidden_activation") or raw.get("hidden_act")
        act = "gelu_pytorch_tanh" if act in ("gelu", "gelu_pytorch_tanh") else act
    else:
        act = raw.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ValueError(f"{source}: hidden_act {act!r} is not supported (expected one of "
                         f"{ACTIVATIONS})")
    return act


# How each family's transformers model picks its sliding layers, once the window is on:
#   "every":   the window applies to every layer (the family has no per-layer pattern; a
#              layer_types or max_window_layers in the file is ignored, as transformers does)
#   "qwen2":   layer_types if the file has them, else the layers from max_window_layers on
#   "pattern": layer_types if the file has them, else every n-th layer is a full one (n from
#              sliding_window_pattern for Gemma 3, 2 for the others)
WINDOW_RULES = {"mistral": "every", "phi3": "every", "mixtral": "every", "qwen3_moe": "every",
                "qwen2": "qwen2", "qwen3": "qwen2",
                "gemma2": "pattern", "gemma3": "pattern", "gpt_oss": "pattern"}
# families whose window is on only with use_sliding_window: true
SWITCHED_WINDOW_FAMILIES = ("qwen2", "qwen3", "qwen3_moe")


def attention_pattern(raw: dict[str, Any], family: str, num_layers: int,
                      source: str) -> tuple[int | None, tuple[str, ...]]:
    """``(sliding_window, layer_types)`` as transformers builds them for ``family``.

    Raises:
        ValueError: bidirectional attention, layer_types of the wrong length or kind, or a
            family whose layers always include sliding ones (Gemma, gpt-oss) without a window
            (transformers cannot build that model either).
    """
    if raw.get("use_bidirectional_attention"):
        raise ValueError(f"{source}: use_bidirectional_attention=true is not supported "
                         "(causal decoders only)")
    rule = WINDOW_RULES.get(family)                # None: no sliding window (Llama)
    window = raw.get("sliding_window") if rule else None
    if family in SWITCHED_WINDOW_FAMILIES and not raw.get("use_sliding_window"):
        window = None                              # the field is there, but off
    if window is None:
        if rule == "pattern":
            raise ValueError(f"{source}: sliding_window: expected a window size ({family} has "
                             "sliding layers), got null")
        return None, ("full_attention",) * num_layers
    if rule == "every":
        types = ("sliding_attention",) * num_layers
    elif raw.get("layer_types"):
        types = tuple(raw["layer_types"])
    elif rule == "qwen2":
        first = int(raw.get("max_window_layers", 28))   # layers from here on slide
        types = tuple("sliding_attention" if i >= first else "full_attention"
                      for i in range(num_layers))
    else:                                          # every n-th layer is a full one
        every = int(raw.get("sliding_window_pattern") or 2) if family == "gemma3" else 2
        types = tuple("full_attention" if (i + 1) % every == 0 else "sliding_attention"
                      for i in range(num_layers))
    if len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"{source}: layer_types: expected {num_layers} entries, each one of "
                         f"{LAYER_TYPES}, got {list(types)}")
    return int(window), types


# Families whose transformers model rotates only part of each head when the config says so
# (``partial_rotary_factor``); the others' rope modules ignore the field.
PARTIAL_ROTARY_FAMILIES = ("phi3",)


def parse_ropes(raw: dict[str, Any], family: str, max_positions: int,
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
    params = dict(raw.get("rope_parameters") or {})
    original = raw.get("original_max_position_embeddings") if family == "phi3" else None

    def parse(layer_params: dict[str, Any], theta: float) -> RopeConfig:
        rope = parse_rope(layer_params, default_theta=theta,
                          max_position_embeddings=max_positions,
                          original_max_position_embeddings=original,
                          default_partial_rotary_factor=raw.get("partial_rotary_factor"),
                          source=source)
        if rope.partial_rotary_factor != 1.0 and family not in PARTIAL_ROTARY_FAMILIES:
            raise ValueError(f"{source}: partial_rotary_factor {rope.partial_rotary_factor} is "
                             f"not supported for {family} (transformers' {family} rotates the "
                             f"whole head; partial rotary: {PARTIAL_ROTARY_FAMILIES})")
        return rope

    if any(t in params for t in LAYER_TYPES):
        full = parse(params.get("full_attention") or {}, raw.get("rope_theta", 10000.0))
        local = params.get("sliding_attention")
        sliding = parse(local, raw.get("rope_local_base_freq", 10000.0)) if local else None
        return full, sliding
    merged = {**dict(raw.get("rope_scaling") or {}), **params}
    full = parse(merged, raw.get("rope_theta", 10000.0))
    if family == "gemma3":
        return full, parse({}, raw["rope_local_base_freq"])
    return full, None
