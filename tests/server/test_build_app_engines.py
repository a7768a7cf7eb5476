"""What ``build_app`` accepts as its engine: an LLMEngine (wrapped in an InprocEngineClient the
app owns) or an EngineClient (the caller's); anything else, or a setting the client already
has, is a ValueError before any engine thread starts."""

from __future__ import annotations

import threading

import pytest

from mini_paged_attn.engine import InprocEngineClient
from mini_paged_attn.server import build_app


def _core_threads() -> int:
    return sum(t.name == "engine-core" and t.is_alive() for t in threading.enumerate())


def test_anything_but_an_engine_or_a_client_is_refused():
    with pytest.raises(ValueError, match="engine: expected an LLMEngine or an EngineClient"):
        build_app(object(), model_name="m")


def test_a_bad_setting_leaves_no_engine_thread(llm):
    before = _core_threads()
    with pytest.raises(ValueError, match="max_queue"):
        build_app(llm.engine, model_name="m", max_queue=0)
    assert _core_threads() == before


def test_a_client_keeps_its_own_failure_limit(llm):
    client = InprocEngineClient(llm.engine)
    try:
        with pytest.raises(ValueError, match="max_consecutive_failures"):
            build_app(client, model_name="m", max_consecutive_failures=2)
        app = build_app(client, model_name="m")
        assert app.state.async_client.client is client
    finally:
        client.shutdown()
    assert client.dead_reason == "the engine core was shut down"
