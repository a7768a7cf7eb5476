"""Engines for tests: the tiny models in fp32, and the check that a drained engine
holds no KV block.

    from helpers.engines import make_engine, assert_pool_whole, run_to_finish
"""

from __future__ import annotations

from typing import Any

from mini_paged_attn.engine import LLMEngine, SamplingParams
from mini_paged_attn.engine.config import EngineConfig


def make_engine(model_dir, *, device: str = "cpu", **config) -> LLMEngine:
    """An fp32 engine with ``EngineConfig(**config)``; the KV pool starts as NaN, so a read of a
    slot nothing wrote shows in the output."""
    engine = LLMEngine.from_model(model_dir, dtype="float32", device=device,
                                  config=EngineConfig(**config))
    engine.cache.pool.fill_(float("nan"))
    return engine


def run_to_finish(engine: LLMEngine, requests: list[tuple[Any, SamplingParams]]) -> list:
    """Add ``(prompt, params)`` requests, step until none is left and return each one's final
    output, in the order given."""
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return [final[i] for i in ids]


def assert_pool_whole(engine: LLMEngine) -> None:
    """No request left, every block free once the prefix cache lets go, every count 0."""
    kv = engine.kv_manager
    assert not engine.has_unfinished_requests()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert kv.num_free_blocks() == kv.num_blocks
    kv.reset_prefix_cache()
    bm = kv.block_manager
    assert bm.get_num_free_blocks() == bm.num_blocks
    assert all(bm.get_ref_count(b) == 0 for b in range(bm.num_blocks))
