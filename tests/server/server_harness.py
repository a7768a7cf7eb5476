"""A real server on 127.0.0.1 (uvicorn in a thread, a free port) for the server tests.

``served(engine, **build_app_kwargs)`` starts one (``engine``: an LLMEngine or an EngineClient)
and stops it at the end of the ``with``. Only one engine core may step an engine at a time:
servers that share one run one after another.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

MODEL_NAME = "tiny"
API_KEY = "test-key"
TIMEOUT_S = 30.0


@dataclass
class Server:
    url: str
    app: Any

    @property
    def async_client(self):
        return self.app.state.async_client

    def client(self, api_key: str | None = API_KEY) -> httpx.Client:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=TIMEOUT_S)

    def metrics(self) -> dict[str, float]:
        """/metrics as ``{'name{label="value",...}': value}``, through prometheus_client's
        parser (so the exposition must be valid)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=TIMEOUT_S).text
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
        return out

    def wait_all_free(self, timeout: float = TIMEOUT_S) -> dict[str, float]:
        """Poll /metrics until no request runs or waits and every KV block is free."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m["mini_paged_attn_requests_running"] == 0
                    and m["mini_paged_attn_requests_waiting"] == 0
                    and m["mini_paged_attn_kv_blocks_free"] == m["mini_paged_attn_kv_blocks_total"]):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"blocks still held after {timeout} s: {m}")
            time.sleep(0.05)


@contextlib.contextmanager
def served(engine: Any, *, sndbuf: int | None = None, sock: socket.socket | None = None,
           **app_kwargs: Any) -> Iterator[Server]:
    """Start the server for ``engine`` on a free port; stop it after. ``sndbuf``: the kernel
    send buffer of its connections (small: a client that does not read blocks it sooner).
    ``sock``: a bound socket to serve on instead (e.g. ``commands.serve.bind``'s)."""
    import uvicorn

    from mini_paged_attn.server.app import build_app

    app_kwargs.setdefault("model_name", MODEL_NAME)
    app = build_app(engine, **app_kwargs)
    # IPPROTO_TCP, not the default 0: asyncio turns Nagle off (TCP_NODELAY) only on sockets
    # that say they are TCP, and with Nagle on every streamed chunk waits ~40 ms for an ACK.
    if sock is None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
    if sndbuf is not None:    # accepted connections inherit it
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield Server(f"http://127.0.0.1:{sock.getsockname()[1]}", app)
    finally:
        server.should_exit = True
        thread.join(TIMEOUT_S)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"


GOOD = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2, "temperature": 0}
CHAT_GOOD = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
             "max_tokens": 2}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for a ``serve`` process)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_serving(proc: Any, url: str, timeout_s: float = 120.0) -> None:
    """Wait until the ``serve`` process ``proc`` (a Popen, stdout piped) answers ``/health``
    at ``url``; AssertionError with its output if it exits or takes over ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"serve did not come up: {proc.stdout.read()}")
        time.sleep(0.2)


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    """``r`` has ``status`` and OpenAI's error body; returns its ``error`` object."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err
    return err


async def cancel_mid_stream(url: str, prompt: str) -> None:
    """Open a streamed completion, read two events, then drop the connection (the server must
    abort the request)."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 200, "stream": True,
            "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S,
                                 headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            n = 0
            async for line in r.aiter_lines():
                n += line.startswith("data: ")
                if n == 2:
                    break  # leaving the block closes the connection mid-stream
