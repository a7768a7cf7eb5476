"""Grammars for structured outputs, through llguidance: StructuredOutputsParams -> a checked
grammar -> a matcher per sample.

llguidance (an optional dependency, the ``structured`` extra) is imported on first use, so the
engine runs without it until a request asks for structured output. :func:`check_grammar` needs
no tokenizer; :class:`GrammarCompiler` holds the model's token trie and a cache of compiled
grammars bounded by their estimated bytes (``cache.py``), so requests with the same constraint
compile it once and each sample starts from a copy.

Every native call on a constraint is guarded twice: :func:`~.limits.check_limits` refuses what
is over :class:`~.limits.GrammarLimits` in Python first, and the call runs on a big-stack thread
with a time budget (:func:`~.contained.run_native`), so neither a deep schema nor a compiler
panic can take the process down. Callers compile before a request is admitted (the server on
its request workers, ``LLMEngine.add_request`` on the caller's thread): the stepping thread then
only copies the cached template.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from .bitmask import bitmask_words
from .cache import TemplateCache, estimate_bytes
from .contained import run_native
from .limits import DEFAULT_LIMITS, GrammarLimits, check_limits
from .params import StructuredOutputsParams

logger = logging.getLogger(__name__)

INSTALL_HINT = 'pip install -e ".[structured]"'
# How JSON is written: compact, as json.dumps does (a model's long runs of whitespace would
# otherwise be valid JSON that never ends).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ValueError("structured_outputs: needs the llguidance package, which is not "
                         f"installed ({INSTALL_HINT})") from None
    return llguidance


def grammar_text(params: StructuredOutputsParams) -> str:
    """llguidance's grammar definition for ``params`` (unchecked: see :func:`check_grammar`).

    Raises:
        ValueError: llguidance is not installed (the message says how to install it).
    """
    llg = _llguidance()
    matcher = llg.LLMatcher
    kind, text = params.key
    if kind == "json":
        return matcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return matcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    if kind == "regex":
        return matcher.grammar_from_regex(text)
    if kind == "choice":
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in
                                                                 params.choice))
    try:   # Lark, or GBNF converted to Lark
        return llg.grammar_from("grammar", text)
    except ValueError as exc:
        raise ValueError(f"structured_outputs.grammar: {exc}") from None


def check_grammar(params: StructuredOutputsParams, limits: GrammarLimits = DEFAULT_LIMITS
                  ) -> None:
    """Raise ``ValueError`` (``structured_outputs.<kind>: <why>``) if ``params`` cannot compile:
    over ``limits``, an invalid JSON schema, regex or grammar, over the compile budget, or
    llguidance missing. No tokenizer needed; the native part runs contained."""
    check_limits(params, limits)
    llg = _llguidance()

    def validate() -> str:
        return llg.LLMatcher.validate_grammar(grammar_text(params),
                                              limits=limits.parser_limits())

    error = run_native(validate, where=f"structured_outputs.{params.kind}",
                       stack_bytes=limits.stack_bytes, timeout_s=limits.compile_timeout_s)
    if error:
        raise ValueError(f"structured_outputs.{params.kind}: {error.strip()}")


class GrammarCompiler:
    """Compiles constraints for one model's vocabulary; safe to call from any thread.

    Args:
        hf_tokenizer: the model's Hugging Face fast tokenizer (its token strings build
            llguidance's token trie, once, on the first structured request).
        vocab_size: the model's logits width (ids past the tokenizer's are never allowed).
        eos_token_ids: the ids that end a sample; a finished grammar allows only these.
        limits: the bounds, compile budget and cache budget.

    It pickles without its token trie and cache (rebuilt on first use where it lands): the
    server's engine-process client checks constraints with the engine's own compiler.
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int],
                 limits: GrammarLimits = DEFAULT_LIMITS) -> None:
        if not isinstance(limits, GrammarLimits):
            raise ValueError(f"limits: expected a GrammarLimits, got {type(limits).__name__}")
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.limits = limits
        self._lock = threading.Lock()
        self._tokenizer = None
        self.cache = TemplateCache(limits.cache_bytes, limits.cache_entry_bytes)

    def __getstate__(self) -> dict:
        return {"hf_tokenizer": self.hf_tokenizer, "vocab_size": self.vocab_size,
                "eos_token_ids": self.eos_token_ids, "limits": self.limits}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    @property
    def tokenizer(self):
        """llguidance's ``LLTokenizer`` for this model (built on first use)."""
        with self._lock:
            if self._tokenizer is None:
                llg = _llguidance()
                import llguidance.hf

                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(
                        self.hf_tokenizer, n_vocab=self.vocab_size,
                        eos_token=self.eos_token_ids or None)
                except ValueError as exc:   # a slow (Python) tokenizer
                    raise ValueError(f"structured_outputs: llguidance {llg.__version__} cannot "
                                     f"use this model's tokenizer: {exc}") from None
            return self._tokenizer

    def compile(self, params: StructuredOutputsParams):
        """A fresh matcher at the start of ``params``' grammar (an ``llguidance.LLMatcher``).

        A constraint not in the cache is checked against the limits, compiled on a contained
        thread within the budget, its first mask computed (what fails on the lexer's first
        step fails here, not mid-generation), and cached if its estimate fits.

        Raises:
            ValueError: the constraint is over the limits or does not compile
                (``structured_outputs.<kind>: why``), or llguidance is missing.
        """
        _llguidance()   # a cached template is of no use without it: say so now
        key = params.key
        template = self.cache.get(key)
        if template is None:
            check_limits(params, self.limits)
            tokenizer = self.tokenizer
            text, template = run_native(
                lambda: self._build(params, tokenizer), where=f"structured_outputs.{params.kind}",
                stack_bytes=self.limits.stack_bytes, timeout_s=self.limits.compile_timeout_s)
            if not self.cache.put(key, template, estimate_bytes(text)):
                logger.info("structured_outputs.%s: a grammar of %d bytes compiled for its "
                            "request only (over the cache's entry cap)", params.kind, len(text))
        return template.deep_copy()

    def _build(self, params: StructuredOutputsParams, tokenizer) -> tuple[str, Any]:
        """(llguidance grammar text, template matcher); on the compile thread."""
        import llguidance.torch as llt
        import torch

        text = grammar_text(params)
        template = _llguidance().LLMatcher(tokenizer, text, log_level=0,
                                           limits=self.limits.parser_limits())
        probe = template.deep_copy() if not template.is_error() else template
        if not probe.is_error():
            llt.fill_next_token_bitmask(probe, torch.zeros((1, bitmask_words(self.vocab_size)),
                                                           dtype=torch.int32), 0)
        if probe.is_error():
            raise ValueError(f"structured_outputs.{params.kind}: {probe.get_error().strip()}")
        return text, template


__all__ = ["GrammarCompiler", "INSTALL_HINT", "check_grammar", "grammar_text"]
