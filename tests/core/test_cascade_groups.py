"""Shared-prefix groups of a step's block tables (``core/cascade.py``): the groups found are the
maximal shared runs, capped to whole blocks before each member's new tokens, and the rule picks
the groups that save enough."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_paged_attn.core.cascade import CascadeRule, find_shared_prefixes, plan_cascade

BLOCK_SIZE = 4
WIDTH = 12


@st.composite
def step_tables(draw):
    """Rows built as a shared prefix (one of a few chains, any length) plus private blocks,
    stale entries past each row's blocks, and each row's computed tokens."""
    num_rows = draw(st.integers(1, 12))
    chains = draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    ids = rng.permutation(10_000).astype(np.int32) + 1          # distinct physical ids
    chain_ids = ids[:chains * WIDTH].reshape(chains, WIDTH)
    fresh = iter(ids[chains * WIDTH:].tolist())
    tables = np.zeros((num_rows, WIDTH), dtype=np.int32)
    computed = np.zeros(num_rows, dtype=np.int64)
    for i in range(num_rows):
        blocks = draw(st.integers(1, WIDTH))
        shared = draw(st.integers(0, blocks))
        chain = draw(st.integers(0, chains - 1))
        tables[i, :shared] = chain_ids[chain, :shared]
        tables[i, shared:blocks] = [next(fresh) for _ in range(blocks - shared)]
        # Stale entries: sometimes a copy of the chain itself, which must not count.
        tables[i, blocks:] = (chain_ids[chain, blocks:] if draw(st.booleans())
                              else rng.integers(1, 10_000, WIDTH - blocks))
        # Tokens before the step's: within the row's blocks, the last block holding new ones.
        computed[i] = draw(st.integers(max(0, (blocks - 1) * BLOCK_SIZE - BLOCK_SIZE),
                                       blocks * BLOCK_SIZE - 1))
    return tables, computed


def _brute_force(tables: np.ndarray, computed: np.ndarray) -> dict[tuple[int, ...], int]:
    """Rows grouped by their first block (rows that may share a block only), each group's
    longest common run of blocks within every member's whole blocks before its new tokens."""
    caps = [min(int(c) // BLOCK_SIZE, WIDTH) for c in computed]
    by_first: dict[int, list[int]] = {}
    for i, cap in enumerate(caps):
        if cap >= 1:
            by_first.setdefault(int(tables[i, 0]), []).append(i)
    found = {}
    for members in by_first.values():
        if len(members) < 2:
            continue
        run = 0
        while (run < min(caps[i] for i in members)
               and len({int(tables[i, run]) for i in members}) == 1):
            run += 1
        found[tuple(members)] = run
    return found


@settings(max_examples=200, deadline=None)
@given(step_tables(), st.integers(2, 4))
def test_groups_are_the_maximal_shared_runs_within_the_caps(case, min_size):
    tables, computed = case
    found = find_shared_prefixes(tables, computed, BLOCK_SIZE, min_size=min_size)
    got = {tuple(found.group(g).tolist()): int(found.prefix_blocks[g])
           for g in range(found.num_groups)}
    assert got == {members: run for members, run in _brute_force(tables, computed).items()
                   if len(members) >= min_size}
    for g in range(found.num_groups):
        members, blocks = found.group(g), int(found.prefix_blocks[g])
        assert len(members) >= 2 and blocks >= 1
        # The prefix is whole blocks before each member's first new token: every member
        # keeps the block of its new tokens (>= 1 key) as its own.
        assert (blocks * BLOCK_SIZE <= computed[members]).all()
        assert (tables[members, :blocks] == tables[members[0], :blocks]).all()


@settings(max_examples=100, deadline=None)
@given(step_tables(), st.integers(2, 4), st.integers(1, 12), st.integers(1, 40))
def test_the_plan_keeps_the_groups_that_pass_the_rule(case, size, prefix, saved):
    tables, computed = case
    rule = CascadeRule(min_group_size=size, min_prefix_tokens=prefix, min_saved_tokens=saved)
    context_lens = computed + 1
    plan = plan_cascade(tables, computed, context_lens, BLOCK_SIZE, rule)
    found = find_shared_prefixes(tables, computed, BLOCK_SIZE)
    expected = {tuple(found.group(g).tolist()): int(found.prefix_blocks[g])
                for g in range(found.num_groups)
                if len(found.group(g)) >= size and found.prefix_blocks[g] * BLOCK_SIZE >= prefix
                and (len(found.group(g)) - 1) * found.prefix_blocks[g] * BLOCK_SIZE >= saved}
    chosen = plan.groups
    assert {tuple(chosen.group(g).tolist()): int(chosen.prefix_blocks[g])
            for g in range(chosen.num_groups)} == expected
    assert plan.uses_cascade == bool(expected)
    assert plan.saved_tokens == sum((len(m) - 1) * b * BLOCK_SIZE for m, b in expected.items())
    assert plan.kv_tokens == int(context_lens.sum())
    assert ("cascade attention" if expected else "plain attention") in str(plan)


def test_the_plan_explains_itself():
    shared = np.arange(1, 5, dtype=np.int32)
    tables = np.stack([np.concatenate([shared, [10 + i, 20 + i]]) for i in range(3)]
                      + [np.arange(30, 36, dtype=np.int32)]).astype(np.int32)
    computed = np.array([20, 21, 22, 23])
    rule = CascadeRule(min_group_size=3, min_prefix_tokens=16, min_saved_tokens=32)
    plan = plan_cascade(tables, computed, computed + 1, BLOCK_SIZE, rule)
    assert plan.uses_cascade and plan.groups.group(0).tolist() == [0, 1, 2]
    assert str(plan) == ("cascade attention: 1 group(s) (3 rows x 16 tokens), 1 row(s) plain; "
                         "saves 32 of 90 KV tokens read (36%)")
    strict = CascadeRule(min_group_size=3, min_prefix_tokens=20, min_saved_tokens=32)
    plain = plan_cascade(tables, computed, computed + 1, BLOCK_SIZE, strict)
    assert not plain.uses_cascade
    assert str(plain).startswith("plain attention: 1 group(s) share a prefix")


@pytest.mark.parametrize("field, value", [("min_group_size", 1), ("min_group_size", 2.5),
                                          ("min_prefix_tokens", 0), ("min_saved_tokens", -3),
                                          ("min_saved_tokens", True)])
def test_rule_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        CascadeRule(**{field: value})


def test_the_step_rows_index_the_table():
    """``table_rows``: the step's rows are rows of a larger table, in any order."""
    rng = np.random.default_rng(3)
    table = rng.permutation(64 * 8).astype(np.int32).reshape(64, 8)
    step_rows = np.array([40, 3, 17, 9])
    table[[3, 9], :3] = table[40, :3]
    found = find_shared_prefixes(table, np.full(4, 30), BLOCK_SIZE, step_rows)
    assert found.group(0).tolist() == [0, 1, 3] and found.prefix_blocks.tolist() == [3]
