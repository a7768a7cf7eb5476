"""Prompt-lookup proposals: the vectorised lookup against a plain search over random token
sequences, and the proposer's per-sequence buffers."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_paged_attn.core.ngram import NgramProposer, propose_ngram


def _reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The spec read literally: n from max_n down, the latest earlier occurrence of the last n
    tokens, the up to k tokens after it."""
    num = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= num:
            continue
        suffix = tokens[num - n:]
        for start in range(num - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=0, max_size=40),
       bounds=st.tuples(st.integers(1, 5), st.integers(0, 3)), k=st.integers(0, 6))
def test_lookup_matches_the_plain_search(tokens, bounds, k):
    min_n, extra = bounds
    max_n = min_n + extra
    got = propose_ngram(np.asarray(tokens, dtype=np.int64), min_n, max_n, k).tolist()
    assert got == _reference(tokens, min_n, max_n, k) if k else got == []


def test_a_repeated_passage_is_proposed_from_its_first_copy():
    passage = [5, 9, 2, 7, 7, 3, 8]
    tokens = [1, *passage, 4, 4, *passage[:3]]
    assert propose_ngram(np.asarray(tokens), 2, 3, 3).tolist() == [7, 7, 3]
    # The longest match wins over a later, shorter one.
    tokens = [1, 2, 3, 9, 0, 3, 8, 1, 2, 3]
    assert propose_ngram(np.asarray(tokens), 1, 3, 2).tolist() == [9, 0]
    assert propose_ngram(np.asarray(tokens), 1, 1, 2).tolist() == [8, 1]
    assert propose_ngram(np.asarray([4, 5, 6]), 1, 3, 4).tolist() == []


def test_the_proposer_keeps_each_sequence_and_follows_its_growth():
    proposer = NgramProposer(1, 2)
    tokens = [3, 4, 5]
    for step in range(600):                         # past the buffer's first capacity
        tokens.append(3 + step % 3)
        assert proposer.propose(7, tokens, 2) == _reference(tokens, 1, 2, 2)
    assert proposer.propose(8, [1, 2, 1], 3) == [2, 1]
    assert len(proposer) == 2
    proposer.retain({8})
    assert len(proposer) == 1
    assert proposer.propose(7, [9, 9], 1) == [9]    # forgotten: rebuilt from these tokens


@pytest.mark.parametrize("min_n, max_n", [(0, 2), (3, 2), (1.0, 2)])
def test_bad_match_lengths_are_refused(min_n, max_n):
    with pytest.raises(ValueError, match="min_n, max_n"):
        NgramProposer(min_n, max_n)
