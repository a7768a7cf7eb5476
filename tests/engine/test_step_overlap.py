"""``LLMEngine.step(overlap=fn)``: fn runs exactly once per step, before the step returns, and
the outputs are the same as without it."""

from __future__ import annotations

import pytest

from mini_paged_attn.engine import LLMEngine, SamplingParams
from mini_paged_attn.engine.config import EngineConfig


def _engine(**config) -> LLMEngine:
    return LLMEngine.from_model("tiny", dtype="float32", device="cpu",
                                config=EngineConfig(block_size=4, num_kv_blocks=32,
                                                    max_num_seqs=4, max_model_len=64, **config))


def _run(engine: LLMEngine, overlap=None) -> tuple[list, list]:
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    rid = engine.add_request([5, 6, 7, 8, 9, 10, 11], params)
    texts, calls = [], []
    while engine.has_unfinished_requests():
        marks = len(calls)
        outputs = engine.step(overlap=None if overlap is None else lambda: calls.append(1))
        if overlap is not None:
            assert len(calls) == marks + 1       # once per step, done when step() returns
        texts += [(o.outputs[0].text, list(o.outputs[0].token_ids)) for o in outputs
                  if o.request_id == rid]
    return texts, calls


def test_overlap_runs_once_per_step_and_changes_no_output():
    plain, _ = _run(_engine())
    overlapped, calls = _run(_engine(), overlap=True)
    assert overlapped == plain and len(calls) >= 5


def test_overlap_runs_in_steps_without_sampling():
    # A 7-token prompt in chunks of 3: the first two steps compute KV but sample nothing.
    engine = _engine(max_num_batched_tokens=3)
    _, calls = _run(engine, overlap=True)
    assert len(calls) == engine.counters.num_steps


def test_overlap_must_be_callable():
    engine = _engine()
    engine.add_request([5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="overlap"):
        engine.step(overlap="send")
    assert engine.counters.num_steps == 0 and engine.has_unfinished_requests()
