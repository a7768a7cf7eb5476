"""An MoE model split over 2 gloo ranks: each rank holds a slice of every expert's intermediate
dim, and the engine's greedy tokens equal transformers': Qwen3-MoE with a dense first layer
(dense and expert feed-forwards all-reduced in the same step), and gpt-oss (interleaved gate/up
columns split by pairs, expert biases added once, sinks split by query head)."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import hf_greedy

from mini_paged_attn.engine.llm import LLM
from mini_paged_attn.engine.sampling_params import SamplingParams

MAX_TOKENS = 6


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_tp2_greedy_matches_transformers(tiny_model_factory, arch):
    model_dir = tiny_model_factory(arch)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (2, 9, 17)]
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)
    llm = LLM(model_dir, dtype="float32", device="cpu", tensor_parallel_size=2, block_size=4,
              num_kv_blocks=32, max_model_len=64)
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                               use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == expected
