"""Logits in the model dtype: the sampler takes them as they are where its path widens the
values itself (greedy, one-pass temperature sampling) and widens them to float32 everywhere
else; the model runner asks the LM head for them only then."""

from __future__ import annotations

import pytest
import torch

from mini_paged_attn.engine import LLMEngine
from mini_paged_attn.engine.config import EngineConfig
from mini_paged_attn.engine.sample.sampler import Sampler
from mini_paged_attn.engine.sampling_params import SamplingParams

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0)
WARM = SamplingParams(temperature=0.8)


@pytest.mark.parametrize("params, seeds, expected", [
    ([GREEDY, WARM], [None, None], True),
    ([SamplingParams(temperature=0.0, seed=3)], [("a", 0)], True),     # a greedy seeded row
    ([WARM, SamplingParams(temperature=0.8, seed=3)], [None, ("a", 0)], False),
    ([WARM, SamplingParams(temperature=0.8, top_k=5)], [None, None], False),
    ([SamplingParams(temperature=0.8, top_p=0.9)], [None], False),
    ([SamplingParams(temperature=0.8, min_p=0.1)], [None], False),
    ([GREEDY, SamplingParams(temperature=0.0, logprobs=2)], [None, None], False),
    ([SamplingParams(temperature=0.0, presence_penalty=1.0)], [None], False),
    ([SamplingParams(temperature=0.0, logit_bias={1: 2.0})], [None], False),
])
def test_which_rows_read_model_dtype_logits(params, seeds, expected):
    assert Sampler.reads_model_dtype(params, seeds) is expected


def _logits(rows: int, vocab: int = 300) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rows)
    return (torch.randn(rows, vocab, generator=gen) * 3).to(torch.bfloat16)


@pytest.mark.parametrize("params", [
    [GREEDY] * 4,
    [WARM, GREEDY, SamplingParams(temperature=1.3), WARM],
])
def test_model_dtype_logits_sample_as_their_float32_values(params):
    """The same generator state gives the same ids for bf16 logits and their float32 copy."""
    logits = _logits(len(params))
    seeds = [None] * len(params)
    ids = [Sampler(CPU, seed=7)(x, params, seeds).token_ids for x in (logits, logits.float())]
    assert ids[0] == ids[1]


@pytest.mark.parametrize("params", [
    [SamplingParams(temperature=0.8, top_k=4), SamplingParams(temperature=0.5, top_p=0.8)],
    [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.9, seed=5)],
    [SamplingParams(temperature=0.0, presence_penalty=1.0, logit_bias={2: 5.0}), GREEDY],
])
def test_other_paths_widen_model_dtype_logits_first(params):
    """Filters, seeds, logprobs and processors see float32 values: the ids and logprobs are
    those of the float32 copy of the same logits."""
    from mini_paged_attn.engine.sample.sampler import SampleRow
    logits = _logits(len(params))
    seeds = [None if p.seed is None else (f"r{i}", 0) for i, p in enumerate(params)]
    rows = [SampleRow((f"r{i}", 0), [1, 2], 0, frozenset()) for i in range(len(params))]
    outs = [Sampler(CPU, seed=7)(x, params, seeds, rows=lambda: rows)
            for x in (logits, logits.float())]
    assert outs[0].token_ids == outs[1].token_ids
    assert outs[0].logprobs == outs[1].logprobs
    if any(p.logprobs is not None for p in params):
        assert outs[0].logprobs[0][0] == pytest.approx(
            torch.log_softmax(logits[0].float(), -1)[outs[0].token_ids[0]].item(), abs=1e-6)


@pytest.mark.parametrize("params, expected", [
    (SamplingParams(temperature=0.7, max_tokens=3), torch.float16),
    (SamplingParams(temperature=0.0, max_tokens=3), torch.float16),
    (SamplingParams(temperature=0.7, top_k=5, max_tokens=3), torch.float32),
    (SamplingParams(temperature=0.0, logprobs=2, max_tokens=3), torch.float32),
])
def test_the_runner_asks_for_model_dtype_logits_only_where_they_are_read(
        tiny_model_factory, monkeypatch, params, expected):
    engine = LLMEngine.from_model(tiny_model_factory("llama"), dtype="float16", device="cpu",
                                  config=EngineConfig(block_size=4, max_num_seqs=4,
                                                      max_model_len=64))
    seen = []
    sample = engine.runner.sampler.sample

    def spy(logits, *args, **kwargs):
        seen.append(logits.dtype)
        return sample(logits, *args, **kwargs)

    monkeypatch.setattr(engine.runner.sampler, "sample", spy)
    engine.add_request([1, 2, 3, 4, 5], params)
    while engine.has_unfinished_requests():
        engine.step()
    assert seen and set(seen) == {expected}
