"""The engine core compiles a request's constraint off its stepping loop: while one request's
grammar compiles, the others are stepped; the held request then runs as usual, or ends as
aborted if the client aborted it meanwhile."""

from __future__ import annotations

import threading

import pytest

from helpers.engine_clients import Collector
from mini_paged_attn.engine import LLM, InprocEngineClient, SamplingParams
from mini_paged_attn.engine.structured import StructuredOutputsParams

pytest.importorskip("llguidance", reason='structured outputs need pip install -e ".[structured]"')

LLM_KWARGS = dict(device="cpu", dtype="float32", block_size=16, num_kv_blocks=64,
                  max_num_seqs=8, max_model_len=128, seed=0)
PLAIN = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
CONSTRAINED = SamplingParams(temperature=0.0, max_tokens=8,
                             structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))


@pytest.fixture()
def held_compile(monkeypatch):
    """An in-process client whose grammar compiles wait for ``release``; yields
    ``(client, release, started)``."""
    engine = LLM("tiny", **LLM_KWARGS).engine
    compiler = engine.structured.compiler
    real_compile = compiler.compile
    release, started = threading.Event(), threading.Event()

    def slow_compile(params):
        if threading.current_thread().name.startswith("core-grammar"):
            started.set()
            assert release.wait(30)
        return real_compile(params)

    monkeypatch.setattr(compiler, "compile", slow_compile)
    client = InprocEngineClient(engine)
    yield client, release, started
    release.set()
    client.shutdown()


def test_others_are_stepped_while_a_constraint_compiles(held_compile):
    client, release, started = held_compile
    collector = Collector()
    client.set_output_handler(collector)
    client.add_request("held", "x", CONSTRAINED)
    assert started.wait(30)
    client.add_request("plain", "hello", PLAIN)
    collector.wait_for(lambda: "plain" in collector.final, "the plain request")
    assert "held" not in collector.outputs          # still compiling: nothing of it yet
    release.set()
    collector.wait_for(lambda: "held" in collector.final, "the held request")
    held = collector.final["held"].outputs[0]
    assert held.finish_reason == "stop" and held.text in ("yes", "no")
    assert not collector.failures


def test_a_request_aborted_while_compiling_ends_as_aborted(held_compile):
    client, release, started = held_compile
    collector = Collector()
    client.set_output_handler(collector)
    client.add_request("held", "x", CONSTRAINED)
    assert started.wait(30)
    assert client.abort_request("held")
    release.set()
    client.add_request("after", "hello", PLAIN)    # the core keeps serving
    collector.wait_for(lambda: "after" in collector.final, "the request after")
    assert "held" not in collector.outputs or collector.final["held"].outputs[0].finish_reason \
        == "abort"
    assert client.stats().kv_blocks_free == LLM_KWARGS["num_kv_blocks"]
