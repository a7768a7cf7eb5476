"""The request body -> a JSON object, refusing everything that is not one as a 400.

Python's json module accepts more than JSON (NaN, Infinity), and some of what it accepts breaks
code further on: a lone surrogate escape (``"\\ud800"``) makes a str that cannot be encoded as
UTF-8, nesting deeper than the recursion limit raises RecursionError, an integer of thousands
of digits cannot be formatted back. :func:`parse_json` stops each of them at the door.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .errors import LONE_SURROGATE, bad_request

# The JSON escape of a UTF-16 surrogate (\ud800-\udfff), or the same letters after an escaped
# backslash (a false alarm: the walk then finds nothing).
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


# Longest JSON integer taken as a number: 20 digits hold every 64-bit value (seed, ids, counts).
MAX_INT_DIGITS = 20


class HugeInt:
    """A JSON integer of more than ``MAX_INT_DIGITS`` digits. No field's type accepts it, so
    validation names the field; meanwhile no arithmetic or message meets a number that Python's
    int <-> str conversion limit (4300 digits) or a 64-bit engine value could choke on."""

    def __init__(self, text: str) -> None:
        self.digits = len(text.lstrip("-"))

    def __str__(self) -> str:
        return f"<an integer of {self.digits} digits>"


def _parse_int(text: str) -> int | HugeInt:
    return int(text) if len(text.lstrip("-")) <= MAX_INT_DIGITS else HugeInt(text)


def _json_type(value: Any) -> str:
    if isinstance(value, (bool, type(None))):
        return json.dumps(value)
    if isinstance(value, (int, float, HugeInt)):
        return "a number"
    return "a string" if isinstance(value, str) else "an array"


def _lone_surrogate_path(data: Any) -> str | None:
    """Where in ``data`` (parsed JSON) a string, key or value, holds a lone surrogate: the
    param name (``messages[0].content``), ``""`` for the top level, None if nowhere.

    Iterative, so a nesting as deep as json.loads accepts cannot overflow the stack.
    """
    todo: list[tuple[Any, str]] = [(data, "")]
    while todo:
        value, where = todo.pop()
        if isinstance(value, str):
            if LONE_SURROGATE.search(value):
                return where
        elif isinstance(value, dict):
            for key, item in value.items():
                name = f"{where}.{key}" if where else key
                if LONE_SURROGATE.search(key):
                    return name
                todo.append((item, name))
        elif isinstance(value, list):
            todo.extend((item, f"{where}[{i}]") for i, item in enumerate(value))
    return None


def preview(value: Any, limit: int = 80) -> str:
    """A short JSON rendering of a rejected value, for an error message (never the whole of a
    big value: strings and containers are cut before they are rendered)."""

    def cut(v: Any, depth: int) -> Any:
        if isinstance(v, str):
            return v[:limit]
        if isinstance(v, list):
            return [cut(x, depth + 1) for x in v[:8]] if depth < 3 else "..."
        if isinstance(v, dict):
            return ({str(k)[:limit]: cut(x, depth + 1) for k, x in list(v.items())[:8]}
                    if depth < 3 else "...")
        return v

    text = json.dumps(cut(value, 0), default=str, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; :class:`APIError` (400) for anything else.

    Rejected as malformed, not left to fail later: invalid UTF-8 or JSON, NaN / Infinity
    literals (not JSON), a nesting deeper than the parser's recursion limit, a string with a
    lone surrogate escape. An integer of more than 20 digits stays in ``data`` as a value no
    field accepts (validation then names the field).
    """
    try:
        data = json.loads(raw, parse_constant=_reject_constant, parse_int=_parse_int)
    except RecursionError:
        raise bad_request("The request body is not valid JSON: it is nested too deeply"
                          ) from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError too
        raise bad_request(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request(f"The request body must be a JSON object, got {_json_type(data)}")
    # A lone surrogate can only come from a \u escape (strict decoding refuses it raw), so a
    # UTF-8 body without one skips the walk: on a big body the walk costs five times the parse.
    where = (_lone_surrogate_path(data) if b"\x00" in raw[:4] or SURROGATE_ESCAPE.search(raw)
             else None)
    if where is not None:
        raise bad_request(f"{where or 'The request body'}: a string holds a lone UTF-16 "
                          "surrogate escape (\\ud800-\\udfff), which is not a character",
                          param=where or None)
    return data
