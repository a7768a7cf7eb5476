"""Prompt lookup (n-gram) proposals for speculative decoding, in numpy (no torch).

A sequence whose output repeats its own text (code edits, summaries quoting their source)
can be continued by looking its last ``n`` tokens up in its earlier tokens, prompt and output
alike: the tokens that followed the latest earlier occurrence are a guess at what comes next,
which the target model then verifies in one forward (``engine/spec/``). ``n`` goes from
``max_n`` down to ``min_n``: a longer match is a better guess, a shorter one finds more.

:func:`propose_ngram` looks one array up. :class:`NgramProposer` keeps each sequence's tokens
in a growing numpy buffer, so a step costs the new tokens' copy and the lookup, not a list's
conversion: the lookup first finds the earlier positions holding the last token (one
vectorised comparison), then extends only those backwards, so it reads the sequence about once
whatever ``n`` is.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

# Tokens a fresh buffer holds; it doubles when full.
_INITIAL_CAPACITY = 256


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """The up to ``k`` tokens that followed the latest earlier occurrence of the last ``n``
    tokens of ``tokens``, for the largest ``n`` in ``max_n .. min_n`` that occurs; empty when
    none does (or ``k`` is 0).

    Args:
        tokens: int64 ``[num_tokens]``, a sequence's tokens (prompt and output).
        min_n, max_n: ``1 <= min_n <= max_n``, the match lengths tried, longest first.
        k: how many tokens to propose at most.

    Returns:
        int64 ``[m]``, ``0 <= m <= k``: a view into ``tokens``.
    """
    num = len(tokens)
    if k <= 0 or num <= min_n:
        return tokens[:0]
    last = num - 1
    # Earlier positions holding the last token: the ends of every candidate match.
    ends = np.flatnonzero(tokens[:last] == tokens[last])
    if not ends.size:
        return tokens[:0]
    lengths = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, min(max_n, last)):
        starts = ends - back
        alive &= starts >= 0
        alive[alive] = tokens[starts[alive]] == tokens[last - back]
        if not alive.any():
            break
        lengths += alive
    for n in range(min(max_n, last), min_n - 1, -1):
        matched = np.flatnonzero(lengths >= n)
        if matched.size:
            follow = int(ends[matched[-1]]) + 1
            return tokens[follow:follow + k]
    return tokens[:0]


class _Tokens:
    """One sequence's tokens as a numpy buffer that grows with it."""

    __slots__ = ("buffer", "length")

    def __init__(self) -> None:
        self.buffer = np.empty(_INITIAL_CAPACITY, dtype=np.int64)
        self.length = 0

    def sync(self, token_ids: Sequence[int]) -> np.ndarray:
        """The buffer made equal to ``token_ids`` (only its new tail is copied: a sequence's
        tokens are appended to, and shrink only when a sample ends); returns the view."""
        num = len(token_ids)
        self.length = min(self.length, num)
        if num > len(self.buffer):
            grown = np.empty(max(num, 2 * len(self.buffer)), dtype=np.int64)
            grown[:self.length] = self.buffer[:self.length]
            self.buffer = grown
        if num > self.length:
            self.buffer[self.length:num] = token_ids[self.length:num]
            self.length = num
        return self.buffer[:num]


class NgramProposer:
    """Prompt-lookup proposals per sequence, with each sequence's tokens kept as numpy.

    Args:
        min_n, max_n: the match lengths tried (``prompt_lookup_min`` / ``prompt_lookup_max``),
            ``1 <= min_n <= max_n``.

    Raises:
        ValueError: a bad ``min_n`` / ``max_n``.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        if not (isinstance(min_n, int) and isinstance(max_n, int) and 1 <= min_n <= max_n):
            raise ValueError(f"min_n, max_n: expected ints with 1 <= min_n <= max_n, got "
                             f"{min_n!r}, {max_n!r}")
        self.min_n, self.max_n = min_n, max_n
        self._tokens: dict[int, _Tokens] = {}

    def propose(self, seq_id: int, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``token_ids`` (the sequence ``seq_id``'s tokens now)."""
        held = self._tokens.get(seq_id)
        if held is None:
            held = self._tokens[seq_id] = _Tokens()
        return propose_ngram(held.sync(token_ids), self.min_n, self.max_n, k).tolist()

    def retain(self, seq_ids: Collection[int]) -> None:
        """Forget the sequences not in ``seq_ids`` (finished or preempted ones)."""
        if len(self._tokens) > len(seq_ids) or any(s not in seq_ids for s in self._tokens):
            for seq_id in [s for s in self._tokens if s not in seq_ids]:
                del self._tokens[seq_id]

    def __len__(self) -> int:
        return len(self._tokens)


__all__ = ["NgramProposer", "propose_ngram"]
