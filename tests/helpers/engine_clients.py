"""Driving an ``EngineClient`` from a test: an output handler that collects, and engine factories
(``"helpers.engine_clients:NAME"``) for ``MPEngineClient(engine_factory=...)`` that make the
child's engine fail on purpose."""

from __future__ import annotations

import os
import threading
from typing import Any

TIMEOUT_S = 60.0


class Collector:
    """An OutputHandler that keeps everything it is given."""

    def __init__(self) -> None:
        self.outputs: dict[str, list[Any]] = {}     # request id -> its outputs, in order
        self.final: dict[str, Any] = {}
        self.failures: list[tuple[str, list[str]]] = []
        self.dead: str | None = None
        self._changed = threading.Condition()

    def on_outputs(self, outputs: list[Any]) -> None:
        with self._changed:
            for out in outputs:
                self.outputs.setdefault(out.request_id, []).append(out)
                if out.finished:
                    self.final[out.request_id] = out
            self._changed.notify_all()

    def on_failure(self, message: str, request_ids: list[str]) -> None:
        with self._changed:
            self.failures.append((message, list(request_ids)))
            self._changed.notify_all()

    def on_dead(self, message: str) -> None:
        with self._changed:
            self.dead = message
            self._changed.notify_all()

    def wait_for(self, predicate, what: str, timeout: float = TIMEOUT_S) -> None:
        with self._changed:
            assert self._changed.wait_for(predicate, timeout), f"timed out waiting for {what}"

    def failed_ids(self) -> set[str]:
        return {rid for _, ids in self.failures for rid in ids}


def collect(client: Any, cases: list[tuple[Any, Any]], prefix: str = "r") -> Collector:
    """Add ``(prompt, params)`` pairs through ``client`` (ids ``prefix-0``, ...) and wait until
    all have finished; what the client delivered meanwhile."""
    collector = Collector()
    client.set_output_handler(collector)
    ids = [f"{prefix}-{i}" for i in range(len(cases))]
    try:
        for rid, (prompt, params) in zip(ids, cases):
            client.add_request(rid, prompt, params)
        collector.wait_for(lambda: all(r in collector.final for r in ids), "the outputs")
    finally:
        client.set_output_handler(None)
    return collector


def run_requests(client: Any, cases: list[tuple[Any, Any]], prefix: str = "r") -> list[Any]:
    """The final outputs of :func:`collect`, in the order of ``cases``."""
    final = collect(client, cases, prefix).final
    return [final[f"{prefix}-{i}"] for i in range(len(cases))]


def wait_pool_free(client: Any, timeout: float = TIMEOUT_S) -> Any:
    """Poll ``client.stats()`` until nothing runs or waits and every block is free."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        s = client.stats()
        if (s.num_running, s.num_waiting, s.kv_blocks_free) == (0, 0, s.kv_blocks_total):
            return s
        assert time.monotonic() < deadline, f"blocks still held after {timeout} s: {s}"
        time.sleep(0.02)


def _failing_engine(model: str, llm_kwargs: dict, prefix: str, fail) -> Any:
    from mini_paged_attn.engine import LLM

    engine = LLM(model, **llm_kwargs).engine
    forward = engine.runner.forward

    def forward_or_fail(out, *args):
        if any(seq.request.request_id.startswith(prefix) for seq in out.seqs):
            fail()
        return forward(out, *args)
    engine.runner.forward = forward_or_fail
    return engine


def poisoned_engine(model: str, **llm_kwargs: Any) -> Any:
    """Every step holding a request whose id starts with "poison" raises."""
    def fail():
        raise RuntimeError("poison request")
    return _failing_engine(model, llm_kwargs, "poison", fail)


def crashing_engine(model: str, **llm_kwargs: Any) -> Any:
    """The process exits at once in a step holding a request whose id starts with "crash"."""
    return _failing_engine(model, llm_kwargs, "crash", lambda: os._exit(3))
