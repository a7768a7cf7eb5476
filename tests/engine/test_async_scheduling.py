"""Asynchronous scheduling (``EngineConfig.async_scheduling``): step t + 1 is scheduled and
launched before step t's tokens reach the host. Every feature must give the same tokens as the
synchronous engine (greedy and seeded samples), leave the pool whole, and keep the prefix cache
as useful (blocks whose last token was still on the device are registered once it is known).
The pool starts NaN (``make_engine``): a step reading a slot nothing wrote shows in the output.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.engines import (assert_pool_whole, make_engine, run_through_failures, run_to_finish,
                             step_to_finish)

from mini_paged_attn.core.request import PLACEHOLDER_TOKEN
from mini_paged_attn.engine import SamplingParams
from mini_paged_attn.engine.config import EngineConfig

VOCAB = 96


def _prompts(n: int, seed: int = 0, shared: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    head = torch.randint(3, VOCAB, (shared,), generator=gen).tolist()
    return [head + torch.randint(3, VOCAB, (int(torch.randint(1, 14, (1,), generator=gen)),),
                                 generator=gen).tolist() for _ in range(n)]


def _both(model_dir, requests, **config):
    """Final outputs of ``requests`` from a synchronous and an asynchronous engine."""
    results = []
    for async_scheduling in (False, True):
        engine = make_engine(model_dir, async_scheduling=async_scheduling, **config)
        assert engine._async is async_scheduling
        results.append(run_to_finish(engine, requests))
        assert_pool_whole(engine)
    return results


def _samples(outputs) -> list:
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outputs]


def test_the_default_is_on_with_cuda_only():
    assert EngineConfig().async_scheduling is None
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling="yes")


PARAMS = {
    "greedy, eos": dict(temperature=0, max_tokens=12),
    "seeded": dict(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True),
    "stop tokens": dict(temperature=1.0, seed=3, max_tokens=16, stop_token_ids=[5, 9, 17, 40]),
    "logprobs": dict(temperature=0.8, seed=1, max_tokens=6, logprobs=3, ignore_eos=True),
    "penalties, min_tokens": dict(temperature=1.0, seed=2, max_tokens=8, min_tokens=5,
                                  presence_penalty=0.5, frequency_penalty=0.3,
                                  repetition_penalty=1.2, stop_token_ids=[4, 6, 8]),
    "n=3": dict(temperature=1.0, seed=4, max_tokens=5, n=3, ignore_eos=True),
    "prompt logprobs": dict(temperature=0, max_tokens=4, prompt_logprobs=2, ignore_eos=True),
    "max_tokens 1": dict(temperature=0, max_tokens=1, ignore_eos=True),
}


@pytest.mark.parametrize("name", PARAMS)
def test_same_tokens_as_the_synchronous_engine(tiny_model_factory, name):
    model = tiny_model_factory("llama")
    params = SamplingParams(**PARAMS[name])
    # Seeded rows draw from their own generators: a batch of them is reproducible.
    requests = [(p, params) for p in _prompts(6, shared=9)]
    sync, asyn = _both(model, requests, block_size=4, max_num_seqs=4,
                       max_num_batched_tokens=16)
    assert _samples(asyn) == _samples(sync)
    if params.logprobs is not None:
        for a, b in zip(asyn, sync):
            for ca, cb in zip(a.outputs, b.outputs):
                assert ca.cumulative_logprob == pytest.approx(cb.cumulative_logprob, abs=1e-5)
    if params.prompt_logprobs is not None:
        assert [o.prompt_logprobs for o in asyn] == [o.prompt_logprobs for o in sync]


def test_preemption_and_chunked_prefill_on_a_small_pool(tiny_model_factory):
    model = tiny_model_factory("llama")
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    requests = [(p, greedy) for p in _prompts(8, seed=1, shared=6)]
    config = dict(block_size=4, num_kv_blocks=24, max_num_seqs=6, max_num_batched_tokens=8)
    sync, asyn = _both(model, requests, **config)
    assert _samples(asyn) == _samples(sync)


def test_a_stop_string_ends_the_sample_as_in_the_synchronous_engine(tiny_model_factory):
    model = tiny_model_factory("llama")
    sync_engine = make_engine(model, async_scheduling=False)
    text = run_to_finish(sync_engine, [([7, 8, 9], SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True))])[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
    sync, asyn = _both(model, [([7, 8, 9], params)])
    assert _samples(asyn) == _samples(sync)
    assert asyn[0].outputs[0].text == sync[0].outputs[0].text
    assert asyn[0].outputs[0].finish_reason == "stop"


def test_generated_blocks_are_cached_once_their_last_token_is_known(tiny_model_factory):
    """A follow-up prompt made of a first answer hits the blocks the answer filled, including
    those whose last token was a placeholder when they were allocated."""
    model = tiny_model_factory("llama")
    greedy = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)
    prompt = _prompts(1, seed=5)[0]
    rates = []
    for async_scheduling in (False, True):
        engine = make_engine(model, async_scheduling=async_scheduling, block_size=4)
        first = run_to_finish(engine, [(prompt, greedy)])[0]
        follow = prompt + list(first.outputs[0].token_ids) + [11, 12]
        second = run_to_finish(engine, [(follow, SamplingParams(max_tokens=2, temperature=0))])
        rates.append((second[0].metrics.num_cached_tokens, second[0].outputs[0].token_ids))
        assert_pool_whole(engine)
    assert rates[1] == rates[0]
    assert rates[0][0] >= 4 * ((len(prompt) + 23) // 4) - 4


def test_the_next_step_runs_before_the_tokens_are_read(tiny_model_factory):
    engine = make_engine(tiny_model_factory("llama"), async_scheduling=True)
    request = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=4,
                                                           ignore_eos=True))
    assert engine.step() == []              # the prompt's step is in flight, nothing read
    step = engine._in_flight
    assert step is not None and step.where is None
    outputs = engine.step()                 # launches the next, then reads the first token
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1]
    seq = engine.scheduler.requests[request].sequences[0]
    assert PLACEHOLDER_TOKEN not in seq.token_ids
    lengths = [1]
    while engine.has_unfinished_requests():
        lengths += [len(o.outputs[0].token_ids) for o in engine.step()]
    assert lengths == [1, 2, 3, 4]
    assert_pool_whole(engine)


def test_aborts_while_a_step_is_in_flight(tiny_model_factory):
    engine = make_engine(tiny_model_factory("llama"), async_scheduling=True, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in _prompts(4, seed=2)]
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None
    assert engine.abort_request(ids[1]) and engine.abort_request(ids[3])
    final = step_to_finish(engine)
    assert {r: final[r].outputs[0].finish_reason for r in ids} == {
        ids[0]: "length", ids[1]: "abort", ids[2]: "length", ids[3]: "abort"}
    assert all(len(final[r].outputs[0].token_ids) == 30 for r in (ids[0], ids[2]))
    assert_pool_whole(engine)


def test_a_failed_step_keeps_the_tokens_of_the_step_in_flight(tiny_model_factory):
    """The step after an in-flight one fails: the in-flight tokens are reported by the next
    step, nothing is lost or leaked, and the tokens equal an undisturbed run."""
    model = tiny_model_factory("llama")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = _prompts(3, seed=3)
    expected = _samples(run_to_finish(make_engine(model, async_scheduling=False),
                                      [(p, params) for p in prompts]))
    engine = make_engine(model, async_scheduling=True)
    outputs = run_through_failures(engine, [(p, params) for p in prompts], max_steps=100)
    assert _samples(outputs) == expected
    assert_pool_whole(engine)


def test_structured_outputs_match_the_synchronous_engine():
    pytest.importorskip("llguidance")
    from mini_paged_attn.engine import LLMEngine
    from mini_paged_attn.engine.structured import StructuredOutputsParams

    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                      "maximum": 99},
                                                "b": {"enum": ["x", "y"]}},
              "required": ["a", "b"], "additionalProperties": False}
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=60,
                             structured_outputs=StructuredOutputsParams(json=schema))
              for s in range(4)]
    params.append(SamplingParams(temperature=1.0, seed=9, max_tokens=12, ignore_eos=True))
    results = []
    for async_scheduling in (False, True):
        engine = LLMEngine.from_model("tiny", dtype="float32", device="cpu", config=EngineConfig(
            block_size=4, num_kv_blocks=128, max_num_seqs=8, max_model_len=128,
            async_scheduling=async_scheduling))
        # The plain request runs first (in flight when asynchronous); the constrained ones
        # join it, and their first masks need its step's tokens.
        plain = engine.add_request("hi", params[-1])
        engine.step()
        engine.step()
        assert (engine._in_flight is not None) is async_scheduling
        final = {}
        constrained = [engine.add_request("hi", p) for p in params[:-1]]
        held = 0
        while engine.has_unfinished_requests():
            final.update((o.request_id, o) for o in engine.step() if o.finished)
            held += engine._held is not None    # grammars hold the sampling to the next call
        assert (held > 0) is async_scheduling
        outputs = [final[i] for i in constrained + [plain]]
        results.append(_samples(outputs))
        texts = [o.outputs[0].text for o in outputs[:4]]
        assert_pool_whole(engine)
        assert not engine.structured._matchers
    assert results[1] == results[0]
    assert [r[0][1] for r in results[1][:4]] == ["stop"] * 4, texts
    assert all(json.loads(t)["b"] in ("x", "y") for t in texts)
