"""One request's sampling or grammar failure ends that request only, through the Python API.

Each test runs a batch of well-behaved neighbours (greedy, seeded with top-p / top-k / min-p /
penalties, one constrained by a JSON schema) beside one hostile request, with asynchronous
scheduling off and on. The neighbours must get exactly the tokens they get without the hostile
request (their rows are seeded or greedy, so batch composition does not move them); the hostile
request either samples under the rule "a row keeps at least its best token" or ends with reason
"error", its output the valid prefix (no token its grammar did not accept).
"""

from __future__ import annotations

import pytest
import torch

from mini_paged_attn.engine import LLM, SamplingParams

pytest.importorskip("llguidance")
from helpers.hostile_requests import (MAX_TOKENS, WORDS, failing_grammar,  # noqa: E402
                                      neighbours_alone, with_hostile)

from mini_paged_attn.engine.structured import StructuredOutputsParams  # noqa: E402

CONFIG = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=256, max_num_seqs=8,
              max_model_len=128)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request):
    return LLM("tiny", async_scheduling=request.param, **CONFIG)


@pytest.fixture(scope="module")
def alone(llm):
    return neighbours_alone(llm)


def test_a_top_p_that_rounds_to_zero_keeps_the_best_token(llm, alone):
    assert torch.tensor(1e-46, dtype=torch.float32).item() == 0.0   # what the sampler sees
    tiny_p = SamplingParams(temperature=1.0, top_p=1e-46, max_tokens=MAX_TOKENS, ignore_eos=True)
    neighbours, hostile = with_hostile(llm, "Numbers 0 1", tiny_p)
    assert neighbours == alone
    greedy = llm.generate("Numbers 0 1", SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                        ignore_eos=True), use_tqdm=False)[0]
    assert hostile.outputs[0].finish_reason == "length"
    assert list(hostile.outputs[0].token_ids) == list(greedy.outputs[0].token_ids)


@pytest.mark.parametrize("filters", [dict(top_p=0.9), dict(min_p=0.3), dict(top_k=4),
                                     dict(top_p=0.5, top_k=3, min_p=0.1)],
                         ids=["top_p", "min_p", "top_k", "all"])
def test_logits_overflowing_to_inf_keep_their_best_tokens(llm, alone, filters):
    # Positive logits of the prompt's tokens divided by 1e-40 overflow float32 to +inf.
    overflow = SamplingParams(temperature=1.0, seed=9, repetition_penalty=1e-40,
                              max_tokens=MAX_TOKENS, ignore_eos=True, **filters)
    neighbours, hostile = with_hostile(llm, "hello hello paged", overflow)
    assert neighbours == alone
    completion = hostile.outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == MAX_TOKENS


@pytest.mark.parametrize("n", [1, 2])
def test_a_row_with_nothing_to_sample_ends_its_request_only(llm, alone, n):
    # The grammar allows only "a" (token 97), min_tokens bans it as a stop token: every logit
    # of the row is -inf from its first step.
    doomed = SamplingParams(temperature=1.0, n=n, max_tokens=8, min_tokens=3, stop_token_ids=[97],
                            logprobs=1, structured_outputs=StructuredOutputsParams(regex="a"))
    neighbours, hostile = with_hostile(llm, "x", doomed)
    assert neighbours == alone
    assert len(hostile.outputs) == n
    for completion in hostile.outputs:
        assert completion.finish_reason == "error"
        assert list(completion.token_ids) == [] and completion.text == ""
        assert not completion.logprobs


def _words_alone(llm):
    return llm.generate("w", SamplingParams(temperature=1.0, seed=5, max_tokens=12, logprobs=1,
                                            structured_outputs=WORDS), use_tqdm=False)[0]


@pytest.mark.parametrize("how", ["raises", "rejects"])
def test_a_grammar_that_fails_on_a_token_ends_its_request_without_that_token(
        llm, alone, monkeypatch, how):
    clean = _words_alone(llm).outputs[0]
    assert clean.finish_reason == "stop" and len(clean.token_ids) > 4
    failing_grammar(monkeypatch, llm, "consume_token", at=3, how=how)
    neighbours, hostile = with_hostile(llm, "w", SamplingParams(
        temperature=1.0, seed=5, max_tokens=12, logprobs=1, structured_outputs=WORDS))
    assert neighbours == alone
    completion = hostile.outputs[0]
    assert completion.finish_reason == "error"
    # The two tokens the grammar took; the third, which it failed on, is not in the output.
    assert list(completion.token_ids) == list(clean.token_ids[:2])
    assert completion.text == llm.tokenizer.decode(clean.token_ids[:2])
    assert len(completion.logprobs) == 2
    assert completion.cumulative_logprob == pytest.approx(
        sum(lp[t] for lp, t in zip(clean.logprobs[:2], clean.token_ids[:2])), abs=1e-5)


def test_a_grammar_mask_that_fails_to_fill_ends_its_request_only(llm, alone, monkeypatch):
    clean = _words_alone(llm).outputs[0]
    # The fourth fill (the mask of the fourth token) raises: three tokens, then an empty mask.
    failing_grammar(monkeypatch, llm, "unsafe_compute_mask_ptr", at=4)
    neighbours, hostile = with_hostile(llm, "w", SamplingParams(
        temperature=1.0, seed=5, max_tokens=12, logprobs=1, structured_outputs=WORDS))
    assert neighbours == alone
    completion = hostile.outputs[0]
    assert completion.finish_reason == "error"
    assert list(completion.token_ids) == list(clean.token_ids[:3])
    assert completion.text == llm.tokenizer.decode(clean.token_ids[:3])


def test_a_grammar_that_fails_to_compile_in_the_step_ends_its_request_only(
        llm, alone, monkeypatch):
    structured = llm.engine.structured
    matcher_of = structured._matcher

    def failing_for_words(request, index):
        if request.params.structured_outputs.key == WORDS.key:
            raise ValueError("structured_outputs.regex: injected failure")
        return matcher_of(request, index)
    monkeypatch.setattr(structured, "_matcher", failing_for_words)
    neighbours, hostile = with_hostile(llm, "w", SamplingParams(
        temperature=1.0, seed=5, max_tokens=12, structured_outputs=WORDS))
    assert neighbours == alone
    assert hostile.outputs[0].finish_reason == "error"
    assert list(hostile.outputs[0].token_ids) == []
