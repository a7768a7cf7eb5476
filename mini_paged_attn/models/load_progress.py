"""Where a model's load time goes: named phases, their progress and a one-line summary.

The loader, the tokenizer and the model runner each time their part of a load through one
:class:`LoadTimer` (config, tokenizer, weights, KV pool, CUDA graphs, warm-up). Library code
only reports: a caller that wants a progress bar passes a callback, which gets a
:class:`LoadEvent` when a phase starts, as it advances and when it ends (the command line
draws one bar over the whole load from them, ``commands/progress.py``); the summary goes to
the log at INFO, e.g. ``loaded in 4.1 s: config 0.1, tokenizer 0.3, weights 2.3, ...``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class LoadEvent:
    """One step of a load: phase ``phase`` has done ``done`` of its ``total`` units (tensors
    for the weights, 1 for a phase that does not count); ``finished`` on its last event,
    with ``elapsed_s`` its time so far."""

    phase: str
    done: int
    total: int
    finished: bool
    elapsed_s: float


ProgressCallback = Callable[[LoadEvent], None]


class LoadPhase:
    """A running phase of a :class:`LoadTimer`; :meth:`advance` reports units done."""

    def __init__(self, timer: LoadTimer, name: str, total: int) -> None:
        self.timer, self.name, self.total = timer, name, total
        self.done = 0
        self.start = time.perf_counter()

    def advance(self, units: int = 1) -> None:
        self.done = min(self.total, self.done + units)
        self.timer._emit(self, finished=False)


class LoadTimer:
    """Times the phases of one load; ``callback`` (optional) sees every :class:`LoadEvent`.

    A phase run twice (two files' weights, say) adds up under its name, in the order the
    phases first ran. Phases may run on several threads (the tokenizer loads beside the
    weights): the callback sees one event at a time, and a phase marked ``concurrent`` is
    named so in the summary (its seconds overlap the others').
    """

    def __init__(self, callback: ProgressCallback | None = None) -> None:
        if callback is not None and not callable(callback):
            raise ValueError(f"load_progress: expected a callable taking a LoadEvent, got "
                             f"{type(callback).__name__}")
        self.callback = callback
        self.start = time.perf_counter()
        self.durations: dict[str, float] = {}
        self.concurrent: set[str] = set()
        # One event at a time reaches the callback (a progress bar, a pipe to a parent).
        self._lock = threading.Lock()

    @contextmanager
    def phase(self, name: str, total: int = 1, *,
              concurrent: bool = False) -> Iterator[LoadPhase]:
        """Time the ``with`` block as phase ``name`` of ``total`` units (>= 1);
        ``concurrent``: it runs beside the other phases, on a thread of its own."""
        assert total >= 1, total
        running = LoadPhase(self, name, total)
        if concurrent:
            self.concurrent.add(name)
        self._emit(running, finished=False)
        try:
            yield running
        finally:
            elapsed = time.perf_counter() - running.start
            with self._lock:
                self.durations[name] = self.durations.get(name, 0.0) + elapsed
            running.done = running.total
            self._emit(running, finished=True)

    def _emit(self, running: LoadPhase, *, finished: bool) -> None:
        if self.callback is not None:
            with self._lock:
                self.callback(LoadEvent(running.name, running.done, running.total, finished,
                                        time.perf_counter() - running.start))

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start

    def summary(self) -> str:
        """``"loaded in 4.1 s: config 0.1, weights 2.3, ..."`` (seconds, phases in order; a
        concurrent phase as ``tokenizer 0.3 (in parallel)``)."""
        with self._lock:
            durations = dict(self.durations)
        parts = ", ".join(f"{name} {seconds:.1f}" + (" (in parallel)" if name in self.concurrent
                                                     else "")
                          for name, seconds in durations.items())
        return f"loaded in {self.elapsed_s():.1f} s" + (f": {parts}" if parts else "")


def timer_or_new(timer: LoadTimer | None) -> LoadTimer:
    """``timer``, or a fresh one without a callback (for callers that time nothing)."""
    return timer if timer is not None else LoadTimer()


__all__ = ["LoadEvent", "LoadPhase", "LoadTimer", "ProgressCallback", "timer_or_new"]
