"""What a frontend (the HTTP server, a benchmark) sees of an engine: an :class:`EngineClient`.

A client validates and sends requests to an :class:`~mini_paged_attn.engine.process.core.
EngineCore`, which steps the engine on its own, and hands the outputs to an
:class:`OutputHandler`, one step's outputs per call, on a thread of the client's (never the
caller's). The frontend never steps an engine. Two implementations:

- :class:`InprocEngineClient`: the core runs on a thread of this process; the engine makes the
  text. Cheapest on a CPU, where the engine's own threads use the cores.
- :class:`~mini_paged_attn.engine.process.mp_client.MPEngineClient`: the core runs in a child
  process; the client makes the text from token ids, off the engine's interpreter lock.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol, runtime_checkable

from ..outputs import EngineStats, RequestOutput
from ..sampling_params import SamplingParams
from .core import EngineCore
from .messages import AbortRequest, AddRequest, Message, PauseRequest, Shutdown

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core has stopped; no request can be served."""


class OutputHandler(Protocol):
    """Receives what an :class:`EngineClient` delivers, on the client's output thread."""

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        """One step's cumulative outputs (a request's text and token ids only grow)."""

    def on_failure(self, message: str, request_ids: list[str]) -> None:
        """These requests failed (the step serving them raised) and were aborted."""

    def on_dead(self, message: str) -> None:
        """The engine is dead or shut down: every live request is lost, nothing more comes."""


@runtime_checkable
class EngineClient(Protocol):
    """An engine seen from outside its core: requests in, outputs to a handler, stats.

    ``tokenizer``, ``model_config`` and ``max_model_len`` are the engine's.
    """

    tokenizer: Any
    model_config: Any
    max_model_len: int

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None, *, final_only: bool = False) -> None:
        """Validate and queue a request.

        Raises:
            ValueError: a bad prompt, params or id (nothing is queued then).
            EngineDeadError: the engine is dead.
        """

    def abort_request(self, request_id: str) -> bool:
        """Abort a live request (its blocks are freed at the core's next step); returns whether
        it was live. Its outputs delivered after this call are stale: ignore them."""

    def pause_request(self, request_id: str, paused: bool = True) -> bool:
        """Pause a live request (it gets no compute and keeps its KV, see
        ``LLMEngine.pause_request``) or resume it, at the core's next step; for a consumer that
        has stopped taking its output. Returns whether it was live."""

    def stats(self) -> EngineStats:
        """The engine's latest stats, counting requests sent but not yet in the engine as
        waiting."""

    def set_output_handler(self, handler: OutputHandler | None) -> None:
        """Where outputs go from now on (None: dropped)."""

    @property
    def dead_reason(self) -> str | None:
        """None while the engine serves; else why it stopped."""

    def shutdown(self) -> None:
        """Stop the core; live requests are aborted and the handler hears ``on_dead``."""


class ClientBookkeeping:
    """What both clients keep: the live requests (id -> the client's state of it), the handler,
    the engine's death, the count of requests sent (for stats), and the checks before sending
    (:meth:`_admit`)."""

    def __init__(self, tokenizer: Any, admission: Any) -> None:
        self.tokenizer = tokenizer
        # The engine's limits (its ``grammar`` compiles constraints before admission).
        self.admission = self._admission = admission
        self._lock = threading.Lock()
        self._live: dict[str, Any] = {}
        self._handler: OutputHandler | None = None
        self._dead_reason: str | None = None
        self._sent_adds = 0

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    def set_output_handler(self, handler: OutputHandler | None) -> None:
        self._handler = handler

    def _admit(self, request_id: str, prompt: Any, params: SamplingParams | None
               ) -> tuple[SamplingParams, str | None, list[int]]:
        """Validate a request against the engine's own limits and make it live here; raises
        before anything changes. Returns ``(params, prompt text or None, prompt ids)``."""
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        if not isinstance(request_id, str):
            raise ValueError(f"request_id: expected a str, got {request_id!r}")
        params, text, ids = self._admission.check(prompt, params, self.tokenizer)
        with self._lock:
            if request_id in self._live:
                raise ValueError(f"request_id: expected a new id, got {request_id!r}")
            self._live[request_id] = self._new_state(params, text, ids)
            self._sent_adds += 1
        return params, text, ids

    def _new_state(self, params: SamplingParams, text: str | None, ids: list[int]) -> Any:
        """What the client keeps of a live request (the in-process client: its params)."""
        return params

    def _is_live(self, request_id: str, paused: Any) -> bool:
        """Whether ``request_id`` is live here (a pause or resume for it goes to the core);
        raises on a ``paused`` that is not a bool, before anything is sent."""
        if not isinstance(paused, bool):
            raise ValueError(f"paused: expected a bool, got {paused!r}")
        with self._lock:
            return request_id in self._live

    def _forget(self, request_id: str) -> bool:
        """Whether it was live here (it is not any more)."""
        with self._lock:
            return self._live.pop(request_id, None) is not None

    def _on_failed(self, message: str, request_ids: list[str] | tuple[str, ...]) -> None:
        """The core failed these requests: forget them, and tell the handler of those that were
        still live here (not aborted meanwhile)."""
        with self._lock:
            hit = [r for r in request_ids if self._live.pop(r, None) is not None]
        handler = self._handler
        if handler is not None and hit:
            handler.on_failure(message, hit)

    def _die(self, message: str) -> None:
        """Record the engine's death (first reason wins) and tell the handler."""
        with self._lock:
            if self._dead_reason is None:
                self._dead_reason = message
            self._live.clear()
        handler = self._handler
        if handler is not None:
            handler.on_dead(message)


class _QueueInbox:
    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[Message] = queue.SimpleQueue()

    def get(self, timeout: float | None) -> Message | None:
        try:
            return self.queue.get(timeout=timeout) if timeout != 0.0 else \
                self.queue.get_nowait()
        except queue.Empty:
            return None


class InprocEngineClient(ClientBookkeeping):
    """An ``LLMEngine`` stepped by an :class:`EngineCore` on a thread of this process.

    Outputs reach the handler on that thread, as the engine made them (text included).

    Args:
        engine: the ``LLMEngine`` (or an object with its add_request / abort_request /
            pause_request / step / has_unfinished_requests / only_paused_requests / stats /
            tokenizer / model_config / max_model_len / admission). While this client runs, no one else may step it.
        max_consecutive_failures: failed steps in a row after which the engine is dead.
    """

    def __init__(self, engine: Any, *, max_consecutive_failures: int = 3) -> None:
        super().__init__(engine.tokenizer, engine.admission)
        self.engine = engine
        self.model_config = engine.model_config
        self.max_model_len = engine.max_model_len
        self._inbox = _QueueInbox()
        self._core = EngineCore(engine, self._inbox, _HandlerOutbox(self),
                                max_consecutive_failures=max_consecutive_failures)
        self._thread = threading.Thread(target=self._core.run, name="engine-core",
                                        daemon=True)
        self._thread.start()

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None, *, final_only: bool = False) -> None:
        params, text, ids = self._admit(request_id, prompt, params)
        self._inbox.queue.put(AddRequest(request_id, text, ids, params, True, final_only))

    def abort_request(self, request_id: str) -> bool:
        if not self._forget(request_id):
            return False
        self._inbox.queue.put(AbortRequest(request_id))
        return True

    def pause_request(self, request_id: str, paused: bool = True) -> bool:
        if not self._is_live(request_id, paused):
            return False
        self._inbox.queue.put(PauseRequest(request_id, paused))
        return True

    def stats(self) -> EngineStats:
        stats = self.engine.stats()  # O(1) and safe from any thread
        return replace(stats, num_waiting=stats.num_waiting + self._sent_adds
                       - self._core.adds_seen)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core thread after its current step; live requests are aborted in the
        engine (whoever steps it next frees their blocks)."""
        self._inbox.queue.put(Shutdown())
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the engine core thread did not stop within %s s", timeout)


class _HandlerOutbox:
    """The in-process core's outbox: straight to the client's handler."""

    def __init__(self, client: InprocEngineClient) -> None:
        self._client = client

    def outputs(self, outputs: list[RequestOutput], stats: Callable[[], EngineStats],
                adds_seen: int) -> None:
        client = self._client
        finished = [o.request_id for o in outputs if o.finished]
        if finished:
            with client._lock:
                for request_id in finished:
                    client._live.pop(request_id, None)
        handler = client._handler
        if handler is not None and outputs:
            handler.on_outputs(outputs)

    def flush(self) -> None:
        pass

    def failed(self, message: str, request_ids: list[str]) -> None:
        self._client._on_failed(message, request_ids)

    def dead(self, message: str) -> None:
        self._client._die(message)


__all__ = ["ClientBookkeeping", "EngineClient", "EngineDeadError", "InprocEngineClient",
           "OutputHandler"]
