"""Engines for tests: the tiny models in fp32, the check that a drained engine holds no KV
block, and the greedy end-to-end check against transformers' ``generate``.

    from helpers.engines import make_engine, assert_pool_whole, run_to_finish
    from helpers.engines import ENGINE, assert_greedy_matches_transformers
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from helpers.tiny_models import hf_greedy
from mini_paged_attn.engine import LLMEngine, SamplingParams
from mini_paged_attn.engine.config import EngineConfig

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
PROMPT_LENS = (3, 13, 21, 30)
# One engine exercises everything at once: blocks of 4, a pool of 12 blocks (the longest request
# needs 10, so the others are preempted), 8 tokens a step (prompts are chunked), prefix caching.
ENGINE = dict(block_size=4, num_kv_blocks=12, max_num_seqs=4, max_num_batched_tokens=8,
              max_model_len=64, enable_prefix_caching=True)


def make_engine(model_dir, *, device: str = "cpu", **config) -> LLMEngine:
    """An fp32 engine with ``EngineConfig(**config)``; the KV pool starts as NaN, so a read of a
    slot nothing wrote shows in the output."""
    engine = LLMEngine.from_model(model_dir, dtype="float32", device=device,
                                  config=EngineConfig(**config))
    engine.cache.pool.fill_(float("nan"))
    return engine


def step_to_finish(engine: LLMEngine, *, max_steps: int = 10_000,
                   step_past: type[BaseException] | tuple[type[BaseException], ...] = ()
                   ) -> dict:
    """Step until no request is left; the final output of each request that finished, by id.
    A step raising one of ``step_past`` (a failed step) is stepped past, as a server would.
    Fails the test if requests are left after ``max_steps`` steps."""
    final = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return final
        try:
            final.update((o.request_id, o) for o in engine.step() if o.finished)
        except step_past:
            pass
    raise AssertionError(f"requests left after {max_steps} steps: {engine._live}")


def run_to_finish(engine: LLMEngine, requests: list[tuple[Any, SamplingParams]]) -> list:
    """Add ``(prompt, params)`` requests, step until none is left and return each one's final
    output, in the order given."""
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    final = step_to_finish(engine)
    return [final[i] for i in ids]


def run_through_failures(engine: LLMEngine, requests: list[tuple[Any, SamplingParams]],
                         fails: Callable[[Any], bool] | None = None,
                         max_steps: int = 400, at: str = "forward") -> list:
    """:func:`run_to_finish`, but a forward whose schedule ``fails(out)`` says so raises (a
    device hiccup; default: every third one) and the caller goes on stepping, as a server
    would. ``at``: the runner's stage that raises, ``"forward"`` (inputs built) or
    ``"prepare"`` (before the runner touched anything). Fails the test if a request did not
    finish within ``max_steps`` steps."""
    stage = getattr(engine.runner, at)
    calls = []
    if fails is None:
        def fails(out):
            calls.append(out)
            return len(calls) % 3 == 0

    def fail_or_run(out, *args):
        if fails(out):
            raise RuntimeError("device hiccup")
        return stage(out, *args)

    setattr(engine.runner, at, fail_or_run)
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    try:
        final = step_to_finish(engine, max_steps=max_steps, step_past=RuntimeError)
    finally:
        setattr(engine.runner, at, stage)
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


def make_prompts(vocab_size: int) -> list[list[int]]:
    """Seeded prompts of ``PROMPT_LENS`` tokens; the last shares the second's first 3 blocks."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    prompts[3][:12] = prompts[1][:12]           # a shared prefix of 3 blocks
    return prompts


def assert_greedy_matches_transformers(llm, model_dir, *, expect_hits: bool = True) -> None:
    """Two rounds of ``make_prompts`` through ``llm`` (an ``LLM`` built with ``ENGINE``-like
    settings) give transformers' greedy tokens; the pool preempted, hit its prefix cache
    (unless ``expect_hits`` is False) and is whole afterwards."""
    prompts = make_prompts(llm.engine.model_config.vocab_size)
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)
    for _ in range(2):          # the second round hits the prefix cache
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = llm.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hit_rate > 0 or not expect_hits
    assert_pool_whole(llm.engine)
