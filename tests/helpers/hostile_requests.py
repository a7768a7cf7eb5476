"""A batch of well-behaved requests to put one hostile request among, and a grammar matcher
that fails on demand, for the tests that one request's sampling or grammar failure ends that
request only (tests/engine/test_sampler_isolation*.py).

    from helpers.hostile_requests import NEIGHBOURS, WORDS, failing_grammar, with_hostile
"""

from __future__ import annotations

from mini_paged_attn.engine import SamplingParams
from mini_paged_attn.engine.structured import StructuredOutputsParams

from helpers.engines import assert_pool_whole

SCHEMA = {"type": "object",
          "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                         "b": {"enum": ["x", "yy"]}},
          "required": ["a", "b"], "additionalProperties": False}
# The hostile request's own grammar (a key of its own, so a patched compiler can find it).
WORDS = StructuredOutputsParams(regex="[a-z]{6,10}")
MAX_TOKENS = 8

# Greedy, seeded with top-p / top-k / min-p / penalties / logprobs, and one constrained by a
# JSON schema: rows whose tokens do not depend on the batch they are in.
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


def samples(outputs) -> list:
    """What a test compares of outputs: per sample its token ids, finish reason and text."""
    return [[(list(c.token_ids), c.finish_reason, c.text) for c in o.outputs] for o in outputs]


def neighbours_alone(llm) -> list:
    """The neighbours' :func:`samples` without any hostile request."""
    return samples(llm.generate([p for p, _ in NEIGHBOURS], [s for _, s in NEIGHBOURS],
                                use_tqdm=False))


def with_hostile(llm, prompt, params) -> tuple[list, object]:
    """Generate the neighbours with a hostile request in the middle of the batch; returns the
    neighbours' :func:`samples` and the hostile request's output. The pool must be whole and
    no grammar matcher left afterwards."""
    prompts = [p for p, _ in NEIGHBOURS]
    params_list = [s for _, s in NEIGHBOURS]
    prompts.insert(2, prompt)
    params_list.insert(2, params)
    outputs = llm.generate(prompts, params_list, use_tqdm=False)
    hostile = outputs.pop(2)
    assert_pool_whole(llm.engine)
    assert not llm.engine.structured._matchers
    return samples(outputs), hostile


class FailingMatcher:
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


def failing_grammar(monkeypatch, llm, method: str, at: int, how: str = "raises") -> None:
    """Make every matcher of :data:`WORDS` that ``llm``'s engine compiles a
    :class:`FailingMatcher` (the other grammars are left as they are)."""
    compiler = llm.engine.structured.compiler
    compile_ = compiler.compile

    def compile_failing(params):
        matcher = compile_(params)
        return FailingMatcher(matcher, method, at, how) if params.key == WORDS.key else matcher
    monkeypatch.setattr(compiler, "compile", compile_failing)
