"""The sampler's penalties, logit_bias and min_tokens against a plain per-row reference, on
random logits (seeded), batched with rows that use none of them."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.sampling_reference import reference_logits

from mini_paged_attn.engine.sample.sampler import SampleRow, Sampler
from mini_paged_attn.engine.sampling_params import SamplingParams

VOCAB = 50
CPU = torch.device("cpu")


def _row(key, prompt, output, stop=frozenset({0})) -> SampleRow:
    return SampleRow(key, prompt, len(output), stop)


ROW_PARAMS = [
    SamplingParams(temperature=0.0),   # none of the features
    SamplingParams(temperature=0.0, presence_penalty=1.5),
    SamplingParams(temperature=0.0, frequency_penalty=-0.7, presence_penalty=0.3),
    SamplingParams(temperature=0.0, repetition_penalty=1.8),
    SamplingParams(temperature=0.0, repetition_penalty=0.5, frequency_penalty=2.0),
    SamplingParams(temperature=0.0, logit_bias={3: 100.0, 7: -100, 9: 2.5}),
    SamplingParams(temperature=0.0, min_tokens=5, max_tokens=8),
    SamplingParams(temperature=0.0, min_tokens=5, max_tokens=8, presence_penalty=-2.0,
                   logit_bias={1: 1.0}),
]


@pytest.mark.parametrize("seed", range(4))
def test_processed_logits_match_the_reference_step_after_step(seed):
    """Greedy rows: every step's argmax is the reference's, the counts follow the sampled
    tokens (kept on the device between steps), and a plain row in the batch is untouched."""
    gen = torch.Generator().manual_seed(seed)
    sampler = Sampler(CPU)
    prompts = [torch.randint(0, VOCAB, (4 + i,), generator=gen).tolist() for i in range(len(ROW_PARAMS))]
    outputs: list[list[int]] = [[] for _ in ROW_PARAMS]
    stops = [frozenset({0, 2}) for _ in ROW_PARAMS]
    for step in range(6):
        # Few distinct values so penalties change which token wins.
        logits = torch.randn(len(ROW_PARAMS), VOCAB, generator=gen) * 3
        expected = [reference_logits(logits[i].tolist(), p, prompts[i], outputs[i], stops[i])
                    for i, p in enumerate(ROW_PARAMS)]
        rows = [SampleRow((f"r{i}", 0), prompts[i], len(outputs[i]), stops[i])
                for i in range(len(ROW_PARAMS))]
        got = sampler(logits.clone(), ROW_PARAMS, [None] * len(ROW_PARAMS), rows=lambda: rows)
        for i, tok in enumerate(got.token_ids):
            ref = torch.tensor(expected[i])
            assert tok == int(ref.argmax()), (step, i, ROW_PARAMS[i])
            outputs[i].append(tok)
    # min_tokens: no stop token before the 5th token, for both rows that ask.
    for i in (6, 7):
        assert not set(outputs[i][:5]) & stops[i]
    counts = sampler.history.counts
    assert counts is not None and int(counts.sum()) == 6 * 5    # five penalised rows


def test_penalised_logits_equal_the_reference_values():
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(3, VOCAB, generator=gen) * 4
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.4,
                             frequency_penalty=0.9)] * 3
    prompts = [[1, 2, 3], [4, 4], [5]]
    outputs = [[6, 6, 7], [], [5, 9]]
    sampler = Sampler(CPU)
    rows = [SampleRow((f"r{i}", 0), prompts[i], 0, frozenset()) for i in range(3)]
    # Count the outputs as if sampled at earlier steps.
    history = sampler.history.rows_for([r.key for r in rows], prompts, VOCAB)
    for i, out in enumerate(outputs):
        for t in out:
            sampler.history.record(history[i:i + 1], torch.tensor([t]))
    from mini_paged_attn.engine.sample.penalties import apply_penalties
    got = apply_penalties(logits, sampler.history.counts[history],
                          sampler.history.in_prompt[history], torch.full((3,), 0.4),
                          torch.full((3,), 0.9), torch.full((3,), 1.3))
    for i in range(3):
        ref = reference_logits(logits[i].tolist(), params[i], prompts[i], outputs[i], frozenset())
        torch.testing.assert_close(got[i], torch.tensor(ref))


def test_seeded_penalised_sampling_does_not_depend_on_the_batch():
    """A seeded, penalised request samples the same tokens alone or next to others."""
    p = SamplingParams(temperature=1.0, seed=11, frequency_penalty=1.0, logit_bias={4: 3.0})
    other = SamplingParams(temperature=0.8, top_p=0.9)
    gen = torch.Generator().manual_seed(3)
    steps = [torch.randn(2, VOCAB, generator=gen) for _ in range(5)]

    def run(batched: bool) -> list[int]:
        sampler = Sampler(CPU, seed=5)
        tokens = []
        for logits in steps:
            row = SampleRow(("a", 0), [1, 2], len(tokens), frozenset())
            if batched:
                out = sampler(logits.clone(), [other, p], [None, ("a", 0)],
                              rows=lambda: [SampleRow(("b", 0), [3], 0, frozenset()), row])
                tokens.append(out.token_ids[1])
            else:
                out = sampler(logits[1:].clone(), [p], [("a", 0)], rows=lambda: [row])
                tokens.append(out.token_ids[0])
        return tokens

    assert run(False) == run(True)


def test_logit_bias_forces_and_bans_tokens_when_sampling():
    sampler = Sampler(CPU, seed=1)
    logits = torch.zeros(64, VOCAB)
    force = SamplingParams(temperature=1.0, logit_bias={17: 100.0})
    ban = SamplingParams(temperature=1.0, top_k=2, logit_bias={0: -100.0, 1: -100.0})
    out = sampler(logits.clone(), [force] * 32 + [ban] * 32, [None] * 64)
    assert out.token_ids[:32] == [17] * 32
    assert not {0, 1} & set(out.token_ids[32:])


def test_history_rows_are_freed_and_reused_on_release():
    sampler = Sampler(CPU)
    p = SamplingParams(temperature=0.0, presence_penalty=1.0)
    logits = torch.zeros(2, VOCAB)
    rows = [_row(("x", 0), [1], []), _row(("x", 1), [1], [])]
    sampler(logits.clone(), [p, p], [None, None], rows=lambda: rows)
    assert len(sampler.history) == 2
    sampler.release("x")
    assert len(sampler.history) == 0
    sampler(logits[:1].clone(), [p], [None], rows=lambda: [_row(("y", 0), [2], [])])
    # The reused row starts from zero counts and y's prompt only.
    row = sampler.history._rows[("y", 0)]
    assert int(sampler.history.counts[row].sum()) == 1
    assert sampler.history.in_prompt[row].nonzero().flatten().tolist() == [2]


def test_plain_requests_touch_no_history():
    sampler = Sampler(CPU)
    sampler(torch.randn(3, VOCAB), [SamplingParams(temperature=0.7)] * 3, [None] * 3)
    assert sampler.history.counts is None


@pytest.mark.parametrize("kwargs,field", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(frequency_penalty=math.nan), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=math.inf), "repetition_penalty"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=17, max_tokens=16), "min_tokens"),
    (dict(logit_bias={1: 101.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"1": 1.0}), "logit_bias"),
    (dict(logit_bias=[1]), "logit_bias"),
    (dict(stop_token_ids=[-3]), "stop_token_ids"),
    (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
])
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kwargs)


def test_good_edges_are_accepted():
    p = SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=1e-3,
                       logit_bias={0: -100, 5: 100}, min_tokens=16, max_tokens=16)
    assert p.uses_history and p.uses_logit_bias and p.logit_bias == {0: -100.0, 5: 100.0}
    plain = SamplingParams(logit_bias={})
    assert not plain.uses_history and not plain.uses_logit_bias and plain.logit_bias is None
