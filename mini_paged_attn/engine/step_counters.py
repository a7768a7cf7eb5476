"""StepCounters: what the engine's steps did, for ``LLMEngine.stats()``: totals, and the output
tokens per second of the recent steps.

The stepping thread counts; any thread may read (the server's engine process takes a snapshot
after every step), so the window of recent steps sits behind a lock of its own.
"""

from __future__ import annotations

import threading
import time
from collections import deque

# Seconds of recent steps over which the generation rate is measured.
RATE_WINDOW_S = 10.0


class StepCounters:
    """Totals since the engine started, and a window of the latest :data:`RATE_WINDOW_S`
    seconds of steps for the rate. Times are ``time.perf_counter()`` seconds."""

    def __init__(self) -> None:
        self.num_steps = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests_finished = 0
        # Steps launched with cascade (shared-prefix) attention (``core.cascade``).
        self.cascade_steps = 0
        self._lock = threading.Lock()
        self._recent: deque[tuple[float, float, int]] = deque()   # (start, end, tokens)
        self._recent_tokens = 0                                    # sum of their tokens

    def count_step(self, num_prefill_tokens: int, num_generated: int, start: float) -> None:
        """A step that began at ``start`` ended now: it computed ``num_prefill_tokens`` prompt
        tokens and gave ``num_generated`` samples a token (stepping thread)."""
        end = time.perf_counter()
        self.num_steps += 1
        self.prompt_tokens += num_prefill_tokens
        self.generation_tokens += num_generated
        with self._lock:
            self._recent.append((start, end, num_generated))
            self._recent_tokens += num_generated
            while self._recent and self._recent[0][1] < end - RATE_WINDOW_S:
                self._recent_tokens -= self._recent.popleft()[2]

    def generation_rate(self) -> float:
        """Output tokens per second over the recent window; 0.0 when no step ended in it
        (any thread, O(1))."""
        with self._lock:
            if not self._recent:
                return 0.0
            first, last = self._recent[0], self._recent[-1]
            tokens = self._recent_tokens
        if last[1] <= time.perf_counter() - RATE_WINDOW_S:
            return 0.0
        span = last[1] - first[0]
        return tokens / span if span > 0 else 0.0


__all__ = ["RATE_WINDOW_S", "StepCounters"]
