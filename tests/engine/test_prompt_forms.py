"""The prompt forms of vLLM (str, token ids, TextPrompt, TokensPrompt, lists of them) at every
entry point that takes prompts, and a TypeError naming the argument for anything else, before
any request is queued."""

from __future__ import annotations

import pytest

import mini_paged_attn
from mini_paged_attn.engine import LLM, SamplingParams, TextPrompt, TokensPrompt
from mini_paged_attn.engine.prompts import parse_prompt, parse_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
IDS = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", device="cpu", block_size=4, num_kv_blocks=64, max_model_len=128,
               max_num_seqs=8)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_the_package_exports_the_typed_dicts():
    assert mini_paged_attn.TokensPrompt is TokensPrompt
    assert mini_paged_attn.TextPrompt is TextPrompt
    assert TokensPrompt(prompt_token_ids=[1, 2]) == {"prompt_token_ids": [1, 2]}


def test_a_tokens_prompt_generates_from_its_ids(llm):
    """``{"prompt_token_ids": ids}`` is the prompt ``ids``, not the text "prompt_token_ids"."""
    plain = llm.generate(IDS, GREEDY, use_tqdm=False)[0]
    typed = llm.generate(TokensPrompt(prompt_token_ids=IDS), GREEDY, use_tqdm=False)[0]
    assert typed.prompt_token_ids == IDS
    assert typed.prompt is None
    assert typed.outputs[0].token_ids == plain.outputs[0].token_ids


def test_a_text_prompt_is_its_text(llm):
    plain = llm.generate("Hello there", GREEDY, use_tqdm=False)[0]
    typed = llm.generate({"prompt": "Hello there"}, GREEDY, use_tqdm=False)[0]
    assert typed.prompt == "Hello there"
    assert typed.prompt_token_ids == plain.prompt_token_ids
    assert typed.outputs[0].token_ids == plain.outputs[0].token_ids


def test_a_mixed_batch_keeps_its_order(llm):
    text_ids = llm.tokenizer.encode("Hello there")
    batch = ["Hello there", {"prompt_token_ids": IDS}, {"prompt": "Hello there"}, IDS,
             tuple(IDS)]
    outputs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == [text_ids, IDS, text_ids, IDS, IDS]
    singles = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in ("Hello there", IDS)]
    a, b = _tokens(singles)
    assert _tokens(outputs) == [a, b, a, b, b]


def test_stream_and_add_request_take_the_typed_forms(llm):
    expected = llm.generate(IDS, GREEDY, use_tqdm=False)[0].outputs[0].text
    assert "".join(llm.stream({"prompt_token_ids": IDS}, GREEDY)) == expected
    engine = llm.engine
    request_id = engine.add_request({"prompt_token_ids": IDS}, GREEDY)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert finished[request_id].prompt_token_ids == IDS
    assert finished[request_id].outputs[0].text == expected


BAD = [
    ({"prompt_token_ids": IDS, "prompt": "x"}, r"prompts\[1\]: expected a dict with exactly one"),
    ({"prompt_ids": IDS}, r"prompts\[1\]: expected a dict with exactly one .*prompt_ids"),
    ({}, r"prompts\[1\]: expected a dict"),
    ({"prompt_token_ids": [1, "2"]}, r"prompts\[1\]\['prompt_token_ids'\]\[1\]: expected an int"),
    ({"prompt_token_ids": [1, 2.0]}, r"\['prompt_token_ids'\]\[1\]: expected an int"),
    ({"prompt_token_ids": [True]}, r"\['prompt_token_ids'\]\[0\]: expected an int"),
    ({"prompt_token_ids": "1 2 3"}, r"\['prompt_token_ids'\]: expected a list of int"),
    ({"prompt": [1, 2]}, r"prompts\[1\]\['prompt'\]: expected a str"),
    (None, r"prompts\[1\]: expected a str, a list of int token ids"),
    (3.5, r"prompts\[1\]: expected a str"),
    ([1, "a"], r"prompts\[1\]\[1\]: expected an int token id"),
    (b"bytes", r"prompts\[1\]: expected a str"),
]


@pytest.mark.parametrize("bad,match", BAD)
def test_generate_refuses_other_forms_before_queuing(llm, bad, match):
    with pytest.raises(TypeError, match=match):
        llm.generate(["fine", bad], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert not llm.engine._pending_adds


@pytest.mark.parametrize("bad", [{"prompt_token_ids": IDS, "prompt": "x"}, {"ids": IDS},
                                 {"prompt_token_ids": [1.0]}, None, 7])
def test_add_request_and_stream_refuse_other_forms(llm, bad):
    with pytest.raises(TypeError, match="prompt"):
        llm.engine.add_request(bad, GREEDY)
    with pytest.raises(TypeError, match="prompt"):
        next(llm.stream(bad, GREEDY))
    assert not llm.engine.has_unfinished_requests()


def test_a_single_bad_prompt_is_named_prompts():
    with pytest.raises(TypeError, match=r"^prompts: expected a dict with exactly one"):
        parse_prompts({"prompt_token_ids": IDS, "extra": 1})
    with pytest.raises(TypeError, match=r"^prompts: expected a prompt or a list"):
        parse_prompts(42)


def test_parse_keeps_what_today_accepts():
    assert parse_prompts("x") == ["x"]
    assert parse_prompts(IDS) == [IDS]
    assert parse_prompts((5, 6)) == [[5, 6]]
    assert parse_prompts([]) == []
    assert parse_prompts([[5], "y"]) == [[5], "y"]
    assert parse_prompt(TextPrompt(prompt="z")) == "z"


def test_out_of_vocabulary_ids_stay_a_value_error(llm):
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match=r"prompts\[0\]: prompt: expected token ids in"):
        llm.generate({"prompt_token_ids": [vocab]}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="at least one token"):
        llm.generate({"prompt_token_ids": []}, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
