"""A model whose every layer has a sliding window (a tiny random Mistral) runs prompts of many
windows on a pool smaller than one prompt: blocks left of the window go back to the pool, and
the tokens are those of a run that keeps every block.

The run that keeps every block uses the same model with an engine told that one layer is a full
one (``ModelConfig.layer_types``), so its KV cache frees nothing.
"""

import dataclasses

import pytest
import torch
from helpers.tiny_models import TINY_WINDOW

from mini_paged_attn.core.args import cdiv
from mini_paged_attn.core.sliding_window import first_needed_block, window_blocks
from mini_paged_attn.engine import LLMEngine
from mini_paged_attn.engine.admission import Admission
from mini_paged_attn.engine.config import EngineConfig
from mini_paged_attn.engine.llm_engine import load_model_and_tokenizer
from mini_paged_attn.engine.sampling_params import SamplingParams

WINDOW = TINY_WINDOW
BLOCK = 4
VOCAB = 200     # under the tiny models' vocabulary


@pytest.fixture(scope="module",
                params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def windowed_tiny(tiny_model_factory, request):
    """``(model, config that keeps every block, its own config, tokenizer)``; on CUDA the
    Triton kernels and decode CUDA graphs run."""
    model, config, tokenizer = load_model_and_tokenizer(tiny_model_factory("mistral"),
                                                        dtype="float32", device=request.param)
    keeps = dataclasses.replace(config, layer_types=("full_attention",) + config.layer_types[1:])
    assert config.uniform_sliding_window == WINDOW and keeps.uniform_sliding_window is None
    return model, keeps, config, tokenizer


def make(windowed_tiny, *, window: bool, num_kv_blocks: int, **config) -> LLMEngine:
    model, keeps, windowed, tokenizer = windowed_tiny
    engine = LLMEngine(model, tokenizer, windowed if window else keeps,
                       EngineConfig(block_size=BLOCK, num_kv_blocks=num_kv_blocks,
                                    enforce_eager=next(model.parameters()).device.type == "cpu",
                                    **config))
    engine.cache.pool.fill_(float("nan"))     # a read of a slot nothing wrote shows
    return engine


def run(engine: LLMEngine, prompts, max_tokens: int, watch=None) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = list(output.outputs[0].token_ids)
        if watch is not None:
            watch(engine)
    return [tokens[i] for i in ids]


def held_blocks(engine: LLMEngine) -> list[int]:
    return [len(seq.block_ids) - seq.num_dropped_blocks for seq in engine.scheduler.running]


def test_many_windows_on_a_small_pool_match_a_run_that_keeps_every_block(windowed_tiny):
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(3, VOCAB, (30,), generator=gen).tolist()
    prompts = [shared + torch.randint(3, VOCAB, (27,), generator=gen).tolist(),   # 57 tokens
               shared + torch.randint(3, VOCAB, (9,), generator=gen).tolist(),    # a prefix hit
               torch.randint(3, VOCAB, (41,), generator=gen).tolist()]
    max_tokens = 12
    full = make(windowed_tiny, window=False, num_kv_blocks=64, max_num_batched_tokens=16)
    expected = run(full, prompts, max_tokens)

    # 6 blocks of 4 hold 24 tokens: less than any prompt. A sequence needs 3 (one window).
    pool = 6
    assert window_blocks(WINDOW, BLOCK) == 3 and WINDOW < 24
    # Synchronous steps: between two of them a sequence holds exactly its window (with a step
    # in flight it also holds that step's new blocks); the asynchronous run must agree.
    small = make(windowed_tiny, window=True, num_kv_blocks=pool, max_num_batched_tokens=16,
                 async_scheduling=False)
    assert run(make(windowed_tiny, window=True, num_kv_blocks=pool, max_num_batched_tokens=16,
                    async_scheduling=True), prompts, max_tokens) == expected
    most = []

    def watch(engine):
        held = held_blocks(engine)
        most.append(max(held, default=0))
        for seq, h in zip(engine.scheduler.running, held):
            # Exactly the blocks from the next query's window on: cdiv(W - 1, bs) + 1 at most.
            p = seq.num_computed_tokens
            assert h == cdiv(p, BLOCK) - first_needed_block(p, WINDOW, BLOCK), seq
            assert h <= window_blocks(WINDOW, BLOCK)
        # The map and the stats see the freeing: used blocks are held or cached ones.
        memory = engine.memory_map()
        stats = engine.stats()
        used = pool - len(memory.free_blocks)
        assert used == pool - engine.kv_manager.block_manager.get_num_free_blocks()
        assert sum(len(s.blocks) for s in memory.sequences) == sum(held)
        assert stats.kv_blocks_free == engine.kv_manager.num_free_blocks()

    got = run(small, prompts, max_tokens, watch)
    assert got == expected
    assert 0 < max(most) <= window_blocks(WINDOW, BLOCK) and small.scheduler.num_preemptions
    kv = small.kv_manager
    assert kv.num_free_blocks() == kv.num_blocks               # drained: the pool is whole
    kv.reset_prefix_cache()
    assert kv.block_manager.get_num_free_blocks() == kv.num_blocks
    assert all(kv.block_manager.get_ref_count(b) == 0 for b in range(kv.num_blocks))


def test_n2_samples_and_a_prefix_hit_that_takes_only_its_window(windowed_tiny):
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, VOCAB, (33,), generator=gen).tolist()
    params = SamplingParams(temperature=1.0, n=2, max_tokens=10, ignore_eos=True, seed=5)
    outputs = {}
    for window, blocks in ((False, 64), (True, 16)):
        engine = make(windowed_tiny, window=window, num_kv_blocks=blocks,
                      max_num_batched_tokens=12)
        done = {}
        for rid in ("a", "b"):     # "b" repeats "a" once it is done: its 8 full blocks are hits
            engine.add_request(prompt, params, request_id=rid)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = sorted(tuple(c.token_ids) for c in out.outputs)
                held = held_blocks(engine)
                assert not window or all(h <= window_blocks(WINDOW, BLOCK) for h in held), held
        outputs[window] = done
        kv = engine.kv_manager
        assert kv.num_hit_tokens == 32 and kv.num_free_blocks() == kv.num_blocks
    assert outputs[True] == outputs[False]


def test_admission_asks_a_windowed_request_for_one_window_of_blocks():
    # A 32k-token prompt with a 4096-token window on a pool of three windows.
    limits = dict(vocab_size=100, max_model_len=40_000, num_blocks=3 * 4096 // 16,
                  block_size=16, max_num_seqs=4)
    params = SamplingParams(max_tokens=16)
    prompt = [1] * 32_768
    Admission(**limits, sliding_window=4096).check(prompt, params, tokenizer=None)
    with pytest.raises(ValueError, match="KV blocks, more than the whole pool"):
        Admission(**limits).check(prompt, params, tokenizer=None)
    # One window's blocks (cdiv(4095, 16) + 1 = 257) is the least a windowed request needs.
    tight = dict(limits, num_blocks=256)
    with pytest.raises(ValueError, match="need 257 KV blocks"):
        Admission(**tight, sliding_window=4096).check(prompt, params, tokenizer=None)
    with pytest.raises(ValueError, match="sliding_window"):
        Admission(**limits, sliding_window=0)
