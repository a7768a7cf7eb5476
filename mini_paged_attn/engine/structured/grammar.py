"""Grammars for structured outputs, through llguidance: StructuredOutputsParams -> a checked
grammar -> a matcher per sample.

llguidance (an optional dependency, the ``structured`` extra) is imported on first use, so the
engine runs without it until a request asks for structured output. :func:`check_grammar` needs
no tokenizer (what the server calls before queueing a request); :class:`GrammarCompiler` holds
the model's token trie and a small cache of compiled grammars, so requests with the same
constraint compile it once and each sample starts from a copy.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from typing import Any

from .params import StructuredOutputsParams

logger = logging.getLogger(__name__)

INSTALL_HINT = 'pip install -e ".[structured]"'
# Compiled grammars kept per engine (least recently used ones go first).
CACHE_SIZE = 128
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


def check_grammar(params: StructuredOutputsParams) -> None:
    """Raise ``ValueError`` (``structured_outputs.<kind>: <why>``) if ``params`` cannot compile:
    an invalid JSON schema, regex or grammar, or llguidance missing. No tokenizer needed."""
    error = _llguidance().LLMatcher.validate_grammar(grammar_text(params))
    if error:
        raise ValueError(f"structured_outputs.{params.kind}: {error.strip()}")


class GrammarCompiler:
    """Compiles constraints for one model's vocabulary; safe to call from any thread.

    Args:
        hf_tokenizer: the model's Hugging Face fast tokenizer (its token strings build
            llguidance's token trie, once, on the first structured request).
        vocab_size: the model's logits width (ids past the tokenizer's are never allowed).
        eos_token_ids: the ids that end a sample; a finished grammar allows only these.
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._lock = threading.Lock()
        self._tokenizer = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()

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

        Raises:
            ValueError: the constraint does not compile (``structured_outputs.<kind>: why``),
                or llguidance is missing.
        """
        key = params.key
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
        if template is None:
            # Compiled outside the lock: a big schema takes a while, other threads go on.
            template = _llguidance().LLMatcher(self.tokenizer, grammar_text(params), log_level=0)
            if template.is_error():
                raise ValueError(f"structured_outputs.{params.kind}: "
                                 f"{template.get_error().strip()}")
            with self._lock:
                self._cache[key] = template
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        return template.deep_copy()


__all__ = ["CACHE_SIZE", "GrammarCompiler", "INSTALL_HINT", "check_grammar", "grammar_text"]
