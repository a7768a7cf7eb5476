"""A time budget for each tensor-parallel step, so a stalled rank fails the step like a dead one.

A rank that dies breaks rank 0's collective at once (gloo sees the closed socket). A rank that
is alive but does not take part (stopped by SIGSTOP, hung in a driver call) leaves rank 0
waiting in the collective until the group's own timeout (``distributed_timeout_s``, 120 s by
default, for every client of the engine). :class:`StepWatchdog` is one thread that rank 0
arms when it sends a step and disarms when the step is over; a step still armed after
``timeout_s`` makes it report which ranks stalled and kill every worker (SIGKILL stops a
stopped process too), which breaks the collective exactly as a death does. The engine is
failed from then on, as after any tensor-parallel failure.

On CUDA, rank 0's part of a step returns once its kernels are queued; a collective that never
completes on the device is caught by NCCL's own timeout instead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)


def _process_state(pid: int | None) -> str | None:
    """The kernel's one-letter state of ``pid`` ("T": stopped), or None where unknown."""
    if pid is None:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[0] if ")" in stat else None


def describe_stall(processes: list, timeout_s: float) -> str:
    """Why a step did not finish: which workers are stopped, or that none answered."""
    stopped = [f"rank {rank} (pid {p.pid})" for rank, p in enumerate(processes, start=1)
               if _process_state(p.pid) in ("T", "t")]
    who = (f"{', '.join(stopped)} is stopped" if len(stopped) == 1
           else f"{', '.join(stopped)} are stopped" if stopped
           else "a worker did not take part")
    return (f"a tensor-parallel step did not finish within {timeout_s:g} s (step_timeout_s): "
            f"{who}; the workers were killed; shut the engine down")


class StepWatchdog:
    """Kill ``processes`` when a step stays armed longer than ``timeout_s``.

    Args:
        timeout_s: the budget of one step, seconds > 0.
        processes: the worker processes (``multiprocessing`` Process objects).
        on_stall: called with the reason (:func:`describe_stall`) before the kill, on the
            watchdog's thread.
    """

    def __init__(self, timeout_s: float, processes: list,
                 on_stall: Callable[[str], None]) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: expected a number > 0, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self._processes = processes
        self._on_stall = on_stall
        self._changed = threading.Condition()
        self._deadline: float | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._watch, name="tp-step-watchdog",
                                        daemon=True)
        self._thread.start()

    def arm(self) -> None:
        """A step starts now."""
        with self._changed:
            self._deadline = time.monotonic() + self.timeout_s
            self._changed.notify()

    def disarm(self) -> None:
        """The step is over (cheap: no wake-up; the thread sees it at its deadline)."""
        with self._changed:
            self._deadline = None

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(5.0)

    def _watch(self) -> None:
        with self._changed:
            while not self._closed:
                if self._deadline is None:
                    self._changed.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._changed.wait(left)
                    continue
                self._deadline = None
                reason = describe_stall(self._processes, self.timeout_s)
                self._closed = True
                break
            else:
                return
        try:
            self._on_stall(reason)
        finally:
            for process in self._processes:
                if process.is_alive():
                    process.kill()
