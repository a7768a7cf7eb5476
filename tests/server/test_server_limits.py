"""What one request may ask for: the body size (413 before the engine sees anything), the caps on
stop strings, prompts, n and n x prompts (400 naming the field), requests that could never fit
--max-queue, tokenizing off the event loop, and 500s that do not leak the exception.
"""

from __future__ import annotations

import json
import logging
import socket
import threading

import httpx
import pytest

from mini_paged_attn.engine import InprocEngineClient
from mini_paged_attn.server.limits import ServerLimits
from server_harness import GOOD, TIMEOUT_S, assert_error, served

JSON = {"Content-Type": "application/json"}
SMALL = ServerLimits(max_request_bytes=4096, max_prompts=4, max_n=3, max_choices=6,
                     max_stop_strings=2, max_stop_chars=5)


class _Recorder:
    """The real engine's client, with its tokenizer calls and add_request calls recorded.

    ``hold``: when cleared, ``encode`` waits for it (a tokenizer busy with a huge prompt).
    """

    def __init__(self, client):
        self._client = client
        self.added: list[str] = []
        self.tokenizer_threads: list[str] = []
        self.hold = threading.Event()
        self.hold.set()
        self.encoding = threading.Event()
        self.tokenizer = _RecordingTokenizer(self)

    def __getattr__(self, name):
        return getattr(self._client, name)

    def add_request(self, request_id, prompt, params=None, *, final_only=False):
        self.added.append(request_id)
        return self._client.add_request(request_id, prompt, params, final_only=final_only)


class _RecordingTokenizer:
    def __init__(self, owner: _Recorder):
        self._owner = owner

    def __getattr__(self, name):
        return getattr(self._owner._client.tokenizer, name)

    def encode(self, text, **kwargs):
        self._owner.tokenizer_threads.append(threading.current_thread().name)
        self._owner.encoding.set()
        assert self._owner.hold.wait(TIMEOUT_S), "the test never released the tokenizer"
        return self._owner._client.tokenizer.encode(text, **kwargs)

    def apply_chat_template(self, messages, **kwargs):
        self._owner.tokenizer_threads.append(threading.current_thread().name)
        return self._owner._client.tokenizer.apply_chat_template(messages, **kwargs)


@pytest.fixture
def recorder(llm):
    client = InprocEngineClient(llm.engine)
    yield _Recorder(client)
    client.shutdown()


# ---- the body size -------------------------------------------------------------------------
def test_limits_are_validated():
    assert ServerLimits().max_request_bytes == 4 * 1024 * 1024
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError, match="max_n: expected an int >= 1"):
            ServerLimits(max_n=bad)


def test_default_body_limit_is_413_before_the_engine_sees_it(recorder):
    with served(recorder) as s:
        body = b'{"model": "tiny", "prompt": "' + b"x" * (4 * 1024 * 1024) + b'"}'
        r = httpx.post(f"{s.url}/v1/completions", content=body, timeout=TIMEOUT_S,
                       headers=JSON)
        assert assert_error(r, 413)["code"] == "request_too_large"
        assert recorder.added == [] and recorder.tokenizer_threads == []
        assert httpx.post(f"{s.url}/v1/completions", json=GOOD,
                          timeout=TIMEOUT_S).status_code == 200


def _chunks(total: int, size: int = 1000):
    yield b'{"model": "tiny", "prompt": "'
    for _ in range(total // size):
        yield b"x" * size
    yield b'"}'


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_a_body_without_content_length_is_counted_as_it_arrives(recorder, endpoint):
    with served(recorder, limits=SMALL) as s:
        # A generator body goes out chunked: no Content-Length to check up front.
        r = httpx.post(f"{s.url}/v1/{endpoint}", content=_chunks(8000), headers=JSON,
                       timeout=TIMEOUT_S)
        assert r.request.headers.get("transfer-encoding") == "chunked"
        assert "content-length" not in r.request.headers
        assert assert_error(r, 413)["code"] == "request_too_large"
        # Just under the limit, chunked too: read whole and served.
        ok = httpx.post(f"{s.url}/v1/completions", timeout=TIMEOUT_S, headers=JSON,
                        content=(c for c in [b'{"model": "tiny", "prompt": "hi", ',
                                             b'"max_tokens": 2}']))
        assert ok.status_code == 200, ok.text
        assert len(recorder.added) == 1


def _read_response(sock: socket.socket) -> str:
    """One whole HTTP response (head and Content-Length body) from ``sock``."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        body += sock.recv(65536)
    return (head + b"\r\n\r\n" + body).decode()


def test_a_content_length_over_the_limit_is_refused_before_the_body_is_sent(recorder):
    with served(recorder, limits=SMALL) as s:
        port = int(s.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 100000000\r\n\r\n")
            response = _read_response(sock)  # answered with no byte of the body sent
        assert response.startswith("HTTP/1.1 413 "), response
        assert '"request_too_large"' in response
        assert recorder.added == [] and recorder.tokenizer_threads == []


# ---- the per-request caps ------------------------------------------------------------------
CAP_CASES = [  # (body changes, whether it is over SMALL, param)
    ({"stop": ["a", "b"]}, False, "stop"),
    ({"stop": ["a", "b", "c"]}, True, "stop"),
    ({"stop": ["12345"]}, False, "stop"),
    ({"stop": ["a", "123456"]}, True, "stop"),
    ({"stop": "123456"}, True, "stop"),
    ({"prompt": [[1], [2], [3], [4]], "n": 1}, False, "prompt"),
    ({"prompt": [[1], [2], [3], [4], [5]]}, True, "prompt"),
    ({"prompt": ["a", "b", "c", "d", "e"]}, True, "prompt"),
    ({"n": 3}, False, "n"),
    ({"n": 4}, True, "n"),
    ({"prompt": [[1], [2]], "n": 3}, False, "n"),
    ({"prompt": [[1], [2], [3]], "n": 3}, True, "n"),
]


@pytest.mark.parametrize("change,over,param", CAP_CASES,
                         ids=[f"{c}-{'over' if o else 'at'}" for c, o, _ in CAP_CASES])
def test_caps_name_the_field_and_queue_nothing(recorder, change, over, param):
    with served(recorder, limits=SMALL) as s:
        r = httpx.post(f"{s.url}/v1/completions", json={**GOOD, **change}, timeout=TIMEOUT_S)
        if over:
            assert_error(r, 400, param)
            assert recorder.added == [] and recorder.tokenizer_threads == []
        else:
            assert r.status_code == 200, r.text


def test_default_caps(recorder):
    with served(recorder) as s:
        for change, param in (({"stop": [str(i) for i in range(17)]}, "stop"),
                              ({"stop": ["x" * 257]}, "stop"),
                              ({"n": 129}, "n"),
                              ({"prompt": [[1]] * 257}, "prompt"),
                              ({"prompt": [[1]] * 3, "n": 128}, "n")):
            r = httpx.post(f"{s.url}/v1/completions", json={**GOOD, **change}, timeout=TIMEOUT_S)
            assert_error(r, 400, param)
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2, "stop": ["s"] * 17}
        assert_error(httpx.post(f"{s.url}/v1/chat/completions", json=chat,
                                timeout=TIMEOUT_S), 400, "stop")
        assert recorder.added == []


def test_a_request_that_can_never_fit_the_queue_is_400_not_429(recorder):
    with served(recorder, max_queue=2) as s:
        r = httpx.post(f"{s.url}/v1/completions", json={**GOOD, "prompt": [[1], [2], [3]]},
                       timeout=TIMEOUT_S)
        assert assert_error(r, 400, "prompt")["code"] == "exceeds_max_queue"
        assert recorder.added == []
        r = httpx.post(f"{s.url}/v1/completions", json={**GOOD, "prompt": [[1], [2]], "n": 3},
                       timeout=TIMEOUT_S)
        assert r.status_code == 200, r.text


# ---- tokenizing off the event loop -----------------------------------------------------------
def test_tokenizer_runs_on_a_worker_thread_while_health_answers(recorder):
    """/health answers while a prompt is being tokenized: the tokenizer is held until then."""
    with served(recorder) as s:
        recorder.hold.clear()
        result: list[httpx.Response] = []
        t = threading.Thread(target=lambda: result.append(httpx.post(
            f"{s.url}/v1/completions", json=GOOD, timeout=TIMEOUT_S)))
        t.start()
        try:
            assert recorder.encoding.wait(TIMEOUT_S)
            # With the tokenizer on the event loop, this would wait for the release below.
            assert httpx.get(f"{s.url}/health", timeout=TIMEOUT_S / 3).status_code == 200
        finally:
            recorder.hold.set()
            t.join(TIMEOUT_S)
        assert result[0].status_code == 200, result[0].text
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2}
        assert httpx.post(f"{s.url}/v1/chat/completions", json=chat,
                          timeout=TIMEOUT_S).status_code == 200
    assert len(recorder.tokenizer_threads) == 2
    assert all(name.startswith("mini-paged-attn-request") for name in recorder.tokenizer_threads)


# ---- 500s ------------------------------------------------------------------------------------
def test_a_500_does_not_echo_the_exception(recorder, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("secret detail /etc/passwd")

    recorder.add_request = broken
    with served(recorder) as s, caplog.at_level(logging.ERROR, "mini_paged_attn.server"):
        r = httpx.post(f"{s.url}/v1/completions", json=GOOD, timeout=TIMEOUT_S)
        err = assert_error(r, 500)
        assert err["type"] == "server_error" and "secret" not in r.text
        assert "error id" in err["message"]
        error_id = err["message"].rsplit(" ", 1)[1].rstrip(")")
    logged = [rec for rec in caplog.records if error_id in rec.getMessage()]
    assert logged and "secret detail" in str(logged[0].exc_info[1])


def test_an_exception_outside_any_route_still_gets_the_500_body(recorder, caplog):
    """The app-wide handler: what raises before a route runs (here a header value that is not
    bytes trips the Content-Type check) is still a JSON 500 that does not echo the exception."""
    import asyncio

    from mini_paged_attn.server.app import build_app

    app = build_app(recorder, model_name="tiny")
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions",
             "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"host", b"localhost"), (b"content-type", "not bytes")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    with caplog.at_level(logging.ERROR, "mini_paged_attn.server"), pytest.raises(AttributeError):
        asyncio.run(app(scope, receive, send))  # re-raised for the ASGI server to log
    assert sent[0]["status"] == 500
    err = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["error"]
    assert err["code"] == "internal_error" and "decode" not in err["message"]
    assert any("error id" in rec.getMessage() for rec in caplog.records)
