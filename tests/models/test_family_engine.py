"""The new families end to end: the engine's greedy outputs equal transformers' ``generate``
for every family (Mistral and Mixtral: every layer windowed; Gemma 2/3 and gpt-oss: windowed
and full layers), with prefix caching, chunked prefill and forced preemption in one engine,
prompts several windows long; Phi-3's fused checkpoint tensors split over two ranks,
and a windowed Phi-3 and Gemma 3 at tensor-parallel size 2 (gloo processes).
"""

from __future__ import annotations

import pytest
import torch
from helpers.engines import ENGINE, assert_greedy_matches_transformers
from helpers.tiny_models import TINY_WINDOW

from mini_paged_attn.distributed import TPGroup
from mini_paged_attn.engine.llm import LLM
from mini_paged_attn.models.loader import load_model

# Mistral's sequences give back the blocks left of their window (3 blocks each at most), so
# preemption needs a smaller pool, one where a prompt's chain of cached blocks does not survive
# to be hit (tests/engine/test_sliding_window_memory.py has a windowed prefix hit); Gemma 2's
# full layers keep every block.
@pytest.mark.parametrize("arch, overrides, num_kv_blocks",
                         [("mistral", {}, 6), ("gemma2", {"tie_word_embeddings": True}, 12)])
def test_windowed_families_match_transformers_through_the_engine(tiny_model_factory, arch,
                                                                 overrides, num_kv_blocks):
    model_dir = tiny_model_factory(arch, **overrides)
    llm = LLM(model_dir, dtype="float32", device="cpu",
              **dict(ENGINE, num_kv_blocks=num_kv_blocks))
    assert llm.engine.model_config.sliding_window == TINY_WINDOW
    assert_greedy_matches_transformers(llm, model_dir, expect_hits=arch != "mistral")


# The other families through the same engine: Phi-3 (fused tensors, full attention), Gemma 3
# (sliding and full layers, two rope tables), and the MoE families: Qwen3-MoE (full attention),
# Mixtral with a window on every layer (so it gives blocks back and needs the smaller pool) and
# gpt-oss (alternating windowed and full layers, sinks).
@pytest.mark.parametrize("arch, overrides, num_kv_blocks",
                         [("phi3", {}, 12), ("gemma3", {}, 12), ("qwen3_moe", {}, 12),
                          ("mixtral", {"sliding_window": TINY_WINDOW}, 6), ("gpt_oss", {}, 12)])
def test_every_family_matches_transformers_through_the_engine(tiny_model_factory, arch,
                                                              overrides, num_kv_blocks):
    model_dir = tiny_model_factory(arch, **overrides)
    llm = LLM(model_dir, dtype="float32", device="cpu",
              **dict(ENGINE, num_kv_blocks=num_kv_blocks))
    windowed = llm.engine.model_config.uniform_sliding_window is not None
    assert_greedy_matches_transformers(llm, model_dir, expect_hits=not windowed)


class _FakeGroup:
    """A process group the layout test never calls (no collective runs)."""


def test_phi3_fused_tensors_split_by_heads_and_rows(tiny_model_factory):
    model_dir = tiny_model_factory("phi3")
    full, config = load_model(model_dir, dtype="float32")
    ranks = [load_model(model_dir, dtype="float32",
                        tp=TPGroup(r, 2, torch.device("cpu"), _FakeGroup()))[0] for r in range(2)]
    hs, inter = config.head_size, config.intermediate_size
    full_qkv = full.layers[1].self_attn.qkv_proj.weight
    q_full, kv_full = config.q_size, config.kv_size
    for r, model in enumerate(ranks):
        attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
        q, kv = attn.num_q_heads * hs, attn.num_kv_heads * hs
        want_q = full_qkv[r * q:(r + 1) * q]
        want_k = full_qkv[q_full + r * kv:q_full + (r + 1) * kv]
        want_v = full_qkv[q_full + kv_full + r * kv:q_full + kv_full + (r + 1) * kv]
        assert torch.equal(attn.qkv_proj.weight, torch.cat([want_q, want_k, want_v]))
        half = inter // 2
        full_gu = full.layers[1].mlp.gate_up_proj.weight
        assert torch.equal(mlp.gate_up_proj.weight,
                           torch.cat([full_gu[r * half:(r + 1) * half],
                                      full_gu[inter + r * half:inter + (r + 1) * half]]))
        assert torch.equal(mlp.down_proj.weight,
                           full.layers[1].mlp.down_proj.weight[:, r * half:(r + 1) * half])


@pytest.mark.parametrize("arch, window", [("phi3", TINY_WINDOW), ("gemma3", None)])
def test_tensor_parallel_size_2(tiny_model_factory, arch, window):
    """Phi-3 windowed on every layer (fused tensors sliced per rank); Gemma 3 mixing windowed
    and full layers, with per-head q/k norms and two rope tables."""
    overrides = {"sliding_window": window} if window else {}
    model_dir = tiny_model_factory(arch, **overrides)
    # Every layer windowed: blocks left of the window are freed, so a smaller pool preempts.
    blocks = 6 if window else ENGINE["num_kv_blocks"]
    llm = LLM(model_dir, dtype="float32", device="cpu", tensor_parallel_size=2,
              **dict(ENGINE, num_kv_blocks=blocks))
    try:
        assert llm.engine.model_config.uniform_sliding_window == window
        assert_greedy_matches_transformers(llm, model_dir, expect_hits=window is None)
    finally:
        llm.shutdown()
