"""The runner's automatic pool size on CPU: the CPU budget, capped at what the running
sequences can ever hold, which is about one window each for a model whose every layer is
windowed (a tiny random Mistral) and every sequence at full length otherwise."""

import dataclasses

import pytest
import torch
from helpers.tiny_models import TINY_WINDOW

from mini_paged_attn.core.args import cdiv
from mini_paged_attn.core.sliding_window import max_blocks_in_use, window_blocks
from mini_paged_attn.engine import LLMEngine
from mini_paged_attn.engine.config import EngineConfig
from mini_paged_attn.engine.llm_engine import load_model_and_tokenizer
from mini_paged_attn.engine.worker.pool_sizing import kv_block_bytes
from mini_paged_attn.engine.sampling_params import SamplingParams

LIMITS = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
              enforce_eager=True)


@pytest.fixture(scope="module")
def mistral(tiny_model_factory):
    model, config, tokenizer = load_model_and_tokenizer(tiny_model_factory("mistral"),
                                                        dtype="float32", device="cpu")
    assert config.uniform_sliding_window == TINY_WINDOW
    return model, config, tokenizer


def test_a_windowed_model_reserves_about_one_window_per_sequence(mistral):
    model, windowed, tokenizer = mistral
    full = dataclasses.replace(windowed, layer_types=("full_attention",)
                               + windowed.layer_types[1:])
    sizes = {}
    for name, config in (("windowed", windowed), ("full", full)):
        engine = LLMEngine(model, tokenizer, config, EngineConfig(**LIMITS))
        sizes[name] = engine.kv_manager.num_blocks
        if name == "windowed":     # it runs in that pool: more than one window per prompt
            params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            for i in range(6):
                engine.add_request(list(range(3, 40 + i)), params)
            while engine.has_unfinished_requests():
                engine.step()
            assert engine.kv_manager.num_free_blocks() == sizes[name]
    bs, seqs = LIMITS["block_size"], LIMITS["max_num_seqs"]
    assert sizes["full"] == seqs * cdiv(LIMITS["max_model_len"], bs)
    assert sizes["windowed"] == max_blocks_in_use(seqs, LIMITS["max_model_len"],
                                                  LIMITS["max_num_batched_tokens"], bs,
                                                  TINY_WINDOW)
    assert seqs * window_blocks(TINY_WINDOW, bs) <= sizes["windowed"] < sizes["full"] // 2


def test_a_cpu_budget_below_the_cap_sizes_the_pool(mistral):
    model, windowed, tokenizer = mistral
    per_block = kv_block_bytes(windowed, LIMITS["block_size"], torch.float32)
    engine = LLMEngine(model, tokenizer, windowed,
                       EngineConfig(**LIMITS, cpu_kv_cache_bytes=11 * per_block - 1))
    assert engine.kv_manager.num_blocks == 10
