"""The embedded default: a seeded random tiny Llama + byte tokenizer, in memory or as an HF dir."""

from __future__ import annotations

import json

import torch
from helpers.paged_batch import PagedBatchBuilder
from helpers.tiny_models import hf_reference_model

from mini_paged_attn.models.loader import load_model
from mini_paged_attn.models.tiny import tiny_llama, write_tiny_llama
from mini_paged_attn.models.tokenizer import load_tokenizer


def test_seeded_and_said_to_be_random(tmp_path):
    a, config, tok = tiny_llama(seed=0)
    b, _, _ = tiny_llama(seed=0)
    c, _, _ = tiny_llama(seed=1)
    assert torch.equal(a.layers[0].self_attn.qkv_proj.weight, b.layers[0].self_attn.qkv_proj.weight)
    assert not torch.equal(a.layers[0].self_attn.qkv_proj.weight, c.layers[0].self_attn.qkv_proj.weight)
    assert config.vocab_size == tok.vocab_size == 259 and tok.eos_token_ids == (256, 258)
    note = json.loads((write_tiny_llama(tmp_path) / "config.json").read_text())
    assert "RANDOM" in note["_mini_paged_attn_note"]


@torch.inference_mode()
def test_written_dir_loads_everywhere_and_matches_transformers(tmp_path):
    model_dir = write_tiny_llama(tmp_path / "tiny", seed=3)
    in_memory, _, _ = tiny_llama(seed=3)
    model, config = load_model(model_dir)
    for name, t in in_memory.checkpoint_targets().items():
        assert torch.equal(model.checkpoint_targets()[name], t), name
    tok = load_tokenizer(model_dir)
    prompt = tok.apply_chat_template([{"role": "user", "content": "héllo"}])
    batch = PagedBatchBuilder(config, block_size=16)
    ids, pos, meta = batch.step({0: prompt})
    logits = model.compute_logits(model(ids, pos, batch.kv_caches, meta))
    ref = hf_reference_model(model_dir)(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)
