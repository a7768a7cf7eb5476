"""The asyncio face of an engine client: per-request output queues for the request handlers.

The engine steps in its core (``engine/process/core.py``), on a thread or in a child process,
never here: requests from every client join its one continuous batch. Handlers call
:meth:`AsyncClient.submit`, which adds one engine request per prompt through the
``EngineClient``, and await their outputs on an ``asyncio.Queue``, filled from the client's
output thread through ``loop.call_soon_threadsafe`` (one wake-up per step and event loop).

Backpressure: a consumer that takes nothing (a stream whose client stopped reading makes its
handler wait in ``send``) leaves its request's newest output waiting while the engine makes more.
Once a request's waiting output is ``max_unsent_tokens`` tokens (in its longest completion) past
the last one taken, the request is paused in the engine (no compute, its KV kept, see
``LLMEngine.pause_request``) and resumed when its consumer takes an output again; a client that
never reads is then dropped by the server's send timeout, which aborts the request.

Failures: the engine cannot say which request made a step raise, so every request in flight at
that moment fails (HTTP 500), and the engine goes on with the next requests. Once the engine is
dead (too many failed steps in a row, an error outside a step, its process gone) every request
fails, ``/health`` answers 503 and new requests are refused.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from ..engine.outputs import EngineStats, RequestOutput
from ..engine.process.client import EngineClient, EngineDeadError

logger = logging.getLogger(__name__)


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
    """Where the outputs of one HTTP request's engine requests go (the route itself is looked
    up under AsyncClient._lock; the other fields are touched on ``loop`` only).

    ``queue`` holds request ids (an output is ready), failures and the cancel mark; ``latest``
    the newest output of each request not yet taken. Outputs are cumulative, so one that
    arrives while an earlier one still waits replaces it: a consumer that falls behind (a
    client that does not read its stream) holds one output per request, not one per step.
    """

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    latest: dict[str, RequestOutput] = field(default_factory=dict)
    # Backpressure (no client: none): the client to pause a request in, the bound, the tokens
    # of each request's output last taken, and the requests paused for their backlog.
    client: EngineClient | None = None
    max_unsent_tokens: int = 0
    taken: dict[str, int] = field(default_factory=dict)
    paused: set[str] = field(default_factory=set)

    def note_taken(self, out: RequestOutput) -> None:
        """The consumer took ``out``: a request paused for its backlog runs again."""
        if self.client is None:
            return
        self.taken[out.request_id] = _tokens(out)
        if out.request_id in self.paused:
            self.paused.discard(out.request_id)
            self.client.pause_request(out.request_id, False)

    def note_unsent(self, out: RequestOutput) -> None:
        """``out`` arrived while an earlier output of its request still waits to be taken."""
        rid = out.request_id
        if (self.client is not None and rid not in self.paused and not out.finished
                and _tokens(out) - self.taken.get(rid, 0) > self.max_unsent_tokens):
            self.paused.add(rid)
            self.client.pause_request(rid, True)


def _tokens(out: RequestOutput) -> int:
    """The tokens of ``out``'s longest completion."""
    return max((len(c.token_ids) for c in out.outputs), default=0)


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

    def __init__(self, engine: AsyncClient, request_ids: list[str], route: _Route):
        self.request_ids = request_ids
        self._engine = engine
        self._route = route
        self._queue = route.queue
        self._latest = route.latest
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
        if isinstance(item, str):   # a request id: its latest output is ready
            item = self._latest.pop(item)
            self._route.note_taken(item)
        if item is _CANCELLED:
            raise ClientGoneError("the client disconnected")
        if isinstance(item, _Failure):  # the failed ones are aborted; the others go too
            self.abort()
            raise RequestFailedError(item.message)
        if item.finished:
            if item.request_id in self._unfinished:
                self._engine._count_finished()
            self._unfinished.discard(item.request_id)
        return self._index[item.request_id], item

    def abort(self) -> None:
        """Abort the requests that have not finished (their blocks go back to the pool)."""
        if self._unfinished:
            self._engine._abort(sorted(self._unfinished))
            self._unfinished.clear()

    def cancel(self) -> None:
        """The client is gone: abort, and wake the consumer with :class:`ClientGoneError`."""
        self.abort()
        self._queue.put_nowait(_CANCELLED)


class AsyncClient:
    """Submits requests to an :class:`~mini_paged_attn.engine.process.client.EngineClient` and
    routes its outputs to asyncio queues (it is the client's output handler while started).

    Args:
        client: the engine client every request goes to.
        max_queue: at most this many requests may wait in the engine's queue (``num_waiting`` of
            its stats: admitted, not yet scheduled); beyond it :meth:`submit` raises
            :class:`QueueFullError`. None: no limit.
        max_unsent_tokens: a request whose waiting output is more than this many tokens past
            what its consumer took is paused until the consumer takes it (see the module doc).
            None: never paused.
        owns_client: :meth:`shutdown` shuts the client down too.
    """

    def __init__(self, client: EngineClient, *, max_queue: int | None = None,
                 max_unsent_tokens: int | None = None, owns_client: bool = False) -> None:
        if max_queue is not None and max_queue < 1:
            raise ValueError(f"max_queue: expected None or >= 1, got {max_queue}")
        if max_unsent_tokens is not None and (
                not isinstance(max_unsent_tokens, int) or isinstance(max_unsent_tokens, bool)
                or max_unsent_tokens < 1):
            raise ValueError(f"max_unsent_tokens: expected None or an int >= 1, got "
                             f"{max_unsent_tokens!r}")
        self.client = client
        self.max_queue = max_queue
        self.max_unsent_tokens = max_unsent_tokens
        self.owns_client = owns_client
        self.counters = ServerCounters()
        # Called with the final output of every request that finishes while its client waits
        # (on the client's output thread): what /metrics' latency histograms observe.
        self.on_finished: Callable[[RequestOutput], None] | None = None
        self._lock = threading.Lock()
        self._routes: dict[str, _Route] = {}
        self._started = False
        self._stopping = False
        self._dead_reason: str | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        if self._started:
            raise RuntimeError("the engine was already started")
        self._started = True
        self.client.set_output_handler(self)

    def shutdown(self) -> None:
        """Stop taking outputs; requests still in flight fail and are aborted."""
        self._stopping = True
        self.client.set_output_handler(None)
        self._fail_all("the server is shutting down", abort=True)
        if self.owns_client:
            self.client.shutdown()

    @property
    def alive(self) -> bool:
        return (self._started and not self._stopping and self.dead_reason is None)

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason or self.client.dead_reason

    def stats(self) -> EngineStats:
        """The engine's ``EngineStats`` (cheap and safe from any thread)."""
        return self.client.stats()

    # ---- called from asyncio handlers -------------------------------------------------------
    def submit(self, prompts: list[str | list[int]], params: Any) -> Submission:
        """Add one engine request per prompt; must be called on the handler's event loop.

        Raises:
            EngineDeadError: the engine is dead.
            QueueFullError: admitting them would exceed ``max_queue``.
            ValueError: the engine rejected a request (e.g. longer than max_model_len); none of
                them was added then.
        """
        if not self.alive:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        if self.max_queue is not None:
            # No race with other submissions: they all run on this one event loop thread, and
            # the client counts a request as waiting from add_request on.
            waiting = self.client.stats().num_waiting
            if waiting + len(prompts) > self.max_queue:
                with self._lock:
                    self.counters.requests_rejected += 1
                raise QueueFullError(f"{waiting} requests are waiting to be scheduled and the "
                                     f"limit is {self.max_queue} (--max-queue); retry later")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        request_ids = [f"req-{uuid.uuid4().hex}" for _ in prompts]
        route = _Route(loop, queue) if self.max_unsent_tokens is None else \
            _Route(loop, queue, client=self.client, max_unsent_tokens=self.max_unsent_tokens)
        with self._lock:  # routed before they are added, so no output can arrive unrouted
            for rid in request_ids:
                self._routes[rid] = route
        added: list[str] = []
        try:
            for rid, prompt in zip(request_ids, prompts):
                self.client.add_request(rid, prompt, params)
                added.append(rid)
        except BaseException:
            self._unroute(request_ids)
            for rid in added:
                self.client.abort_request(rid)
            raise
        return Submission(self, request_ids, route)

    def _abort(self, request_ids: list[str]) -> None:
        removed = self._unroute(request_ids)  # those not finished or failed yet
        if not removed:
            return
        for rid in removed:
            self.client.abort_request(rid)
        with self._lock:
            self.counters.requests_aborted += len(removed)

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

    # ---- the client's output thread (OutputHandler) -----------------------------------------
    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        deliveries = []
        finished = []
        with self._lock:
            for out in outputs:
                route = self._routes.get(out.request_id)
                if route is None:
                    continue  # aborted by its client while the step ran
                if out.finished:
                    del self._routes[out.request_id]
                    finished.append(out)
                deliveries.append((route, out))
        _deliver(deliveries)
        if self.on_finished is not None:
            for out in finished:
                self.on_finished(out)

    def on_failure(self, message: str, request_ids: list[str]) -> None:
        # The core aborted them already (every request of the failed step).
        with self._lock:
            routes = [route for rid in request_ids
                      if (route := self._routes.pop(rid, None)) is not None]
            self.counters.requests_failed += len(routes)
        _deliver([(route, _Failure(message)) for route in routes])

    def on_dead(self, message: str) -> None:
        if self._dead_reason is None:
            self._dead_reason = message
        logger.critical("the engine is dead: %s", message)
        self._fail_all(message, abort=False)

    def _fail_all(self, message: str, *, abort: bool) -> None:
        with self._lock:
            routes, self._routes = self._routes, {}
            self.counters.requests_failed += len(routes)
        _deliver([(route, _Failure(message)) for route in routes.values()])  # clients first
        if abort:
            for rid in routes:
                self.client.abort_request(rid)


def _deliver(deliveries: list[tuple[_Route, Any]]) -> None:
    """Hand each item to its route on the route's event loop: one wake-up per loop, not one
    per item."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Route, Any]]] = {}
    for route, item in deliveries:
        by_loop.setdefault(route.loop, []).append((route, item))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # that event loop is closed: the server is going away
            pass


def _put_all(items: list[tuple[_Route, Any]]) -> None:
    for route, item in items:
        if isinstance(item, _Failure):
            route.queue.put_nowait(item)
            continue
        if item.request_id not in route.latest:    # else the waiting mark covers this one
            route.queue.put_nowait(item.request_id)
        else:
            route.note_unsent(item)
        route.latest[item.request_id] = item
