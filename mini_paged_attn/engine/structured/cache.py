"""TemplateCache: compiled grammars kept by an estimate of their memory, not by their count.

A compiled matcher holds its grammar, lexer and parser tables, which grow with the grammar's
text: measured on the tiny model (RSS after compiling, then computing the first mask), a 64 KiB
regex kept ~7 MB, a 280 kB one ~58 MB, a 1 MB one ~203 MB; ~100-210 bytes per byte of grammar.
:func:`estimate_bytes` takes the high end with a floor, so the byte budget holds for the grammars
that cost the most per byte; small schemas cost little either way.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

# Bytes kept per byte of llguidance grammar text (the high end of the measurements above), and
# the least one entry is counted (the matcher's fixed tables).
BYTES_PER_GRAMMAR_BYTE = 256
MIN_ENTRY_BYTES = 64 * 1024


def estimate_bytes(grammar_text: str) -> int:
    """What a template compiled from ``grammar_text`` (llguidance's grammar) is counted as."""
    return max(MIN_ENTRY_BYTES, BYTES_PER_GRAMMAR_BYTE * len(grammar_text))


class TemplateCache:
    """Least recently used templates, ``max_bytes`` of estimates in all; an entry over
    ``max_entry_bytes`` is never kept. Safe from any thread.

    Args:
        max_bytes: the estimates' sum never exceeds it.
        max_entry_bytes: the largest estimate kept.
    """

    def __init__(self, max_bytes: int, max_entry_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.max_entry_bytes = min(max_entry_bytes, max_bytes)
        self._lock = threading.Lock()
        self._entries: OrderedDict[Any, tuple[Any, int]] = OrderedDict()
        self._bytes = 0

    def get(self, key: Any) -> Any | None:
        """The template for ``key`` (now the most recently used), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: Any, template: Any, size: int) -> bool:
        """Keep ``template`` counted as ``size`` bytes, dropping the least recently used ones
        to make room; False (nothing changes) if ``size`` is over the entry cap."""
        if size > self.max_entry_bytes:
            return False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            while self._entries and self._bytes + size > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped
            self._entries[key] = (template, size)
            self._bytes += size
        return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    @property
    def bytes(self) -> int:
        """The estimates of the kept templates, summed."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Any) -> bool:
        return key in self._entries


__all__ = ["BYTES_PER_GRAMMAR_BYTE", "MIN_ENTRY_BYTES", "TemplateCache", "estimate_bytes"]
