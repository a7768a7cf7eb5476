"""SamplingParams.prompt_logprobs: per prompt position, the log-softmax of the full forward's
logits (transformers' model of the same tiny checkpoint, float32), also when the prompt is
computed over several chunks and when its prefix is in the prefix cache."""

from __future__ import annotations

import pytest
import torch
from helpers.engines import assert_pool_whole, make_engine, run_to_finish
from helpers.tiny_models import hf_reference_model

from mini_paged_attn.engine import SamplingParams

PROMPT = [3, 17, 42, 99, 5, 250, 7, 7, 120, 64, 33, 201, 8, 150, 77, 12, 90, 45, 6]   # 19
OTHER = PROMPT[:12] + [11, 22, 33]        # shares 3 blocks of 4 with PROMPT


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


def _reference(model_dir, prompt: list[int]) -> torch.Tensor:
    """float32 ``[len(prompt) - 1, vocab]``: row ``j`` is the log-softmax predicting token j+1."""
    with torch.no_grad():
        logits = hf_reference_model(model_dir)(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def _check(entries, prompt, ref, k):
    assert len(entries) == len(prompt) and entries[0] is None
    for pos in range(1, len(prompt)):
        entry, row = entries[pos], ref[pos - 1]
        token = prompt[pos]
        assert entry[token] == pytest.approx(row[token].item(), abs=1e-4)
        top_values, top_ids = row.topk(k) if k else (row[:0], row[:0].long())
        assert set(entry) == set(top_ids.tolist()) | {token}
        for value, i in zip(top_values.tolist(), top_ids.tolist()):
            assert entry[i] == pytest.approx(value, abs=1e-4)


@pytest.mark.parametrize("budget", [64, 8])     # 8 < 19: the prompt comes in three chunks
@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_match_a_full_forward(model_dir, budget, k):
    engine = make_engine(model_dir, block_size=4, num_kv_blocks=32, max_num_seqs=4,
                         max_num_batched_tokens=budget, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=k, logprobs=1)
    plain = SamplingParams(temperature=0, max_tokens=2)
    out, other = run_to_finish(engine, [(PROMPT, params), (OTHER, plain)])
    _check(out.prompt_logprobs, PROMPT, _reference(model_dir, PROMPT), k)
    assert other.prompt_logprobs is None
    # The first generated token's logprob continues the prompt's: the same forward.
    first = out.outputs[0].token_ids[0]
    ref_all = torch.log_softmax(hf_reference_model(model_dir)(
        torch.tensor([PROMPT])).logits[0, -1].float(), dim=-1)
    assert out.outputs[0].logprobs[0][first] == pytest.approx(ref_all[first].item(), abs=1e-4)
    assert_pool_whole(engine)


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(model_dir):
    engine = make_engine(model_dir, block_size=4, num_kv_blocks=32, max_num_seqs=4,
                         max_model_len=64)
    plain = SamplingParams(temperature=0, max_tokens=1)
    run_to_finish(engine, [(OTHER, plain)])          # OTHER's first blocks are now cached
    again, = run_to_finish(engine, [(OTHER, plain)])
    assert again.metrics.num_cached_tokens > 0
    out, = run_to_finish(engine, [(OTHER, SamplingParams(temperature=0, max_tokens=1,
                                                 prompt_logprobs=2))])
    assert out.metrics.num_cached_tokens == 0
    _check(out.prompt_logprobs, OTHER, _reference(model_dir, OTHER), 2)
    assert_pool_whole(engine)


def test_streamed_outputs_carry_prompt_logprobs_once_the_prompt_is_done(model_dir):
    engine = make_engine(model_dir, block_size=4, num_kv_blocks=32, max_num_seqs=4,
                         max_num_batched_tokens=8, max_model_len=64)
    rid = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=3,
                                                    prompt_logprobs=1, ignore_eos=True))
    seen = []
    while engine.has_unfinished_requests():
        seen += [o for o in engine.step() if o.request_id == rid]
    assert [len(o.outputs[0].token_ids) for o in seen] == [1, 2, 3]
    assert all(o.prompt_logprobs is seen[-1].prompt_logprobs for o in seen)
    assert len(seen[-1].prompt_logprobs) == len(PROMPT)


def test_a_one_token_prompt_has_just_the_first_none(model_dir):
    engine = make_engine(model_dir, block_size=4, num_kv_blocks=8, max_model_len=16)
    out, = run_to_finish(engine, [([9], SamplingParams(max_tokens=1, prompt_logprobs=0))])
    assert out.prompt_logprobs == [None]


@pytest.mark.parametrize("bad", [-1, 21, 1.5, "2", True])
def test_bad_prompt_logprobs_are_refused_by_name(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)
