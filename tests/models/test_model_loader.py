"""load_model: single and sharded safetensors into the fused parameters; dtypes; clear errors."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import safetensors
import torch
from safetensors.torch import load_file, save_file

from mini_paged_attn.models.loader import checkpoint_files, load_model


def read_checkpoint(model_dir) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in checkpoint_files(model_dir):
        tensors.update(load_file(str(f)))
    return tensors


@pytest.mark.parametrize("arch, kwargs", [
    ("llama", {}),
    ("qwen2", {"tie_word_embeddings": True}),
    ("qwen3", {"max_shard_size": "100KB"}),
])
def test_every_checkpoint_tensor_lands_in_its_rows(tiny_model_factory, arch, kwargs):
    model_dir = tiny_model_factory(arch, **kwargs)
    model, config = load_model(model_dir)
    checkpoint = read_checkpoint(model_dir)
    if kwargs.get("max_shard_size"):
        assert len(checkpoint_files(model_dir)) > 1
    targets = model.checkpoint_targets()
    assert set(targets) <= set(checkpoint)
    for name, target in targets.items():
        torch.testing.assert_close(target, checkpoint[name], atol=0, rtol=0, msg=name)
    # The fused rows really are one tensor: q, k, v stacked in qkv_proj.
    attn = model.layers[1].self_attn
    stacked = torch.cat([checkpoint[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    torch.testing.assert_close(attn.qkv_proj.weight, stacked, atol=0, rtol=0)
    if config.tie_word_embeddings:
        assert model.lm_head is None
    assert not any(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("arch, kwargs", [
    ("mistral", {}), ("phi3", {}), ("gemma2", {"tie_word_embeddings": True}), ("gemma3", {})])
def test_the_model_names_exactly_the_checkpoints_tensors(tiny_model_factory, arch, kwargs):
    """Each family's mapping covers every tensor transformers saved and no other: a forgotten
    norm or a misspelt name would fail here before any parity test."""
    model_dir = tiny_model_factory(arch, **kwargs)
    model, _ = load_model(model_dir)
    checkpoint = read_checkpoint(model_dir)
    assert set(model.checkpoint_targets()) == set(checkpoint) - {
        n for n in checkpoint if model.is_ignored_checkpoint_tensor(n)}
    for name, target in model.checkpoint_targets().items():
        torch.testing.assert_close(target, checkpoint[name], atol=0, rtol=0, msg=name)


def test_loads_in_the_requested_dtype_reading_on_the_device(tiny_model_factory, monkeypatch):
    model_dir = tiny_model_factory("qwen2")
    devices = []
    original = safetensors.safe_open

    def recording_safe_open(path, framework, device="cpu"):
        devices.append(device)
        return original(path, framework=framework, device=device)

    monkeypatch.setattr(safetensors, "safe_open", recording_safe_open)
    model, config = load_model(model_dir, dtype="bfloat16", device="cpu")
    assert devices == ["cpu"]        # read where the weights go, no detour
    assert config.dtype == torch.float32       # the checkpoint's; the model is what was asked
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rotary.cos_sin_cache.dtype == torch.bfloat16
    emb = read_checkpoint(model_dir)["model.embed_tokens.weight"]
    torch.testing.assert_close(model.embed_tokens.weight, emb.to(torch.bfloat16), atol=0, rtol=0)


@pytest.fixture
def llama_copy(tiny_model_factory, tmp_path):
    """A private copy of the tiny Llama dir that a test may break."""
    return shutil.copytree(tiny_model_factory("llama"), tmp_path / "llama")


def edit_config(model_dir, **changes):
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_unknown_architecture_names_it(llama_copy):
    edit_config(llama_copy, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*supported.*Qwen3ForCausalLM"):
        load_model(llama_copy)


def test_missing_directory_and_config(tmp_path, llama_copy):
    with pytest.raises(FileNotFoundError, match="nowhere.* is not a directory"):
        load_model(tmp_path / "nowhere")
    (llama_copy / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(llama_copy)


def test_no_safetensors(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_model(llama_copy)


def test_missing_shard_names_it(tiny_model_factory, tmp_path):
    model_dir = shutil.copytree(tiny_model_factory("qwen3", max_shard_size="100KB"), tmp_path / "q3")
    shard = checkpoint_files(model_dir)[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_model(model_dir)


def test_missing_tensor_names_it(llama_copy):
    path = llama_copy / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(llama_copy)


def test_shape_mismatch_names_tensor_and_file(llama_copy):
    edit_config(llama_copy, intermediate_size=96)
    with pytest.raises(ValueError, match=r"model\.safetensors.*mlp\.\w+_proj\.weight.*shape"):
        load_model(llama_copy)


def test_unused_tensors_are_logged_not_fatal(llama_copy, caplog):
    path = llama_copy / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)   # expected: silent
    tensors["model.extra.weight"] = torch.ones(3)
    save_file(tensors, str(path), metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="mini_paged_attn.models.loader"):
        load_model(llama_copy)
    assert "model.extra.weight" in caplog.text and "inv_freq" not in caplog.text
