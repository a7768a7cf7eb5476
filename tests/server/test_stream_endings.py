"""Whatever the model writes and whatever fails, a response ends cleanly.

The engine's outputs are rewritten here (``_ScriptedEngine``: the real engine, whose outputs'
text is replaced by a script), so the tiny random model "writes" hostile text: a tool call
nested 1,100 levels deep. A streamed response always ends with ``data: [DONE]``, after an
``{"error": ...}`` event when something failed once it had started.
"""

from __future__ import annotations

import dataclasses
import json
import threading

import httpx
import pytest
from helpers.tool_specs import MESSAGES, TOOLS

from mini_paged_attn.engine.process.client import InprocEngineClient
from mini_paged_attn.engine.tools.parsers import (MAX_JSON_DEPTH, PARSERS, ToolCallMode,
                                               json_depth)
from mini_paged_attn.server.formats import ResponseFormat
from server_harness import API_KEY, CHAT_GOOD, GOOD, TIMEOUT_S, served

DEEP_CALL = "<tool_call>" + "[" * 1100


class _ScriptedEngine:
    """The real engine with every output's text replaced by ``script`` (the tokens stay the
    model's), and steps that fail on demand (``fail_steps``: how many of the next steps
    raise, after ``steps_before_failing`` good ones)."""

    def __init__(self, engine):
        self._engine = engine
        self.script: str | None = None
        self.fail_steps = 0
        self.steps_before_failing = 0
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self, overlap=None):
        with self._lock:
            if self.fail_steps and self.steps_before_failing == 0:
                self.fail_steps -= 1
                raise RuntimeError("injected step failure")
            self.steps_before_failing = max(0, self.steps_before_failing - 1)
        outputs = self._engine.step(overlap)
        if self.script is None:
            return outputs
        return [dataclasses.replace(out, outputs=[dataclasses.replace(c, text=self.script)
                                                  for c in out.outputs])
                for out in outputs]


@pytest.fixture(scope="module")
def engine(llm):
    return _ScriptedEngine(llm.engine)


@pytest.fixture(scope="module")
def server(engine):
    client = InprocEngineClient(engine, max_consecutive_failures=1000)
    try:
        with served(client, api_key=API_KEY) as s:
            yield s
    finally:
        client.shutdown()


@pytest.fixture
def script(engine):
    def set_script(text: str | None) -> None:
        engine.script = text
    yield set_script
    engine.script = None
    engine.fail_steps = 0


def _events(server, path: str, body: dict) -> list[str]:
    """The ``data:`` payloads of a streamed response, in order."""
    with server.client() as c, c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]


CHAT_TOOLS = {**CHAT_GOOD, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto",
              "max_tokens": 3}


# ---- the parsers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text", [DEEP_CALL, DEEP_CALL + "]" * 1100 + "</tool_call>",
                                  '<tool_call>{"name": "f", "arguments": ' + "[" * 5000,
                                  '<tool_call>{"name": "f", "arguments": "' + "[" * 5000 + '"}'])
def test_hermes_reads_deep_text_as_content(text):
    content, calls = PARSERS["hermes"].extract(text)
    assert content == text and calls == []


def test_llama3_json_and_required_read_deep_text_as_content():
    deep = '{"name": "f", "parameters": ' + "{\"a\": " * 3000
    assert PARSERS["llama3_json"].extract(deep) == (deep, [])
    assert ToolCallMode("required").extract("[" * 3000 + "]" * 3000, "stop")[1] == []
    assert ToolCallMode("required").extract('{"name": "f"}', "stop")[1] == []


def test_calls_up_to_the_depth_cap_are_read():
    args = "[" * (MAX_JSON_DEPTH - 2) + "]" * (MAX_JSON_DEPTH - 2)
    text = f'<tool_call>{{"name": "f", "arguments": {{"a": {args}}}}}</tool_call>'
    (call,) = PARSERS["hermes"].extract(text)[1]
    assert json.loads(call.arguments) == {"a": json.loads(args)}


def test_json_depth_skips_strings():
    assert json_depth('{"a": "[[[{{{\\"[[["}') == 1
    assert json_depth("]]]" + "[" * 7) == 7
    assert json_depth("no json") == 0


# ---- through the server ------------------------------------------------------------------------
def test_a_deep_tool_call_is_content_not_a_500(server, script):
    script(DEEP_CALL)
    with server.client() as c:
        r = c.post("/v1/chat/completions", json=CHAT_TOOLS)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["content"] == DEEP_CALL and not message.get("tool_calls")


def test_a_streamed_deep_tool_call_ends_with_done(server, script):
    script(DEEP_CALL)
    events = _events(server, "/v1/chat/completions", CHAT_TOOLS)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in chunk for chunk in chunks)
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    assert text == DEEP_CALL


@pytest.mark.parametrize("path, body", [("/v1/completions", {**GOOD, "max_tokens": 6}),
                                        ("/v1/chat/completions", {**CHAT_GOOD, "max_tokens": 6})])
def test_a_chunk_that_cannot_be_made_ends_the_stream_with_an_error_and_done(
        server, monkeypatch, caplog, path, body):
    original = ResponseFormat.chunk

    def broken_chunk(self, index, comp, **kwargs):
        # The finishing chunk: always made, however many steps' outputs a chunk carries.
        if comp.finish_reason is not None:
            raise RuntimeError("chunk bug")
        return original(self, index, comp, **kwargs)

    monkeypatch.setattr(ResponseFormat, "chunk", broken_chunk)
    with caplog.at_level("ERROR", "mini_paged_attn.server"):
        events = _events(server, path, {**body, "ignore_eos": True})
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["type"] == "server_error" and "chunk bug" not in err["message"]
    error_id = err["message"].rsplit(" ", 1)[1].rstrip(")")
    assert any(error_id in rec.getMessage() and rec.exc_info for rec in caplog.records)
    server.wait_all_free()


def test_an_engine_failure_mid_stream_ends_with_an_error_and_done(server, engine, caplog):
    engine.steps_before_failing, engine.fail_steps = 2, 1
    with caplog.at_level("ERROR", "mini_paged_attn.server"):
        events = _events(server, "/v1/completions", {**GOOD, "max_tokens": 20, "ignore_eos": True})
    engine.fail_steps = 0
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "internal_error" and "injected" not in err["message"]
    error_id = err["message"].rsplit(" ", 1)[1].rstrip(")")
    logged = [rec.getMessage() for rec in caplog.records if error_id in rec.getMessage()]
    assert logged and "injected step failure" in logged[0]
    server.wait_all_free()


def test_an_engine_failure_before_the_first_token_is_a_logged_500(server, engine, caplog):
    engine.steps_before_failing, engine.fail_steps = 0, 1
    with caplog.at_level("ERROR", "mini_paged_attn.server"), server.client() as c:
        r = c.post("/v1/completions", json=GOOD)
    engine.fail_steps = 0
    assert r.status_code == 500
    error_id = r.json()["error"]["message"].rsplit(" ", 1)[1].rstrip(")")
    assert any(error_id in rec.getMessage() and "injected step failure" in rec.getMessage()
               for rec in caplog.records)
    with server.client() as c:
        assert c.post("/v1/completions", json=GOOD).status_code == 200


def test_the_server_still_serves(server):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as c:
        assert c.get("/health").status_code == 200
    server.wait_all_free()
