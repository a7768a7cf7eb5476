"""Tokenizer: a thin wrapper over a ``transformers`` tokenizer loaded from a local directory,
and IncrementalDetokenizer, which turns a growing list of token ids into text deltas.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .config import check_model_dir, read_json

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")

# Prompt tokens kept as left context when detokenizing the first generated tokens: some
# tokenizers (sentencepiece) decode a token differently at the start of a text (no leading space).
_DETOKENIZE_CONTEXT = 6
_REPLACEMENT = "\ufffd"   # what decoding gives for an incomplete UTF-8 sequence

# What tells whether a chat template renders tools: a one-message conversation rendered with
# and without this function spec.
_PROBE_MESSAGES = [{"role": "user", "content": "What time is it?"}]
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": "get_current_time", "description": "The current time",
    "parameters": {"type": "object", "properties": {}, "required": []}}}]


class Tokenizer:
    """encode / decode / chat template / eos ids over a ``transformers`` tokenizer.

    ``eos_token_ids`` is the tokenizer's eos token plus ``extra_eos_token_ids`` (load_tokenizer
    passes those of config.json and generation_config.json: instruct models stop on several).
    """

    def __init__(self, hf_tokenizer: Any, *, extra_eos_token_ids: Sequence[int] = (),
                 name: str = "tokenizer"):
        self.hf = hf_tokenizer
        self.name = name
        ids: list[int] = []
        for i in (hf_tokenizer.eos_token_id, *extra_eos_token_ids):
            if isinstance(i, int) and i not in ids:
                ids.append(i)
        self.eos_token_ids: tuple[int, ...] = tuple(ids)
        # The Rust tokenizer decodes ~10x faster than the Python wrapper, which matters when
        # every running request detokenizes every step; use it unless the wrapper would change
        # the text (clean_up_tokenization_spaces).
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        self._raw_decode = (backend.decode if backend is not None
                            and not getattr(hf_tokenizer, "clean_up_tokenization_spaces", False)
                            else None)
        # Chat template (its text) -> whether it renders tools, and the templates warned
        # about; from any thread (the server renders on worker threads).
        self._renders_tools: dict[str, bool | None] = {}
        self._warned_tools: set[str] = set()
        self._renders_tools_lock = threading.Lock()

    def __getstate__(self) -> dict:
        # The engine process sends its tokenizer to the client: a lock does not pickle (the
        # probes are redone there, and warned about there, once).
        state = dict(self.__dict__)
        state.pop("_renders_tools_lock")
        state["_renders_tools"], state["_warned_tools"] = {}, set()
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._renders_tools_lock = threading.Lock()

    @property
    def eos_token_id(self) -> int | None:
        """The primary eos id (the tokenizer's own, else the first extra one)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self.hf.pad_token_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (may be below the model's vocab_size)."""
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's bos etc. when ``add_special_tokens``)."""
        if not isinstance(text, str):
            raise ValueError(f"text: expected a str, got {type(text).__name__}")
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        if self._raw_decode is not None:
            return self._raw_decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return list(self.hf.convert_ids_to_tokens(list(token_ids)))

    def apply_chat_template(self, messages: list[dict[str, Any]], *,
                            add_generation_prompt: bool = True, tokenize: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            **template_kwargs: Any) -> list[int] | str:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the chat template.

        Returns the token ids (``tokenize=True``) or the rendered text. The text is encoded
        without adding special tokens: the template writes them itself. ``tools``: OpenAI-style
        ``[{"type": "function", "function": {"name", "description", "parameters"}}]``, which
        templates that support tool use render into the prompt; others drop them, and then a
        warning is logged, once per template (see :meth:`renders_tools`).

        Raises:
            ValueError: the tokenizer has no chat template, or ``messages`` is malformed.
        """
        if not self.has_chat_template:
            raise ValueError(f"messages: {self.name} has no chat template "
                             "(pass a plain prompt instead)")
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise ValueError("messages: expected a list of {'role': ..., 'content': ...} dicts, "
                             f"got {messages!r:.200}")
        if tools is not None:
            template_kwargs["tools"] = tools
        if tools:
            self._warn_if_tools_dropped(template_kwargs.get("chat_template"))
        text = self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                           tokenize=False, **template_kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def renders_tools(self, chat_template: str | None = None) -> bool | None:
        """Whether the chat template (``chat_template``, else the tokenizer's own) writes tools
        into the prompt: a probe conversation rendered with and without one function spec
        differs. With a template that drops them the model never sees the functions, so
        ``tool_choice="auto"`` practically never calls one ("required" and a named function
        still constrain the output to a call); :meth:`apply_chat_template` then warns, once
        per template. Probed once per template. None: no chat template, or the probe does
        not render (a template that needs other messages).
        """
        template = chat_template or getattr(self.hf, "chat_template", None)
        if not template:
            return None
        key = str(template)      # a dict of named templates too (transformers picks one)
        with self._renders_tools_lock:
            if key in self._renders_tools:
                return self._renders_tools[key]
            extra = {"chat_template": chat_template} if chat_template else {}
            try:
                plain, with_tools = (
                    self.hf.apply_chat_template(_PROBE_MESSAGES, tools=tools, tokenize=False,
                                                add_generation_prompt=True, **extra)
                    for tools in (None, _PROBE_TOOLS))
            except Exception as exc:    # the template's own checks (roles, ...): unknown
                logger.debug("%s: could not probe the chat template for tools: %s",
                             self.name, exc)
                rendered = None
            else:
                rendered = plain != with_tools
            self._renders_tools[key] = rendered
        return rendered

    def _warn_if_tools_dropped(self, chat_template: str | None) -> None:
        """A warning, the first time only, that a request's tools miss the template."""
        if self.renders_tools(chat_template) is not False:
            return
        key = str(chat_template or self.hf.chat_template)
        with self._renders_tools_lock:
            if key in self._warned_tools:
                return
            self._warned_tools.add(key)
        logger.warning(
            "%s: the chat template ignores tools, so the model never sees their specs: "
            "tool_choice='auto' will practically never call one ('required' or a named "
            "function still constrain the output to a call); use a model whose template "
            "renders tools (README: Tools and chat templates)", self.name)

    def detokenizer(self, prompt_token_ids: Sequence[int] = (), *,
                    skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_token_ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Feed generated token ids, get text deltas; the concatenated deltas only ever grow.

    It decodes a short window of recent tokens twice (with and without the newest) and emits the
    difference, holding back text that ends in an incomplete UTF-8 sequence (a byte-level token
    can carry half a character) until the rest arrives; :meth:`flush` releases what is left at
    the end. Each :meth:`add` costs O(window), not O(generated tokens).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (), *,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_token_ids[-_DETOKENIZE_CONTEXT:])
        self._prefix_offset = 0               # window start
        self._read_offset = len(self._ids)    # tokens before it have been emitted as text
        self.token_ids: list[int] = []        # generated tokens fed so far
        self.text = ""                        # text emitted so far

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or (not final and new_text.endswith(_REPLACEMENT)):
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def add(self, token_ids: int | Sequence[int]) -> str:
        """Append one or more generated token ids; return the new text ("" while held back)."""
        new = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        self._ids.extend(new)
        self.token_ids.extend(new)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of generation: the held-back text (an incomplete character as U+FFFD)."""
        return self._advance(final=True)


def check_tokenizer_dir(model_dir: str | Path) -> Path:
    """``model_dir`` as a Path, if it is a directory holding a tokenizer file: the checks of
    :func:`load_tokenizer` that need no transformers (a caller that loads the tokenizer on a
    thread runs them first, so a wrong path fails at once).

    Raises:
        FileNotFoundError: ``model_dir`` is missing or holds no tokenizer file (named).
    """
    model_dir = check_model_dir(model_dir)
    if not any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        raise FileNotFoundError(f"model_dir: no tokenizer in {str(model_dir)!r} (expected one of "
                                f"{', '.join(TOKENIZER_FILES)})")
    return model_dir


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The tokenizer of a local Hugging Face model directory (nothing is downloaded): what
    ``AutoTokenizer`` gives, without importing it where the base class gives the same
    (``hf_tokenizer.py``).

    Extra eos ids come from config.json and generation_config.json when present.

    Raises:
        FileNotFoundError: ``model_dir`` is missing or holds no tokenizer file (named).
    """
    from .hf_tokenizer import load_hf_tokenizer

    model_dir = check_tokenizer_dir(model_dir)
    hf = load_hf_tokenizer(model_dir)
    extra: list[int] = []
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if path.is_file():
            eos = read_json(path).get("eos_token_id")
            extra.extend([eos] if isinstance(eos, int) else (eos or []))
    return Tokenizer(hf, extra_eos_token_ids=extra, name=f"the tokenizer of {model_dir}")
