"""Structured outputs under asynchronous scheduling: a step's sampling is held until the next
call (its grammar masks need the tokens of the step before it). Every output must equal the
synchronous engine's, no placeholder may reach an output, and nothing may leak: blocks,
matchers, sampler state.
"""

from __future__ import annotations

import json

import pytest
from helpers.engines import (assert_pool_whole, make_engine, run_through_failures, run_to_finish,
                             step_to_finish)

from mini_paged_attn.core.request import PLACEHOLDER_TOKEN
from mini_paged_attn.engine import SamplingParams

pytest.importorskip("llguidance")
from mini_paged_attn.engine.structured import StructuredOutputsParams  # noqa: E402

SCHEMA = {"type": "object",
          "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                         "b": {"enum": ["x", "yy"]}, "c": {"type": "string", "maxLength": 6}},
          "required": ["a", "b", "c"], "additionalProperties": False}
JSON = StructuredOutputsParams(json=SCHEMA)
CONFIG = dict(block_size=4, num_kv_blocks=256, max_num_seqs=8, max_model_len=128)

VARIANTS = {
    "seeded": dict(temperature=1.0, seed=3, max_tokens=60),
    "greedy": dict(temperature=0, max_tokens=60),
    "penalties, min_tokens": dict(temperature=1.0, seed=5, max_tokens=60, min_tokens=4,
                                  presence_penalty=0.4, frequency_penalty=0.2,
                                  repetition_penalty=1.3),
    "logprobs": dict(temperature=0.9, seed=7, max_tokens=60, logprobs=2),
    # Ends on its length at the step whose sampling is held.
    "max_tokens 1": dict(temperature=1.0, seed=1, max_tokens=1),
    "max_tokens 3": dict(temperature=1.0, seed=2, max_tokens=3),
}


def _samples(outputs) -> list:
    return [[(list(c.token_ids), c.finish_reason, c.text) for c in o.outputs] for o in outputs]


def _requests(variant: str) -> list:
    """Constrained requests of ``variant`` (seeds differ per request) beside plain ones."""
    kwargs = dict(VARIANTS[variant])
    requests = []
    for i in range(5):
        if "seed" in kwargs:
            kwargs["seed"] += 1
        requests.append((f"item {i}:", SamplingParams(**kwargs, structured_outputs=JSON)))
    plain = SamplingParams(temperature=1.0, seed=11, max_tokens=9, ignore_eos=True)
    requests += [("plain", plain), ("other", plain)]
    return requests


def _engines():
    return [make_engine("tiny", async_scheduling=a, **CONFIG) for a in (False, True)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_held_sampling_gives_the_synchronous_tokens(variant):
    results = []
    for engine in _engines():
        outputs = run_to_finish(engine, _requests(variant))
        results.append(outputs)
        assert_pool_whole(engine)
        assert not engine.structured._matchers
        assert not len(engine.runner.sampler.history) and not engine.runner.sampler._seeded
    sync, asyn = results
    assert _samples(asyn) == _samples(sync)
    for a, b in zip(asyn, sync):
        for ca, cb in zip(a.outputs, b.outputs):
            if cb.cumulative_logprob is not None:
                assert ca.cumulative_logprob == pytest.approx(cb.cumulative_logprob, abs=1e-5)
    for output in asyn[:5]:
        completion = output.outputs[0]
        if completion.finish_reason == "stop":
            assert set(json.loads(completion.text)) == {"a", "b", "c"}


def test_streamed_outputs_never_show_a_token_in_flight():
    requests = _requests("seeded")
    sync_engine, engine = _engines()
    expected = _samples(run_to_finish(sync_engine, requests))
    ids = [engine.add_request(p, params) for p, params in requests]
    seen: dict[str, list[int]] = {}
    final = {}
    held = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens = list(output.outputs[0].token_ids)
            assert PLACEHOLDER_TOKEN not in tokens
            before = seen.get(output.request_id, [])
            assert tokens[:len(before)] == before       # outputs only ever grow
            seen[output.request_id] = tokens
            if output.finished:
                final[output.request_id] = output
        held += engine._held is not None
    assert held > 0
    assert _samples([final[i] for i in ids]) == expected
    assert_pool_whole(engine)


def test_aborts_while_a_sampling_is_held():
    engine = make_engine("tiny", async_scheduling=True, **CONFIG)
    requests = _requests("seeded")
    ids = [engine.add_request(p, params) for p, params in requests]
    for _ in range(4):
        engine.step()
    assert engine._held is not None
    assert engine.abort_request(ids[0]) and engine.abort_request(ids[5])
    final = step_to_finish(engine)
    assert final[ids[0]].outputs[0].finish_reason == "abort"
    assert final[ids[5]].outputs[0].finish_reason == "abort"
    assert all(PLACEHOLDER_TOKEN not in o.outputs[0].token_ids for o in final.values())
    assert_pool_whole(engine)
    assert not engine.structured._matchers


def test_a_failed_step_keeps_the_held_tokens():
    """The step after a held one fails: the held step is still sampled and its tokens
    reported, so the outputs equal an undisturbed run."""
    requests = _requests("seeded")
    sync_engine, engine = _engines()
    expected = _samples(run_to_finish(sync_engine, requests))
    outputs = run_through_failures(engine, requests)
    assert _samples(outputs) == expected
    assert_pool_whole(engine)
    assert not engine.structured._matchers


def test_min_tokens_counts_the_tokens_before_the_held_step():
    """min_tokens reads a sample's token count as it was when its step was launched: the
    held step's sampling comes after the scheduler moved past it (one placeholder more)."""
    words = StructuredOutputsParams(regex="[a-z]{1,12}")
    eos_first = {256: 50.0}     # the end-of-sequence token wins as soon as it is allowed
    requests = [(f"w{i}", SamplingParams(temperature=1.0, seed=i, max_tokens=20, min_tokens=m,
                                         logit_bias=eos_first, structured_outputs=words))
                for i, m in enumerate((2, 5, 7))]
    results = []
    for engine in _engines():
        results.append(run_to_finish(engine, requests))
        assert_pool_whole(engine)
    sync, asyn = results
    assert _samples(asyn) == _samples(sync)
    # min_tokens letters, then the end-of-sequence token as soon as it is allowed.
    assert [len(o.outputs[0].token_ids) for o in asyn] == [3, 6, 8]
    assert all(o.outputs[0].token_ids[-1] == 256 for o in asyn)


def test_forks_and_prompt_logprobs_between_held_steps():
    """Steps that must be synchronous (a fork, prompt logprobs) come between held ones: the
    engine switches modes step by step and the tokens stay the synchronous engine's."""
    json = dict(temperature=1.0, max_tokens=40, structured_outputs=JSON)
    requests = [("a:", SamplingParams(**json, seed=1)),
                ("b:", SamplingParams(**json, seed=2, n=2)),
                ("c:", SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=1,
                                      ignore_eos=True)),
                ("d:", SamplingParams(**json, seed=3))]
    results = []
    for engine in _engines():
        ids = [engine.add_request(*requests[0])]
        engine.step()
        engine.step()
        # The rest join while a step is held (asynchronous) or after it (synchronous).
        ids += [engine.add_request(p, params) for p, params in requests[1:]]
        final = {}
        modes = []
        while engine.has_unfinished_requests():
            final.update((o.request_id, o) for o in engine.step() if o.finished)
            modes.append(engine._held is not None)
        results.append([final[i] for i in ids])
        assert_pool_whole(engine)
        assert not engine.structured._matchers
        if engine._async:   # held steps, and synchronous ones between them
            assert any(modes) and not all(modes)
    sync, asyn = results
    assert _samples(asyn) == _samples(sync)
    assert asyn[2].prompt_logprobs == sync[2].prompt_logprobs
    assert len(asyn[1].outputs) == 2


def test_a_held_sampling_that_fails_ends_its_samples_and_waits_for_the_fill():
    """The held step's own sampling raises: the step raises, its samples end with reason
    "error" (their tokens never existed), the grammar fill it started is waited for before
    anything else touches the matchers, and the engine goes on with the other requests."""
    engine = make_engine("tiny", async_scheduling=True, **CONFIG)
    requests = _requests("seeded")
    ids = [engine.add_request(p, params) for p, params in requests]
    engine.step()
    engine.step()
    assert engine._held is not None
    waited = []
    start = engine.structured.start

    def recording_start(out):
        wait = start(out)

        def recorded():
            waited.append(out)
            return wait()
        return recorded

    held = engine._held
    sample = engine.runner.sample
    calls = []

    def fail_twice(prepared, *args, **kwargs):
        if prepared is held.prepared:
            calls.append(prepared)
            if len(calls) <= 2:     # the step's own try, then the one after its failure
                raise RuntimeError("sampler failed")
        return sample(prepared, *args, **kwargs)

    engine.structured.start = recording_start
    engine.runner.sample = fail_twice
    with pytest.raises(RuntimeError, match="sampler failed"):
        engine.step()
    assert waited, "the fill was not waited for"
    assert len(calls) == 2
    del engine.structured.start
    del engine.runner.sample
    final = step_to_finish(engine)
    reasons = [final[i].outputs[0].finish_reason for i in ids]
    assert "error" in reasons
    assert all(PLACEHOLDER_TOKEN not in final[i].outputs[0].token_ids for i in ids)
    assert_pool_whole(engine)
    assert not engine.structured._matchers


WORDS = StructuredOutputsParams(regex="[a-z]{8,12}")


def test_a_held_step_failing_on_the_last_call_still_drains():
    """The last call of a run has an empty schedule and only finishes the held step; its
    sampling fails once there. The request, which ended on its length with that token in
    flight, must still finish, without a placeholder among its tokens."""
    engine = make_engine("tiny", async_scheduling=True, **CONFIG)
    rid = engine.add_request("w", SamplingParams(temperature=1.0, seed=1, max_tokens=3,
                                                 structured_outputs=WORDS))
    sample = engine.runner.sample
    failures = []

    def fail_on_the_empty_call(prepared, *args, **kwargs):
        # A call that launches nothing samples only the held step.
        if engine.last_schedule.is_empty and not failures:
            failures.append(prepared)
            raise RuntimeError("sampler failed")
        return sample(prepared, *args, **kwargs)

    engine.runner.sample = fail_on_the_empty_call
    final = step_to_finish(engine, max_steps=60, step_past=RuntimeError)
    assert failures
    assert PLACEHOLDER_TOKEN not in final[rid].outputs[0].token_ids
    assert_pool_whole(engine)
    assert not engine.structured._matchers


# The calls at which each fails: those that come right after the call that reads the tokens
# finishing the constrained request.
@pytest.mark.parametrize("where, failing_call", [("start", 4), ("advance", 3)])
def test_a_failure_after_the_previous_tokens_were_read_reports_them(where, failing_call):
    """Starting the held step's fill (or feeding the grammars) fails after the previous step's
    tokens were put in place: the requests those tokens finished are still reported."""
    engine = make_engine("tiny", async_scheduling=True, **CONFIG)
    ids = [engine.add_request("w", SamplingParams(temperature=1.0, seed=1, max_tokens=3,
                                                  structured_outputs=WORDS)),
           engine.add_request("plain", SamplingParams(temperature=1.0, seed=2, max_tokens=12,
                                                      ignore_eos=True))]
    real = getattr(engine.structured, where)
    calls = []

    def fail_once_late(*args):
        calls.append(1)
        if len(calls) == failing_call:
            raise RuntimeError("grammar failure")
        return real(*args)

    setattr(engine.structured, where, fail_once_late)
    final = step_to_finish(engine, max_steps=60, step_past=RuntimeError)
    assert set(final) == set(ids)
    assert all(PLACEHOLDER_TOKEN not in o.outputs[0].token_ids for o in final.values())
    assert_pool_whole(engine)


def test_a_sample_whose_last_token_is_in_flight_is_not_reported_finished():
    """n=2 samples drift apart under preemption: one ends on its length while its last token
    is still in flight and its sibling runs. Until that token arrives the sample is reported
    running, so a streaming client that stops at the first finish_reason gets every token."""
    words = StructuredOutputsParams(regex="[a-z]{30,60}")   # never ends before max_tokens
    mismatches = []
    for blocks in (14, 16, 18):
        engine = make_engine("tiny", async_scheduling=True, block_size=4, num_kv_blocks=blocks,
                             max_num_seqs=8, max_model_len=128)
        for i in range(4):
            engine.add_request(f"p{i} ", SamplingParams(temperature=1.0, seed=i, n=2,
                                                        max_tokens=12 + i,
                                                        structured_outputs=words))
        first_done, final = {}, {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                for c in o.outputs:
                    if c.finish_reason is not None:
                        first_done.setdefault((o.request_id, c.index), len(c.token_ids))
                if o.finished:
                    final[o.request_id] = o
        assert_pool_whole(engine)
        mismatches += [key for key, n in first_done.items()
                       if n != len(final[key[0]].outputs[key[1]].token_ids)]
    assert not mismatches


def test_a_request_that_ends_on_its_length_finishes_after_its_last_token():
    """Its length ends it when the held step is scheduled past, one call before its last token
    is known: the finish time (what the end-to-end latency metric reads) is not before it."""
    engine = make_engine("tiny", async_scheduling=True, **CONFIG)
    rid = engine.add_request("w", SamplingParams(temperature=1.0, seed=1, max_tokens=4,
                                                 structured_outputs=WORDS))
    metrics = step_to_finish(engine)[rid].metrics
    assert metrics.finished_time >= metrics.last_token_time


def test_a_schedule_that_fails_while_a_step_is_held_loses_nothing():
    """Scheduling the next step raises once while a step is held: the held step is still
    sampled and its tokens reported, so the outputs equal an undisturbed run."""
    requests = _requests("seeded")
    sync_engine, engine = _engines()
    expected = _samples(run_to_finish(sync_engine, requests))
    schedule = engine.scheduler.schedule
    calls = []

    def fail_once(*args):
        # A step in flight shows as placeholders among the running sequences' tokens.
        calls.append(any(seq.awaits_token for seq in engine.scheduler.running))
        if len(calls) == 6:
            assert calls[-1], "no step in flight to lose"
            raise RuntimeError("scheduler failed")
        return schedule(*args)

    engine.scheduler.schedule = fail_once
    ids = [engine.add_request(p, params) for p, params in requests]
    final = step_to_finish(engine, max_steps=60, step_past=RuntimeError)
    assert _samples([final[i] for i in ids]) == expected
    assert_pool_whole(engine)
    assert not engine.structured._matchers
