"""Structured outputs through the engine on the tiny random Llama: its output is noise, so every
constrained sample that parses shows the grammar did the work. Sampling is seeded at temperature
1 (the noise explores the grammar); an unconstrained greedy request in the same batch must get
the tokens it gets alone."""

from __future__ import annotations

import re
import sys

import pytest
import torch
from helpers.engines import assert_pool_whole, run_to_finish
from helpers.json_checks import assert_valid

from mini_paged_attn.engine import LLMEngine, SamplingParams
from mini_paged_attn.engine.config import EngineConfig
from mini_paged_attn.engine.structured import (GrammarCompiler, StructuredOutputsParams,
                                               TokenMasks, apply_token_masks)

pytest.importorskip("llguidance", reason='structured outputs need pip install -e ".[structured]"')

S = StructuredOutputsParams
# Bounded everywhere, so noise finishes it in a few dozen tokens.
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 5},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "pet": {"enum": ["cat", "dog"]}},
          "required": ["name", "age", "pet"], "additionalProperties": False}
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def engine():
    return LLMEngine.from_model("tiny", dtype="float32", device="cpu", config=EngineConfig(
        block_size=4, num_kv_blocks=128, max_num_seqs=16, max_model_len=128))


def _run(engine: LLMEngine, requests: list[tuple[str | list[int], SamplingParams]]) -> list:
    outs = run_to_finish(engine, requests)
    assert_pool_whole(engine)
    assert not engine.structured._matchers      # every matcher released
    return outs


def _sampled(structured: StructuredOutputsParams, seed: int = 0, **kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(temperature=1.0, seed=seed, structured_outputs=structured, **kwargs)


def test_json_schema_every_sample_parses_and_validates(engine):
    outs = _run(engine, [("hi", _sampled(S(json=SCHEMA), seed=s, n=2)) for s in range(3)])
    texts = [c.text for out in outs for c in out.outputs]
    for out in outs:
        for c in out.outputs:
            assert c.finish_reason == "stop", c
            value = assert_valid(c.text, SCHEMA)
            assert list(value) == ["name", "age", "pet"]      # the schema's order
            # The complete grammar forced an end-of-sequence token right after the object.
            assert c.token_ids[-2] == ord("}") and c.token_ids[-1] in engine.eos_token_ids
    assert len(set(texts)) > 1      # samples differ: each has its own matcher and noise


def test_schema_given_as_text_and_json_object(engine):
    import json

    text_schema = _run(engine, [("x", _sampled(S(json=json.dumps(SCHEMA)), seed=5))])[0]
    assert_valid(text_schema.outputs[0].text, SCHEMA)
    # Any object: biased towards closing it, else noise writes keys for a long time (the
    # bias still applies under a grammar).
    biased = _sampled(S(json_object=True), seed=1, max_tokens=64,
                      logit_bias={ord("}"): 8.0, ord('"'): 4.0})
    out = _run(engine, [("x", biased)])[0].outputs[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict)


@pytest.mark.parametrize("structured, check", [
    (S(regex=r"[a-z]{2,4}-[0-9]{2}"), lambda t: re.fullmatch(r"[a-z]{2,4}-[0-9]{2}", t)),
    (S(choice=["yes", "no", "maybe so"]), lambda t: t in ("yes", "no", "maybe so")),
    (S(grammar='start: "(" item ("," item)* ")"\nitem: "a" | "bb"'),
     lambda t: re.fullmatch(r"\((a|bb)(,(a|bb))*\)", t)),
    (S(grammar='root ::= "<" digit digit? ">"\ndigit ::= [0-9]'),   # GBNF
     lambda t: re.fullmatch(r"<[0-9]{1,2}>", t)),
])
def test_regex_choice_and_grammars_match(engine, structured, check):
    outs = _run(engine, [("go", _sampled(structured, seed=s, n=2)) for s in range(2)])
    for out in outs:
        for c in out.outputs:
            assert c.finish_reason == "stop" and check(c.text), c.text


def test_unconstrained_rows_are_untouched(engine):
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = _run(engine, [([5, 6, 7, 8], greedy)])[0].outputs[0].token_ids
    mixed = _run(engine, [("a", _sampled(S(json=SCHEMA), n=2)), ([5, 6, 7, 8], greedy),
                          ("b", _sampled(S(choice=["no"])))])
    assert mixed[1].outputs[0].token_ids == alone
    assert mixed[2].outputs[0].text == "no"


def test_greedy_penalised_rows_follow_the_grammar(engine):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, repetition_penalty=1.3,
                            presence_penalty=0.5, structured_outputs=S(json=SCHEMA))
    out = _run(engine, [("p", params)])[0].outputs[0]
    assert out.finish_reason == "stop"
    assert_valid(out.text, SCHEMA)


def test_a_complete_grammar_ends_the_sample_under_ignore_eos(engine):
    params = _sampled(S(choice=["yes", "no"]), ignore_eos=True, max_tokens=20)
    out = _run(engine, [("x", params)])[0].outputs[0]
    assert out.finish_reason == "stop" and out.text in ("yes", "no")
    assert out.token_ids[-1] in engine.eos_token_ids and len(out.token_ids) == len(out.text) + 1


def test_cut_by_max_tokens_is_a_length_finish(engine):
    out = _run(engine, [("x", _sampled(S(json=SCHEMA), max_tokens=4))])[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert out.text.startswith('{"name": "'[:len(out.text)])


def test_a_rejected_token_ends_that_request_with_an_error(engine):
    # The grammar allows only "a", min_tokens bans it (a stop token): every logit is -inf, the
    # sampled token breaks the grammar. That sample ends with "error"; the others go on. (A
    # regex: admission refuses a choice whose entries are all shorter than min_tokens.)
    doomed = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3, stop_token_ids=[97],
                            structured_outputs=S(regex="a"))
    fine = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = _run(engine, [("x", doomed), ("y", fine)])
    assert outs[0].outputs[0].finish_reason == "error"
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 6


def test_compiled_once_per_constraint(engine, monkeypatch):
    compiler = engine.structured.compiler
    import llguidance

    built = []
    real = llguidance.LLMatcher

    class Counting:
        def __new__(cls, *args, **kwargs):
            built.append(1)
            return real(*args, **kwargs)

    monkeypatch.setattr(llguidance, "LLMatcher", Counting)
    monkeypatch.setattr(Counting, "validate_grammar", real.validate_grammar, raising=False)
    for name in ("grammar_from_json_schema", "grammar_from_regex", "grammar_from_lark"):
        monkeypatch.setattr(Counting, name, getattr(real, name), raising=False)
    compiler.cache.clear()
    new_schema = dict(SCHEMA, title="compiled once")
    _run(engine, [("q", _sampled(S(json=new_schema), seed=s, n=2)) for s in range(3)])
    assert len(built) == 1


@pytest.mark.parametrize("kwargs, match", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": [1]}, "structured_outputs.json"),
    ({"json_object": "yes"}, "json_object"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", 3]}, "structured_outputs.choice"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"grammar": 5}, "structured_outputs.grammar"),
])
def test_params_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        S(**kwargs)


def test_sampling_params_take_only_the_dataclass():
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": SCHEMA})


@pytest.mark.parametrize("structured, match", [
    (S(json={"type": "strnig"}), "structured_outputs.json"),
    (S(json={"type": "string", "pattern": "(("}), "structured_outputs.json"),
    (S(regex="a(b"), "structured_outputs.regex"),
    (S(grammar="start: undefined_rule"), "structured_outputs.grammar"),
])
def test_bad_constraints_are_refused_before_queueing(engine, structured, match):
    with pytest.raises(ValueError, match=match):
        engine.add_request("x", _sampled(structured))
    assert not engine.has_unfinished_requests() and not engine._pending_adds


def test_without_llguidance_the_error_says_how_to_install(engine, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)      # import fails
    compiler = GrammarCompiler(engine.tokenizer.hf, 259, [256])
    with pytest.raises(ValueError, match=re.escape('pip install -e ".[structured]"')):
        compiler.compile(S(regex="a"))


@pytest.mark.parametrize("vocab", [31, 32, 33, 259])
def test_apply_token_masks_against_a_loop(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen)
    rows = [1, 2, 4]
    allowed = torch.rand(len(rows), vocab, generator=gen) < 0.3
    words = (vocab + 31) // 32
    bitmask = torch.zeros(len(rows), words, dtype=torch.int32)
    for r in range(len(rows)):
        for t in allowed[r].nonzero().flatten().tolist():
            bitmask[r, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
    expected = logits.clone()
    for r, row in enumerate(rows):
        expected[row][~allowed[r]] = float("-inf")
    apply_token_masks(logits, TokenMasks(rows, bitmask))
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    every = torch.randn(len(rows), vocab, generator=gen)
    want = every.masked_fill(~allowed, float("-inf"))
    apply_token_masks(every, TokenMasks([0, 1, 2], bitmask))
    torch.testing.assert_close(every, want, rtol=0, atol=0)


@pytest.mark.gpu
def test_on_the_gpu_outputs_validate_and_the_mask_matches_the_cpu():
    gpu = LLMEngine.from_model("tiny", dtype="float32", device="cuda", config=EngineConfig(
        block_size=16, num_kv_blocks=64, max_num_seqs=16, max_model_len=128))
    outs = _run(gpu, [("hi", _sampled(S(json=SCHEMA), seed=s, n=2)) for s in range(4)]
                + [([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))])
    for out in outs[:-1]:
        for c in out.outputs:
            assert c.finish_reason == "stop"
            assert_valid(c.text, SCHEMA)
    assert len(outs[-1].outputs[0].token_ids) == 8
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 259, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 9), generator=gen, dtype=torch.int64).to(
        torch.int32)
    on_gpu = logits.cuda()
    apply_token_masks(logits, TokenMasks([0, 3, 5], bitmask))
    apply_token_masks(on_gpu, TokenMasks([0, 3, 5], bitmask.pin_memory()))
    torch.testing.assert_close(on_gpu.cpu(), logits, rtol=0, atol=0)
