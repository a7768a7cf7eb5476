"""Which running sequences a step's context budget takes (no torch).

A step's time grows with the context its sequences attend over (the KV tokens each query reads),
not only with its new tokens: a few requests thousands of tokens long can make every step, and
so every short request sharing it, several times slower. ``SchedulerConfig.
max_num_batched_context_tokens`` bounds the sum, over a step's sequences, of the context each
one attends over (its computed tokens plus its new ones; one window under a sliding window).

When the running sequences need more, the step takes them shortest context first while the
budget lasts, so short requests are never delayed by long ones; and the sequence the budget left
out most often in a row (ties: the oldest) runs too, over the budget if need be: the long ones
take turns, each waiting at most as many steps as there are long sequences. The shortest one
always runs, so every step makes progress.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from .request import Sequence


def context_cost(seq: Sequence, num_new_tokens: int, window: int | None) -> int:
    """The KV tokens ``seq``'s queries read in a step that computes ``num_new_tokens`` of it."""
    context = seq.num_computed_tokens + num_new_tokens
    return context if window is None else min(context, window + num_new_tokens)


def defer_for_context(candidates: Seq[Sequence], costs: Seq[int], budget: int) -> set[int]:
    """The ``seq_id``s of the ``candidates`` (running order) this step leaves out so that the
    sum of ``costs`` (aligned, from :func:`context_cost`) stays within ``budget``; counts
    each sequence's deferrals in a row (``Sequence.num_deferred``)."""
    if sum(costs) <= budget:
        for seq in candidates:
            seq.num_deferred = 0
        return set()
    starving = max(range(len(candidates)), key=lambda k: candidates[k].num_deferred)
    if not candidates[starving].num_deferred:
        starving = -1
    used = 0
    deferred: set[int] = set()
    for k in sorted(range(len(candidates)), key=costs.__getitem__):   # stable: oldest first
        seq = candidates[k]
        if k == starving or not used or used + costs[k] <= budget:
            used += costs[k] if k != starving else 0
            seq.num_deferred = 0
        else:
            seq.num_deferred += 1
            deferred.add(seq.seq_id)
    return deferred


__all__ = ["context_cost", "defer_for_context"]
