"""The engine core's child process: :func:`run_core_process` and its pipe ends.

In one process the engine thread and the HTTP event loop take turns on the interpreter lock: on a
GPU, where a step is mostly Python waiting on short kernels, the event loop's per-chunk work
lengthens every step (docs/performance-notes.md, "Server"). Here the engine steps in a child
process, unhindered,
and sends each step's outputs while its next step runs on the GPU: the output deltas the
engine makes itself for requests added with ``deltas=True`` (``engine/deltas.py``: new token
ids; text only where stop strings need it), with no cumulative output built per step. The
parent's side is :class:`~mini_paged_attn.engine.process.mp_client.MPEngineClient`.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...models.load_progress import LoadEvent, ProgressCallback
from ..outputs import EngineStats
from .core import EngineCore
from .messages import EngineDead, Loading, Message, Outputs, Ready, StepFailed, decode, encode

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoreLaunch:
    """How the child builds its engine.

    ``engine_factory``: ``"module:function"``, called as ``function(model, **llm_kwargs)`` to
    make the ``LLMEngine`` (importable in the child); None: ``LLM(model, **llm_kwargs).engine``,
    whose load progress goes to the client. Tests use it to build engines that fail on purpose.
    """

    model: str
    llm_kwargs: dict = field(default_factory=dict)
    engine_factory: str | None = None
    max_consecutive_failures: int = 3

    def build_engine(self, load_progress: ProgressCallback | None = None) -> Any:
        if self.engine_factory is None:
            from ..llm import LLM
            return LLM(self.model, load_progress=load_progress, **self.llm_kwargs).engine
        module, _, name = self.engine_factory.partition(":")
        return getattr(importlib.import_module(module), name)(self.model, **self.llm_kwargs)


class PipeInbox:
    """The core's end of the client's command pipe."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def get(self, timeout: float | None) -> Message | None:
        if timeout is not None and not self._conn.poll(timeout):
            return None
        return decode(self._conn.recv_bytes())  # EOFError once the client is gone


class PipeOutbox:
    """The core's end of the result pipe; its core reports output deltas (``deltas=True``).
    A step's deltas wait to be sent until the next step has enqueued its device work
    (``flush`` is the step's ``overlap``): pickling and writing them then runs while the GPU
    computes, not between steps (inline, that work is a gap between steps; on a thread of its
    own, the interpreter lock puts it inside the next step's host phase;
    docs/performance-notes.md, "Server")."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._pending: tuple[list[tuple], EngineStats, int] | None = None

    def outputs(self, outputs: list[tuple], stats: Callable[[], EngineStats],
                adds_seen: int) -> None:
        self.flush()
        self._pending = (outputs, stats(), adds_seen)

    def flush(self) -> None:
        if self._pending is None:
            return
        outputs, stats, adds_seen = self._pending
        self._pending = None
        self.send(Outputs(outputs, stats, adds_seen))

    def failed(self, message: str, request_ids: list[str]) -> None:
        self.send(StepFailed(message, tuple(request_ids)))

    def dead(self, message: str) -> None:
        self.send(EngineDead(message))

    def send(self, message: Message) -> None:
        if self._pending is not None and not isinstance(message, Outputs):
            self.flush()  # in order
        self._conn.send_bytes(encode(message))


class _LoadingSender:
    """The load's progress for the client: every phase's first and last event, and between
    them at most one event a phase every :data:`PROGRESS_INTERVAL_S`. A client may still be
    importing its own stack when the load starts; fewer messages than the pipe's buffer holds
    keep the load from waiting for it."""

    def __init__(self, outbox: PipeOutbox) -> None:
        self._outbox = outbox
        self._last: dict[str, float] = {}

    def __call__(self, event: LoadEvent) -> None:
        now = time.monotonic()
        first = event.done == 0 and not event.finished
        if not (first or event.finished) and now - self._last.get(event.phase, 0.0) < \
                PROGRESS_INTERVAL_S:
            return
        self._last[event.phase] = now
        self._outbox.send(Loading(event))


PROGRESS_INTERVAL_S = 0.1


def run_core_process(launch: CoreLaunch, commands: Any, results: Any) -> None:
    """The child: build the engine, say :class:`Ready`, then serve until shut down.

    Args:
        launch: how to build the engine.
        commands: the receiving end of the client's command pipe.
        results: the sending end of the result pipe.
    """
    outbox = PipeOutbox(results)
    try:
        engine = launch.build_engine(_LoadingSender(outbox))
        outbox.send(Ready(engine.tokenizer, engine.model_config, engine.max_model_len,
                          engine.admission, engine.stats()))
        core = EngineCore(engine, PipeInbox(commands), outbox,
                          max_consecutive_failures=launch.max_consecutive_failures, deltas=True)
    except (ValueError, FileNotFoundError) as exc:   # what it was given cannot be loaded
        logger.debug("the engine could not start", exc_info=True)
        kind = "FileNotFoundError" if isinstance(exc, FileNotFoundError) else "ValueError"
        outbox.send(EngineDead(str(exc), user_error=kind))
        return
    except BaseException as exc:
        logger.exception("the engine could not start")
        outbox.send(EngineDead(f"the engine could not start: {type(exc).__name__}: {exc}"))
        return
    try:
        core.run()
    except OSError:  # the client is gone: nobody to tell
        pass
    finally:
        shutdown = getattr(engine, "shutdown", None)
        if shutdown is not None:    # the engine's tensor-parallel workers, if it has any
            shutdown()


__all__ = ["CoreLaunch", "PipeInbox", "PipeOutbox", "run_core_process"]
