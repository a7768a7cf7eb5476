"""The queue limit, engine failures and /health, on an engine behind a gate.

A failed engine step fails the requests in it (500) and the engine goes on; too many failed
steps in a row kill its core, after which /health and every request answer 503. The engine runs
in an ``InprocEngineClient`` made here, around a wrapper that holds and fails its steps.
"""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import pytest

from server_harness import CHAT_GOOD, GOOD, TIMEOUT_S, assert_error, served

from mini_paged_attn.engine import InprocEngineClient


class _TestEngine:
    """The real engine behind a gate (step() waits for it) and with injectable step failures."""

    def __init__(self, engine):
        self._engine = engine
        self.gate = threading.Event()
        self.gate.set()
        self.failures_to_inject = 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self, overlap=None):
        assert self.gate.wait(TIMEOUT_S), "the test never opened the gate"
        if self.failures_to_inject:
            self.failures_to_inject -= 1
            raise RuntimeError("injected failure")
        return self._engine.step(overlap)


@contextlib.contextmanager
def _served_gated(llm, max_consecutive_failures: int = 3, **app_kwargs):
    """A server over ``llm``'s engine behind a gate: ``(server, the gated engine, client)``."""
    engine = _TestEngine(llm.engine)
    client = InprocEngineClient(engine, max_consecutive_failures=max_consecutive_failures)
    try:
        with served(client, **app_kwargs) as s:
            yield s, engine, client
    finally:
        engine.gate.set()
        client.shutdown()


def _post_in_thread(url: str, body: dict, results: list) -> threading.Thread:
    def post() -> None:
        results.append(httpx.post(url, json=body, timeout=TIMEOUT_S))

    t = threading.Thread(target=post)
    t.start()
    return t


def _wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


def test_queue_limit_rejects_with_429(llm):
    with _served_gated(llm, max_queue=2) as (s, engine, client):
        engine.gate.clear()  # admitted requests wait for their first token until it opens
        results: list[httpx.Response] = []
        threads = [_post_in_thread(f"{s.url}/v1/completions", GOOD, results) for _ in range(2)]
        _wait_until(lambda: client.stats().num_waiting == 2, "two requests wait")
        r = httpx.post(f"{s.url}/v1/completions", json=GOOD, timeout=TIMEOUT_S)
        err = assert_error(r, 429)
        assert err["code"] == "queue_full" and "Retry-After" in r.headers
        assert s.metrics()["mini_paged_attn_requests_waiting"] == 2
        engine.gate.set()
        for t in threads:
            t.join(TIMEOUT_S)
        assert [r.status_code for r in results] == [200, 200]
        assert httpx.post(f"{s.url}/v1/completions", json=GOOD,
                          timeout=TIMEOUT_S).status_code == 200
        s.wait_all_free()


@pytest.mark.parametrize("stream", [False, True])
def test_client_gone_before_its_first_token_aborts_it(llm, stream):
    """A client that gives up while its request waits (the engine is held) aborts it at once."""
    with _served_gated(llm) as (s, engine, _):
        engine.gate.clear()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{s.url}/v1/completions", json={**GOOD, "stream": stream},
                       timeout=httpx.Timeout(TIMEOUT_S, read=0.3))
        _wait_until(lambda: s.async_client.counters.requests_aborted == 1, "it is aborted")
        engine.gate.set()
        s.wait_all_free()
        assert s.async_client.counters.requests_finished == 0


def test_engine_failure_fails_its_requests_and_the_engine_goes_on(llm):
    with _served_gated(llm, max_consecutive_failures=2) as (s, engine, _):
        # A failed step: the requests in it get 500 (non-streamed and streamed alike).
        engine.failures_to_inject = 1
        r = httpx.post(f"{s.url}/v1/completions", json=GOOD, timeout=TIMEOUT_S)
        assert assert_error(r, 500)["type"] == "server_error"
        # The cause goes to the log, not to the client.
        assert "injected failure" not in r.json()["error"]["message"]
        # (the step after a failure applies its aborts; it must not meet the next injection)
        _wait_until(lambda: not llm.engine.has_unfinished_requests(), "the abort is applied")
        engine.failures_to_inject = 1
        r = httpx.post(f"{s.url}/v1/completions", json={**GOOD, "stream": True},
                       timeout=TIMEOUT_S)
        assert_error(r, 500)
        _wait_until(lambda: not llm.engine.has_unfinished_requests(), "the abort is applied")
        # The engine lives on: health is fine, the next requests succeed, no block is held.
        assert httpx.get(f"{s.url}/health", timeout=TIMEOUT_S).status_code == 200
        with s.client(api_key=None) as c:
            assert c.post("/v1/completions", json=GOOD).status_code == 200
            assert c.post("/v1/chat/completions", json=CHAT_GOOD).status_code == 200
        s.wait_all_free()
        # Failures in a row up to the limit kill the core (the step after a failure, which
        # applies its aborts, fails too): 503 everywhere, and /health says so.
        engine.failures_to_inject = 2
        r = httpx.post(f"{s.url}/v1/completions", json=GOOD, timeout=TIMEOUT_S)
        assert r.status_code == 500
        _wait_until(lambda: not s.async_client.alive, "the engine is dead")
        health = httpx.get(f"{s.url}/health", timeout=TIMEOUT_S)
        assert assert_error(health, 503)["code"] == "engine_dead"
        assert assert_error(httpx.post(f"{s.url}/v1/completions", json=GOOD,
                                        timeout=TIMEOUT_S), 503)["code"] == "engine_dead"
        assert s.metrics()["mini_paged_attn_engine_up"] == 0
    # The dead core queued the aborts of its requests: the next step frees their blocks.
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.stats().kv_blocks_free == llm.stats().kv_blocks_total
