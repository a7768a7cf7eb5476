"""The paged decoder against transformers' own forward, token for token (fp32, CPU).

Every variant is a tiny random checkpoint written by transformers: Llama (plain and with llama3
rope scaling), Qwen2 (tied and untied embeddings, qkv bias; windowed from layer 1 on, as
use_sliding_window and max_window_layers say), Qwen3 (q/k norm, head_dim 32, sharded), Phi-3
(fused checkpoint projections; longrope; partial rotary, its factor at the top of config.json or
inside rope_parameters), Mistral (sliding window), Gemma 2 (sandwich norms,
GeGLU, soft-caps, alternating windows, tied) and Gemma 3 (q/k norms, local rope base). Windows
are shorter than the longer prompts. Caches are NaN-poisoned and blocks come out of a shuffled
free list.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers.model_parity import (assert_prefill_then_decode_match,
                                  assert_triton_backend_matches_torch, load_with_reference)
from helpers.paged_batch import PagedBatchBuilder
from helpers.tiny_models import (LLAMA3_ROPE_SCALING, PHI3_LONGROPE, hf_logits,
                                 hf_reference_model, random_prompts)

from mini_paged_attn.models.loader import load_model

VARIANTS = {
    "llama": ("llama", {}),
    "llama3-rope": ("llama", {"rope_scaling": LLAMA3_ROPE_SCALING}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen2-untied": ("qwen2", {}),
    "qwen3-sharded": ("qwen3", {"max_shard_size": "100KB"}),
    "phi3": ("phi3", {}),
    "phi3-longrope": ("phi3", {"rope_scaling": PHI3_LONGROPE, "original_max_position_embeddings": 64}),
    "mistral-window": ("mistral", {}),
    "qwen2-window-from-layer-1": ("qwen2", {"use_sliding_window": True, "sliding_window": 6,
                                           "max_window_layers": 1}),
    "gemma2-tied": ("gemma2", {"tie_word_embeddings": True}),
    "gemma3": ("gemma3", {}),
    # Partial rotary (12 of 16 dims), the factor where each config.json layout puts it.
    "phi3-partial-top-level": ("phi3", {"partial_rotary_factor": 0.75}, "top-level"),
    "phi3-partial-rope-parameters": ("phi3", {"partial_rotary_factor": 0.75}, "rope_parameters"),
}


def _partial_rotary_layout(model_dir, layout: str, tmp_path_factory):
    """A copy of ``model_dir`` whose config.json holds ``partial_rotary_factor`` only at the
    top, next to ``rope_theta`` (older files: Phi-4-mini), or only inside ``rope_parameters``
    (transformers 5 writes both)."""
    copy = tmp_path_factory.mktemp(f"layout-{layout}")
    shutil.copytree(model_dir, copy, dirs_exist_ok=True)
    raw = json.loads((copy / "config.json").read_text())
    if layout == "top-level":
        rope = raw.pop("rope_parameters")
        raw["rope_theta"] = rope["rope_theta"]
        raw["partial_rotary_factor"] = rope["partial_rotary_factor"]
    else:
        raw.pop("partial_rotary_factor")
    (copy / "config.json").write_text(json.dumps(raw))
    return copy
ATOL = 1e-4
BLOCK_SIZE = 4
PROMPT_LENS = (1, 3, BLOCK_SIZE, BLOCK_SIZE + 1, 11)   # 11: nearly two windows of 6


@pytest.fixture(scope="module", params=list(VARIANTS))
def models(request, tiny_model_factory, tmp_path_factory):
    arch, kwargs, *layout = VARIANTS[request.param]
    model_dir = tiny_model_factory(arch, **kwargs)
    if layout:
        model_dir = _partial_rotary_layout(model_dir, layout[0], tmp_path_factory)
    return load_with_reference(model_dir)


def test_prefill_then_decode_match_transformers(models):
    assert_prefill_then_decode_match(*models, PROMPT_LENS, block_size=BLOCK_SIZE, atol=ATOL)


@torch.inference_mode()
def test_chunked_prefill_prefix_hit_and_decode_in_one_step(models):
    """One varlen step mixing a prompt's second chunk, a decode, and a prefix-cache hit
    (caches: strided K/V views of one interleaved pool)."""
    model, config, hf = models
    a, b = random_prompts(config.vocab_size, (10, 6), seed=1)
    c_tail = random_prompts(config.vocab_size, (3,), seed=2)[0]
    batch = PagedBatchBuilder(config, block_size=BLOCK_SIZE, seed=3, interleaved=True)
    ids, pos, meta = batch.step({"a": a[:6], "b": b})             # a's first chunk, b whole
    logits = model.compute_logits(model(ids, pos, batch.kv_caches, meta))
    b_next = int(logits[-1].argmax())
    batch.share_prefix("c", "a", num_full_blocks=1)               # c = a[:4] (cached) + c_tail
    ids, pos, meta = batch.step({"a": a[6:], "b": [b_next], "c": c_tail})
    logits = model.compute_logits(model(ids, pos, batch.kv_caches, meta))
    cu = meta.cu_seqlens_q.tolist()
    assert meta.context_lens.tolist() == [10, 7, 7] and meta.max_seqlen_q == 4
    torch.testing.assert_close(logits[cu[0]:cu[1]], hf_logits(hf, a)[6:], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[cu[1]], hf_logits(hf, b + [b_next])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[cu[2]:cu[3]], hf_logits(hf, a[:4] + c_tail)[4:], atol=ATOL,
                               rtol=0)


@torch.inference_mode()
def test_padding_rows_are_inert(models):
    """CUDA-graph padding (slot -1, context length 0) changes neither real rows nor the cache."""
    model, config, _ = models
    prompts = random_prompts(config.vocab_size, (5, 2), seed=4)
    plain, padded = (PagedBatchBuilder(config, block_size=BLOCK_SIZE, seed=5) for _ in range(2))
    outs = []
    for batch, pad_to in ((plain, None), (padded, 4)):
        ids, pos, meta = batch.step(dict(enumerate(prompts)))
        model(ids, pos, batch.kv_caches, meta)
        ids, pos, meta = batch.step({0: [7], 1: [9]}, pad_to=pad_to)
        outs.append(model.compute_logits(model(ids, pos, batch.kv_caches, meta)))
    assert outs[1].shape[0] == 4
    torch.testing.assert_close(outs[1][:2], outs[0], atol=1e-5, rtol=0)   # matmul blocking differs
    for (k0, v0), (k1, v1) in zip(plain.kv_caches, padded.kv_caches):
        torch.testing.assert_close(k1, k0, atol=1e-5, rtol=0, equal_nan=True)
        torch.testing.assert_close(v1, v0, atol=1e-5, rtol=0, equal_nan=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma2", "gemma3"])
@torch.inference_mode()
def test_bf16_error_is_within_transformers_bf16_noise(tiny_model_factory, arch):
    """bf16 cannot match fp32 exactly; it must be as close to it as transformers' own bf16 is."""
    model_dir = tiny_model_factory(arch)
    model, config = load_model(model_dir, dtype=torch.bfloat16)
    prompt = random_prompts(config.vocab_size, (40,), seed=6)[0]
    batch = PagedBatchBuilder(config, block_size=16, dtype=torch.bfloat16)
    ids, pos, meta = batch.step({0: prompt})
    ours = model.compute_logits(model(ids, pos, batch.kv_caches, meta))
    exact = hf_logits(hf_reference_model(model_dir), prompt)
    hf_bf16 = hf_logits(hf_reference_model(model_dir, dtype=torch.bfloat16), prompt)
    noise = (hf_bf16 - exact).abs().max().item()
    assert 0 < (ours - exact).abs().max().item() <= 1.5 * noise


@pytest.mark.parametrize("arch, kwargs", [("llama", {}), ("qwen3", {}), ("gemma2", {}),
                                          ("gemma3", {}), ("phi3", {"partial_rotary_factor": 0.5})])
def test_triton_backend_matches_torch_backend(tiny_model_factory, arch, kwargs):
    """The model through the Triton kernels (the interpreter on CPU; the GPU when there is one)
    with strided pool views, a mixed prefill step and a padded decode step."""
    assert_triton_backend_matches_torch(tiny_model_factory(arch, **kwargs), list(range(3, 12)),
                                        block_size=BLOCK_SIZE)
