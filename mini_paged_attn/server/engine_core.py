"""The engine in a process of its own: the child's side (:func:`core_main`).

In one process the engine thread and the HTTP event loop take turns on the interpreter lock: on a
GPU, where a step is mostly Python waiting on short kernels, the event loop's per-chunk work
made steps 8-46% longer (BENCHMARKS.md). Here the engine steps in a child process, unhindered,
and sends each step's outputs as deltas (new token ids; text only where stop strings need it)
through a pipe while its next step runs on the GPU. The server's side is
:class:`~mini_paged_attn.server.engine_core_client.EngineCoreClient`, which starts this process,
validates and sends requests, and rebuilds the outputs.

Messages, child to client: ``("ready", CoreInfo)`` or ``("error", text)`` once; then
``("outputs", deltas, stats, adds_seen)`` per step, ``("failed", text, request_ids)`` for a
step that raised (those requests are aborted) or a request the engine refused,
``("called", result)`` / ``("called_error", text)`` for ``call``. Client to child:
``("add", prompt_ids, params, request_id)``, ``("abort", request_id)``,
``("call", fn, args)``, ``("shutdown",)``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoreInfo:
    """What the child tells the client once its engine is built."""

    tokenizer: Any
    model_config: Any
    max_model_len: int
    admission: Any
    stats: Any


@dataclass
class _Sent:
    """What the child has sent of one completion so far."""

    text: str = ""
    tokens: int = 0


def _delta(out: Any, sent: dict[str, dict[int, _Sent]]) -> tuple:
    """One RequestOutput as what changed since the last delta of its request."""
    per_completion = sent.pop(out.request_id, {}) if out.finished else \
        sent.setdefault(out.request_id, {})
    completions = []
    for comp in out.outputs:
        s = per_completion.setdefault(comp.index, _Sent())
        keep = len(s.text) if comp.text.startswith(s.text) else 0  # stop strings may cut it
        new_logprobs = None if comp.logprobs is None else list(comp.logprobs[s.tokens:])
        completions.append((comp.index, keep, comp.text[keep:], list(comp.token_ids[s.tokens:]),
                            comp.finish_reason, comp.cumulative_logprob, new_logprobs))
        s.text, s.tokens = comp.text, len(comp.token_ids)
    return out.request_id, completions, out.finished, out.metrics


class _Outbox:
    """Everything the child sends, in order. A step's outputs wait to be sent until the next
    step has enqueued its device work (``LLMEngine.step(overlap=...)``): turning them into
    deltas, pickling and writing them then runs while the GPU computes, not between steps
    (inline, that left a 0.3-1 ms gap between steps on an H100 host; on a thread of its own,
    the interpreter lock put the same work inside the next step's host phase)."""

    def __init__(self, results: Any) -> None:
        self._results = results
        self._sent: dict[str, dict[int, _Sent]] = {}  # request id -> completion -> sent so far
        self._pending: tuple | None = None            # the last step's (outputs, stats, added)

    def outputs(self, outputs: list[Any], stats: Any, added: int) -> None:
        self.flush()
        self._pending = (outputs, stats, added)

    def flush(self) -> None:
        """Send the waiting step's outputs now."""
        if self._pending is None:
            return
        outputs, stats, added = self._pending
        self._pending = None
        self._results.send(("outputs", [_delta(o, self._sent) for o in outputs], stats, added))

    def send(self, message: tuple) -> None:
        self.flush()
        self._results.send(message)


def core_main(model: str, llm_kwargs: dict, commands: Any, results: Any) -> None:
    """The child: build the engine, then apply commands and step while there is work."""
    from ..engine import LLM

    try:
        engine = LLM(model, **llm_kwargs).engine
        results.send(("ready", CoreInfo(engine.tokenizer, engine.model_config,
                                        engine.max_model_len, engine.admission, engine.stats())))
    except BaseException as exc:
        results.send(("error", f"the engine could not start: {type(exc).__name__}: {exc}"))
        return
    outbox = _Outbox(results)
    try:
        _serve_commands(engine, commands, outbox)
    finally:
        try:
            outbox.flush()
        except OSError:  # the server is gone
            pass


def _serve_commands(engine: Any, commands: Any, outbox: _Outbox) -> None:
    added = 0
    live: set[str] = set()   # requests added here and not yet finished or aborted
    while True:
        idle = not engine.has_unfinished_requests()
        if idle:  # no step will carry the last outputs out: send them now
            outbox.flush()
        while idle or commands.poll():
            try:
                kind, *args = commands.recv()
            except EOFError:  # the server is gone
                return
            idle = False
            if kind == "add":
                prompt_ids, params, request_id = args
                added += 1
                try:
                    # Text is made in the server's process (EngineCoreClient._rebuild), off
                    # this thread, unless stop strings need it here.
                    engine.add_request(prompt_ids, params, request_id=request_id,
                                       detokenize=bool(params.stop))
                    live.add(request_id)
                except ValueError as exc:  # the client checked the same limits: a bug
                    outbox.send(("failed", f"the engine rejected {request_id}: {exc}",
                                 [request_id]))
            elif kind == "abort":
                # Its last output (finished, reason "abort") comes out of the next step.
                engine.abort_request(args[0])
                live.discard(args[0])
            elif kind == "call":  # benchmarks and tests: fn(engine, *args) in this process
                fn, fn_args = args
                try:
                    outbox.send(("called", fn(engine, *fn_args)))
                except Exception as exc:
                    outbox.send(("called_error", f"{type(exc).__name__}: {exc}"))
            elif kind == "shutdown":
                return
        if not engine.has_unfinished_requests():
            continue
        try:
            outputs = engine.step(overlap=outbox.flush)
        except Exception as exc:
            logger.exception("engine step failed")
            # The server fails every request in flight when a step fails (it cannot tell which
            # one broke it): abort them here at once, so the failing step is not retried until
            # the server's aborts arrive, each retry sending one more failure.
            failed = sorted(live)
            for request_id in failed:
                engine.abort_request(request_id)
            live.clear()
            outbox.send(("failed", f"{type(exc).__name__}: {exc}", failed))
            continue
        live.difference_update(o.request_id for o in outputs if o.finished)
        outbox.outputs(outputs, engine.stats(), added)


__all__ = ["CoreInfo", "core_main"]
