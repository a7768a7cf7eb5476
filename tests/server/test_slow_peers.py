"""Peers that stall: an upload that stops half-way, a client that never reads its stream.

Raw sockets, so the test decides exactly what the peer sends and reads; every wait is bounded
by a socket timeout or a polling deadline.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import pytest

from mini_paged_attn.server.async_client import AsyncClient
from mini_paged_attn.server.limits import ServerLimits
from server_harness import API_KEY, GOOD, TIMEOUT_S, served

LIMITS = ServerLimits(body_timeout_s=1, send_timeout_s=1)


@pytest.fixture(scope="module")
def server(llm):
    with served(llm.engine, api_key=API_KEY, limits=LIMITS, sndbuf=4096) as s:
        yield s


def _connect(server, rcvbuf: int | None = None) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(TIMEOUT_S)
    sock.connect((host, int(port)))
    return sock


def _head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Length: {length}\r\n\r\n").encode()


def _read_all(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def test_a_stalled_upload_gets_408_and_is_dropped(server):
    body = json.dumps({**GOOD, "prompt": "x" * 500}).encode()
    with _connect(server) as sock:
        sock.sendall(_head("/v1/completions", len(body)) + body[:100])
        answer = _read_all(sock)      # the server answers, then closes: EOF ends the read
    status, _, rest = answer.partition(b"\r\n")
    assert b" 408 " in status, answer[:300]
    assert b'"request_timeout"' in rest and b"connection: close" in rest.lower()


def test_a_slow_but_steady_upload_is_not_cut(server):
    body = json.dumps({**GOOD, "prompt": "y" * 50}).encode()
    with _connect(server) as sock:
        sock.sendall(_head("/v1/completions", len(body)))
        for i in range(0, len(body), 40):     # well inside the budget
            sock.sendall(body[i:i + 40])
        status = sock.recv(65536).partition(b"\r\n")[0]
    assert b" 200 " in status


def test_a_client_that_never_reads_its_stream_is_dropped(server, caplog):
    body = json.dumps({**GOOD, "max_tokens": 200, "ignore_eos": True, "stream": True,
                       "n": 4, "logprobs": 5}).encode()
    with caplog.at_level(logging.WARNING, "mini_paged_attn.server"), \
            _connect(server, rcvbuf=4096) as sock:
        sock.sendall(_head("/v1/completions", len(body)) + body)
        deadline = time.monotonic() + TIMEOUT_S
        while not any("took nothing of its response" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "the server never gave up on the client"
            time.sleep(0.05)
        received = _read_all(sock)    # what was buffered, then EOF: the server closed it
    assert received.startswith(b"HTTP/1.1 200")
    assert b"data: [DONE]" not in received   # it was cut, not finished
    server.wait_all_free()


def test_the_server_serves_after_the_stalled_peers(server):
    with server.client() as c:
        assert c.post("/v1/completions", json=GOOD).status_code == 200


# ---- a consumer that falls behind holds one output per request ---------------------------------
class _QuietClient:
    """An EngineClient stand-in that only records what is added."""

    tokenizer = model_config = None
    max_model_len = 100
    dead_reason = None

    def add_request(self, *args, **kwargs):
        pass

    def abort_request(self, request_id):
        return True

    def set_output_handler(self, handler):
        self.handler = handler

    def shutdown(self):
        pass


def test_outputs_waiting_for_a_slow_consumer_are_coalesced():
    from mini_paged_attn.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput

    client = _QuietClient()
    engine = AsyncClient(client)
    engine.start()

    async def scenario():
        submission = engine.submit([[1, 2]], None)
        (rid,) = submission.request_ids

        def produce():
            for step in range(1, 201):
                comp = CompletionOutput(0, "a" * step, list(range(step)),
                                        finish_reason="length" if step == 200 else None)
                engine.on_outputs([RequestOutput(rid, None, [1, 2], [comp], step == 200,
                                                 RequestMetrics(0.0))])

        thread = threading.Thread(target=produce)
        thread.start()
        thread.join(TIMEOUT_S)
        await asyncio.sleep(0)          # let the deliveries run
        for _ in range(100):
            await asyncio.sleep(0)
        assert submission._queue.qsize() == 1
        outs = [out async for _, out in submission]
        assert len(outs) == 1 and outs[0].finished and len(outs[0].outputs[0].token_ids) == 200

    asyncio.run(scenario())
    engine.shutdown()
