"""Tool calls in a model's output: one parser per format, and what a request's ``tool_choice``
makes of a finished (or streaming) choice's text.

Formats:

- ``hermes`` (Qwen2.5, Qwen3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, possibly several, possibly after some text.
- ``llama3_json`` (Llama 3.1-3.3): the whole output is a JSON object ``{"name": ...,
  "parameters": {...}}`` (several separated by ``;``), after an optional ``<|python_tag|>``.
- ``mistral`` and ``pythonic``: in ``more_formats.py``.

With ``tool_choice`` "required" or a named function the grammar shapes the output instead (see
``engine/tools/choice.py``), and :class:`ToolCallMode` reads that shape.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

# Marks a Llama 3 tool call when the tokenizer keeps special tokens in the text.
_PYTHON_TAG = "<|python_tag|>"

# Deepest JSON nesting read as a call's body; deeper text is not a call. Python's json
# recurses once per level and raises RecursionError near 1000 levels (less on a deep stack),
# and a model writes whatever it likes: the parsers must never reach that.
MAX_JSON_DEPTH = 128
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


def json_depth(text: str) -> int:
    """The deepest nesting of ``[`` / ``{`` in ``text`` outside JSON strings (iterative: any
    text, however deep, is measured without recursion)."""
    depth = deepest = 0
    for match in _BRACKET.finditer(_JSON_STRING.sub('""', text)):
        if match.group() in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth = max(0, depth - 1)
    return deepest


def _loads(text: str) -> Any:
    """``json.loads(text)``; ValueError for anything it rejects or nests deeper than
    ``MAX_JSON_DEPTH``."""
    if json_depth(text) > MAX_JSON_DEPTH:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text)
    except RecursionError:      # cannot happen under the depth cap; kept as a second wall
        raise ValueError("nested too deeply") from None


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` entry (``index``: the streamed delta's form)."""
        out = {"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _call_from(obj: Any, args_key: str) -> ToolCall | None:
    """A ToolCall from a decoded ``{"name": ..., args_key: ...}`` (None if it is not one)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):        # already JSON text
        try:
            _loads(args)
        except ValueError:
            return None
        return ToolCall(obj["name"], args)
    try:
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))
    except (RecursionError, ValueError):   # decoded under the depth cap: a second wall
        return None


def json_list_calls(text: str) -> list[ToolCall] | None:
    """Calls from a JSON list of ``{"name", "arguments"}`` objects (None: ``text`` is not a
    non-empty such list)."""
    try:
        items = _loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = [_call_from(item, "arguments") for item in items]
    return None if None in calls else calls


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class HermesParser:
    """``<tool_call>{json}</tool_call>`` blocks (the text before the first is the content)."""

    name = "hermes"
    start = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)`` of a finished output; no block: the text is all content."""
        at = text.find(self.start)
        if at == -1:
            return text, []
        calls = []
        for body in self._block.findall(text[at:]):
            try:
                call = _call_from(_loads(body), "arguments")
            except ValueError:
                call = None
            if call is None:      # not a call after all: the whole text is content
                return text, []
            calls.append(call)
        content = text[:at].strip()
        return content or None, calls

    def content_end(self, text: str) -> int:
        """How much of a growing ``text`` is content for sure (may be streamed now)."""
        at = text.find(self.start)
        return at if at != -1 else len(text) - _held_prefix(text, self.start)


class Llama3JsonParser:
    """The whole output is ``{"name": ..., "parameters": {...}}`` (``;``-separated if several)."""

    name = "llama3_json"
    start = "{"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)`` of a finished output; not a call: the text is all content."""
        body = text.strip().removeprefix(_PYTHON_TAG).strip()
        if not body.startswith("{") or json_depth(body) > MAX_JSON_DEPTH:
            return text, []
        decoder = json.JSONDecoder()
        calls, at = [], 0
        while at < len(body):
            try:
                obj, at = decoder.raw_decode(body, at)
            except (ValueError, RecursionError):
                return text, []
            call = _call_from(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            while at < len(body) and body[at] in " \t\r\n;":
                at += 1
        return None, calls

    def content_end(self, text: str) -> int:
        """How much of a growing ``text`` is content for sure (0 while it may be a call)."""
        body = text.lstrip()
        if not body or body.startswith(("{", _PYTHON_TAG)) or _PYTHON_TAG.startswith(body):
            return 0        # may still be a call: hold it all
        return len(text)


# The other formats build on this module's helpers, so they are imported once those exist.
from .more_formats import MistralParser, PythonicParser  # noqa: E402

PARSERS = {p.name: p for p in (HermesParser(), Llama3JsonParser(), MistralParser(),
                               PythonicParser())}


def parser_for_template(chat_template: str | None) -> str:
    """The parser a chat template's tool format needs (``hermes`` when it shows none;
    ``pythonic`` is never guessed: its templates look like JSON ones)."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if _PYTHON_TAG in template or ('"parameters"' in template and "ipython" in template):
        return "llama3_json"
    return "hermes"


@dataclass(frozen=True)
class ToolCallMode:
    """How a chat request's output becomes tool calls.

    ``kind``: "auto" (``parser`` finds calls in free text), "required" (the grammar made the
    output a JSON list of ``{"name", "arguments"}``) or "named" (the grammar made the output
    the arguments of ``function``).
    """

    kind: Literal["auto", "required", "named"]
    parser: Any = None
    function: str | None = None

    def content_end(self, text: str) -> int:
        """How much of a growing text may be streamed as content now (the rest may be a
        call, sent whole once the choice finishes)."""
        if self.kind != "auto":
            return 0
        return self.parser.content_end(text)

    def extract(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)`` of a finished choice; no calls: the text is all content."""
        if self.kind == "auto":
            return self.parser.extract(text)
        if finish_reason != "stop":      # cut short: not a whole call
            return text, []
        if self.kind == "named":
            return None, [ToolCall(self.function, text)]
        calls = json_list_calls(text)
        return (None, calls) if calls else (text, [])


__all__ = ["MAX_JSON_DEPTH", "HermesParser", "Llama3JsonParser", "PARSERS", "ToolCall",
           "ToolCallMode", "json_depth", "json_list_calls", "parser_for_template"]
