"""Backpressure: a stream whose client stops reading is paused in the engine (no compute, its
KV kept) once its unsent output passes ``max_unsent_tokens``, and runs on when the client
reads again; an ordinary client beside it is served meanwhile.

Raw sockets with a small receive buffer, so the test decides when the peer reads; every wait is
bounded by a socket timeout or a polling deadline.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from mini_paged_attn.commands.serve import bind
from mini_paged_attn.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from mini_paged_attn.server.async_client import AsyncClient
from mini_paged_attn.server.limits import ServerLimits
from server_harness import API_KEY, GOOD, TIMEOUT_S, served

# A send budget longer than the test: the client is paused, never dropped.
LIMITS = ServerLimits(send_timeout_s=60, max_unsent_tokens=4)
MAX_TOKENS = 230


@pytest.fixture(scope="module")
def server(llm):
    # The socket `serve` listens on, kernel buffers as they come: what it bounds is what lets
    # a stream fall behind its client at all (else the kernel queues the whole stream).
    with served(llm.engine, api_key=API_KEY, limits=LIMITS, sock=bind("127.0.0.1", 0)) as s:
        yield s


def _wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def _stream_request() -> bytes:
    # n=4 with logprobs: a few kilobytes a step, so the buffers fill long before the end.
    body = json.dumps({**GOOD, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
                       "n": 4, "logprobs": 5}).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def test_a_stream_nobody_reads_is_paused_then_resumed(server, llm):
    engine = llm.engine
    host, port = server.url.removeprefix("http://").split(":")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(TIMEOUT_S)
        sock.connect((host, int(port)))
        sock.sendall(_stream_request())
        _wait_until(engine.only_paused_requests, "the unread stream is paused")
        # Paused, not finished: it holds its KV, and an ordinary request runs beside it.
        assert engine.has_unfinished_requests()
        r = httpx.post(f"{server.url}/v1/completions", json=GOOD, timeout=TIMEOUT_S,
                       headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 200
        _wait_until(engine.only_paused_requests, "only the unread stream is left")
        received = b""
        while chunk := sock.recv(65536):      # the client reads: the request runs on
            received += chunk
            if received.rstrip().endswith(b"data: [DONE]"):
                break
    assert received.startswith(b"HTTP/1.1 200")
    events = [json.loads(line[6:]) for line in received.decode().splitlines()
              if line.startswith("data: {")]
    finished = [c for e in events for c in e["choices"] if c.get("finish_reason")]
    assert sorted(c["index"] for c in finished) == [0, 1, 2, 3]
    assert all(c["finish_reason"] == "length" for c in finished)
    server.wait_all_free()


# ---- the rule, on a stand-in engine client -------------------------------------------------
class _PauseRecorder:
    """An EngineClient stand-in that records pause and resume calls."""

    tokenizer = model_config = None
    max_model_len = 100
    dead_reason = None

    def __init__(self) -> None:
        self.pauses: list[tuple[str, bool]] = []

    def add_request(self, *args, **kwargs):
        pass

    def abort_request(self, request_id):
        return True

    def pause_request(self, request_id, paused=True):
        self.pauses.append((request_id, paused))
        return True

    def set_output_handler(self, handler):
        self.handler = handler

    def shutdown(self):
        pass


def _output(rid: str, tokens: int, finished: bool = False) -> RequestOutput:
    comp = CompletionOutput(0, "a" * tokens, list(range(tokens)),
                            finish_reason="length" if finished else None)
    return RequestOutput(rid, None, [1, 2], [comp], finished, RequestMetrics(0.0))


def _deliver_in_thread(engine: AsyncClient, outputs: list[RequestOutput]) -> None:
    thread = threading.Thread(target=lambda: [engine.on_outputs([o]) for o in outputs])
    thread.start()
    thread.join(TIMEOUT_S)


async def _settle() -> None:
    for _ in range(20):         # let the deliveries scheduled on the loop run
        await asyncio.sleep(0)


def test_the_backlog_pauses_past_the_bound_and_a_take_resumes():
    client = _PauseRecorder()
    engine = AsyncClient(client, max_unsent_tokens=8)
    engine.start()

    async def scenario():
        submission = engine.submit([[1, 2]], None)
        (rid,) = submission.request_ids
        _deliver_in_thread(engine, [_output(rid, t) for t in range(1, 9)])
        await _settle()
        assert client.pauses == []              # 8 tokens unsent: at the bound, not past it
        _deliver_in_thread(engine, [_output(rid, t) for t in range(9, 15)])
        await _settle()
        assert client.pauses == [(rid, True)]   # once, however far past
        _, out = await anext(submission)
        assert len(out.outputs[0].token_ids) == 14 and client.pauses[-1] == (rid, False)
        # A consumer that keeps up is never paused: every output is taken before the next.
        for t in range(15, 40):
            _deliver_in_thread(engine, [_output(rid, t)])
            await _settle()
            await anext(submission)
        assert len(client.pauses) == 2
        _deliver_in_thread(engine, [_output(rid, 40, finished=True)])
        await _settle()
        outs = [o async for _, o in submission]
        assert outs[-1].finished and len(client.pauses) == 2

    asyncio.run(scenario())
    engine.shutdown()


def test_max_unsent_tokens_is_checked():
    with pytest.raises(ValueError, match="max_unsent_tokens"):
        AsyncClient(_PauseRecorder(), max_unsent_tokens=0)
    with pytest.raises(ValueError, match="max_unsent_tokens"):
        ServerLimits(max_unsent_tokens=0)
