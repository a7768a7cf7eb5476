"""The two EngineClients over the tiny model: the same greedy outputs, aborts that free the
pool, a paused request that computes nothing until resumed, failed steps that fail only their requests, death that says why, and no child process
left after shutdown."""

from __future__ import annotations

import contextlib
import time

import pytest

from helpers.engine_clients import (Collector, run_requests, wait_pool_free)
from mini_paged_attn.engine import (LLM, EngineDeadError, InprocEngineClient, MPEngineClient,
                                    SamplingParams)

LLM_KWARGS = dict(device="cpu", dtype="float32", block_size=16, num_kv_blocks=64,
                  max_num_seqs=16, max_model_len=256, seed=0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = ["The paged cache", [7, 8, 9, 10], "héllo wörld ✓ 你好"]


@pytest.fixture(scope="module")
def mp_client():
    client = MPEngineClient("tiny", LLM_KWARGS, start_timeout=120)
    yield client
    client.shutdown()
    assert client.process.exitcode is not None


@pytest.fixture()
def inproc_client():
    client = InprocEngineClient(LLM("tiny", **LLM_KWARGS).engine)
    yield client
    client.shutdown()


def _texts(outputs):
    return [[(c.text, list(c.token_ids), c.finish_reason) for c in o.outputs] for o in outputs]


def test_inproc_and_mp_clients_give_the_same_outputs(inproc_client, mp_client):
    stop_cases = [(p, GREEDY) for p in PROMPTS] + [
        (PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=7,
                                    ignore_eos=True)),
        (PROMPTS[1], SamplingParams(temperature=0.9, max_tokens=8, n=2, seed=3,
                                    presence_penalty=1.0, frequency_penalty=0.5,
                                    repetition_penalty=1.3, logit_bias={5: 2.0},
                                    min_tokens=2)),
        (PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                    prompt_logprobs=2)),
        (PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                    logprobs=2))]
    want = run_requests(inproc_client, stop_cases, "in")
    # A stop string taken from the greedy text: the MP core then makes the text itself.
    stop = want[0].outputs[0].text[3:5]
    cases = stop_cases + [(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=10,
                                                      ignore_eos=True, stop=[stop]))]
    want += run_requests(inproc_client, cases[-1:], "in-stop")
    got = run_requests(mp_client, cases, "mp")
    assert _texts(got) == _texts(want)
    # Logprobs to float tolerance: the batches of the two runs differ.
    for g, w in zip(got[-2].outputs[0].logprobs, want[-2].outputs[0].logprobs):
        assert g.keys() == w.keys() and list(g.values()) == pytest.approx(list(w.values()),
                                                                          abs=1e-4)
    assert want[-1].outputs[0].finish_reason == "stop"
    assert [o.prompt for o in got[:3]] == [o.prompt for o in want[:3]]
    # The prompt logprobs, and the finished outputs' metrics, arrive whole.
    assert got[-3].prompt_logprobs[0] is None and len(got[-3].prompt_logprobs) == 4
    for g, w in zip(got[-3].prompt_logprobs[1:], want[-3].prompt_logprobs[1:]):
        assert g.keys() == w.keys() and list(g.values()) == pytest.approx(list(w.values()),
                                                                          abs=1e-4)
    for g, w in zip(got, want):
        assert (g.metrics.num_prompt_tokens, g.metrics.num_generation_tokens) == \
            (w.metrics.num_prompt_tokens, w.metrics.num_generation_tokens)
        assert g.metrics.finished_time is not None and g.metrics.last_token_time is not None


@pytest.mark.parametrize("which", ["inproc", "mp"])
def test_abort_frees_the_pool_and_stops_the_outputs(which, request):
    client = request.getfixturevalue(f"{which}_client")
    collector = Collector()
    client.set_output_handler(collector)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    client.add_request("long", [5] * 20, long)
    collector.wait_for(lambda: "long" in collector.outputs, "a first output")
    assert client.abort_request("long")
    assert not client.abort_request("long")       # no longer live
    wait_pool_free(client)
    assert "long" not in collector.final or collector.final["long"].outputs[0].finish_reason \
        == "abort"
    client.set_output_handler(None)


def _settled(read, what: str, interval_s: float = 0.3):
    """``read()`` once two reads ``interval_s`` apart agree (a paused request's outputs stop)."""
    deadline = time.monotonic() + 30
    before = read()
    while True:
        time.sleep(interval_s)
        now = read()
        if now == before:
            return now
        assert time.monotonic() < deadline, f"{what} never settled"
        before = now


@pytest.mark.parametrize("which", ["inproc", "mp"])
def test_a_paused_request_computes_nothing_until_resumed(which, request):
    client = request.getfixturevalue(f"{which}_client")
    collector = Collector()
    client.set_output_handler(collector)
    # Few tokens: a loaded machine decodes a handful a second in the engine process.
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    client.add_request("paused", [5] * 20, long)
    collector.wait_for(lambda: "paused" in collector.outputs, "a first output")
    assert client.pause_request("paused")
    with pytest.raises(ValueError, match="paused"):
        client.pause_request("paused", "yes")

    def tokens():
        return len(collector.outputs["paused"][-1].outputs[0].token_ids)

    held = _settled(tokens, "the paused request's tokens")
    assert held < 60 and "paused" not in collector.final
    if which == "inproc":       # the core waits for a message instead of stepping
        _settled(lambda: client.stats().num_steps, "the step count")
    assert client.pause_request("paused", False)
    collector.wait_for(lambda: "paused" in collector.final, "the resumed request's end")
    assert len(collector.final["paused"].outputs[0].token_ids) == 60
    assert not client.pause_request("paused")        # finished: no longer live
    wait_pool_free(client)
    client.set_output_handler(None)


@pytest.mark.parametrize("which", ["inproc", "mp"])
def test_bad_requests_fail_before_anything_is_sent(which, request):
    client = request.getfixturevalue(f"{which}_client")
    with pytest.raises(ValueError, match="max_model_len"):
        client.add_request("too-long", [5] * 250, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="prompt"):
        client.add_request("empty", [], SamplingParams())
    with pytest.raises(ValueError, match="request_id"):
        client.add_request(7, [5], SamplingParams())
    assert client.stats().num_waiting == 0


@contextlib.contextmanager
def _failing_client(factory: str):
    """An MPEngineClient whose child builds its engine with ``factory`` (helpers.engine_clients)
    and a Collector as its handler; shut down after."""
    client = MPEngineClient("tiny", LLM_KWARGS, start_timeout=120,
                            engine_factory=f"helpers.engine_clients:{factory}")
    collector = Collector()
    client.set_output_handler(collector)
    try:
        yield client, collector
    finally:
        client.shutdown()


def test_a_failed_step_fails_its_requests_once_and_later_requests_run():
    """The core aborts the requests of a failed step itself, so it does not retry the step."""
    with _failing_client("poisoned_engine") as (client, collector):
        client.add_request("poison-1", [5, 6, 7, 8], SamplingParams(max_tokens=4))
        collector.wait_for(lambda: collector.failures, "the failure")
        assert collector.failures[0][1] == ["poison-1"]
        assert "poison request" in collector.failures[0][0]
        inproc = InprocEngineClient(LLM("tiny", **LLM_KWARGS).engine)
        want = run_requests(inproc, [(p, GREEDY) for p in PROMPTS[:2]])
        inproc.shutdown()
        got = run_requests(client, [(p, GREEDY) for p in PROMPTS[:2]])
        client.set_output_handler(collector)
        assert _texts(got) == _texts(want)
        assert len(collector.failures) == 1 and client.dead_reason is None
        wait_pool_free(client)


def test_a_dead_engine_process_says_why_and_refuses_requests():
    with _failing_client("crashing_engine") as (client, collector):
        client.add_request("crash-1", [5, 6, 7], SamplingParams(max_tokens=4))
        collector.wait_for(lambda: collector.dead is not None, "the death")
        assert "exit code 3" in collector.dead and client.dead_reason == collector.dead
        with pytest.raises(EngineDeadError, match="exit code 3"):
            client.add_request("after", [5], SamplingParams())
    assert client.process.exitcode == 3


def test_too_many_failed_steps_kill_the_inproc_core():
    engine = LLM("tiny", **LLM_KWARGS).engine
    engine.step = _always_fail  # the aborts of the first failure are never applied either
    client = InprocEngineClient(engine, max_consecutive_failures=2)
    collector = Collector()
    client.set_output_handler(collector)
    client.add_request("a", [5, 6], SamplingParams(max_tokens=2))
    collector.wait_for(lambda: collector.dead is not None, "the death")
    assert "2 failed steps in a row" in collector.dead
    assert collector.failed_ids() == {"a"}       # failed once, then the retry killed the core
    with pytest.raises(EngineDeadError):
        client.add_request("b", [5], SamplingParams())
    client.shutdown()


def _always_fail(overlap=None):
    raise RuntimeError("injected")


def test_the_engine_process_is_gone_after_shutdown():
    client = MPEngineClient("tiny", LLM_KWARGS, start_timeout=120)
    collector = Collector()
    client.set_output_handler(collector)
    client.add_request("live", [5] * 8, SamplingParams(max_tokens=200, ignore_eos=True))
    pid = client.process.pid
    client.shutdown()
    assert client.process.exitcode == 0
    assert collector.dead == "the engine core was shut down"
    deadline = time.monotonic() + 10
    while _alive(pid):
        assert time.monotonic() < deadline, "the engine process outlived shutdown"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
