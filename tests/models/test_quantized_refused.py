"""Quantized checkpoints are refused, by their quant_method or by their tensors, before any
weight is read: loaded as plain weights (their scales ignored) they answer garbage."""

from __future__ import annotations

import json
import shutil

import pytest
import safetensors
import torch
from safetensors.torch import load_file, save_file

from mini_paged_attn.engine import LLM
from mini_paged_attn.models.checkpoint import check_unquantized, safetensors_header
from mini_paged_attn.models.config import ModelConfig
from mini_paged_attn.models.loader import load_model

SUPPORTED = "only unquantized bf16/fp16/fp32 safetensors checkpoints and GGUF files load"
Q_PROJ = "model.layers.0.self_attn.q_proj"


@pytest.fixture
def model_copy(tiny_model_factory, tmp_path):
    """A writable copy of the tiny Llama directory."""
    return shutil.copytree(tiny_model_factory("llama"), tmp_path / "model")


@pytest.fixture
def no_weight_read(monkeypatch):
    """Fail the test if a safetensors file is opened for its tensors."""
    def refuse(*args, **kwargs):
        raise AssertionError("a weight was read before the checkpoint was refused")
    monkeypatch.setattr(safetensors, "safe_open", refuse)


def _edit_config(model_dir, **fields) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))


def _edit_tensors(model_dir, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _fp8_compressed_tensors(tensors: dict) -> None:
    """What a compressed-tensors FP8 checkpoint stores: e4m3 weights and per-channel scales."""
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        weight = tensors[name]
        scale = weight.abs().amax(dim=1, keepdim=True) / 448.0
        tensors[name] = (weight / scale).to(torch.float8_e4m3fn)
        tensors[name[:-len("weight")] + "weight_scale"] = scale


COMPRESSED_TENSORS_FP8 = {
    "quant_method": "compressed-tensors", "format": "float-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "strategy": "channel"}}}}


def _refusal(model_dir) -> str:
    with pytest.raises(ValueError) as caught:
        load_model(model_dir)
    message = str(caught.value)
    assert "\n" not in message
    assert SUPPORTED in message
    return message


def test_a_compressed_tensors_fp8_checkpoint_is_refused_by_its_method(model_copy,
                                                                      no_weight_read):
    _edit_tensors(model_copy, _fp8_compressed_tensors)
    _edit_config(model_copy, quantization_config=COMPRESSED_TENSORS_FP8)
    message = _refusal(model_copy)
    assert "quant_method 'compressed-tensors' is not supported" in message
    assert "config.json" in message


@pytest.mark.parametrize("method", ["gptq", "awq", "fp8", "bitsandbytes", "mxfp4",
                                    "modelopt", "torchao"])
def test_every_quant_method_is_refused_by_name(model_copy, no_weight_read, method):
    _edit_config(model_copy, quantization_config={"quant_method": method, "bits": 4})
    assert f"quant_method {method!r} is not supported" in _refusal(model_copy)


def test_a_quantization_config_without_a_method_is_refused(model_copy, no_weight_read):
    _edit_config(model_copy, quantization_config={"load_in_8bit": True})
    assert "quant_method None is not supported" in _refusal(model_copy)


def test_the_llm_refuses_it_too(model_copy, no_weight_read):
    _edit_config(model_copy, quantization_config=COMPRESSED_TENSORS_FP8)
    with pytest.raises(ValueError, match="'compressed-tensors' is not supported"):
        LLM(str(model_copy), device="cpu", num_kv_blocks=16)


def _to_fp8(tensors):
    tensors[f"{Q_PROJ}.weight"] = tensors[f"{Q_PROJ}.weight"].to(torch.float8_e4m3fn)


def _to_int8(tensors):
    tensors[f"{Q_PROJ}.weight"] = tensors[f"{Q_PROJ}.weight"].mul(100).to(torch.int8)


def _with_weight_scale(tensors):
    tensors[f"{Q_PROJ}.weight_scale"] = torch.ones(1)


def _with_input_scale(tensors):
    tensors[f"{Q_PROJ}.input_scale"] = torch.ones(1)


def _gptq(tensors):
    weight = tensors.pop(f"{Q_PROJ}.weight")
    tensors[f"{Q_PROJ}.qweight"] = torch.zeros(weight.shape[1] // 8, weight.shape[0],
                                               dtype=torch.int32)
    tensors[f"{Q_PROJ}.qzeros"] = torch.zeros(1, weight.shape[0] // 8, dtype=torch.int32)
    tensors[f"{Q_PROJ}.scales"] = torch.ones(1, weight.shape[0], dtype=torch.float16)


@pytest.mark.parametrize("edit,named", [
    (_to_fp8, f"'{Q_PROJ}.weight' (F8_E4M3)"),
    (_to_int8, f"'{Q_PROJ}.weight' (I8)"),
    (_with_weight_scale, f"'{Q_PROJ}.weight_scale' (F32)"),
    (_with_input_scale, f"'{Q_PROJ}.input_scale' (F32)"),
    (_gptq, "qweight' (I32)"),
])
def test_quantized_tensors_without_a_quantization_config_are_refused(model_copy,
                                                                     no_weight_read, edit,
                                                                     named):
    _edit_tensors(model_copy, edit)
    message = _refusal(model_copy)
    assert named in message
    assert "has no quantization_config" in message and "model.safetensors" in message


@pytest.mark.parametrize("fields", [{}, {"quantization_config": None},
                                    {"quantization_config": {}}])
def test_plain_checkpoints_still_load(model_copy, fields):
    _edit_config(model_copy, **fields)
    model, config = load_model(model_copy)
    assert config.architecture == "LlamaForCausalLM"
    assert next(model.parameters()).dtype == torch.float32


def test_gpt_oss_mxfp4_keeps_its_hint_in_the_same_words(tiny_model_factory):
    raw = json.loads((tiny_model_factory("gpt_oss") / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4"}
    with pytest.raises(ValueError) as caught:
        ModelConfig.from_dict(raw)
    message = str(caught.value)
    assert "quant_method 'mxfp4' is not supported" in message and SUPPORTED in message
    assert "Mxfp4Config(dequantize=True)" in message and "\n" not in message


def test_the_header_is_read_without_the_tensors(model_copy, tmp_path):
    entries = safetensors_header(model_copy / "model.safetensors")
    assert entries[f"{Q_PROJ}.weight"]["dtype"] == "F32"
    assert "__metadata__" not in entries
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x10\x00")
    assert safetensors_header(short) == {}
    check_unquantized({}, [model_copy / "model.safetensors", short], "config.json")
