"""ModelConfig from config.json as transformers 4.4x and 5.x write it, and its errors."""

from __future__ import annotations

import json

import pytest
import torch

from mini_paged_attn.models.config import ModelConfig, RopeConfig, parse_dtype, resolve_dtype

# The fields that matter of published configs (transformers 4.4x spellings).
QWEN25_05B = {"architectures": ["Qwen2ForCausalLM"], "bos_token_id": 151643, "eos_token_id": 151645,
              "hidden_act": "silu", "hidden_size": 896, "intermediate_size": 4864,
              "max_position_embeddings": 32768, "model_type": "qwen2", "num_attention_heads": 14,
              "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
              "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
              "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936}
LLAMA32_1B = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000,
              "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
              "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
              "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
              "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": True,
              "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"},
              "torch_dtype": "bfloat16", "vocab_size": 128256}
QWEN3_06B = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "head_dim": 128,
             "hidden_size": 1024, "intermediate_size": 3072, "max_position_embeddings": 40960,
             "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
             "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
             "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
             "use_sliding_window": False, "vocab_size": 151936, "eos_token_id": 151645}
LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 11008,
             "max_position_embeddings": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
             "num_key_value_heads": 32, "rms_norm_eps": 1e-05, "rope_scaling": None,
             "torch_dtype": "float16", "vocab_size": 32000, "bos_token_id": 1, "eos_token_id": 2}


def test_qwen25_flags():
    c = ModelConfig.from_dict(QWEN25_05B)
    assert (c.family, c.num_layers, c.num_q_heads, c.num_kv_heads, c.head_size) == ("qwen2", 24, 14, 2, 64)
    assert c.qkv_bias and not c.o_bias and not c.qk_norm and c.tie_word_embeddings
    assert c.rope == RopeConfig(theta=1e6) and c.dtype == torch.bfloat16
    assert c.eos_token_ids == (151645,) and c.bos_token_id == 151643


def test_llama32_llama3_rope_and_head_dim():
    c = ModelConfig.from_dict(LLAMA32_1B)
    assert c.rope == RopeConfig(theta=500000.0, rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                high_freq_factor=4.0, original_max_position_embeddings=8192)
    assert (c.head_size, c.q_size, c.kv_size) == (64, 2048, 512)
    assert not (c.qkv_bias or c.o_bias or c.qk_norm)


def test_qwen3_head_dim_from_config_and_qk_norm():
    c = ModelConfig.from_dict(QWEN3_06B)
    assert c.head_size == 128 and c.q_size == 2048 != c.hidden_size
    assert c.qk_norm and not c.qkv_bias and c.rope.theta == 1e6


def test_llama2_defaults():
    c = ModelConfig.from_dict(LLAMA2_7B)
    assert c.rope == RopeConfig(theta=10000.0) and c.dtype == torch.float16
    assert c.head_size == 128 and c.num_kv_heads == 32


def test_transformers5_spelling_equals_4x():
    v5 = {k: v for k, v in LLAMA32_1B.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    v5["rope_parameters"] = {**LLAMA32_1B["rope_scaling"], "rope_theta": 500000.0}
    v5["dtype"] = "bfloat16"
    assert ModelConfig.from_dict(v5) == ModelConfig.from_dict(LLAMA32_1B)


def test_attention_bias_and_generation_config_eos():
    c = ModelConfig.from_dict({**LLAMA2_7B, "attention_bias": True, "eos_token_id": [2, 5]},
                              generation_config={"eos_token_id": [5, 7]})
    assert c.qkv_bias and c.o_bias
    assert c.eos_token_ids == (2, 5, 7)


def test_from_model_dir_reads_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_05B))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    assert ModelConfig.from_model_dir(tmp_path).eos_token_ids == (151645, 151643)


def test_missing_config_json_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_model_dir(tmp_path)


@pytest.mark.parametrize("patch, match", [
    ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel.*LlamaForCausalLM"),
    ({"architectures": None}, "architectures"),
    ({"hidden_size": None}, "hidden_size"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "proportional", "factor": 4.0}}, "proportional"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                       "high_freq_factor": 1.0}}, "high_freq_factor"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 64}}, "long_factor"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 3,
                       "long_factor": [1.0] * 3}}, "short_factor"),
    ({"torch_dtype": "int8"}, "int8"),
    ({"num_key_value_heads": 5}, "num_kv_heads"),
    ({"num_attention_heads": 0}, "num_q_heads"),
])
def test_bad_configs_raise_naming_the_field(patch, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict({**LLAMA2_7B, **patch})


def test_dtype_resolution():
    c = ModelConfig.from_dict(QWEN25_05B)
    assert resolve_dtype(None, c) == resolve_dtype("auto", c) == torch.bfloat16
    assert resolve_dtype("float16", c) == resolve_dtype(torch.float16, c) == torch.float16
    assert parse_dtype("torch.float32") == torch.float32
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype(torch.int8, c)
