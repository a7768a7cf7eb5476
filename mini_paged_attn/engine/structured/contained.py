"""Running llguidance's compiler where its failures stay contained.

llguidance compiles recursively in native code, and a Rust panic reaches Python as pyo3's
``PanicException``, a ``BaseException`` that ``except Exception`` lets through. :func:`run_native`
calls a function on a fresh thread with a stack far larger than the bounds of
:class:`~.limits.GrammarLimits` let a compile use, waits for it at most the limits' timeout, and
turns whatever it raises into a ``ValueError`` naming the field (a panic is logged with an error
id, which the message carries).

A compile past its budget cannot be interrupted and runs on in the background: at most
:data:`MAX_RUNNING` compile threads exist at once, so such compiles cannot pile up; a call that
finds every slot taken for its whole budget is refused like a compile over the budget.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")
# threading.stack_size() applies to every thread started after it: set and restored around
# our own thread's start, one start at a time.
_STACK_SIZE_LOCK = threading.Lock()
# Compile threads alive at once, in this process (a timed-out one keeps its slot until it ends).
MAX_RUNNING = 4
_RUNNING = threading.BoundedSemaphore(MAX_RUNNING)


class _Outcome:
    """What the compile thread produced (written by it, read after join)."""

    __slots__ = ("value", "error")

    def __init__(self) -> None:
        self.value = None
        self.error: BaseException | None = None


def run_native(fn: Callable[[], T], *, where: str, stack_bytes: int, timeout_s: float) -> T:
    """``fn()`` on a thread with a ``stack_bytes`` stack; its result.

    Raises:
        ValueError: ``where: ...``: ``fn`` raised a ValueError (its message, the field
            prefix added if missing), panicked or raised anything else (logged with an error
            id), or did not finish within ``timeout_s`` (it goes on in the background, its
            result dropped: a native call cannot be interrupted), or found no free compile
            slot within ``timeout_s`` (:data:`MAX_RUNNING`).
    """
    outcome = _Outcome()
    started = time.monotonic()
    if not _RUNNING.acquire(timeout=timeout_s):
        logger.warning("%s: refused, %d grammar compiles still running", where, MAX_RUNNING)
        raise ValueError(f"{where}: the server's grammar compiler is busy with {MAX_RUNNING} "
                         "compiles; try again later")

    def body() -> None:
        try:
            outcome.value = fn()
        except BaseException as exc:   # pyo3's PanicException is a BaseException
            outcome.error = exc
        finally:
            _RUNNING.release()

    thread = threading.Thread(target=body, name="grammar-compile", daemon=True)
    with _STACK_SIZE_LOCK:
        before = threading.stack_size(stack_bytes)
        try:
            thread.start()
        except BaseException:
            _RUNNING.release()
            raise
        finally:
            threading.stack_size(before)
    thread.join(max(0.0, timeout_s - (time.monotonic() - started)))
    if thread.is_alive():
        logger.warning("%s: compiling took over %s s; refused (the compile goes on in the "
                       "background)", where, timeout_s)
        raise ValueError(f"{where}: compiling it took over {timeout_s} s (the server's "
                         "budget); simplify the constraint")
    error = outcome.error
    if error is None:
        return outcome.value
    if isinstance(error, ValueError):
        message = str(error)
        raise ValueError(message if message.startswith(where) else f"{where}: {message}") \
            from None
    error_id = uuid.uuid4().hex[:12]
    logger.error("%s: the grammar compiler failed (error id %s)", where, error_id,
                 exc_info=(type(error), error, error.__traceback__))
    raise ValueError(f"{where}: the grammar compiler could not compile this constraint "
                     f"({type(error).__name__}; error id {error_id})") from None


__all__ = ["MAX_RUNNING", "run_native"]
