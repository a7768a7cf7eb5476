"""The family registry: a new dense family is one module plus one registry line, every family
module is listed once, and configs take the family's defaults (transformers' class's: see
test_config_defaults.py)."""

from __future__ import annotations

import importlib
import json
import pkgutil
import shutil
import sys
import textwrap

import pytest
from helpers.engines import ENGINE, assert_greedy_matches_transformers

from mini_paged_attn.models import families, registry
from mini_paged_attn.models.config import ModelConfig
from mini_paged_attn.models.family import Family
from mini_paged_attn.models.llama import CausalLM

# A family module as a contributor would write it: the Llama family under new names, its
# defaults those of transformers' Llama config class.
CLONE_MODULE = textwrap.dedent('''
    """A Llama clone: the shared decoder as it is."""
    from mini_paged_attn.models.family import Family
    from mini_paged_attn.models.llama import CausalLM

    FAMILY = Family(name="llama_clone", architecture="LlamaCloneForCausalLM",
                    model_type="llama_clone", hf_model_type="llama", model_class=CausalLM,
                    defaults={"max_position_embeddings": 2048})
''')


@pytest.fixture
def clone_family(tmp_path, monkeypatch) -> Family:
    """The clone's module, importable from ``tmp_path``, and the registry with its one line."""
    (tmp_path / "llama_clone_family.py").write_text(CLONE_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    family = importlib.import_module("llama_clone_family").FAMILY
    yield family
    sys.modules.pop("llama_clone_family", None)     # the next test imports its own copy


def _clone_dir(tiny_model_factory, tmp_path):
    llama_dir = tiny_model_factory("llama")
    clone_dir = shutil.copytree(llama_dir, tmp_path / "clone")
    config = json.loads((clone_dir / "config.json").read_text())
    config.update(architectures=["LlamaCloneForCausalLM"], model_type="llama_clone")
    (clone_dir / "config.json").write_text(json.dumps(config))
    return llama_dir, clone_dir


def test_a_new_dense_family_is_one_module_and_one_registry_line(tiny_model_factory, tmp_path,
                                                                 clone_family, monkeypatch):
    from mini_paged_attn.engine.llm import LLM

    llama_dir, clone_dir = _clone_dir(tiny_model_factory, tmp_path)
    with pytest.raises(ValueError, match="LlamaCloneForCausalLM"):
        ModelConfig.from_model_dir(clone_dir)
    monkeypatch.setattr(registry, "REGISTRY", registry.REGISTRY.with_family(clone_family))
    config = ModelConfig.from_model_dir(clone_dir)
    assert config.family == "llama_clone" and config.family_spec is clone_family
    llm = LLM(clone_dir, dtype="float32", device="cpu", **ENGINE)
    assert type(llm.engine.runner.model) is CausalLM
    # transformers' own Llama on the original directory: the same weights, the same tokens
    assert_greedy_matches_transformers(llm, llama_dir)


def test_a_file_of_the_new_model_type_alone_is_recognised(tiny_model_factory, tmp_path,
                                                          clone_family, monkeypatch):
    _, clone_dir = _clone_dir(tiny_model_factory, tmp_path)
    raw = json.loads((clone_dir / "config.json").read_text())
    del raw["architectures"]
    monkeypatch.setattr(registry, "REGISTRY", registry.REGISTRY.with_family(clone_family))
    assert ModelConfig.from_dict(raw).architecture == "LlamaCloneForCausalLM"


def test_every_family_module_is_registered_once_under_its_name():
    modules = sorted(m.name for m in pkgutil.iter_modules(families.__path__))
    declared = [importlib.import_module(f"{families.__name__}.{m}").FAMILY for m in modules]
    assert [f.name for f in declared] == modules
    assert sorted(registry.REGISTRY.families, key=lambda f: f.name) == declared
    assert sorted(registry.FAMILY_MODULES) == modules


@pytest.mark.parametrize("field", ["name", "architecture", "model_type"])
def test_a_registry_refuses_a_family_twice(field):
    llama = registry.REGISTRY.by_name("llama")
    fresh = {"name": "other", "architecture": "OtherForCausalLM", "model_type": "other"}
    fresh[field] = getattr(llama, field)
    with pytest.raises(ValueError, match=field):
        registry.REGISTRY.with_family(Family(**fresh, model_class=CausalLM))


@pytest.mark.parametrize("fields, match", [
    ({"window": "sometimes"}, "window"), ({"qkv_bias": "never"}, "qkv_bias"),
    ({"name": ""}, "name"), ({"model_class": dict}, "model_class"),
    ({"defaults": {"eos_token_id": 2}}, "defaults.*token ids"), ({"defaults": [1]}, "defaults"),
    ({"rope_types": ()}, "rope_types"), ({"rope_types": "default"}, "rope_types"),
])
def test_bad_families_name_the_field(fields, match):
    base = {"name": "other", "architecture": "OtherForCausalLM", "model_type": "other",
            "model_class": CausalLM}
    with pytest.raises(ValueError, match=match):
        registry.REGISTRY.with_family(Family(**{**base, **fields}))


SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
         "max_position_embeddings": 512}


def test_fields_absent_from_the_file_take_transformers_defaults():
    """A Qwen3 file without head_dim gets Qwen3Config's (not hidden_size / heads), a gpt-oss
    file without rope_scaling transformers' yarn, a Gemma 2 file without soft-caps its caps."""
    from transformers import Gemma2Config, GptOssConfig, Qwen3Config

    qwen3 = ModelConfig.from_dict({"architectures": ["Qwen3ForCausalLM"], **SMALL})
    assert qwen3.head_size == Qwen3Config().head_dim != SMALL["hidden_size"] // 4
    oss = ModelConfig.from_dict({"architectures": ["GptOssForCausalLM"], **SMALL,
                                 "num_local_experts": 4, "num_experts_per_tok": 2})
    hf_rope = GptOssConfig().rope_parameters
    assert (oss.rope.rope_type, oss.rope.factor, oss.rope.theta) == (
        "yarn", hf_rope["factor"], hf_rope["rope_theta"])
    gemma = ModelConfig.from_dict({"architectures": ["Gemma2ForCausalLM"], **SMALL})
    hf = Gemma2Config()
    assert (gemma.attn_logit_softcap, gemma.final_logit_softcap) == (
        hf.attn_logit_softcapping, hf.final_logit_softcapping)


def test_token_ids_come_from_the_file_not_the_class_defaults():
    """LlamaConfig's default eos/bos ids (2, 1) belong to no particular tokenizer."""
    config = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], **SMALL})
    assert config.eos_token_ids == () and config.bos_token_id is None


def test_a_config_transformers_refuses_names_the_file_and_the_field():
    with pytest.raises(ValueError, match="my/config.json.*num_hidden_layers"):
        ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], **SMALL,
                               "num_hidden_layers": "two"}, source="my/config.json")


def test_the_wrong_class_for_a_family_refuses():
    from mini_paged_attn.models.gemma import GemmaForCausalLM

    config = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], **SMALL})
    with pytest.raises(ValueError, match="llama config is built by CausalLM"):
        GemmaForCausalLM(config, device="meta")
