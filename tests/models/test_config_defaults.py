"""Each family's declared config defaults against its transformers config class.

``ModelConfig`` reads config.json without transformers: a field the file leaves out takes the
default its family declares (``Family.defaults`` over ``config_families.SHARED_DEFAULTS``).
Here every registered family's files are also read the way the library read them before,
through transformers' config class of the family, and both must give the same ModelConfig;
the declared defaults must be the class's. A default that drifts from the installed
transformers fails here.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
from helpers.tiny_models import tiny_config_json

from mini_paged_attn.models import config as config_module
from mini_paged_attn.models.config import ModelConfig
from mini_paged_attn.models.config_families import SHARED_DEFAULTS, config_fields
from mini_paged_attn.models.family import TOKEN_ID_FIELDS
from mini_paged_attn.models.registry import REGISTRY

FAMILIES = [f.name for f in REGISTRY.families]

# Only what a file must give: the sizes that shape the weights. 32 heads: a multiple of every
# family's default kv heads; 30 layers: past Gemma 3's every-sixth full layer and Qwen's
# max_window_layers default (28).
SIZES = {"hidden_size": 256, "intermediate_size": 128, "num_attention_heads": 32,
         "num_hidden_layers": 30, "vocab_size": 300}
EXPERT_SIZES = {"qwen3_moe": {"num_experts": 16, "moe_intermediate_size": 32},
                "mixtral": {"num_local_experts": 4}, "gpt_oss": {"num_local_experts": 4}}

# Files as transformers 4.x wrote them (rope_theta + rope_scaling, torch_dtype, the old "type"
# key), one per family, each leaving out what the family defaults.
V4_FILES = {
    "llama": {"rope_theta": 5e5, "torch_dtype": "bfloat16",
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    "mistral": {"rope_scaling": {"type": "linear", "factor": 2.0}, "sliding_window": 16},
    "qwen2": {"use_sliding_window": True, "max_window_layers": 4, "rope_theta": 1e6,
              "torch_dtype": "float16"},
    "qwen3": {"use_sliding_window": True, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                          "original_max_position_embeddings": 128}},
    "phi3": {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 4,
                              "long_factor": [2.0] * 4},
             "original_max_position_embeddings": 128, "partial_rotary_factor": 1.0},
    "gemma2": {"hidden_act": "gelu", "sliding_window": 8},
    "gemma3": {"rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_theta": 1e5,
               "rope_local_base_freq": 100.0, "sliding_window_pattern": 3},
    "qwen3_moe": {"use_sliding_window": True, "norm_topk_prob": True, "rope_theta": 1e6},
    "mixtral": {"torch_dtype": "bfloat16", "sliding_window": 32},
    "gpt_oss": {"rope_theta": 1e4},
}


# Declared defaults that are constants of the family's transformers modeling code, not fields of
# its config class, in some transformers versions (4.x: gpt-oss's SwiGLU alpha and limit).
MODELING_CONSTANTS = {"gpt_oss": ("swiglu_alpha", "swiglu_limit")}


def hf_config_fields(family, raw, source):
    """``config_fields`` as the library computed it before: ``raw`` through transformers'
    config class of ``family`` (which fills the defaults), token ids left unset, then only
    spelt the library's way (the family's declared defaults unused, but for the modeling
    constants the class has no field for)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    kwargs = {**dict.fromkeys(TOKEN_ID_FIELDS),
              **{k: v for k, v in raw.items() if k != "model_type"}}
    hf = CONFIG_MAPPING[family.config_model_type](**copy.deepcopy(kwargs)).to_dict()
    constants = {k: family.defaults[k] for k in MODELING_CONSTANTS.get(family.name, ())
                 if k not in hf}
    return config_fields(dataclasses.replace(family, defaults=constants), hf, source)


def read_both(raw: dict, monkeypatch) -> tuple[ModelConfig, ModelConfig]:
    """``raw`` read with the declared defaults, and through transformers' config class."""
    ours = ModelConfig.from_dict(copy.deepcopy(raw))
    with monkeypatch.context() as patched:
        patched.setattr(config_module, "config_fields", hf_config_fields)
        theirs = ModelConfig.from_dict(copy.deepcopy(raw))
    return ours, theirs


def minimal(name: str, **fields) -> dict:
    return {"architectures": [REGISTRY.by_name(name).architecture], **SIZES,
            **EXPERT_SIZES.get(name, {}), **fields}


@pytest.mark.parametrize("name", FAMILIES)
def test_a_file_of_sizes_only_reads_as_transformers_reads_it(name, monkeypatch):
    ours, theirs = read_both(minimal(name), monkeypatch)
    assert ours == theirs
    if REGISTRY.by_name(name).window_switch:        # the window's defaults, switched on
        ours, theirs = read_both(minimal(name, use_sliding_window=True), monkeypatch)
        assert ours == theirs and ours.sliding_window is not None


@pytest.mark.parametrize("name", FAMILIES)
def test_the_tiny_test_configs_read_as_transformers_reads_them(name, monkeypatch):
    ours, theirs = read_both(tiny_config_json(name), monkeypatch)
    assert ours == theirs


@pytest.mark.parametrize("name", FAMILIES)
def test_transformers_4x_spellings_read_as_transformers_reads_them(name, monkeypatch):
    ours, theirs = read_both(minimal(name, **V4_FILES[name]), monkeypatch)
    assert ours == theirs
    assert ours.rope == theirs.rope and ours.dtype == theirs.dtype   # (named on failure)


@pytest.mark.parametrize("name", FAMILIES)
def test_declared_defaults_are_the_config_class_defaults(name):
    """Field by field: what ``config_fields`` fills in for a file of sizes only is what the
    family's transformers class holds. The rope fields are compared as parsed ropes above
    (transformers 5 keeps theta inside its rope dict, 4.x beside it)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    family = REGISTRY.by_name(name)
    cls = CONFIG_MAPPING[family.config_model_type]
    sizes = {k: v for k, v in minimal(name).items() if k != "architectures"}
    hf = cls(**sizes)
    # Qwen's classes drop the window unless it is on; its default shows with the switch on.
    windowed = cls(**sizes, use_sliding_window=True) if family.window_switch else hf
    fields = config_fields(family, minimal(name), "config.json")
    rope_keys = ("rope_theta", "rope_parameters", family.sliding_rope_theta_field)
    checked = []
    for key in {**SHARED_DEFAULTS, **family.defaults}:
        if key in rope_keys:
            continue
        holder = windowed if key == "sliding_window" else hf
        # Gemma 3 keeps sliding_window_pattern private in transformers 5.
        missing = object()
        theirs = getattr(holder, key, getattr(holder, f"_{key}", missing))
        if theirs is missing:
            assert key not in family.defaults or key in MODELING_CONSTANTS.get(name, ()), \
                f"{name}: {key} is no field of {cls.__name__}"
            continue         # a shared default this class has no field for: never read
        assert fields[key] == theirs, f"{name}: {key}"
        checked.append(key)
    unchecked = set(family.defaults) - set(rope_keys) - set(checked)
    assert unchecked <= set(MODELING_CONSTANTS.get(name, ()))


def test_every_family_names_a_transformers_config_class():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for family in REGISTRY.families:
        assert family.config_model_type in CONFIG_MAPPING, family.name


def test_reading_a_config_leaves_the_declared_defaults_as_they_were():
    oss = REGISTRY.by_name("gpt_oss")
    before = copy.deepcopy(dict(oss.defaults))
    fields = config_fields(oss, minimal("gpt_oss"), "config.json")
    fields["rope_parameters"]["factor"] = 2.0
    assert dict(oss.defaults) == before
    with pytest.raises(TypeError):
        oss.defaults["rope_theta"] = 1.0


@pytest.mark.parametrize("patch, match", [
    ({"num_hidden_layers": "two"}, "my/config.json: num_hidden_layers"),
    ({"head_dim": 0}, "my/config.json: head_dim"),
    ({"rms_norm_eps": "small"}, "my/config.json: rms_norm_eps"),
    ({"rope_theta": "big"}, "my/config.json: rope_theta"),
    ({"rope_scaling": "linear"}, "my/config.json: rope_scaling"),
    ({"rope_parameters": {"full_attention": [1.0]}}, "my/config.json: rope_parameters"),
])
def test_fields_of_the_wrong_kind_name_the_file_and_the_field(patch, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(minimal("llama", **patch), source="my/config.json")


@pytest.mark.parametrize("rope_type", ["linear", "yarn"])
def test_phi3_refuses_the_rope_types_its_transformers_class_refuses(rope_type):
    raw = minimal("phi3", rope_scaling={"rope_type": rope_type, "factor": 2.0})
    with pytest.raises(ValueError, match=f"{rope_type}.*phi3"):
        ModelConfig.from_dict(raw)
