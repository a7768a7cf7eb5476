"""The engine core's messages: every kind round-trips through bytes, and garbage is refused."""

from __future__ import annotations

import pytest

from mini_paged_attn.engine import SamplingParams
from mini_paged_attn.engine.process.messages import (
    PAYLOADS, AbortRequest, AddRequest, CompletionDelta, EngineDead, Loading, MessageKind,
    OutputDelta, Outputs, PauseRequest, Ready, Shutdown, StepFailed, decode, encode)
from mini_paged_attn.engine.outputs import EngineStats, RequestMetrics
from mini_paged_attn.models.load_progress import LoadEvent

STATS = EngineStats(kv_blocks_total=8, kv_blocks_free=5, num_running=2, num_waiting=1)
MESSAGES = [
    AddRequest("a", None, [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4,
                                                    stop=["x"]), True),
    AddRequest("b", "hi", [4], SamplingParams(n=2, seed=1), False, final_only=True),
    AbortRequest("a"),
    PauseRequest("a", True),
    Shutdown(),
    Loading(LoadEvent("weights", 3, 10, False, 0.25)),
    Ready("tokenizer", {"vocab_size": 10}, 64, "admission", STATS),
    # Output deltas are plain tuples, laid out as OutputDelta / CompletionDelta.
    Outputs([("a", [(0, 2, "lo", [7, 8], None, -1.5, [{7: -0.5}], None),
                    (1, 0, "", [9], "stop", None, None, 9)],
              False, RequestMetrics(arrival_time=1.0, num_prompt_tokens=3), [None, {4: -1.0}]),
             ("b", [(0, 0, "", [3], None, None, None, None)], False, None, None)],
            STATS, adds_seen=2),
    StepFailed("RuntimeError: boom", ("a", "b")),
    EngineDead("the engine core died"),
]


def test_every_kind_has_one_payload_and_is_covered():
    assert set(PAYLOADS) == set(MessageKind)
    assert {m.kind for m in MESSAGES} == set(MessageKind)
    assert all(PAYLOADS[m.kind] is type(m) for m in MESSAGES)


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: m.kind.value)
def test_round_trip(message):
    back = decode(encode(message))
    assert type(back) is type(message) and back == message


def test_output_deltas_travel_as_plain_tuples_and_read_by_name():
    """No class is pickled per delta (that costs a Python call per object); the named tuples
    read what arrives."""
    outputs = next(m for m in MESSAGES if isinstance(m, Outputs))
    back = decode(encode(outputs))
    assert all(type(d) is tuple and all(type(c) is tuple for c in d[1]) for d in back.deltas)
    assert type(back.stats) is EngineStats and back.stats == STATS
    delta = OutputDelta(*back.deltas[0])
    assert delta.request_id == "a" and delta.metrics.num_prompt_tokens == 3
    first, second = (CompletionDelta(*c) for c in delta.completions)
    assert (first.suffix, first.new_logprobs, second.stop_reason) == ("lo", [{7: -0.5}], 9)
    data = encode(outputs)
    assert b"OutputDelta" not in data and b"CompletionDelta" not in data
    assert b"kv_blocks_total" not in data and b"arrival_time" not in data  # fields, no names


def test_payloads_are_frozen():
    with pytest.raises(AttributeError):
        AbortRequest("a").request_id = "b"


@pytest.mark.parametrize("data", [b"not a pickle", encode(Shutdown())[:-3],
                                  __import__("pickle").dumps(("nope", ())),
                                  __import__("pickle").dumps(("abort", ("a", "extra")))])
def test_decode_refuses_what_encode_did_not_make(data):
    with pytest.raises(ValueError, match="data"):
        decode(data)
