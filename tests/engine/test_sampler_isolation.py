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
from helpers.engines import assert_pool_whole

from mini_paged_attn.engine import LLM, SamplingParams

pytest.importorskip("llguidance")
from mini_paged_attn.engine.structured import StructuredOutputsParams  # noqa: E402

CONFIG = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=256, max_num_seqs=8,
              max_model_len=128)
SCHEMA = {"type": "object",
          "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                         "b": {"enum": ["x", "yy"]}},
          "required": ["a", "b"], "additionalProperties": False}
# The hostile request's own grammar (a key of its own, so a patched compiler can find it).
WORDS = StructuredOutputsParams(regex="[a-z]{6,10}")
MAX_TOKENS = 8

NEIGHBOURS = [
    ("The quick brown", SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)),
    ("Hello world", SamplingParams(temperature=1.0, top_p=0.9, seed=1, max_tokens=MAX_TOKENS,
                                   ignore_eos=True)),
    ("Blocks of", SamplingParams(temperature=0.8, top_k=5, min_p=0.05, seed=2,
                                 max_tokens=MAX_TOKENS, ignore_eos=True)),
    ("def forward", SamplingParams(temperature=1.0, seed=3, repetition_penalty=1.2, top_p=0.8,
                                   max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)),
    ("item:", SamplingParams(temperature=1.0, seed=4, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA))),
]


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request):
    return LLM("tiny", async_scheduling=request.param, **CONFIG)


@pytest.fixture(scope="module")
def alone(llm):
    """The neighbours' outputs without any hostile request."""
    return _samples(llm.generate([p for p, _ in NEIGHBOURS], [s for _, s in NEIGHBOURS],
                                 use_tqdm=False))


def _samples(outputs) -> list:
    return [[(list(c.token_ids), c.finish_reason, c.text) for c in o.outputs] for o in outputs]


def _with_hostile(llm, prompt, params):
    """Generate the neighbours with a hostile request in the middle of the batch; returns the
    neighbours' outputs and the hostile one's."""
    prompts = [p for p, _ in NEIGHBOURS]
    params_list = [s for _, s in NEIGHBOURS]
    prompts.insert(2, prompt)
    params_list.insert(2, params)
    outputs = llm.generate(prompts, params_list, use_tqdm=False)
    hostile = outputs.pop(2)
    assert_pool_whole(llm.engine)
    assert not llm.engine.structured._matchers
    return _samples(outputs), hostile


def test_a_top_p_that_rounds_to_zero_keeps_the_best_token(llm, alone):
    assert torch.tensor(1e-46, dtype=torch.float32).item() == 0.0   # what the sampler sees
    tiny_p = SamplingParams(temperature=1.0, top_p=1e-46, max_tokens=MAX_TOKENS, ignore_eos=True)
    neighbours, hostile = _with_hostile(llm, "Numbers 0 1", tiny_p)
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
    neighbours, hostile = _with_hostile(llm, "hello hello paged", overflow)
    assert neighbours == alone
    completion = hostile.outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == MAX_TOKENS


@pytest.mark.parametrize("n", [1, 2])
def test_a_row_with_nothing_to_sample_ends_its_request_only(llm, alone, n):
    # The grammar allows only "a" (token 97), min_tokens bans it as a stop token: every logit
    # of the row is -inf from its first step.
    doomed = SamplingParams(temperature=1.0, n=n, max_tokens=8, min_tokens=3, stop_token_ids=[97],
                            logprobs=1, structured_outputs=StructuredOutputsParams(choice=["a"]))
    neighbours, hostile = _with_hostile(llm, "x", doomed)
    assert neighbours == alone
    assert len(hostile.outputs) == n
    for completion in hostile.outputs:
        assert completion.finish_reason == "error"
        assert list(completion.token_ids) == [] and completion.text == ""
        assert not completion.logprobs


class _FailingMatcher:
    """An llguidance matcher whose ``method`` fails on its ``at``-th call (1-based): raises, or
    (``how="rejects"``, for consume_token) returns False as for a token it does not allow."""

    def __init__(self, real, method: str, at: int, how: str) -> None:
        self._real, self._method, self._at, self._how = real, method, at, how
        self._calls = 0

    def __getattr__(self, name):
        attr = getattr(self._real, name)
        if name != self._method:
            return attr

        def call(*args):
            self._calls += 1
            if self._calls == self._at:
                if self._how == "rejects":
                    return False
                raise RuntimeError(f"injected failure of {name}")
            return attr(*args)
        return call


def _failing_grammar(monkeypatch, llm, method: str, at: int, how: str = "raises") -> None:
    compiler = llm.engine.structured.compiler
    compile_ = compiler.compile

    def compile_failing(params):
        matcher = compile_(params)
        return _FailingMatcher(matcher, method, at, how) if params.key == WORDS.key else matcher
    monkeypatch.setattr(compiler, "compile", compile_failing)


def _words_alone(llm):
    return llm.generate("w", SamplingParams(temperature=1.0, seed=5, max_tokens=12, logprobs=1,
                                            structured_outputs=WORDS), use_tqdm=False)[0]


@pytest.mark.parametrize("how", ["raises", "rejects"])
def test_a_grammar_that_fails_on_a_token_ends_its_request_without_that_token(
        llm, alone, monkeypatch, how):
    clean = _words_alone(llm).outputs[0]
    assert clean.finish_reason == "stop" and len(clean.token_ids) > 4
    _failing_grammar(monkeypatch, llm, "consume_token", at=3, how=how)
    neighbours, hostile = _with_hostile(llm, "w", SamplingParams(
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
    _failing_grammar(monkeypatch, llm, "unsafe_compute_mask_ptr", at=4)
    neighbours, hostile = _with_hostile(llm, "w", SamplingParams(
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
    neighbours, hostile = _with_hostile(llm, "w", SamplingParams(
        temperature=1.0, seed=5, max_tokens=12, structured_outputs=WORDS))
    assert neighbours == alone
    assert hostile.outputs[0].finish_reason == "error"
    assert list(hostile.outputs[0].token_ids) == []
