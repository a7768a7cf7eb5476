"""Tool calls through the chat endpoint, with the official openai client.

"required" and a named function constrain the tiny random model's noise to valid calls; "auto"
reads calls out of the text (forced here into Hermes form by a one-string choice, since noise
never writes one). Streamed calls arrive whole in one delta when the choice ends.
"""

from __future__ import annotations

import json

import pytest
from helpers.json_checks import assert_valid
from helpers.tool_specs import HERMES_CALL, MESSAGES, SCHEMAS, TOOLS

from server_harness import CHAT_GOOD, assert_error

openai = pytest.importorskip("openai", reason="the openai client (pip install .[test])")
pytest.importorskip("llguidance", reason='tool calls need pip install -e ".[structured]"')



def _check_call(call, names=tuple(SCHEMAS)) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    assert_valid(call.function.arguments, SCHEMAS[call.function.name])


def test_required_gives_valid_calls(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                       tool_choice="required", n=2, temperature=1.0, seed=2,
                                       max_tokens=160)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None and choice.message.tool_calls
        for call in choice.message.tool_calls:
            _check_call(call)
        ids = [c.id for c in choice.message.tool_calls]
        assert len(set(ids)) == len(ids)


def test_required_without_parallel_calls_gives_one(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False,
                                       temperature=1.0, seed=4, max_tokens=120)
    (call,) = r.choices[0].message.tool_calls
    _check_call(call)


def test_named_function(client):
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=1, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    _check_call(call, names=("get_time",))


def test_streamed_required_calls_arrive_whole(client):
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                            tool_choice="required", n=2, temperature=1.0,
                                            seed=6, max_tokens=160, stream=True)
    calls: dict[int, list] = {}
    reasons: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            assert not choice.delta.content      # nothing of the call leaks as text
            if choice.delta.tool_calls:
                calls.setdefault(choice.index, []).extend(choice.delta.tool_calls)
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert reasons == {0: "tool_calls", 1: "tool_calls"}
    for index, deltas in calls.items():
        assert [d.index for d in deltas] == list(range(len(deltas)))
        for d in deltas:
            _check_call(d)


def test_auto_without_a_call_is_plain_content(client):
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                           max_tokens=12)
    auto = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                          max_tokens=12, tools=TOOLS)
    assert auto.choices[0].message.content == plain.choices[0].message.content
    assert auto.choices[0].message.tool_calls is None
    assert auto.choices[0].finish_reason == plain.choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_a_hermes_call(client, stream):
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="auto",
                  max_tokens=120, extra_body={"structured_outputs": {"choice": [HERMES_CALL]}})
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls, reason, content = choice.message.tool_calls, choice.finish_reason, \
            choice.message.content
    else:
        calls, reason, content = [], None, ""
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                calls += choice.delta.tool_calls or []
                reason = choice.finish_reason or reason
    assert reason == "tool_calls" and not content
    (call,) = calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {"tz": "UTC"}


def test_a_conversation_with_tool_results_is_accepted(client):
    messages = [*MESSAGES,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather",
                                  "arguments": '{"city": "Paris", "unit": "C"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    r = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                       max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


def _adds(server) -> int:
    return server.async_client.client._core.adds_seen


BAD = [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "none"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strnig"}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tools[0].function.parameters"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {
        "name": "g", "parameters": {"type": "object", "properties": {"x": {"type": "nope"}}}}}],
      "tool_choice": "required"}, "tools[1].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name"),
    ({"tools": [TOOLS[1], TOOLS[1]]}, "tools[1].function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
]


@pytest.mark.parametrize("extra, param", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_tool_requests_are_400s_and_nothing_is_queued(server, extra, param):
    before = _adds(server)
    with server.client() as c:
        assert_error(c.post("/v1/chat/completions", json={**CHAT_GOOD, **extra}), 400, param)
    assert _adds(server) == before
