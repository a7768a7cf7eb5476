"""Rope variants against transformers: the inverse frequencies of its rope functions, and the
cos/sin its rotary modules produce (attention factor included), from the same config.json."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from mini_paged_attn.models.config import ModelConfig
from mini_paged_attn.models.rope import RopeConfig, parse_rope, rope_inv_freq, rope_table

HEAD = 32
MAX_POS = 256
ORIGINAL = 64
LONGROPE = {"rope_type": "longrope",
            "short_factor": [1.0 + 0.05 * i for i in range(HEAD // 2)],
            "long_factor": [1.0 + 0.5 * i for i in range(HEAD // 2)]}

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn-betas-mscale": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16, "beta_slow": 2,
                          "mscale": 0.707, "mscale_all_dim": 1.0,
                          "original_max_position_embeddings": ORIGINAL},
    "yarn-attention-factor-untruncated": {"rope_type": "yarn", "factor": 4.0,
                                          "attention_factor": 1.3, "truncate": False,
                                          "original_max_position_embeddings": ORIGINAL},
}


def hf_config(scaling: dict | None, arch: str = "llama"):
    from transformers import LlamaConfig, Phi3Config

    scaling = copy.deepcopy(scaling)             # transformers fills theta into the dict it gets
    kwargs = dict(hidden_size=HEAD * 2, num_attention_heads=2, num_key_value_heads=2,
                  intermediate_size=64, num_hidden_layers=1, vocab_size=32,
                  max_position_embeddings=MAX_POS, rope_theta=10000.0)
    if arch == "phi3":
        return Phi3Config(**kwargs, rope_scaling=scaling, original_max_position_embeddings=ORIGINAL)
    return LlamaConfig(**kwargs, rope_scaling=scaling)


def ours(config) -> RopeConfig:
    return ModelConfig.from_dict(config.to_dict()).rope


def hf_cos_sin(config, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    cls = Phi3RotaryEmbedding if config.model_type == "phi3" else LlamaRotaryEmbedding
    x = torch.zeros(1, 1, positions.numel(), HEAD)
    cos, sin = cls(config)(x, positions[None])
    return cos[0, :, :HEAD // 2], sin[0, :, :HEAD // 2]


@pytest.mark.parametrize("name", list(SCALINGS))
def test_inv_freq_and_attention_factor_match_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = hf_config(SCALINGS[name])
    rope = ours(config)
    assert rope.rope_type == (SCALINGS[name] or {}).get("rope_type", "default")
    if rope.rope_type == "default":
        want = 1.0 / (10000.0 ** (torch.arange(0, HEAD, 2).float() / HEAD))
        factor = 1.0
    else:
        want, factor = ROPE_INIT_FUNCTIONS[rope.rope_type](config, "cpu")
    torch.testing.assert_close(rope_inv_freq(HEAD, rope), want, atol=0, rtol=1e-6)
    assert rope.attention_factor == pytest.approx(factor, rel=1e-12)


@pytest.mark.parametrize("name", list(SCALINGS))
def test_table_matches_transformers_rotary_module(name):
    config = hf_config(SCALINGS[name])
    table = rope_table(HEAD, MAX_POS, ours(config), dtype=torch.float32)
    positions = torch.tensor([0, 1, 5, ORIGINAL - 1, ORIGINAL, MAX_POS - 1])
    cos, sin = hf_cos_sin(config, positions)
    # fp32 angles near position 256 round at ~1e-5 relative; the tables agree to that.
    torch.testing.assert_close(table[positions, :HEAD // 2], cos, atol=5e-6, rtol=0)
    torch.testing.assert_close(table[positions, HEAD // 2:], sin, atol=5e-6, rtol=0)


def test_longrope_short_below_original_long_from_it():
    """Phi-3's longrope: transformers uses the short factors while the sequence fits the original
    context and the long ones for a sequence past it; the table holds each on its positions."""
    config = hf_config(LONGROPE, arch="phi3")
    rope = ours(config)
    assert rope.original_max_position_embeddings == ORIGINAL
    assert rope.attention_factor == pytest.approx(
        math.sqrt(1 + math.log(MAX_POS / ORIGINAL) / math.log(ORIGINAL)))
    table = rope_table(HEAD, MAX_POS, rope, dtype=torch.float32)
    short = torch.arange(ORIGINAL)
    cos, sin = hf_cos_sin(config, short)                         # fits: short factors
    torch.testing.assert_close(table[short, :HEAD // 2], cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(table[short, HEAD // 2:], sin, atol=1e-6, rtol=0)
    whole = torch.arange(MAX_POS)
    cos, _ = hf_cos_sin(hf_config(LONGROPE, arch="phi3"), whole)   # past it: long factors
    torch.testing.assert_close(table[ORIGINAL:, :HEAD // 2], cos[ORIGINAL:], atol=1e-5, rtol=0)
    assert not torch.allclose(table[:ORIGINAL, :HEAD // 2], cos[:ORIGINAL], atol=1e-3)


def test_dynamic_equals_default_inside_the_table():
    """NTK scaling only moves the base for sequences past max_position_embeddings, which the
    table (max_position_embeddings rows) never holds."""
    dynamic = parse_rope({"rope_type": "dynamic", "factor": 4.0}, default_theta=500.0,
                         max_position_embeddings=MAX_POS)
    default = parse_rope({}, default_theta=500.0, max_position_embeddings=MAX_POS)
    assert torch.equal(rope_table(HEAD, MAX_POS, dynamic, dtype=torch.float32),
                       rope_table(HEAD, MAX_POS, default, dtype=torch.float32))


def test_spellings_of_transformers_4x_and_5_agree():
    scaling = SCALINGS["yarn"]
    v4 = {"rope_theta": 1e6, "rope_scaling": scaling}
    v5 = {"rope_parameters": {**scaling, "rope_theta": 1e6}}
    base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 2,
            "intermediate_size": 64, "num_hidden_layers": 1, "vocab_size": 32,
            "max_position_embeddings": MAX_POS}
    assert ModelConfig.from_dict({**base, **v4}).rope == ModelConfig.from_dict({**base, **v5}).rope
    phi_su = {**base, "architectures": ["Phi3ForCausalLM"], "original_max_position_embeddings": 32,
              "rope_scaling": {**LONGROPE, "type": "su", "rope_type": None}}
    rope = ModelConfig.from_dict(phi_su).rope
    assert rope.rope_type == "longrope" and rope.original_max_position_embeddings == 32
    assert rope.factor == MAX_POS / 32


@pytest.mark.parametrize("params, match", [
    ({"rope_type": "yarn", "factor": 0.0}, "factor"),
    ({"rope_type": "longrope", "short_factor": [1.0]}, "long_factor"),
    ({"rope_type": "yarn", "factor": 2.0, "attention_factor": -1.0}, "attention_factor"),
    ({"rope_type": "mrope"}, "mrope"),
    ({"partial_rotary_factor": 0.0}, "partial_rotary_factor"),
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor"),
    ({"partial_rotary_factor": "half"}, "partial_rotary_factor"),
])
def test_bad_rope_parameters_name_the_field(params, match):
    with pytest.raises(ValueError, match=match):
        parse_rope(params, default_theta=1e4, max_position_embeddings=MAX_POS)


# ---- partial rotary (Phi-3 / Phi-4-mini: rotate the first int(factor * head_dim) dims) ----------

def phi3_partial(factor: float, scaling: dict | None = None, *, layout: str = "top-level"):
    """A Phi-3 config.json dict with ``partial_rotary_factor`` where ``layout`` says: at the top
    (the older files, e.g. Phi-4-mini), inside ``rope_parameters`` (transformers 5) or inside
    ``rope_scaling`` (4.x); the transformers config it loads as comes with it."""
    from transformers import Phi3Config

    raw = hf_config(None, arch="phi3").to_dict()
    raw.pop("rope_parameters", None)
    raw.pop("partial_rotary_factor", None)
    raw["rope_theta"] = 10000.0
    if scaling is not None or layout == "rope_scaling":
        raw["rope_scaling"] = dict(scaling or {"rope_type": "default"})
    if layout == "top-level":
        raw["partial_rotary_factor"] = factor
    elif layout == "rope_scaling":
        raw["rope_scaling"]["partial_rotary_factor"] = factor
    else:
        raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0,
                                  **(scaling or {}), "partial_rotary_factor": factor}
        raw.pop("rope_scaling", None)
    return raw, Phi3Config.from_dict(copy.deepcopy(raw))


@pytest.mark.parametrize("layout", ["top-level", "rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("factor", [0.75, 0.5, 1.0])
def test_partial_rotary_table_matches_transformers_phi3(layout, factor):
    raw, hf = phi3_partial(factor, layout=layout)
    assert hf.rope_parameters["partial_rotary_factor"] == factor
    config = ModelConfig.from_dict(raw)
    rotary_dim = int(HEAD * factor)
    assert config.rope.partial_rotary_factor == factor
    assert config.rope.rotary_dim(HEAD) == rotary_dim
    table = rope_table(HEAD, MAX_POS, config.rope, dtype=torch.float32)
    assert table.shape == (MAX_POS, rotary_dim)
    positions = torch.tensor([0, 1, 5, MAX_POS - 1])
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    cos, sin = Phi3RotaryEmbedding(hf)(torch.zeros(1, 1, 4, HEAD), positions[None])
    assert cos.shape[-1] == rotary_dim
    torch.testing.assert_close(table[positions, :rotary_dim // 2], cos[0, :, :rotary_dim // 2],
                               atol=5e-6, rtol=0)
    torch.testing.assert_close(table[positions, rotary_dim // 2:], sin[0, :, :rotary_dim // 2],
                               atol=5e-6, rtol=0)


def test_partial_rotary_longrope_like_phi4_mini():
    """Phi-4-mini: longrope with per-pair factors for the rotated pairs only, the partial
    factor at the top of config.json."""
    rotary_dim = int(HEAD * 0.75)
    scaling = {"rope_type": "longrope",
               "short_factor": [1.0 + 0.05 * i for i in range(rotary_dim // 2)],
               "long_factor": [1.0 + 0.5 * i for i in range(rotary_dim // 2)]}
    raw, hf = phi3_partial(0.75, scaling)
    config = ModelConfig.from_dict(raw)
    table = rope_table(HEAD, MAX_POS, config.rope, dtype=torch.float32)
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    positions = torch.arange(ORIGINAL)
    cos, sin = Phi3RotaryEmbedding(hf)(torch.zeros(1, 1, ORIGINAL, HEAD), positions[None])
    torch.testing.assert_close(table[positions], torch.cat([cos[0, :, :rotary_dim // 2],
                                                            sin[0, :, :rotary_dim // 2]], -1),
                               atol=5e-6, rtol=0)
    raw["rope_scaling"] = dict(LONGROPE)                      # factors for the whole head
    with pytest.raises(ValueError, match="short_factor"):
        ModelConfig.from_dict(raw)


def test_the_file_s_rope_parameters_win_over_the_top_level_factor():
    raw, hf = phi3_partial(0.5, layout="rope_parameters")
    raw["partial_rotary_factor"] = 0.75          # transformers: setdefault, the dict's stays
    assert type(hf).from_dict(copy.deepcopy(raw)).rope_parameters["partial_rotary_factor"] == 0.5
    assert ModelConfig.from_dict(raw).rope.partial_rotary_factor == 0.5


@pytest.mark.parametrize("where", ["top-level", "rope_parameters"])
def test_partial_rotary_outside_phi3_is_refused(where):
    """transformers' other families rotate the whole head whatever the factor says (their rope
    modules do not read it): refused rather than guessed."""
    base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 2,
            "intermediate_size": 64, "num_hidden_layers": 1, "vocab_size": 32,
            "max_position_embeddings": MAX_POS}
    raw = ({**base, "partial_rotary_factor": 0.5} if where == "top-level" else
           {**base, "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelConfig.from_dict(raw)
    assert ModelConfig.from_dict({**base, "partial_rotary_factor": 1.0}).rope.rotary_dim(32) == 32


@pytest.mark.parametrize("factor", [0.3, 0.1])
def test_partial_rotary_needs_an_even_number_of_rotated_dims(factor):
    raw, _ = phi3_partial(factor)                 # 32 * 0.3 -> 9 dims, 32 * 0.1 -> 3
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelConfig.from_dict(raw)
