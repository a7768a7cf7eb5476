"""Sliding-window arithmetic on blocks: which KV blocks a windowed sequence still needs (no torch).

With Hugging Face's ``sliding_window = W``, the query at position ``p`` attends to the keys at
positions ``p - W + 1 .. p``. Queries only move forward, so once a sequence has ``p`` tokens in
the cache (its next query is at ``p`` or later), every key before ``p - W + 1`` is dead: a block
whose last token lies before that position will never be read again and can go back to the pool.

A sequence's ``block_ids`` keep their logical meaning (entry ``i`` covers tokens
``i*block_size .. (i+1)*block_size - 1``); the entries given back are a prefix of it and hold
:data:`PAD_BLOCK_ID`. The pad is an in-range id, so every block-table entry passes the attention
ops' range check; it is never read, since it lies wholly left of every later query's window.
"""

from __future__ import annotations

from .args import cdiv, positive_int

# Stands in for the blocks a sequence gave back (any in-range id would do: it is never read).
PAD_BLOCK_ID = 0


def check_sliding_window(sliding_window: object) -> int | None:
    """``sliding_window`` as a Python int >= 1, or None (full attention).

    Raises:
        ValueError: anything else (0, a negative number, a float, a bool), naming the argument.
    """
    if sliding_window is None:
        return None
    return positive_int("sliding_window", sliding_window)


def first_needed_block(num_computed_tokens: int, sliding_window: int | None,
                       block_size: int) -> int:
    """Index of the first block a query at position ``num_computed_tokens`` (or later) reads:
    the blocks before it are dead. 0 without a window."""
    if sliding_window is None:
        return 0
    return max(0, num_computed_tokens - sliding_window + 1) // block_size


def window_blocks(sliding_window: int, block_size: int) -> int:
    """The most blocks one query's window touches: ``W`` consecutive positions start anywhere
    in a block, so they span at most ``cdiv(W - 1, block_size) + 1`` blocks. It is also the
    smallest pool in which a windowed sequence alone can always make progress (one token at a
    time)."""
    return cdiv(sliding_window - 1, block_size) + 1


def min_blocks_to_run(num_tokens: int, block_size: int, sliding_window: int | None) -> int:
    """The smallest pool in which one sequence that grows to ``num_tokens`` tokens with K/V can
    run alone: all its blocks without a window, else at most one window's
    (:func:`window_blocks`; the scheduler then shrinks prompt chunks to what the pool holds)."""
    blocks = cdiv(num_tokens, block_size)
    if sliding_window is None:
        return blocks
    return min(blocks, window_blocks(sliding_window, block_size))


def max_blocks_in_use(max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
                      block_size: int, sliding_window: int | None) -> int:
    """The most blocks the running sequences together can ever hold: a pool larger than this
    is never used up (prefix-cache reuse aside).

    Without a window it is every sequence at full length. With one, a sequence computing ``t``
    new tokens holds the blocks of positions ``c - W + 1 .. c + t - 1`` (its earlier blocks
    went back after the last step): ``W - 1 + t`` positions, at most ``window_blocks(W) +
    cdiv(t - 1, block_size)`` blocks. Over one step the ``t`` add up to at most
    ``max_num_batched_tokens`` (T). ``j >= 1`` extra blocks take ``t >= (j - 1) * bs + 2``
    tokens, so ``k`` sequences with extra blocks get ``k + (T - 2k) // bs`` of them at most:
    the most with ``k`` as large as it goes (``bs >= 2``), or ``T`` (``bs == 1``, k = 0).
    """
    full = cdiv(max_model_len, block_size)
    if sliding_window is None:
        return max_num_seqs * full
    windows = max_num_seqs * min(full, window_blocks(sliding_window, block_size))
    if block_size == 1:
        chunks = max_num_batched_tokens
    else:
        k = min(max_num_seqs, max_num_batched_tokens // 2)
        chunks = k + (max_num_batched_tokens - 2 * k) // block_size
    return min(max_num_seqs * full, windows + chunks)


__all__ = ["PAD_BLOCK_ID", "check_sliding_window", "first_needed_block", "max_blocks_in_use",
           "min_blocks_to_run", "window_blocks"]
