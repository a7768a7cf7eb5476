"""Two more tool-call formats, after vLLM's parsers of the same names:

- ``mistral`` (Mistral 7B v0.3, Nemo, Small, Devstral): ``[TOOL_CALLS]`` then a JSON list of
  ``{"name", "arguments"}``, or (newer tokenizers) ``[TOOL_CALLS]name[ARGS]{...}`` once per
  call. ``[TOOL_CALLS]`` is a special token, gone from a text decoded without special tokens:
  an output that is nothing but such a JSON list is read as calls too.
- ``pythonic`` (Llama 3.2 / 4 with the pythonic template, ToolACE): the whole output is a
  Python list of calls with literal keyword arguments, ``[f(x=1), g(city="Paris")]``, maybe
  between ``<|python_start|>`` and ``<|python_end|>``. It is parsed by :mod:`ast`, never run.
"""

from __future__ import annotations

import ast
import json
import re

from .parsers import (MAX_JSON_DEPTH, ToolCall, _held_prefix, _loads, json_depth,
                      json_list_calls)

_TOOL_CALLS = "[TOOL_CALLS]"
_ARGS = "[ARGS]"
_CALL_ID = "[CALL_ID]"
_PY_START, _PY_END = "<|python_start|>", "<|python_end|>"
# Python's parser gives up (SyntaxError) past 200 nested brackets; a longer or deeper text
# than these is not read as calls, so ast never sees what could exhaust it.
MAX_PYTHONIC_CHARS = 1 << 20
_PAREN = re.compile(r"[()]")


def _named_calls(parts: list[str]) -> list[ToolCall] | None:
    """Calls from ``name[ARGS]{json}`` pieces (``[CALL_ID]id`` allowed before ``[ARGS]``)."""
    calls = []
    for part in parts:
        name, sep, args = part.partition(_ARGS)
        name = name.split(_CALL_ID, 1)[0].strip()
        if not sep or not name:
            return None
        try:
            _loads(args.strip())
        except ValueError:
            return None
        calls.append(ToolCall(name, args.strip()))
    return calls


class MistralParser:
    """``[TOOL_CALLS][...]`` or ``[TOOL_CALLS]name[ARGS]{...}`` (the text before is content)."""

    name = "mistral"
    start = _TOOL_CALLS

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)`` of a finished output; not calls: the text is all content."""
        at = text.find(_TOOL_CALLS)
        if at == -1:
            calls = json_list_calls(text.strip()) if text.lstrip().startswith("[") else None
            return (None, calls) if calls else (text, [])
        rest = text[at + len(_TOOL_CALLS):].strip()
        if rest.startswith("["):
            calls = json_list_calls(rest)
        else:
            calls = _named_calls([p for p in rest.split(_TOOL_CALLS) if p.strip()])
        if not calls:
            return text, []
        content = text[:at].strip()
        return content or None, calls

    def content_end(self, text: str) -> int:
        """How much of a growing ``text`` is content for sure (0 while it may be calls)."""
        if text.lstrip().startswith("["):      # the marker, or a list without it
            return 0
        at = text.find(_TOOL_CALLS)
        return at if at != -1 else len(text) - _held_prefix(text, _TOOL_CALLS)


def _literal(node: ast.expr) -> object:
    value = ast.literal_eval(node)
    json.dumps(value)          # only what JSON can carry (no sets, bytes, complex numbers)
    return value


def _pythonic_calls(body: str) -> list[ToolCall] | None:
    """Calls from ``[f(a=1), g(b="x")]`` (None: it is not a list of such calls)."""
    if (len(body) > MAX_PYTHONIC_CHARS
            or json_depth(_PAREN.sub(lambda m: "[" if m.group() == "(" else "]", body))
            > MAX_JSON_DEPTH):
        return None
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                and all(k.arg is not None for k in node.keywords)):
            return None
        try:
            args = {k.arg: _literal(k.value) for k in node.keywords}
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
        calls.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False)))
    return calls


class PythonicParser:
    """The whole output is ``[f(a=1), ...]``, maybe inside ``<|python_start|>...<|python_end|>``."""

    name = "pythonic"
    start = "["

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)`` of a finished output; not calls: the text is all content."""
        body = text.strip().removeprefix(_PY_START).removesuffix(_PY_END).strip()
        calls = _pythonic_calls(body) if body.startswith("[") else None
        return (None, calls) if calls else (text, [])

    def content_end(self, text: str) -> int:
        """How much of a growing ``text`` is content for sure (0 while it may be a call)."""
        body = text.lstrip()
        if not body or body.startswith(("[", _PY_START)) or _PY_START.startswith(body):
            return 0
        return len(text)


__all__ = ["MAX_PYTHONIC_CHARS", "MistralParser", "PythonicParser"]
