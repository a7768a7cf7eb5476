"""Bad input, unknown routes and the API key.

Every rejection must carry OpenAI's error body with the right status, and the server must go on
serving: a good request right after each bad one still succeeds.
"""

from __future__ import annotations

import httpx
import pytest

from server_harness import API_KEY, CHAT_GOOD, GOOD, MODEL_NAME, TIMEOUT_S, assert_error

# The official client comes with the test extra; the GPU machines run these modules without it.
openai = pytest.importorskip("openai", reason="the openai client (pip install .[test])")

# (endpoint, body, status, param): body is a dict (sent as JSON) or raw bytes.
BAD_INPUTS = [
    ("completions", b'{"model": "tiny", "prompt": ', 400, None),
    ("completions", b"[1, 2]", 400, None),
    ("completions", {**GOOD, "max_tokens": "5"}, 400, "max_tokens"),
    ("completions", {**GOOD, "temperature": "hot"}, 400, "temperature"),
    ("completions", {**GOOD, "prompt": 3}, 400, "prompt"),
    ("completions", {**GOOD, "stream": "yes"}, 400, "stream"),
    ("completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {**GOOD, "temperature": -0.5}, 400, "temperature"),
    ("completions", {**GOOD, "top_p": 1.5}, 400, "top_p"),
    ("completions", {**GOOD, "n": 0}, 400, "n"),
    ("completions", {**GOOD, "top_k": -2}, 400, "top_k"),
    ("completions", {**GOOD, "min_p": 2}, 400, "min_p"),
    ("completions", {**GOOD, "prompt": "x" * 300}, 400, "prompt"),
    ("completions", {**GOOD, "prompt": [5, 999999]}, 400, "prompt"),
    ("completions", {**GOOD, "max_tokens": 250, "prompt": "x" * 100}, 400, "max_tokens"),
    ("completions", {**GOOD, "model": "gpt-4"}, 404, "model"),
    ("completions", {**GOOD, "best_of_luck": 1}, 400, "best_of_luck"),
    ("completions", {k: v for k, v in GOOD.items() if k != "model"}, 400, "model"),
    ("chat/completions", {**CHAT_GOOD, "messages": []}, 400, "messages"),
    ("chat/completions", {**CHAT_GOOD, "messages": [{"role": "robot", "content": "hi"}]}, 400,
     "messages[0].role"),
    ("chat/completions", {**CHAT_GOOD, "messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content"),
    ("chat/completions", {**CHAT_GOOD, "max_tokens": -1}, 400, "max_tokens"),
    ("chat/completions", {**CHAT_GOOD, "messages": [{"role": "user", "content": "x" * 300}]},
     400, "messages"),
]


@pytest.mark.parametrize("endpoint,body,status,param", BAD_INPUTS,
                         ids=[f"{i}-{b[2]}-{b[3]}" for i, b in enumerate(BAD_INPUTS)])
def test_bad_input_is_rejected_and_the_next_request_succeeds(server, endpoint, body, status,
                                                             param):
    with server.client() as c:
        if isinstance(body, bytes):
            r = c.post(f"/v1/{endpoint}", content=body,
                       headers={"Content-Type": "application/json"})
        else:
            r = c.post(f"/v1/{endpoint}", json=body)
        err = assert_error(r, status, param)
        assert err["type"] == "invalid_request_error"
        good = c.post(f"/v1/{endpoint}", json=GOOD if endpoint == "completions" else CHAT_GOOD)
        assert good.status_code == 200, good.text


def test_openai_client_raises_bad_request(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                           timeout=TIMEOUT_S)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=0)
    assert info.value.body["param"] == "max_tokens"


def test_unknown_route_and_method(server):
    with server.client() as c:
        assert_error(c.get("/v1/nothing"), 404)
        assert_error(c.get("/v1/completions"), 405)


def test_api_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(f"{server.url}/v1/completions", json=GOOD, headers=headers,
                       timeout=TIMEOUT_S)
        assert assert_error(r, 401)["code"] == "invalid_api_key"
    assert_error(httpx.get(f"{server.url}/v1/models", timeout=TIMEOUT_S), 401)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0,
                           timeout=TIMEOUT_S)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    # Probes need no key.
    assert httpx.get(f"{server.url}/health", timeout=TIMEOUT_S).status_code == 200
    assert httpx.get(f"{server.url}/metrics", timeout=TIMEOUT_S).status_code == 200
    with server.client() as c:
        assert c.post("/v1/completions", json=GOOD).status_code == 200
