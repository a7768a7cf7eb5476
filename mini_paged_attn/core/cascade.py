"""Cascade (shared-prefix) attention: which sequences of a step share a run of KV blocks, and
whether attending over that run once per group pays.

Sequences that hit the same cached prefix (a common system prompt) or were forked from one
request (``n > 1``) hold the *same physical blocks* at the start of their block tables. Plain
paged attention reads those blocks once per sequence; cascade attention reads them once per
group and merges the result with each sequence's attention over its own blocks (the op is
``ops.cascade_attention``). This module decides, from the step's host block-table rows alone
(numpy, no torch), which groups to form.

Block sharing is prefix-closed: a physical block shared at table index ``j`` implies the same
blocks at ``0 .. j`` (prefix-cache entries are named by hash chains, forks copy their parent's
table and diverge by copy-on-write). So sequences are grouped by their first block, and each
member's shared run is its common run with the group's first row. A group's prefix is capped
to whole blocks that every member computed before this step's tokens, so every member keeps
the block of its new tokens (at least one key) as its own, and no query's causal mask cuts
into the prefix.

:class:`CascadeRule` says when a group is worth it; the runner checks it every step, so
:func:`find_shared_prefixes` is vectorised (tens of microseconds for 256 rows of 256 blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .args import positive_int

# The defaults of CascadeRule. A cascade step runs eagerly (a captured decode graph holds the
# plain path) and adds a launch for the prefix and a merge per layer, so it must save a lot of
# KV reads to win: with 8+ sequences over a prefix of 256+ tokens, the prefix's reads shrink
# 8-fold or more. MIN_SAVED_TOKENS bounds the reads saved per step from below (a group of 8 over
# 2048 tokens saves 14336), where a step's launch overheads stop mattering against its memory
# traffic. Tuned on a GPU; see docs/architecture.md, "Cascade attention".
MIN_GROUP_SIZE = 8
MIN_PREFIX_TOKENS = 256
MIN_SAVED_TOKENS = 8192


@dataclass(frozen=True)
class CascadeRule:
    """When a group of sequences sharing a prefix attends over it once (cascade).

    A group qualifies when it has at least ``min_group_size`` sequences, its shared prefix
    holds at least ``min_prefix_tokens`` tokens, and the KV tokens it saves reading,
    ``(group size - 1) * prefix tokens``, are at least ``min_saved_tokens``. A step uses
    cascade attention when some group qualifies; the others' sequences attend plainly in the
    same launch.
    """

    min_group_size: int = MIN_GROUP_SIZE
    min_prefix_tokens: int = MIN_PREFIX_TOKENS
    min_saved_tokens: int = MIN_SAVED_TOKENS

    def __post_init__(self) -> None:
        for name in ("min_group_size", "min_prefix_tokens", "min_saved_tokens"):
            object.__setattr__(self, name, positive_int(name, getattr(self, name)))
        if self.min_group_size < 2:
            raise ValueError("min_group_size: expected an int >= 2 (a group of one shares "
                             f"nothing), got {self.min_group_size}")

    def qualifies(self, sizes: np.ndarray, prefix_tokens: np.ndarray) -> np.ndarray:
        """bool ``[num_groups]``: which groups of ``sizes`` sequences over ``prefix_tokens``
        shared tokens (int arrays ``[num_groups]``) pass the rule."""
        return ((sizes >= self.min_group_size) & (prefix_tokens >= self.min_prefix_tokens)
                & ((sizes - 1) * prefix_tokens >= self.min_saved_tokens))


@dataclass(frozen=True)
class SharedPrefixes:
    """Groups of rows whose block tables start with the same physical blocks.

    Attributes:
        rows: int64 ``[num_grouped]``: row indices (into the step's rows), group by group, in
            row order within a group; its first row leads the group.
        starts: int64 ``[num_groups + 1]``: group ``g`` is ``rows[starts[g]:starts[g + 1]]``.
        prefix_blocks: int64 ``[num_groups]``: whole blocks every member of the group shares
            (>= 1), capped as the module doc says.
    """

    rows: np.ndarray
    starts: np.ndarray
    prefix_blocks: np.ndarray

    @property
    def num_groups(self) -> int:
        return len(self.prefix_blocks)

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.starts)

    def group(self, g: int) -> np.ndarray:
        return self.rows[self.starts[g]:self.starts[g + 1]]

    def select(self, keep: np.ndarray) -> SharedPrefixes:
        """The groups where bool ``keep`` ``[num_groups]`` is set."""
        sizes = self.sizes[keep]
        members = np.repeat(keep, self.sizes)
        starts = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=starts[1:])
        return SharedPrefixes(self.rows[members], starts, self.prefix_blocks[keep])


_EMPTY = SharedPrefixes(np.zeros(0, np.int64), np.zeros(1, np.int64), np.zeros(0, np.int64))


def find_shared_prefixes(tables: np.ndarray, computed: np.ndarray, block_size: int,
                         table_rows: np.ndarray | None = None, *,
                         min_size: int = 2) -> SharedPrefixes:
    """The groups (``min_size`` rows or more) whose tables start with the same physical blocks.

    Args:
        tables: int ``[num_table_rows, width]``: block-table rows (entries past a row's
            blocks are stale: never compared).
        computed: int ``[num_rows]``: tokens each row has in the cache before this step's new
            ones. A row shares at most ``computed // block_size`` blocks (whole blocks before
            its first new token; a row with none is in no group).
        block_size: tokens per block.
        table_rows: int ``[num_rows]``: the row of ``tables`` of each of the step's rows;
            None: row ``i`` is ``tables[i]``. Only the columns a group can share are read.
        min_size: the smallest group to return (>= 2); smaller ones are not compared at all,
            so a step that shares little costs a sort and a count.

    Returns:
        :class:`SharedPrefixes` (its rows index the step's rows); each group's prefix is the longest run of blocks all its
        members hold at the start of their tables, within every member's cap.
    """
    caps = np.minimum(np.asarray(computed, dtype=np.int64) // block_size, tables.shape[1])
    at = (np.arange(len(caps)) if table_rows is None
          else np.asarray(table_rows, dtype=np.int64))
    eligible = np.flatnonzero(caps >= 1)
    if len(eligible) < 2:
        return _EMPTY
    first = tables[at[eligible], 0]
    order = np.argsort(first, kind="stable")
    rows, first = eligible[order], first[order]
    new = np.empty(len(rows), dtype=bool)
    new[0] = True
    np.not_equal(first[1:], first[:-1], out=new[1:])
    group_of = np.cumsum(new) - 1
    sizes = np.bincount(group_of)
    big = sizes[group_of] >= max(min_size, 2)          # groups of one share nothing
    if not big.any():
        return _EMPTY
    rows, new = rows[big], new[big]
    starts = np.flatnonzero(new)
    leaders = rows[starts][np.cumsum(new) - 1]
    member_caps = caps[rows]
    span = int(member_caps.max())
    same = tables[at[rows], :span] == tables[at[leaders], :span]
    # The first column where a member leaves its leader; ``span`` where it never does.
    run = np.where(same.all(axis=1), span, same.argmin(axis=1))
    run = np.minimum(run, member_caps)
    prefix_blocks = np.minimum.reduceat(run, starts)
    bounds = np.append(starts, len(rows)).astype(np.int64)
    return SharedPrefixes(rows.astype(np.int64), bounds, prefix_blocks.astype(np.int64))


@dataclass(frozen=True)
class CascadePlan:
    """The cascade decision of one step: the groups that attend over their prefix once.

    Attributes:
        groups: the chosen groups (none: the step attends plainly).
        block_size: tokens per block.
        num_rows: sequences in the step.
        candidates: groups of ``min_group_size`` rows or more that share a prefix, before
            the rest of the rule.
        kv_tokens: KV tokens the step reads plainly (its context lengths, summed).
        saved_tokens: KV tokens the chosen groups do not read again.
    """

    groups: SharedPrefixes
    block_size: int
    num_rows: int
    candidates: int
    kv_tokens: int
    saved_tokens: int

    @property
    def uses_cascade(self) -> bool:
        return self.groups.num_groups > 0

    def __str__(self) -> str:
        g = self.groups
        if not self.uses_cascade:
            return (f"plain attention: {self.candidates} group(s) share a prefix, none "
                    f"passes the rule ({self.num_rows} rows, {self.kv_tokens} KV tokens)")
        parts = ", ".join(f"{size} rows x {blocks * self.block_size} tokens"
                          for size, blocks in zip(g.sizes.tolist(), g.prefix_blocks.tolist()))
        plain = self.num_rows - len(g.rows)
        share = self.saved_tokens / self.kv_tokens if self.kv_tokens else 0.0
        return (f"cascade attention: {g.num_groups} group(s) ({parts}), {plain} row(s) plain; "
                f"saves {self.saved_tokens} of {self.kv_tokens} KV tokens read "
                f"({100 * share:.0f}%)")


def plan_cascade(tables: np.ndarray, computed: np.ndarray, context_lens: np.ndarray,
                 block_size: int, rule: CascadeRule,
                 table_rows: np.ndarray | None = None, *,
                 max_groups: int | None = None) -> CascadePlan:
    """Which groups of the step attend over their shared prefix once (see :class:`CascadeRule`).

    ``tables``, ``computed``, ``block_size``, ``table_rows``: as :func:`find_shared_prefixes`;
    ``context_lens``: int ``[num_rows]``, each row's tokens after the step's writes;
    ``max_groups``: at most this many groups (a captured decode graph holds a fixed number),
    those of the qualifying groups that save the most reads; None: every qualifying group.
    """
    found = find_shared_prefixes(tables, computed, block_size, table_rows,
                                 min_size=rule.min_group_size)
    kv_tokens = int(np.asarray(context_lens).sum())
    if not found.num_groups:
        return CascadePlan(found, block_size, len(computed), 0, kv_tokens, 0)
    sizes = found.sizes
    keep = rule.qualifies(sizes, found.prefix_blocks * block_size)
    if max_groups is not None and int(keep.sum()) > max_groups:
        saves = np.where(keep, (sizes - 1) * found.prefix_blocks, -1)
        keep = np.zeros_like(keep)
        keep[np.argsort(-saves, kind="stable")[:max_groups]] = True
    chosen = found if keep.all() else found.select(keep)
    saved = int(((sizes[keep] - 1) * found.prefix_blocks[keep]).sum()) * block_size
    return CascadePlan(chosen, block_size, len(computed), found.num_groups, kv_tokens, saved)


__all__ = ["CascadePlan", "CascadeRule", "MIN_GROUP_SIZE", "MIN_PREFIX_TOKENS",
           "MIN_SAVED_TOKENS", "SharedPrefixes", "find_shared_prefixes", "plan_cascade"]
