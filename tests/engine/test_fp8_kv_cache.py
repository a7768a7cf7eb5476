"""The engine with an fp8 (e4m3) KV cache: ``kv_cache_dtype="fp8"`` on the tiny models (CPU).

The pool is ``torch.float8_e4m3fn`` (NaN-poisoned at the start: a read of an unwritten slot
would give NaN log-probabilities), twice the blocks of a 16-bit pool fit the same budget, and
the first step's log-probabilities stay within 0.1 of the full-precision cache's. Token
equality is not expected: the tiny random models' top tokens are often within 0.02 of each
other, which e4m3 rounding of K/V may flip.
"""

from __future__ import annotations

import pytest
import torch

from helpers.engines import assert_pool_whole, make_engine
from mini_paged_attn.engine import LLM, SamplingParams
from mini_paged_attn.engine.config import EngineConfig
from mini_paged_attn.engine.worker.pool_sizing import kv_block_bytes
from mini_paged_attn.ops.kv_quant import FP8_DTYPE

HAS_CUDA = torch.cuda.is_available()
PROMPT_LENS = (1, 5, 13, 20)
OPTIONS = dict(block_size=4, num_kv_blocks=48, max_num_seqs=8, max_num_batched_tokens=256,
               max_model_len=64)


def _prompts(vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(8)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _first_step_close(model_dir, backend: str, tol: float, **options) -> None:
    """Greedy runs over an fp8 and a full-precision cache: the first step's top-3
    log-probabilities agree within ``tol`` on the tokens both list."""
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3)
    runs = {}
    for kv_dtype in ("auto", "fp8"):
        engine = make_engine(model_dir, kv_cache_dtype=kv_dtype, backend=backend,
                             **{**OPTIONS, **options})
        vocab = engine.runner.model_config.vocab_size
        outputs = LLM.from_engine(engine).generate(_prompts(vocab), params, use_tqdm=False)
        runs[kv_dtype] = [o.outputs[0] for o in outputs]
        assert_pool_whole(engine)
        if kv_dtype == "fp8":
            assert engine.cache.pool.dtype == FP8_DTYPE
    for full, fp8 in zip(runs["auto"], runs["fp8"]):
        assert len(fp8.token_ids) == 6
        first_full, first_fp8 = full.logprobs[0], fp8.logprobs[0]   # {token: logprob}, top 3
        common = first_full.keys() & first_fp8.keys()
        assert common
        for token in common:
            assert abs(first_full[token] - first_fp8[token]) < tol


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp8_cache_generates_close_to_the_full_precision_cache(tiny_model_factory, backend):
    # Eager: the torch backend reads lengths on the host, which a CUDA graph cannot capture.
    _first_step_close(tiny_model_factory("qwen3"), backend, 0.1,
                      device="cuda" if HAS_CUDA else "cpu", enforce_eager=True)


@pytest.mark.gpu
def test_fp8_cache_with_cuda_graphs(tiny_model_factory):
    """Decode steps replayed from CUDA graphs read and write the fp8 pool."""
    _first_step_close(tiny_model_factory("llama"), "triton", 0.1, device="cuda",
                      enforce_eager=False)


def test_fp8_pool_holds_twice_the_blocks_of_a_16_bit_one(tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    budget = dict(block_size=4, max_num_seqs=4, max_model_len=512, cpu_kv_cache_bytes=1 << 16)
    from mini_paged_attn.engine import LLMEngine
    blocks = {}
    for kv_dtype in ("auto", "fp8"):
        engine = LLMEngine.from_model(model_dir, dtype="float16", device="cpu",
                                      config=EngineConfig(kv_cache_dtype=kv_dtype, **budget))
        blocks[kv_dtype] = engine.runner.num_blocks
        assert engine.cache.pool.nbytes <= 1 << 16
    assert blocks["fp8"] == 2 * blocks["auto"]
    config = engine.runner.model_config
    assert kv_block_bytes(config, 4, FP8_DTYPE) * 2 == kv_block_bytes(config, 4, torch.float16)


@pytest.mark.parametrize("bad", ["fp16", "FP8", "e4m3", None, 8])
def test_unknown_kv_cache_dtype_raises(bad):
    with pytest.raises(ValueError, match="^kv_cache_dtype: expected one of"):
        EngineConfig(kv_cache_dtype=bad)


def test_fp8_alias():
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8_e4m3"
