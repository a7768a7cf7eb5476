"""A step that raises, at any stage of the pipeline, is settled in one place
(``EngineStep.settle_failure``): the step that was to run goes back to the waiting queue, the
step in flight before it keeps its tokens when they can still be read (else its samples end with
reason "error"), no block leaks, and the next step runs."""

from __future__ import annotations

import pytest
import torch
from helpers.engines import (
    assert_pool_whole,
    make_engine,
    run_to_finish,
    step_to_finish,
)

from mini_paged_attn.core.request import PLACEHOLDER_TOKEN
from mini_paged_attn.engine import SamplingParams
from mini_paged_attn.engine.engine_step import EngineStep

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, 96, (n,), generator=gen).tolist() for n in (5, 9, 14)]


def _tokens(outputs) -> list:
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outputs]


@pytest.fixture
def settled(monkeypatch):
    """The failures ``EngineStep.settle_failure`` settled (one entry per call)."""
    calls = []
    settle = EngineStep.settle_failure

    def spy(self):
        calls.append(self.out)
        settle(self)
    monkeypatch.setattr(EngineStep, "settle_failure", spy)
    return calls


def _fail_once(monkeypatch, owner, name: str) -> list:
    """Make ``owner.name`` raise on its next call only; returns the calls that raised."""
    real = getattr(owner, name)
    raised = []

    def fail(*args, **kwargs):
        if not raised:
            raised.append(args)
            raise RuntimeError(f"{name} failed")
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, fail)
    return raised


@pytest.mark.parametrize("stage", ["schedule", "prepare", "forward", "sample"])
def test_a_failure_at_any_stage_is_settled_once_and_loses_nothing(tiny_model_factory, stage,
                                                                  settled, monkeypatch):
    model = tiny_model_factory("llama")
    requests = [(p, PARAMS) for p in _prompts()]
    expected = _tokens(run_to_finish(make_engine(model, async_scheduling=False), requests))
    engine = make_engine(model, async_scheduling=True)
    ids = [engine.add_request(p, params) for p, params in requests]
    engine.step()
    engine.step()
    assert engine._in_flight is not None
    owner = engine.scheduler if stage == "schedule" else engine.runner
    raised = _fail_once(monkeypatch, owner, stage)
    with pytest.raises(RuntimeError, match=f"{stage} failed"):
        engine.step()
    assert raised and len(settled) == 1
    assert engine._in_flight is None and engine._held is None
    final = step_to_finish(engine, max_steps=60)
    assert len(settled) == 1
    assert _tokens([final[i] for i in ids]) == expected
    assert_pool_whole(engine)


def test_in_flight_tokens_that_cannot_be_read_end_their_samples(tiny_model_factory, settled,
                                                                monkeypatch):
    """The forward fails and so does the read of the step in flight: those samples end with
    reason "error" without a placeholder among their tokens, their blocks return to the pool,
    and the engine serves the next request."""
    engine = make_engine(tiny_model_factory("llama"), async_scheduling=True)
    ids = [engine.add_request(p, PARAMS) for p in _prompts()]
    engine.step()
    engine.step()
    in_flight = engine._in_flight
    assert in_flight is not None and in_flight.sample is not None

    def lost():
        raise RuntimeError("device lost the tokens")
    monkeypatch.setattr(in_flight.sample, "read", lost)
    _fail_once(monkeypatch, engine.runner, "forward")
    with pytest.raises(RuntimeError, match="forward failed"):
        engine.step()
    assert len(settled) == 1
    later = engine.add_request([7, 8, 9], PARAMS)
    final = step_to_finish(engine, max_steps=60)
    for i in ids:
        (sample,) = final[i].outputs
        assert sample.finish_reason == "error"
        assert PLACEHOLDER_TOKEN not in sample.token_ids and len(sample.token_ids) < 6
    assert final[later].outputs[0].finish_reason == "length"
    assert len(final[later].outputs[0].token_ids) == 6
    assert_pool_whole(engine)


@pytest.mark.gpu
@pytest.mark.parametrize("stage", ["prepare", "forward", "sample"])
def test_on_cuda_a_failed_step_under_graphs_loses_nothing(tiny_model_factory, stage, settled,
                                                          monkeypatch):
    """The default CUDA engine (asynchronous scheduling, decode graphs) fails a decode step
    while another is in flight: settled once, and every request still gets the tokens of an
    undisturbed run."""
    model = tiny_model_factory("llama")
    requests = [(p, PARAMS) for p in _prompts()]
    expected = _tokens(run_to_finish(make_engine(model, device="cuda"), requests))
    engine = make_engine(model, device="cuda")
    assert engine._async and engine.runner.graphs is not None
    ids = [engine.add_request(p, params) for p, params in requests]
    for _ in range(4):
        engine.step()
        if engine._in_flight is not None and engine.last_schedule.decode_only:
            break
    assert engine._in_flight is not None and engine.last_schedule.decode_only
    _fail_once(monkeypatch, engine.runner, stage)
    with pytest.raises(RuntimeError, match=f"{stage} failed"):
        engine.step()
    assert len(settled) == 1
    final = step_to_finish(engine, max_steps=60)
    assert _tokens([final[i] for i in ids]) == expected
    assert_pool_whole(engine)
