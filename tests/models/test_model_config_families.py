"""ModelConfig of the families beyond Llama/Qwen: sliding-window layers, Gemma fields, files
recognized by model_type, compared with what transformers' own config classes decide."""

from __future__ import annotations

import pytest
import torch

from mini_paged_attn.models.config import ModelConfig, RopeConfig

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=300, max_position_embeddings=512)

# The fields that matter of published configs (transformers 4.4x spellings).
GEMMA3_1B = {"architectures": ["Gemma3ForCausalLM"], "attention_bias": False,
             "attn_logit_softcapping": None, "final_logit_softcapping": None, "head_dim": 256,
             "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
             "intermediate_size": 6912, "max_position_embeddings": 32768,
             "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26,
             "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
             "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
             "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
             "vocab_size": 262144, "eos_token_id": [1, 106], "bos_token_id": 2}
GEMMA2_2B = {"architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": 50.0,
             "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
             "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304,
             "intermediate_size": 9216, "max_position_embeddings": 8192,
             "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4,
             "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
             "sliding_window": 4096, "cache_implementation": "hybrid", "torch_dtype": "float32",
             "vocab_size": 256000}
MISTRAL_7B_V01 = {"architectures": ["MistralForCausalLM"], "hidden_act": "silu",
                  "hidden_size": 4096, "intermediate_size": 14336,
                  "max_position_embeddings": 32768, "num_attention_heads": 32,
                  "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
                  "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
                  "torch_dtype": "bfloat16", "vocab_size": 32000}


def hf_dict(config) -> dict:
    """config.json as a converter writes it: no architectures, model_type says the family."""
    raw = config.to_dict()
    assert not raw.get("architectures")
    return raw


def test_gemma3_1b_published_config():
    c = ModelConfig.from_dict(GEMMA3_1B)
    assert (c.family, c.head_size, c.attn_scale) == ("gemma3", 256, 256 ** -0.5)
    assert c.qk_norm and c.tie_word_embeddings and c.hidden_act == "gelu_pytorch_tanh"
    assert c.sliding_window == 512 and c.uniform_sliding_window is None
    assert [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == [5, 11, 17, 23]
    assert c.rope == RopeConfig(theta=1e6) and c.sliding_rope == RopeConfig(theta=1e4)
    assert c.layer_rope(0) == c.sliding_rope and c.layer_rope(5) == c.rope
    assert c.layer_window(0) == 512 and c.layer_window(5) is None
    assert c.attn_logit_softcap == c.final_logit_softcap == 0.0


def test_gemma2_2b_published_config():
    c = ModelConfig.from_dict(GEMMA2_2B)
    assert c.layer_types[:4] == ("sliding_attention", "full_attention") * 2
    assert (c.attn_logit_softcap, c.final_logit_softcap) == (50.0, 30.0)
    assert c.sliding_rope is None and c.layer_rope(0) == c.rope == RopeConfig(theta=1e4)
    assert not c.qk_norm and c.tie_word_embeddings


def test_mistral_window_on_every_layer_or_none():
    c = ModelConfig.from_dict(MISTRAL_7B_V01)
    assert c.uniform_sliding_window == c.sliding_window == 4096
    assert set(c.layer_types) == {"sliding_attention"}
    c = ModelConfig.from_dict({**MISTRAL_7B_V01, "sliding_window": None})   # v0.2 and later
    assert c.sliding_window is None and c.uniform_sliding_window is None
    assert set(c.layer_types) == {"full_attention"}


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen3_moe",
            "mixtral", "gpt_oss"]
# Families whose transformers model windows every layer (no per-layer pattern).
EVERY_LAYER = ("mistral", "phi3", "qwen3_moe", "mixtral")


def _hf_family_config(family: str, **fields):
    import transformers as tf

    cls = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config,
           "qwen3": tf.Qwen3Config, "phi3": tf.Phi3Config, "gemma2": tf.Gemma2Config,
           "gemma3": tf.Gemma3TextConfig, "qwen3_moe": tf.Qwen3MoeConfig,
           "mixtral": tf.MixtralConfig, "gpt_oss": tf.GptOssConfig}[family]
    moe = {"num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32} if family in ("qwen3_moe", "mixtral", "gpt_oss") else {}
    return cls(**SMALL, **moe, **fields)


def _hf_layer_windows(hf, seq_len: int = 24) -> list[int | None]:
    """Each layer's window as transformers' own model applies it: the keys its last query
    attends to in a ``seq_len`` prompt (None: all of them), from the eager attention weights."""
    from transformers import AutoModelForCausalLM

    hf = type(hf).from_dict(hf.to_dict())
    small = {"hidden_size": 16, "intermediate_size": 16, "num_attention_heads": 2,
             "num_key_value_heads": 1, "head_dim": 8, "vocab_size": 8, "moe_intermediate_size": 8,
             "pad_token_id": None}
    for key, value in small.items():
        if hasattr(hf, key):
            setattr(hf, key, value)
    hf._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf).eval()
    with torch.no_grad():
        out = model(torch.zeros(1, seq_len, dtype=torch.long), output_attentions=True)
    seen = [int((a[0, 0, -1] > 0).sum()) for a in out.attentions]
    return [None if n == seq_len else n for n in seen]


@pytest.mark.parametrize("family", FAMILIES)
def test_model_type_only_files_match_transformers_layer_pattern(family):
    fields = {"llama": {}, "qwen2": dict(use_sliding_window=True, max_window_layers=4),
              "qwen3": dict(use_sliding_window=True, max_window_layers=2),
              "qwen3_moe": dict(use_sliding_window=True)}.get(family, {})
    hf = _hf_family_config(family, sliding_window=16, **fields)
    c = ModelConfig.from_dict(hf_dict(hf))
    assert c.family == family
    assert [c.layer_window(i) for i in range(c.num_layers)] == _hf_layer_windows(hf)
    if family == "llama":
        assert c.sliding_window is None and set(c.layer_types) == {"full_attention"}
        return
    assert c.sliding_window == 16
    assert c.uniform_sliding_window == (16 if family in EVERY_LAYER else None)


# A Qwen3-MoE file windowed on: the family has no max_window_layers (a leftover one in the file,
# as published Qwen3-MoE configs carry, is ignored) and no layer_types.
@pytest.mark.parametrize("extra", [{}, {"max_window_layers": 48}, {"max_window_layers": 2},
                                   {"layer_types": ["full_attention"] * 6}])
def test_qwen3_moe_windows_every_layer_like_transformers(extra):
    raw = {**hf_dict(_hf_family_config("qwen3_moe")), "use_sliding_window": True,
           "sliding_window": 8, **extra}
    c = ModelConfig.from_dict(raw)
    assert c.uniform_sliding_window == 8 and set(c.layer_types) == {"sliding_attention"}


@pytest.mark.parametrize("family, window", [("qwen2", 4096), ("qwen3", 4096),
                                            ("qwen3_moe", 4096), ("gpt_oss", 128),
                                            ("mistral", 4096), ("gemma2", 4096)])
def test_window_absent_from_the_file_is_transformers_default(family, window):
    fields = {"use_sliding_window": True, "max_window_layers": 0} if "qwen" in family else {}
    hf = _hf_family_config(family, **fields)
    raw = {k: v for k, v in hf_dict(hf).items() if k not in ("sliding_window", "layer_types")}
    c = ModelConfig.from_dict(raw)
    assert c.sliding_window == hf.sliding_window == window
    hf.sliding_window = 8                   # the same layers, a window shorter than the prompt
    want = [8 if w else None for w in _hf_layer_windows(hf)]
    assert [8 if c.layer_window(i) else None for i in range(c.num_layers)] == want


def test_gemma2_and_gpt_oss_alternate_whatever_sliding_window_pattern_says():
    """Only Gemma 3 reads sliding_window_pattern; Gemma 2 and gpt-oss alternate."""
    for family in ("gemma2", "gpt_oss", "gemma3"):
        hf = _hf_family_config(family, sliding_window=16)
        raw = {**{k: v for k, v in hf_dict(hf).items() if k != "layer_types"},
               "sliding_window_pattern": 3}
        c = ModelConfig.from_dict(raw)
        want = _hf_layer_windows(type(hf).from_dict(raw))
        assert [c.layer_window(i) for i in range(c.num_layers)] == want


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "gpt_oss"])
def test_sliding_layers_without_a_window_are_refused(family):
    raw = {**hf_dict(_hf_family_config(family)), "sliding_window": None}
    with pytest.raises(ValueError, match="sliding_window"):
        ModelConfig.from_dict(raw)


def test_qwen_sliding_window_is_off_unless_use_sliding_window():
    from transformers import Qwen2Config

    c = ModelConfig.from_dict(hf_dict(Qwen2Config(**SMALL, sliding_window=16)))
    assert c.sliding_window is None and set(c.layer_types) == {"full_attention"}
    raw = {**hf_dict(Qwen2Config(**SMALL)), "use_sliding_window": True, "sliding_window": 8,
           "max_window_layers": 0, "layer_types": None}   # a 4.x file: no layer_types
    c = ModelConfig.from_dict(raw)
    assert c.uniform_sliding_window == 8


def test_gemma3_transformers5_rope_per_layer_type_equals_4x():
    from transformers import Gemma3TextConfig

    scaling = {"rope_type": "linear", "factor": 8.0}
    v4 = {**GEMMA3_1B, "rope_scaling": scaling}
    v5 = hf_dict(Gemma3TextConfig(**{k: v for k, v in GEMMA3_1B.items()
                                     if k not in ("architectures", "model_type", "torch_dtype",
                                                  "rope_theta", "rope_local_base_freq",
                                                  "sliding_window_pattern", "rope_scaling")},
                                  rope_scaling=scaling, rope_theta=1e6, rope_local_base_freq=1e4))
    assert "full_attention" in v5["rope_parameters"]
    a, b = ModelConfig.from_dict(v4), ModelConfig.from_dict(v5)
    assert a.rope == b.rope == RopeConfig(theta=1e6, rope_type="linear", factor=8.0)
    assert a.sliding_rope == b.sliding_rope == RopeConfig(theta=1e4)
    assert a.layer_types == b.layer_types


def test_direct_construction_fills_layer_types():
    c = ModelConfig.from_dict(MISTRAL_7B_V01)
    kwargs = {f: getattr(c, f) for f in ("architecture", "num_layers", "hidden_size",
                                         "intermediate_size", "num_q_heads", "num_kv_heads",
                                         "head_size", "vocab_size", "max_position_embeddings",
                                         "rms_norm_eps", "rope")}
    assert ModelConfig(**kwargs).layer_types == ("full_attention",) * 32
    assert ModelConfig(**kwargs, sliding_window=8).uniform_sliding_window == 8
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig(**kwargs, sliding_window=8, layer_types=("sliding_attention",) * 3)
    with pytest.raises(ValueError, match="sliding_window"):
        ModelConfig(**kwargs, layer_types=("sliding_attention",) * 32)
    with pytest.raises(ValueError, match="sliding_window"):
        ModelConfig(**kwargs, sliding_window=0)


@pytest.mark.parametrize("raw, match", [
    ({**GEMMA3_1B, "use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({**GEMMA3_1B, "hidden_activation": "relu"}, "relu"),
    ({**GEMMA2_2B, "layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ({**GEMMA2_2B, "layer_types": ["chunked_attention"] * 26}, "chunked_attention"),
    ({k: v for k, v in GEMMA3_1B.items() if k != "architectures"} | {"model_type": "gemma3"},
     "model_type 'gemma3'"),
    ({**GEMMA3_1B, "architectures": ["Gemma3ForConditionalGeneration"]},
     "Gemma3ForConditionalGeneration"),
])
def test_bad_family_configs_name_the_field(raw, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(raw)


def test_dtype_and_defaults_of_gemma_files_without_them():
    raw = {k: v for k, v in GEMMA2_2B.items()
           if k not in ("query_pre_attn_scalar", "head_dim", "final_logit_softcapping")}
    c = ModelConfig.from_dict(raw)
    assert c.head_size == 256 and c.attn_scale == 256 ** -0.5 and c.final_logit_softcap == 30.0
    assert c.dtype == torch.float32


def test_each_family_gets_its_class_and_a_wrong_class_refuses():
    from mini_paged_attn.models.gemma import GemmaForCausalLM
    from mini_paged_attn.models.llama import CausalLM
    from mini_paged_attn.models.registry import build_model

    small = dict(GEMMA2_2B, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=16)
    gemma = ModelConfig.from_dict(small)
    assert type(build_model(gemma, device="meta")) is GemmaForCausalLM
    with pytest.raises(ValueError, match="gemma2 config"):
        CausalLM(gemma, device="meta")
    phi = ModelConfig.from_dict({**MISTRAL_7B_V01, "architectures": ["Phi3ForCausalLM"],
                                 "hidden_size": 32, "intermediate_size": 64,
                                 "num_hidden_layers": 1, "num_attention_heads": 2,
                                 "num_key_value_heads": 1, "vocab_size": 16})
    phi_model = build_model(phi, device="meta")
    assert type(phi_model) is CausalLM and "model.layers.0.self_attn.qkv_proj.weight" in \
        phi_model.checkpoint_shards()


@pytest.mark.parametrize("family", FAMILIES)
def test_rms_norm_eps_absent_from_the_file_is_transformers_default(family):
    hf = _hf_family_config(family)
    raw = {k: v for k, v in hf_dict(hf).items() if k != "rms_norm_eps"}
    assert ModelConfig.from_dict(raw).rms_norm_eps == type(hf)().rms_norm_eps
