"""The engine core: the busy loop that owns an ``LLMEngine`` and steps it whenever it has work.

Between steps it applies what its client sent (:mod:`mini_paged_attn.engine.process.messages`:
add, abort, pause, shutdown); it waits for a message only when no request is unfinished or every
unfinished one is paused, so requests from every client join the engine's one continuous batch. It runs on a thread of its own next to
:class:`~mini_paged_attn.engine.process.client.InprocEngineClient`, or in the child process of
:class:`~mini_paged_attn.engine.process.mp_client.MPEngineClient`; the two differ only in their
:class:`CoreInbox` and :class:`CoreOutbox`.

Failures: the engine cannot say which request made a ``step()`` raise, so every request live at
that moment is aborted at once (a retried step would fail again) and reported as failed; the
loop goes on with later requests. After ``max_consecutive_failures`` failed steps in a row, or
an error outside ``step()``, the core is dead: live requests are aborted, the outbox hears
:class:`~mini_paged_attn.engine.process.messages.EngineDead` and the loop ends.

Structured outputs: a request whose constraint is not compiled yet is held back while a worker
thread compiles it into the engine's grammar cache (bounded and contained, see
``engine/structured``), and is added once that is done, so no compile ever runs on the loop
that steps everyone else. The frontends compile before they send (the server's request
workers), so this matters where the core has a cache of its own (the engine process).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from ...errors import TensorParallelError
from ..deltas import request_of
from ..outputs import EngineStats, RequestOutput
from .messages import AbortRequest, AddRequest, Message, PauseRequest, Shutdown

logger = logging.getLogger(__name__)

# Threads compiling held requests' constraints, and how often an idle core looks at them.
COMPILE_WORKERS = 2
COMPILE_POLL_S = 0.005


class CoreInbox(Protocol):
    """Where the core's messages come from."""

    def get(self, timeout: float | None) -> Message | None:
        """The next message; None if none came within ``timeout`` seconds (None: wait).

        Raises:
            EOFError: the client is gone; nothing more will come.
        """


class CoreOutbox(Protocol):
    """Where the core's results go (called on the core's thread only)."""

    def outputs(self, outputs: list[RequestOutput | tuple], stats: Callable[[], EngineStats],
                adds_seen: int) -> None:
        """One step's outputs (output deltas from a core made with ``deltas=True``); they may
        wait until :meth:`flush`. ``stats``: the engine's stats now, for an outbox that
        reports them (taking them costs a little per step)."""

    def flush(self) -> None:
        """Deliver what waits. Called inside each step once its device work is enqueued (host
        work then costs no step time) and whenever the core goes idle."""

    def failed(self, message: str, request_ids: list[str]) -> None:
        """A step raised, or the engine refused a request; ``request_ids`` were aborted."""

    def dead(self, message: str) -> None:
        """The core has stopped for good."""


class EngineCore:
    """Steps ``engine`` while it has work, applying ``inbox`` messages between steps.

    Args:
        engine: an ``LLMEngine`` (or an object with its add_request / abort_request /
            pause_request / step / has_unfinished_requests / only_paused_requests / stats).
        inbox: where messages come from.
        outbox: where outputs, failures and the core's death go.
        max_consecutive_failures: failed steps in a row after which the core is dead.
        deltas: add every request with ``deltas=True``: the outbox gets output deltas
            (``engine/deltas.py``), not cumulative outputs (the engine process's core).
    """

    def __init__(self, engine: Any, inbox: CoreInbox, outbox: CoreOutbox, *,
                 max_consecutive_failures: int = 3, deltas: bool = False) -> None:
        if max_consecutive_failures < 1:
            raise ValueError("max_consecutive_failures: expected >= 1, "
                             f"got {max_consecutive_failures}")
        if not isinstance(deltas, bool):
            raise ValueError(f"deltas: expected a bool, got {deltas!r}")
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self.max_consecutive_failures = max_consecutive_failures
        self._add_options = {"deltas": True} if deltas else {}
        # AddRequest messages applied so far (read from the client's threads: an int, so a
        # torn read cannot happen).
        self.adds_seen = 0
        self._live: set[str] = set()   # requests added here and not yet finished or aborted
        # Requests whose constraint compiles on a worker: id -> (compile, message, aborted).
        self._compiling: dict[str, tuple[Future, AddRequest, bool]] = {}
        self._compile_pool: ThreadPoolExecutor | None = None

    def run(self) -> None:
        """Serve until :class:`Shutdown`, the client's end, or death (the outbox hears it)."""
        try:
            stopped = self._loop()
        except BaseException as exc:
            self._stop_compiles()
            message = f"the engine core died: {type(exc).__name__}: {exc}"
            logger.critical("%s", message, exc_info=not isinstance(exc, _TooManyFailures))
            self._abort_live()
            self.outbox.dead(message)
            return
        self._stop_compiles()
        self._abort_live()  # their blocks go back at whoever steps the engine next
        if stopped:
            self.outbox.flush()
            self.outbox.dead("the engine core was shut down")

    def _stop_compiles(self) -> None:
        """Drop the held requests (the client learns of the core's end) and their workers."""
        self._compiling.clear()
        if self._compile_pool is not None:
            self._compile_pool.shutdown(wait=False, cancel_futures=True)

    # ---- the loop -------------------------------------------------------------------------
    def _loop(self) -> bool:
        """True after Shutdown; False when the client is gone."""
        engine, outbox = self.engine, self.outbox
        failures = 0
        while True:
            self._admit_compiled()
            # Every live request paused: a step would compute nothing, so wait for a message.
            idle = not engine.has_unfinished_requests() or engine.only_paused_requests()
            if idle:  # no step will carry the last outputs out: deliver them now
                outbox.flush()
            try:
                wait = (COMPILE_POLL_S if self._compiling else None) if idle else 0.0
                message = self.inbox.get(wait)
                while message is not None:
                    if isinstance(message, Shutdown):
                        return True
                    self._apply(message)
                    message = self.inbox.get(0.0)
            except EOFError:
                return False
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step(overlap=outbox.flush)
            except TensorParallelError:
                raise                  # a rank is gone: no later step can succeed
            except Exception as exc:
                failures += 1
                logger.exception("engine step failed (%d in a row)", failures)
                failed = self._abort_live()
                text = (f"the engine failed while serving this request: "
                        f"{type(exc).__name__}: {exc}")
                if failures >= self.max_consecutive_failures:
                    raise _TooManyFailures(f"{failures} failed steps in a row, the last: "
                                           f"{type(exc).__name__}: {exc}") from exc
                outbox.failed(text, failed)
                continue
            failures = 0
            for output in outputs:
                request_id, finished = request_of(output)
                if finished:
                    self._live.discard(request_id)
            outbox.outputs(outputs, engine.stats, self.adds_seen)

    def _apply(self, message: Message) -> None:
        if isinstance(message, AddRequest):
            if self._compile_first(message):
                return
            self._add(message)
        elif isinstance(message, AbortRequest):
            held = self._compiling.get(message.request_id)
            if held is not None:    # added once compiled, then aborted: its output says so
                self._compiling[message.request_id] = (held[0], held[1], True)
                return
            # Its last output (finished, reason "abort") comes out of the next step.
            self.engine.abort_request(message.request_id)
            self._live.discard(message.request_id)
        elif isinstance(message, PauseRequest):
            # One still compiling has no output yet, so no consumer has fallen behind on it.
            self.engine.pause_request(message.request_id, message.paused)
        else:
            raise TypeError(f"the engine core cannot take a {type(message).__name__} message")

    def _compile_first(self, message: AddRequest) -> bool:
        """Start compiling ``message``'s constraint on a worker if the engine's grammar cache
        lacks it; True if it was held back for that."""
        constraint = message.params.structured_outputs
        structured = getattr(self.engine, "structured", None)
        if constraint is None or structured is None or constraint.key in structured.compiler.cache:
            return False
        if self._compile_pool is None:
            self._compile_pool = ThreadPoolExecutor(COMPILE_WORKERS,
                                                    thread_name_prefix="core-grammar")
        future = self._compile_pool.submit(structured.compiler.compile, constraint)
        self._compiling[message.request_id] = (future, message, False)
        return True

    def _admit_compiled(self) -> None:
        """Add the held requests whose compile is done (a failed compile fails in
        ``add_request`` as it would have, with the same message)."""
        for request_id, (future, message, aborted) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            if self._add(message) and aborted:
                self.engine.abort_request(request_id)
                self._live.discard(request_id)

    def _add(self, message: AddRequest) -> bool:
        """Add ``message``'s request to the engine; False if the engine refused it."""
        self.adds_seen += 1
        prompt = message.prompt if message.prompt is not None else message.prompt_token_ids
        try:
            self.engine.add_request(prompt, message.params, request_id=message.request_id,
                                    final_only=message.final_only,
                                    detokenize=message.detokenize, **self._add_options)
        except ValueError as exc:  # the client checked the same limits: a bug
            self.outbox.failed(f"the engine rejected {message.request_id}: {exc}",
                               [message.request_id])
            return False
        self._live.add(message.request_id)
        return True

    def _abort_live(self) -> list[str]:
        """Abort every live request (queued in the engine); returns their ids."""
        live = sorted(self._live)
        self._live.clear()
        for request_id in live:
            self.engine.abort_request(request_id)
        return live


class _TooManyFailures(RuntimeError):
    """The step failure that made the core give up."""


__all__ = ["CoreInbox", "CoreOutbox", "EngineCore"]
