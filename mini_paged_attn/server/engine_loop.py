"""One engine thread for the whole server, and the bridge from it to asyncio request handlers.

The engine thread runs ``LLMEngine.step()`` while any request is unfinished and sleeps otherwise;
requests from every client join the engine's one continuous batch (this file schedules nothing).
Handlers call ``LLMEngine.add_request`` / ``abort_request`` directly (both are thread-safe) and
receive their outputs on an ``asyncio.Queue``, filled from the engine thread through
``loop.call_soon_threadsafe``.

Failures: the engine cannot say which request made a ``step()`` raise, so every request in flight
at that moment fails (HTTP 500) and is aborted, and the loop goes on with the next requests. After
``max_consecutive_failures`` failed steps in a row, or an error outside ``step()``, the loop is
dead: every request fails, ``/health`` answers 503 and new requests are refused.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class QueueFullError(RuntimeError):
    """Admitting the request would put more than ``max_queue`` requests in the waiting queue."""


class RequestFailedError(RuntimeError):
    """The engine failed while serving this request (the server goes on)."""


class ClientGoneError(Exception):
    """The client disconnected; the request was aborted."""


@dataclass
class _Failure:
    message: str


_CANCELLED = object()


@dataclass
class _Route:
    """Where the outputs of one engine request go (touched under EngineLoop._lock)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass
class ServerCounters:
    """Totals since the server started, for /metrics."""

    requests_finished: int = 0
    requests_aborted: int = 0
    requests_failed: int = 0
    requests_rejected: int = 0


class Submission:
    """The engine requests of one HTTP request (one per prompt); their outputs share one queue.

    Iterate it (``async for index, output in submission``) to get ``(prompt index, RequestOutput)``
    until every request has finished. Raises :class:`RequestFailedError` if the engine failed,
    :class:`ClientGoneError` after :meth:`cancel`. :meth:`abort` is idempotent and cheap: call it
    in a ``finally``.
    """

    def __init__(self, engine_loop: EngineLoop, request_ids: list[str], queue: asyncio.Queue):
        self.request_ids = request_ids
        self._engine_loop = engine_loop
        self._queue = queue
        self._index = {rid: i for i, rid in enumerate(request_ids)}
        self._unfinished = set(request_ids)

    @property
    def done(self) -> bool:
        return not self._unfinished

    def __aiter__(self) -> AsyncIterator[tuple[int, Any]]:
        return self

    async def __anext__(self) -> tuple[int, Any]:
        if not self._unfinished:
            raise StopAsyncIteration
        return self._take(await self._queue.get())

    def ready(self) -> list[tuple[int, Any]]:
        """The outputs already queued, without waiting (a consumer that fell behind uses the
        latest output of each request: text and token ids only grow)."""
        items = []
        while self._unfinished and not self._queue.empty():
            items.append(self._take(self._queue.get_nowait()))
        return items

    def _take(self, item: Any) -> tuple[int, Any]:
        if item is _CANCELLED:
            raise ClientGoneError("the client disconnected")
        if isinstance(item, _Failure):  # the engine thread already aborted them all
            self._unfinished.clear()
            raise RequestFailedError(item.message)
        if item.finished:
            if item.request_id in self._unfinished:
                self._engine_loop._count_finished()
            self._unfinished.discard(item.request_id)
        return self._index[item.request_id], item

    def abort(self) -> None:
        """Abort the requests that have not finished (their blocks go back to the pool)."""
        if self._unfinished:
            self._engine_loop._abort(sorted(self._unfinished))
            self._unfinished.clear()

    def cancel(self) -> None:
        """The client is gone: abort, and wake the consumer with :class:`ClientGoneError`."""
        self.abort()
        self._queue.put_nowait(_CANCELLED)


@dataclass
class EngineLoop:
    """Runs ``engine.step()`` on one thread and routes outputs to asyncio queues.

    Args:
        engine: an ``LLMEngine`` (anything with its add_request / abort_request / step /
            has_unfinished_requests / stats).
        max_queue: at most this many requests may wait in the engine's queue (``num_waiting`` of
            its stats: admitted, not yet scheduled); beyond it :meth:`submit` raises
            :class:`QueueFullError`. None: no limit.
        max_consecutive_failures: failed steps in a row after which the loop is declared dead.
    """

    engine: Any
    max_queue: int | None = None
    max_consecutive_failures: int = 3
    counters: ServerCounters = field(default_factory=ServerCounters)

    def __post_init__(self) -> None:
        if self.max_queue is not None and self.max_queue < 1:
            raise ValueError(f"max_queue: expected None or >= 1, got {self.max_queue}")
        if self.max_consecutive_failures < 1:
            raise ValueError("max_consecutive_failures: expected >= 1, "
                             f"got {self.max_consecutive_failures}")
        self._lock = threading.Lock()
        self._routes: dict[str, _Route] = {}
        self._wake = threading.Event()
        self._step_wanted = False  # an abort to apply even if nothing is unfinished
        self._stopping = False
        self._dead_reason: str | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine loop was already started")
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread after its current step; requests still in flight fail."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._fail_all("the server is shutting down", abort=True)

    @property
    def alive(self) -> bool:
        return (self._thread is not None and self._thread.is_alive()
                and self._dead_reason is None and not self._stopping)

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    def stats(self) -> Any:
        """The engine's ``EngineStats`` (its stats() is cheap and safe from any thread)."""
        return self.engine.stats()

    # ---- called from asyncio handlers -------------------------------------------------------
    def submit(self, prompts: list[str | list[int]], params: Any) -> Submission:
        """Add one engine request per prompt; must be called on the handler's event loop.

        Raises:
            EngineDeadError: the loop has died.
            QueueFullError: admitting them would exceed ``max_queue``.
            ValueError: the engine rejected a request (e.g. longer than max_model_len); none of
                them was added then.
        """
        if not self.alive:
            raise EngineDeadError(self._dead_reason or "the engine loop is not running")
        if self.max_queue is not None:
            # No race with other submissions: they all run on this one event loop thread, and
            # the engine counts a request as waiting from add_request on.
            waiting = self.engine.stats().num_waiting
            if waiting + len(prompts) > self.max_queue:
                with self._lock:
                    self.counters.requests_rejected += 1
                raise QueueFullError(f"{waiting} requests are waiting to be scheduled and the "
                                     f"limit is {self.max_queue} (--max-queue); retry later")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        request_ids = [f"req-{uuid.uuid4().hex}" for _ in prompts]
        route = _Route(loop, queue)
        with self._lock:  # routed before they are added, so no output can arrive unrouted
            for rid in request_ids:
                self._routes[rid] = route
        added: list[str] = []
        try:
            for rid, prompt in zip(request_ids, prompts):
                self.engine.add_request(prompt, params, request_id=rid)
                added.append(rid)
        except BaseException:
            self._unroute(request_ids)
            for rid in added:
                self.engine.abort_request(rid)
            self._wake.set()
            raise
        self._wake.set()
        return Submission(self, request_ids, queue)

    def _abort(self, request_ids: list[str]) -> None:
        removed = self._unroute(request_ids)  # those the engine thread has not finished or failed
        if not removed:
            return
        for rid in removed:
            self.engine.abort_request(rid)
        with self._lock:
            self.counters.requests_aborted += len(removed)
        self._step_wanted = True
        self._wake.set()

    def _count_finished(self) -> None:
        with self._lock:
            self.counters.requests_finished += 1

    def _unroute(self, request_ids: list[str]) -> list[str]:
        removed = []
        with self._lock:
            for rid in request_ids:
                if self._routes.pop(rid, None) is not None:
                    removed.append(rid)
        return removed

    # ---- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        failures = 0
        try:
            while not self._stopping:
                self._wake.clear()  # before looking for work, so no wake-up is lost
                if not (self._step_wanted or self.engine.has_unfinished_requests()):
                    self._wake.wait()
                    continue
                self._step_wanted = False
                try:
                    outputs = self.engine.step()
                except Exception as exc:
                    failures += 1
                    logger.exception("engine step failed (%d in a row)", failures)
                    if failures >= self.max_consecutive_failures:
                        raise
                    self._fail_all(f"the engine failed while serving this request: "
                                   f"{type(exc).__name__}: {exc}", abort=True)
                    continue
                failures = 0
                self._dispatch(outputs)
        except BaseException as exc:  # the loop is dead: say so everywhere
            self._dead_reason = f"the engine loop died: {type(exc).__name__}: {exc}"
            logger.critical("%s", self._dead_reason, exc_info=True)
            try:  # the aborts are queued; whoever steps the engine next frees their blocks
                self._fail_all(self._dead_reason, abort=True)
            except Exception:
                logger.exception("aborting the requests of a dead engine loop failed")

    def _dispatch(self, outputs: list[Any]) -> None:
        deliveries = []
        with self._lock:
            for out in outputs:
                route = self._routes.get(out.request_id)
                if route is None:
                    continue  # aborted by its client while the step ran
                if out.finished:
                    del self._routes[out.request_id]
                deliveries.append((route, out))
        _deliver(deliveries)

    def _fail_all(self, message: str, *, abort: bool) -> None:
        with self._lock:
            routes, self._routes = self._routes, {}
            self.counters.requests_failed += len(routes)
        _deliver([(route, _Failure(message)) for route in routes.values()])  # clients first
        if abort:
            self._step_wanted = True
            for rid in routes:
                self.engine.abort_request(rid)


def _deliver(deliveries: list[tuple[_Route, Any]]) -> None:
    """Put each item on its route's queue: one wake-up per event loop, not one per item."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
    for route, item in deliveries:
        by_loop.setdefault(route.loop, []).append((route.queue, item))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # that event loop is closed: the server is going away
            pass


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)
