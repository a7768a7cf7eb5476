"""Small requests that ask for huge responses or huge work, through the real server.

A request may not ask for more log-probability entries than the server's cap (a 400 naming the
field, before anything is queued), a prompt too long for the context is refused from its byte
length before it is tokenized, error messages quote a bounded piece of what the client sent,
and a big response body is built off the event loop and sent in pieces.
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from mini_paged_attn.engine.process.client import InprocEngineClient
from mini_paged_attn.server import bodies
from mini_paged_attn.server.formats import ResponseFormat
from mini_paged_attn.server.limits import ServerLimits
from mini_paged_attn.server.prompt_bytes import check_prompt_bytes, prompt_byte_cap
from server_harness import CHAT_GOOD, GOOD, MODEL_NAME, TIMEOUT_S, assert_error, served

HEALTH_TIMEOUT_S = 5.0
LIMITS = ServerLimits(max_response_logprob_entries=2000, max_logprobs=8)


class _Counting:
    """The real engine's client with its add_request and tokenizer calls counted."""

    def __init__(self, client):
        self._client = client
        self.added = 0
        self.tokenized = 0
        self.tokenizer = _CountingTokenizer(self)

    def __getattr__(self, name):
        return getattr(self._client, name)

    def add_request(self, *args, **kwargs):
        self.added += 1
        return self._client.add_request(*args, **kwargs)


class _CountingTokenizer:
    def __init__(self, owner: _Counting):
        self._owner = owner

    def __getattr__(self, name):
        return getattr(self._owner._client.tokenizer, name)

    def encode(self, *args, **kwargs):
        self._owner.tokenized += 1
        return self._owner._client.tokenizer.encode(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self._owner.tokenized += 1
        return self._owner._client.tokenizer.apply_chat_template(*args, **kwargs)


@pytest.fixture(scope="module")
def counting(llm):
    client = InprocEngineClient(llm.engine)
    yield _Counting(client)
    client.shutdown()


@pytest.fixture(scope="module")
def server(counting):
    with served(counting, limits=LIMITS) as s:
        yield s


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as c:
        yield c


def _refused_before_queueing(counting, http, path, body, param, *, tokenized=None):
    added, before = counting.added, counting.tokenized
    err = assert_error(http.post(path, json=body), 400, param)
    assert counting.added == added, "the request was queued"
    if tokenized is not None:
        assert counting.tokenized - before == tokenized
    return err


# ---- the response's size ----------------------------------------------------------------------
AMPLIFIED = [
    # 2 prompts x 40 tokens, n=3, prompt_logprobs=8: 2 x 3 x 40 x 9 = 2160 entries
    ("/v1/completions", {**GOOD, "prompt": [[5] * 40, [6] * 40], "n": 3, "prompt_logprobs": 8},
     "prompt_logprobs"),
    # echo + logprobs repeat the prompt's logprobs in every choice: 4 x 100 x 6 + output
    ("/v1/completions", {**GOOD, "prompt": [7] * 100, "n": 4, "echo": True, "logprobs": 5},
     "echo"),
    # the output side: n=4 x 100 tokens x 6
    ("/v1/completions", {**GOOD, "n": 4, "max_tokens": 100, "logprobs": 5}, "logprobs"),
    # chat: n=12 x 20 tokens x 9
    ("/v1/chat/completions", {**CHAT_GOOD, "n": 12, "max_tokens": 20, "logprobs": True,
                              "top_logprobs": 8}, "top_logprobs"),
]


@pytest.mark.parametrize("path, body, param", AMPLIFIED, ids=[a[2] for a in AMPLIFIED])
def test_a_response_over_the_logprob_entry_cap_is_a_400(counting, http, path, body, param):
    err = _refused_before_queueing(counting, http, path, body, param)
    assert str(LIMITS.max_response_logprob_entries) in err["message"]


def test_chat_without_max_tokens_counts_the_room_left(counting, http):
    """No max_tokens: the completion may take the whole context, and the cap counts it so."""
    body = {**CHAT_GOOD, "logprobs": True, "top_logprobs": 8, "n": 2}
    del body["max_tokens"]
    _refused_before_queueing(counting, http, "/v1/chat/completions", body, "top_logprobs")


def test_a_response_under_the_cap_is_served(http):
    r = http.post("/v1/completions", json={**GOOD, "prompt": [5] * 20, "n": 2,
                                           "prompt_logprobs": 8, "max_tokens": 3})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert len(choice["prompt_logprobs"]) == 20


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {**CHAT_GOOD, "logprobs": True, "top_logprobs": 9}, "top_logprobs"),
    ("/v1/completions", {**GOOD, "prompt_logprobs": 9}, "prompt_logprobs"),
])
def test_max_logprobs_caps_the_alternatives(counting, http, path, body, param):
    err = _refused_before_queueing(counting, http, path, body, param)
    assert "at most 8" in err["message"]


def test_response_caps_are_validated():
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_response_logprob_entries"):
            ServerLimits(max_response_logprob_entries=bad)
    assert ServerLimits().max_logprobs == 20


# ---- prompts too long for the context, from their bytes ------------------------------------------
def test_a_prompt_over_the_byte_cap_is_refused_before_tokenizing(server, counting, http):
    cap = server.app.state.served.max_prompt_bytes
    assert cap is not None
    err = _refused_before_queueing(counting, http, "/v1/completions",
                                   {**GOOD, "prompt": "hello " * (cap // 6 + 1)}, "prompt",
                                   tokenized=0)
    assert err["code"] == "context_length_exceeded"
    err = _refused_before_queueing(
        counting, http, "/v1/chat/completions",
        {**CHAT_GOOD, "messages": [{"role": "user", "content": "a" * (cap // 2)},
                                   {"role": "user", "content": "b" * (cap // 2 + 1)}]},
        "messages", tokenized=0)
    assert err["code"] == "context_length_exceeded"
    # One prompt of a list over the cap: none of them is tokenized.
    err = _refused_before_queueing(counting, http, "/v1/completions",
                                   {**GOOD, "prompt": ["hi", "x" * (cap + 1)]}, "prompt[1]",
                                   tokenized=0)


def test_the_byte_cap_never_refuses_a_prompt_that_fits(llm):
    """The longest vocabulary entries, as text, as many as fit: under the cap."""
    tok = llm.engine.tokenizer
    max_len = llm.engine.max_model_len
    cap = prompt_byte_cap(tok, max_len)
    pieces = sorted((tok.decode([i]) for i in range(tok.vocab_size)),
                    key=lambda t: -len(t.encode()))
    for piece in pieces[:20]:
        if not piece:
            continue
        text = piece * (max_len - 1)
        while len(tok.encode(text)) >= max_len:
            text = text[:-len(piece)]
        check_prompt_bytes(cap, [text], "prompt", max_len)     # does not raise


def test_no_vocabulary_no_cap():
    assert prompt_byte_cap(object(), 100) is None
    check_prompt_bytes(None, ["x" * 10_000], "prompt", 100)


# ---- bounded echoes ------------------------------------------------------------------------------
def test_a_huge_model_name_is_not_echoed_whole(http):
    name = "m" * 1_000_000
    r = http.post("/v1/completions", json={**GOOD, "model": name})
    err = assert_error(r, 404, "model")
    assert len(r.content) < 2000 and MODEL_NAME in err["message"]
    assert "1000000 characters" in err["message"]


def test_a_huge_unknown_field_is_not_echoed_whole(http):
    r = http.post("/v1/completions", json={**GOOD, "k" * 100_000: 1})
    err = assert_error(r, 400)
    assert len(r.content) < 5000 and len(err["param"]) < 300


# ---- big bodies off the event loop, in pieces ---------------------------------------------------
def test_building_a_response_does_not_hold_the_event_loop(server, monkeypatch):
    """While a response is being built, /health answers: the building waits for that."""
    building, health_answered = threading.Event(), threading.Event()
    original = ResponseFormat.response

    def slow_response(self, *args, **kwargs):
        building.set()
        # Longer than /health's own timeout below: a held loop fails the test, not a hang.
        assert health_answered.wait(4 * HEALTH_TIMEOUT_S), "/health never answered"
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ResponseFormat, "response", slow_response)

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT_S) as c:
            request = asyncio.create_task(c.post("/v1/completions", json=GOOD))
            while not building.is_set():
                assert not request.done(), request.result().text
                await asyncio.sleep(0.01)
            health = await c.get("/health", timeout=HEALTH_TIMEOUT_S)
            health_answered.set()
            return health, await request

    health, r = asyncio.run(scenario())
    assert health.status_code == 200 and r.status_code == 200, r.text


def test_a_big_body_goes_out_in_pieces(monkeypatch):
    obj = {"choices": [{"text": "x" * 1000, "i": i} for i in range(50)]}
    pieces: list[bytes] = []

    async def run():
        async def off_loop(fn):
            return fn()
        response = await bodies.json_body(lambda: obj, off_loop)
        async for piece in response.body_iterator:
            pieces.append(piece)
        return response

    monkeypatch.setattr(bodies, "CHUNK_BYTES", 4096)
    response = asyncio.run(run())
    assert len(pieces) > 1 and all(len(p) <= 4096 for p in pieces)
    assert json.loads(b"".join(pieces)) == obj
    assert int(response.headers["content-length"]) == sum(map(len, pieces))


def test_a_body_sent_in_pieces_arrives_whole(http, monkeypatch):
    monkeypatch.setattr(bodies, "CHUNK_BYTES", 512)
    r = http.post("/v1/completions", json={**GOOD, "n": 3, "max_tokens": 12, "logprobs": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["choices"]) == 3 and len(r.content) > 512
    assert all(len(c["logprobs"]["tokens"]) == 12 or c["finish_reason"] == "stop"
               for c in body["choices"])
