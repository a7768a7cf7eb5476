"""Who owns the block bookkeeping: the engine builds one ``KVCacheManager`` from the block count
its runner sized, the scheduler allocates through it and the device pool follows that same
object; a tensor-parallel rank other than 0 keeps none (rank 0's scheduler allocates every
block)."""

from __future__ import annotations

import pytest
from helpers.engines import assert_pool_whole, make_engine, run_to_finish

from mini_paged_attn.core.kv_cache_manager import KVCacheManager
from mini_paged_attn.engine import SamplingParams
from mini_paged_attn.engine.config import EngineConfig, resolve_max_model_len
from mini_paged_attn.engine.worker.tp_worker import build_worker_runner
from mini_paged_attn.models.loader import load_model

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_the_scheduler_allocates_the_blocks_the_pool_holds(tiny_model_factory):
    engine = make_engine(tiny_model_factory("llama"), block_size=4, num_kv_blocks=24,
                         enable_prefix_caching=True)
    kv = engine.kv_manager
    assert engine.scheduler.kv is kv
    assert engine.cache.kv_manager is kv and engine.cache.block_manager is kv.block_manager
    assert kv.num_blocks == engine.runner.num_blocks == engine.cache.num_blocks
    assert kv.enable_prefix_caching and kv.block_size == 4
    engine.add_request(list(range(3, 12)), GREEDY)
    engine.step()
    (seq,) = engine.scheduler.running
    # What the scheduler handed out is what the pool's map shows as held.
    held = {b.block for b in engine.memory_map().blocks if b.ref_count}
    assert held == set(seq.block_ids)
    assert kv.block_manager.get_num_free_blocks() == kv.num_blocks - len(held)
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_whole(engine)


def test_a_sliding_window_reaches_the_scheduler_s_manager(tiny_model_factory):
    engine = make_engine(tiny_model_factory("mistral"), block_size=4, num_kv_blocks=16)
    window = engine.model_config.uniform_sliding_window
    assert window is not None and engine.scheduler.kv.sliding_window == window
    assert run_to_finish(engine, [(list(range(3, 40)), GREEDY)])[0].finished
    assert_pool_whole(engine)


def test_a_tensor_parallel_worker_s_pool_keeps_no_block_bookkeeping(tiny_model_factory):
    """A rank other than 0 builds its runner as the worker process does: the pool stores K/V
    and copies blocks, but holds no block manager nor prefix cache of its own."""
    config = EngineConfig(block_size=4, num_kv_blocks=8, max_model_len=64)
    model, model_config = load_model(tiny_model_factory("llama"), dtype="float32",
                                     device="cpu")
    max_len = resolve_max_model_len(config, model_config.max_position_embeddings)
    runner = build_worker_runner(model, model_config, config, max_len)
    cache = runner.cache
    assert cache.kv_manager is None and cache.block_manager is None
    assert cache.num_blocks == runner.num_blocks == 8
    assert not any(isinstance(v, KVCacheManager) for v in vars(runner).values())
    cache.copy_blocks([(1, 2)])       # copy-on-write still works: rank 0 names the pairs
    with pytest.raises(RuntimeError, match="no block bookkeeping"):
        cache.add_sequence(0, 4)
    assert "free_blocks=-/8" in repr(cache)
