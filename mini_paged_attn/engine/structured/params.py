"""StructuredOutputsParams: the one constraint a request's output must satisfy (vLLM's names)."""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, field
from typing import Any

# The kinds of constraint, in the order they are looked for.
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrains every generated sample to a grammar; exactly one field is set.

    Args:
        json: a JSON schema (a dict, or its JSON text): the output is one JSON value valid
            against it.
        json_object: True: the output is one JSON object (any keys and values).
        regex: the output matches this regular expression (Rust ``regex`` syntax, whole text).
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar, Lark or GBNF/EBNF text (``start`` / ``root`` rule).

    JSON is written compactly, as ``json.dumps`` does: ``", "`` between items, ``": "`` after
    keys, no other whitespace (a schema's ``x-guidance`` options may change that).

    Raises:
        ValueError: none or several fields set, or a field of the wrong type, named.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    # ``(kind, canonical text)``: what compiled grammars are cached by.
    key: tuple[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs: expected exactly one of json, json_object, "
                             f"regex, choice, grammar; got {given or 'none'}")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            schema = value
            if isinstance(schema, str):
                try:
                    schema = _json.loads(schema)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.json: expected a JSON schema, got "
                                     f"text that is not JSON ({exc})") from None
            if not isinstance(schema, dict):
                raise ValueError("structured_outputs.json: expected a JSON schema object, got "
                                 f"{type(schema).__name__}")
            # Key order kept: properties are generated in the order the schema lists them.
            try:
                text = _json.dumps(schema, ensure_ascii=False, allow_nan=False,
                                   default=_not_json)
            except (TypeError, ValueError, RecursionError) as exc:
                # Huge integers (the server keeps them unparsed), NaN, nesting Python's encoder
                # cannot follow: none of them is JSON a schema compiler can read.
                raise ValueError("structured_outputs.json: expected a JSON schema of plain JSON "
                                 f"values, got {str(exc)[:200]}") from None
        elif kind == "json_object":
            if value is not True:
                raise ValueError(f"structured_outputs.json_object: expected True, got {value!r}")
            text = ""
        elif kind == "choice":
            if (not isinstance(value, (list, tuple)) or not value
                    or not all(isinstance(c, str) and c for c in value)):
                raise ValueError("structured_outputs.choice: expected a non-empty list of "
                                 f"non-empty strings, got {value!r:.200}")
            object.__setattr__(self, "choice", tuple(value))
            text = _json.dumps(list(value), ensure_ascii=False)
        else:
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"structured_outputs.{kind}: expected a non-empty string, "
                                 f"got {value!r:.200}")
            text = value
        object.__setattr__(self, "key", (kind, text))

    @property
    def max_output_bytes(self) -> int | None:
        """The longest output the constraint allows, in UTF-8 bytes, when it is known without
        compiling (``choice``: its longest entry); else None."""
        if self.kind != "choice":
            return None
        return max(len(c.encode("utf-8", "surrogatepass")) for c in self.choice)

    @property
    def kind(self) -> str:
        """Which field is set: one of ``KINDS``."""
        return self.key[0]


def _not_json(value: Any) -> Any:
    # The server's parser keeps integers of over 20 digits as a placeholder whose str says so.
    raise TypeError(f"{value}" if type(value).__name__ == "HugeInt"
                    else f"a {type(value).__name__}, which is not JSON")


__all__ = ["KINDS", "StructuredOutputsParams"]
