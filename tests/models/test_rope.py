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
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
])
def test_bad_rope_parameters_name_the_field(params, match):
    with pytest.raises(ValueError, match=match):
        parse_rope(params, default_theta=1e4, max_position_embeddings=MAX_POS)
