"""Hostile constraints through the Python API: each one refused with a ValueError naming its
field, before llguidance's native code can overflow its stack or panic. The constraints that
used to kill the interpreter (SIGSEGV) run in a child process, which must exit cleanly."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from mini_paged_attn.engine.structured import (GrammarLimits, StructuredOutputsParams,
                                               check_grammar, check_limits)
from mini_paged_attn.engine.structured.cache import TemplateCache, estimate_bytes

pytest.importorskip("llguidance", reason='structured outputs need pip install -e ".[structured]"')

S = StructuredOutputsParams


def chained_refs(n: int) -> dict:
    """A schema of ``n`` objects, each one's required property the next (94 kB at 1000)."""
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}},
                      "required": ["x"]} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def chained_rules(n: int) -> str:
    return "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(n)) + f'\nr{n}: "x"\n'


# What the child does, each with the field its error must name. ``LLM`` cases build the tiny
# model and go through generate / chat; the others call the compiler front doors directly.
CHILD = textwrap.dedent("""
    import json, sys
    sys.path[:0] = {paths!r}
    from test_grammar_limits import chained_refs, chained_rules
    from mini_paged_attn.engine import LLM, SamplingParams
    from mini_paged_attn.engine.structured import StructuredOutputsParams as S, check_grammar
    case = {case!r}
    refs, rules = chained_refs(1000), chained_rules(3000)
    tool = [{{"type": "function", "function": {{"name": "f", "parameters": refs}}}}]
    try:
        if case == "check_grammar json":
            check_grammar(S(json=refs))
        elif case == "check_grammar grammar":
            check_grammar(S(grammar=rules))
        else:
            llm = LLM("tiny", dtype="float32", device="cpu", block_size=4, num_kv_blocks=32,
                      max_num_seqs=4, max_model_len=64)
            if case == "generate json":
                llm.generate("x", SamplingParams(max_tokens=4, structured_outputs=S(json=refs)),
                             use_tqdm=False)
            elif case == "generate grammar":
                llm.generate("x", SamplingParams(max_tokens=4,
                                                 structured_outputs=S(grammar=rules)),
                             use_tqdm=False)
            else:
                choice = ({{"type": "function", "function": {{"name": "f"}}}}
                          if case == "chat named" else "required")
                llm.chat([{{"role": "user", "content": "hi"}}], SamplingParams(max_tokens=4),
                         tools=tool, tool_choice=choice, use_tqdm=False)
    except ValueError as exc:
        print("REFUSED", exc)
    else:
        print("ACCEPTED")
""")


@pytest.mark.parametrize("case, field", [
    ("check_grammar json", "structured_outputs.json"),
    ("check_grammar grammar", "structured_outputs.grammar"),
    ("generate json", "structured_outputs.json"),
    ("generate grammar", "structured_outputs.grammar"),
    ("chat named", "tools[0].function.parameters"),
    ("chat required", "tools[0].function.parameters"),
])
def test_stack_overflowing_constraints_are_refused_in_a_child(case, field):
    here = sys.modules[__name__].__file__.rsplit("/", 1)[0]
    code = CHILD.format(paths=[here, here.rsplit("/", 2)[0]], case=case)
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=300)
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    out = child.stdout.strip().splitlines()[-1]
    assert out.startswith("REFUSED") and field in out, (out, child.stderr[-2000:])


@pytest.mark.parametrize("params, field, words", [
    (S(json=chained_refs(400)), "structured_outputs.json", "every $ref followed"),
    (S(grammar=chained_rules(2500)), "structured_outputs.grammar", "rules"),
    (S(regex="a{1000000}"), "structured_outputs.regex", "repetition"),
    (S(regex="(ab){20000,}"), "structured_outputs.regex", "repetition"),
    (S(regex="x" * 70_000), "structured_outputs.regex", "bytes"),
    (S(choice=[f"c{i}" for i in range(3000)]), "structured_outputs.choice", "entries"),
    (S(choice=["x" * 1000] * 100), "structured_outputs.choice", "bytes"),
    (S(json={"anyOf": [{"const": i} for i in range(5000)]}), "structured_outputs.json", "anyOf"),
    (S(json={"enum": list(range(2000))}), "structured_outputs.json", "enum"),
    (S(json={"type": "integer", "maximum": 10 ** 21}), "structured_outputs.json", "64 bits"),
    (S(json={"type": "string", "minLength": 10 ** 6}), "structured_outputs.json", "minLength"),
    (S(json={"type": "string", "pattern": "a{99999}"}), "structured_outputs.json", "pattern"),
    (S(json={"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
     "structured_outputs.json", "refers back to itself"),
    (S(json={"$defs": {"A": {"type": "array", "items": {"$ref": "#/$defs/A"}, "minItems": 1}},
             "$ref": "#/$defs/A"}), "structured_outputs.json", "refers back to itself"),
])
def test_over_a_bound_is_a_value_error_naming_the_field(params, field, words):
    with pytest.raises(ValueError) as info:
        check_limits(params)
    assert str(info.value).startswith(f"{field}: ") and words in str(info.value)
    with pytest.raises(ValueError, match=f"^{field}: "):   # the front door checks first
        check_grammar(params)


def test_deep_nesting_and_huge_integers_are_value_errors():
    deep: dict = {"type": "integer"}
    for _ in range(3000):
        deep = {"type": "array", "items": deep}
    for schema in (deep, {"type": "object", "properties": {"a": {"const": float("nan")}}}):
        with pytest.raises(ValueError, match="^structured_outputs.json: "):
            check_grammar(S(json=schema))


@pytest.mark.parametrize("params", [
    # Recursion that can end (an optional field, an array that may be empty) is fine.
    S(json={"type": "object", "properties": {"a": {"$ref": "#"}}}),
    S(json={"$defs": {"T": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/T"}}}, "required": ["kids"]}},
        "$ref": "#/$defs/T"}),
    S(json=chained_refs(200)),
    S(json={"type": "integer", "minimum": -(2 ** 62), "maximum": 2 ** 63 - 1}),
    S(choice=[f"label {i}" for i in range(1000)]),
    S(regex=r"[a-z]{1,10000}\{99999\}"),
    S(grammar=chained_rules(1500)),
])
def test_real_sized_constraints_pass(params):
    check_grammar(params)


def test_a_compiler_panic_is_a_logged_value_error(monkeypatch, caplog):
    from mini_paged_attn.engine.structured import grammar

    class PanicException(BaseException):   # what pyo3 raises: not an Exception
        pass

    def panics(params):
        raise PanicException("index out of bounds")

    monkeypatch.setattr(grammar, "grammar_text", panics)
    with pytest.raises(ValueError) as info:
        check_grammar(S(regex="a+"))
    message = str(info.value)
    assert message.startswith("structured_outputs.regex: ") and "PanicException" in message
    error_id = message.rsplit("error id ", 1)[1].rstrip(")")
    assert any(error_id in r.getMessage() and r.exc_info for r in caplog.records)


def test_a_compile_over_the_time_budget_is_refused(monkeypatch):
    import threading

    from mini_paged_attn.engine.structured import grammar

    release = threading.Event()
    monkeypatch.setattr(grammar, "grammar_text", lambda params: release.wait(30) and "")
    try:
        with pytest.raises(ValueError, match="^structured_outputs.regex: compiling it took"):
            check_grammar(S(regex="a+"), GrammarLimits(compile_timeout_s=1))
    finally:
        release.set()


def test_compiles_past_their_budget_cannot_pile_up():
    import threading

    from mini_paged_attn.engine.structured.contained import MAX_RUNNING, run_native

    release = threading.Event()
    stuck = [threading.Thread(target=run_native, args=(lambda: release.wait(30),),
                              kwargs={"where": "f", "stack_bytes": 1 << 20, "timeout_s": 0.1})
             for _ in range(MAX_RUNNING)]
    for thread in stuck:     # each one refused after 0.1 s, its compile still running
        thread.start()
    for thread in stuck:
        thread.join()
    try:
        with pytest.raises(ValueError, match="^g: the server's grammar compiler is busy"):
            run_native(lambda: 1, where="g", stack_bytes=1 << 20, timeout_s=0.2)
    finally:
        release.set()
    assert run_native(lambda: 2, where="g", stack_bytes=1 << 20, timeout_s=5) == 2


def test_limits_reject_bad_values():
    with pytest.raises(ValueError, match="GrammarLimits.max_choices"):
        GrammarLimits(max_choices=0)


# ---- the template cache: bounded by estimated bytes ---------------------------------------

def test_cache_drops_least_recently_used_to_stay_within_bytes():
    cache = TemplateCache(max_bytes=100, max_entry_bytes=60)
    assert cache.put("a", "A", 40) and cache.put("b", "B", 40)
    assert cache.get("a") == "A"                 # "b" is now the least recently used
    assert cache.put("c", "C", 40)
    assert "b" not in cache and cache.get("a") == "A" and cache.get("c") == "C"
    assert cache.bytes == 80 <= cache.max_bytes
    assert not cache.put("big", "X", 61)         # over the entry cap: not kept, nothing dropped
    assert "big" not in cache and len(cache) == 2 and cache.bytes == 80
    assert cache.put("a", "A2", 10) and cache.bytes == 50   # replaced, counted once


def test_compiler_cache_is_bounded_by_bytes_not_count():
    from mini_paged_attn.engine import LLMEngine
    from mini_paged_attn.engine.config import EngineConfig
    from mini_paged_attn.engine.structured import GrammarCompiler
    from mini_paged_attn.engine.structured.grammar import grammar_text

    engine = LLMEngine.from_model("tiny", dtype="float32", device="cpu", config=EngineConfig(
        block_size=4, num_kv_blocks=16, max_num_seqs=2, max_model_len=64))
    regexes = [S(regex=f"(x{i}|y)" + "[a-z]" * 2000) for i in range(6)]
    one = estimate_bytes(grammar_text(regexes[0]))
    base = engine.structured.compiler
    compiler = GrammarCompiler(base.hf_tokenizer, base.vocab_size, base.eos_token_ids,
                               GrammarLimits(cache_bytes=3 * one + one // 2,
                                             cache_entry_bytes=2 * one))
    for params in regexes:
        matcher = compiler.compile(params)
        assert not matcher.is_error()
    assert len(compiler.cache) == 3 and compiler.cache.bytes <= compiler.limits.cache_bytes
    assert all(r.key in compiler.cache for r in regexes[3:])
    big = S(regex="[a-z]" * 6000)
    assert not compiler.compile(big).is_error()      # compiled for its request ...
    assert big.key not in compiler.cache             # ... but over the entry cap: not kept
    assert len(compiler.cache) == 3


def test_min_tokens_longer_than_every_choice_is_refused_at_admission():
    from mini_paged_attn.engine import LLMEngine, SamplingParams
    from mini_paged_attn.engine.config import EngineConfig

    engine = LLMEngine.from_model("tiny", dtype="float32", device="cpu", config=EngineConfig(
        block_size=4, num_kv_blocks=16, max_num_seqs=2, max_model_len=64))
    params = SamplingParams(max_tokens=20, min_tokens=10, structured_outputs=S(choice=["yes",
                                                                                        "no"]))
    with pytest.raises(ValueError, match="^min_tokens: expected at most 3"):
        engine.add_request("x", params)
    assert not engine.has_unfinished_requests()
    engine.add_request("x", SamplingParams(max_tokens=20, min_tokens=3,
                                           structured_outputs=S(choice=["yes", "no"])))
