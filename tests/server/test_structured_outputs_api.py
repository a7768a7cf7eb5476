"""response_format and structured_outputs through the server, with the official openai client.

The tiny random model writes noise, so a choice that parses and validates shows the grammar at
work; streamed or not, n > 1, both endpoints. Bad constraints are 400s naming the parameter,
and nothing reaches the engine.
"""

from __future__ import annotations

import json
import re
import sys

import pytest
from helpers.json_checks import assert_valid

from server_harness import API_KEY, CHAT_GOOD, GOOD, assert_error, served

openai = pytest.importorskip("openai", reason="the openai client (pip install .[test])")
pytest.importorskip("llguidance", reason='structured outputs need pip install -e ".[structured]"')

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 5},
                         "size": {"type": "integer", "minimum": 0, "maximum": 999},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "size", "tags"], "additionalProperties": False}
JSON_SCHEMA_FORMAT = {"type": "json_schema",
                      "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
MAX_TOKENS = 80


def _adds(server) -> int:
    """Requests the engine has been sent so far."""
    return server.async_client.client._core.adds_seen


def _stream_texts(stream, chat: bool) -> tuple[dict[int, str], dict[int, str]]:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            piece = (choice.delta.content if chat else choice.text) or ""
            texts[choice.index] = texts.get(choice.index, "") + piece
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons


def test_chat_json_schema_every_choice_validates(client):
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "describe a thing"}], n=3,
        temperature=1.0, seed=3, max_tokens=MAX_TOKENS, response_format=JSON_SCHEMA_FORMAT)
    assert len(r.choices) == 3
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice
        assert_valid(choice.message.content, SCHEMA)
    assert r.usage.completion_tokens > 0


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streamed_json_schema_n2(client, chat):
    kwargs = dict(model="tiny", n=2, temperature=1.0, seed=11, max_tokens=MAX_TOKENS,
                  stream=True, response_format=JSON_SCHEMA_FORMAT)
    if chat:
        stream = client.chat.completions.create(
            messages=[{"role": "user", "content": "stream it"}], **kwargs)
    else:
        kwargs["extra_body"] = {"response_format": kwargs.pop("response_format")}
        stream = client.completions.create(prompt="A thing:", **kwargs)
    texts, reasons = _stream_texts(stream, chat)
    assert sorted(texts) == [0, 1] and set(reasons.values()) == {"stop"}
    for text in texts.values():
        assert_valid(text, SCHEMA)


def test_json_object(client, llm):
    close = llm.engine.tokenizer.encode("}", add_special_tokens=False)
    assert len(close) == 1
    # Noise would write keys for a long time: a bias towards "}" (still applied) ends it.
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "json please"}], temperature=1.0,
        seed=0, max_tokens=MAX_TOKENS, response_format={"type": "json_object"},
        logit_bias={str(close[0]): 8})
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict)


def test_text_format_is_unconstrained(client):
    plain = client.completions.create(model="tiny", prompt="same", max_tokens=8, temperature=0)
    text = client.completions.create(model="tiny", prompt="same", max_tokens=8, temperature=0,
                                     extra_body={"response_format": {"type": "text"}})
    assert text.choices[0].text == plain.choices[0].text


@pytest.mark.parametrize("structured, check", [
    ({"regex": "[a-z]{3}@[0-9]{2}"}, lambda t: re.fullmatch("[a-z]{3}@[0-9]{2}", t)),
    ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"grammar": 'start: "[" ("x" | "yy")+ "]"'}, lambda t: re.fullmatch(r"\[(x|yy)+\]", t)),
])
def test_structured_outputs_extension(client, structured, check):
    r = client.completions.create(model="tiny", prompt="pick", n=2, temperature=1.0, seed=5,
                                  max_tokens=40, extra_body={"structured_outputs": structured})
    for choice in r.choices:
        assert choice.finish_reason == "stop" and check(choice.text), choice.text


BAD = [
    ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strnig"}}}}, "response_format.json_schema.schema"),
    ("completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "(("}}}},
     "response_format.json_schema.schema"),
    ("chat/completions", {"response_format": {"type": "json_schema"}}, "response_format"),
    ("chat/completions", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("completions", {"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ("completions", {"structured_outputs": {"grammar": "start: nowhere"}},
     "structured_outputs.grammar"),
    ("completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("completions", {"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ("completions", {"structured_outputs": {"regex": "a"},
                     "response_format": {"type": "json_object"}}, "structured_outputs"),
]


@pytest.mark.parametrize("endpoint, extra, param", BAD, ids=[b[2] for b in BAD])
def test_bad_constraints_are_400s_and_nothing_is_queued(server, endpoint, extra, param):
    body = {**(GOOD if endpoint == "completions" else CHAT_GOOD), **extra}
    before = _adds(server)
    with server.client() as c:
        assert_error(c.post(f"/v1/{endpoint}", json=body), 400, param)
    assert _adds(server) == before


def test_without_llguidance_the_400_says_how_to_install(server, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)     # its import fails
    before = _adds(server)
    with server.client() as c:
        err = assert_error(c.post("/v1/chat/completions", json={
            **CHAT_GOOD, "response_format": {"type": "json_object"}}), 400, "response_format")
    assert 'pip install -e ".[structured]"' in err["message"]
    assert _adds(server) == before


def test_engine_in_a_child_process(model_dir):
    """The constraint travels to the engine's process, which compiles it for its own copy of
    the tokenizer; the client there rebuilds the text without losing its last character."""
    import httpx

    from mini_paged_attn.engine import MPEngineClient

    small = {"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}},
             "required": ["pet"], "additionalProperties": False}
    core = MPEngineClient(str(model_dir), dict(device="cpu", block_size=16, num_kv_blocks=64,
                                               max_num_seqs=8, max_model_len=256, seed=0),
                          start_timeout=300)
    try:
        with served(core, api_key=API_KEY) as server, httpx.Client(
                base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"},
                timeout=120) as c:
            r = c.post("/v1/chat/completions", json={
                **CHAT_GOOD, "max_tokens": 40, "temperature": 1.0, "seed": 9, "n": 2,
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "pet", "schema": small}}}).json()
            for choice in r["choices"]:
                assert choice["finish_reason"] == "stop"
                assert_valid(choice["message"]["content"], small)
    finally:
        core.shutdown()


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_that_cannot_finish_is_a_500(server, llm, stream):
    # The grammar allows only "a", a stop token that min_tokens bans: the engine ends the
    # choice with reason "error" rather than a broken output; the server answers 500 (an error
    # event once streaming) and goes on serving. (A regex: a choice shorter than min_tokens is
    # refused before admission.)
    (a,) = llm.engine.tokenizer.encode("a", add_special_tokens=False)
    body = {**CHAT_GOOD, "max_tokens": 8, "min_tokens": 4, "temperature": 0, "stream": stream,
            "stop_token_ids": [a], "structured_outputs": {"regex": "a"}}
    with server.client() as c:
        r = c.post("/v1/chat/completions", json=body)
        if stream:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"       # after the error event, as every stream ends
            assert json.loads(events[-2])["error"]["code"] == "internal_error"
        else:
            assert_error(r, 500)
        assert c.post("/v1/chat/completions", json=CHAT_GOOD).status_code == 200
