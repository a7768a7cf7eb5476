"""The sampler's per-row rules: a row keeps at least its best token under every filter, a row
with nothing to sample (all -inf, or a NaN) is flagged instead of failing the batch, and every id
is in the vocabulary. The rows around a bad one get the tokens they get without it."""

from __future__ import annotations

import pytest
import torch

from mini_paged_attn.engine.sample.sampler import Sampler
from mini_paged_attn.engine.sampling_params import SamplingParams

CPU = torch.device("cpu")
VOCAB = 300
NEG_INF = float("-inf")

MIXES = {
    "greedy": [SamplingParams(temperature=0.0)] * 4,
    "one pass": [SamplingParams(temperature=0.7)] * 4,
    "filters": [SamplingParams(temperature=1.0, seed=1, top_p=1e-46),
                SamplingParams(temperature=0.9, seed=2, top_p=0.9, top_k=7),
                SamplingParams(temperature=0.0, min_p=0.2),
                SamplingParams(temperature=1.2, seed=3, min_p=1.0, logprobs=3)],
}


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _seeds(params, keys):
    return [(k, 0) if p.seed is not None else None for p, k in zip(params, keys)]


@pytest.mark.parametrize("mix", MIXES)
def test_rows_with_nothing_to_sample_are_flagged_and_the_others_keep_their_tokens(mix):
    good = MIXES[mix]
    logits = _logits(len(good))
    bad = torch.full((3, VOCAB), NEG_INF)
    bad[1, 17] = float("nan")           # a NaN among -inf
    bad[2] = _logits(1, seed=5)[0]
    bad[2, 40] = float("nan")           # a NaN among finite logits
    # Bad rows first, between and last: rows 0, 3 and 6 of 7.
    batch = torch.cat([bad[:1], logits[:2], bad[1:2], logits[2:], bad[2:]])
    params = [good[0], *good[:2], good[1], *good[2:], good[-1]]
    keys = ["b0", "g0", "g1", "b1", "g2", "g3", "b2"]
    out = Sampler(CPU, seed=3)(batch.clone(), params, _seeds(params, keys))
    assert out.invalid_rows == [0, 3, 6]
    assert all(0 <= t < VOCAB for t in out.token_ids)
    alone = Sampler(CPU, seed=3)(logits.clone(), good, _seeds(good, keys[1:3] + keys[4:6]))
    assert alone.invalid_rows == []
    got = [out.token_ids[i] for i in (1, 2, 4, 5)]
    for i, p in enumerate(good):
        if p.greedy or p.seed is not None:    # batch-independent rows
            assert got[i] == alone.token_ids[i], (i, p)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_p=1e-46),
    SamplingParams(temperature=1.0, seed=4, top_p=1e-30, min_p=0.5),
    SamplingParams(temperature=0.5, top_k=1),
    SamplingParams(temperature=1.0, seed=4, min_p=1.0),
], ids=["top_p 1e-46", "top_p 1e-30 + min_p", "top_k 1", "min_p 1"])
def test_the_tightest_filters_keep_the_best_token(params):
    logits = _logits(5, seed=2)
    seeds = [("r", i) if params.seed is not None else None for i in range(5)]
    out = Sampler(CPU)(logits.clone(), [params] * 5, seeds)
    assert out.token_ids == logits.argmax(dim=-1).tolist() and out.invalid_rows == []


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0, top_k=3, seed=1)], ids=["top_p", "min_p", "race", "greedy",
                                                             "top_k seeded"])
def test_logits_at_inf_are_the_best_tokens(params):
    logits = _logits(4, seed=3)
    best = {0: [5], 1: [7, 250], 2: [0, 1, 2], 3: [299]}
    for row, cols in best.items():
        logits[row, cols] = float("inf")
    seeds = [("r", i) if params.seed is not None else None for i in range(4)]
    out = Sampler(CPU)(logits, [params] * 4, seeds)
    assert out.invalid_rows == []
    assert all(out.token_ids[row] in cols for row, cols in best.items()), out.token_ids


def test_a_row_with_one_allowed_token_always_gets_it():
    logits = torch.full((64, VOCAB), NEG_INF)
    cols = torch.randint(0, VOCAB, (64,), generator=torch.Generator().manual_seed(4))
    logits[torch.arange(64), cols] = torch.randn(64, generator=torch.Generator().manual_seed(5))
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.5),
                   SamplingParams(temperature=0.0)):
        out = Sampler(CPU)(logits.clone(), [params] * 64, [None] * 64)
        assert out.token_ids == cols.tolist() and out.invalid_rows == []
