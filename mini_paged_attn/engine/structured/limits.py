"""GrammarLimits: how big a constraint may be before llguidance ever sees it.

llguidance compiles schemas and grammars recursively in native code: a chain of ~1000 ``$ref``s
or ~3000 Lark rules overflows an 8 MiB thread stack and kills the process, and a 100k-entry
``choice`` or ``a{1000000}`` runs its lexer out of fuel mid-generation. :func:`check_limits`
walks the constraint in Python, without recursion, and refuses what is over a bound with a
``ValueError`` naming the field, before any native call. The bounds are generous for real
schemas (pydantic models, OpenAI tool specs, classification labels); the native compile then
runs on a thread whose stack is sized far above what they allow (``contained.py``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import Any

from .params import StructuredOutputsParams


@dataclass(frozen=True)
class GrammarLimits:
    """The bounds of one constraint, and the budget of compiling it; every one an int >= 1.

    Checked in Python before llguidance (:func:`check_limits`):

    - ``max_schema_bytes``: a JSON schema's compact JSON text.
    - ``max_schema_nodes``: objects and arrays in a schema document.
    - ``max_schema_depth``: nesting of a schema document (its JSON, objects and arrays).
    - ``max_ref_depth``: nesting of a schema's objects with every ``$ref`` followed (a
      recursive reference counts once; a chained object property is ~3 levels): what
      llguidance's compiler recurses through.
    - ``max_branches``: members of one ``anyOf`` / ``oneOf`` / ``allOf``, entries of one ``enum``.
    - ``max_repeat``: a count in a regex repetition (``a{n}``, ``a{n,m}``) and a schema's
      ``minLength`` / ``minItems`` / ``minProperties`` (output the grammar must force).
    - ``max_regex_bytes``: a regex (``structured_outputs.regex``, a schema's ``pattern``).
    - ``max_grammar_bytes``, ``max_grammar_rules``: a Lark / GBNF grammar's text and rules.
    - ``max_choices``, ``max_choice_bytes``: ``choice`` entries and their UTF-8 bytes in all
      (llguidance allows 2000 alternatives in one grammar row).
    - Integers in a schema must fit a signed 64-bit value; numbers must be finite.

    The budget of the native compile (llguidance's ``LLParserLimits``, its defaults except
    ``max_grammar_size``): ``max_items_in_row``, ``initial_lexer_fuel`` (~50k a ms),
    ``step_lexer_fuel``, ``step_max_items``, ``max_lexer_states`` (1-2 kB each),
    ``max_grammar_size``; and ``compile_timeout_s``, the seconds a compile may take before its
    request is refused.

    ``stack_bytes``: the stack of the compile thread. At the bounds above a compile needs well
    under 8 MiB (1000 chained object ``$ref``s overflow 8 MiB, ~8 kB a level); 256 MiB is
    reserved address space, touched only as deep as the compile goes.

    The compiled-grammar cache: ``cache_bytes`` in all, ``cache_entry_bytes`` for one grammar
    (a larger one is compiled for its request and not kept). See ``cache.py`` for the estimate.
    """

    max_schema_bytes: int = 512 * 1024
    max_schema_nodes: int = 50_000
    max_schema_depth: int = 128
    max_ref_depth: int = 1024
    max_branches: int = 1000
    max_repeat: int = 10_000
    max_regex_bytes: int = 64 * 1024
    max_grammar_bytes: int = 256 * 1024
    max_grammar_rules: int = 2000
    max_choices: int = 1000
    max_choice_bytes: int = 64 * 1024
    max_items_in_row: int = 2000
    initial_lexer_fuel: int = 1_000_000
    step_lexer_fuel: int = 200_000
    step_max_items: int = 50_000
    max_lexer_states: int = 250_000
    max_grammar_size: int = 200_000
    compile_timeout_s: int = 20
    stack_bytes: int = 256 * 1024 * 1024
    cache_bytes: int = 512 * 1024 * 1024
    cache_entry_bytes: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GrammarLimits.{f.name}: expected an int >= 1, got {value!r}")

    def parser_limits(self):
        """llguidance's ``LLParserLimits`` of this budget."""
        import llguidance

        return llguidance.LLParserLimits(
            max_items_in_row=self.max_items_in_row, initial_lexer_fuel=self.initial_lexer_fuel,
            step_lexer_fuel=self.step_lexer_fuel, step_max_items=self.step_max_items,
            max_lexer_states=self.max_lexer_states, max_grammar_size=self.max_grammar_size,
            verbose_errors=False)


DEFAULT_LIMITS = GrammarLimits()
INT64_MAX = 2 ** 63 - 1
# a{n}, a{n,}, a{n,m}: the counts (digits only; an escaped "\{" is no repetition).
_REPEAT = re.compile(r"(?<!\\)\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
# The start of a Lark rule or terminal definition (``name:``, ``?name:``, ``NAME.2:``), or of
# a GBNF rule (``name ::=``).
_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w.-]*[ \t]*(?:\.[-\d]+)?[ \t]*(?::|::=)", re.M)
_BRANCH_KEYS = ("anyOf", "oneOf", "allOf", "enum")
_FORCED_COUNT_KEYS = ("minLength", "minItems", "minProperties", "minContains")


def _fail(message: str) -> ValueError:
    return ValueError(message)


def check_limits(params: StructuredOutputsParams, limits: GrammarLimits = DEFAULT_LIMITS
                 ) -> None:
    """Raise ``ValueError`` (``structured_outputs.<kind>: <which bound, its value, the
    limit>``) if ``params`` is over one of ``limits``' bounds. Pure Python, no recursion."""
    kind, text = params.key
    where = f"structured_outputs.{kind}"
    if kind == "json":
        _check_schema(params.json, text, limits, where)
    elif kind == "regex":
        _check_regex(text, limits, where)
    elif kind == "choice":
        if len(params.choice) > limits.max_choices:
            raise _fail(f"{where}: expected at most {limits.max_choices} entries, got "
                        f"{len(params.choice)}")
        size = sum(len(c.encode("utf-8", "surrogatepass")) for c in params.choice)
        if size > limits.max_choice_bytes:
            raise _fail(f"{where}: expected at most {limits.max_choice_bytes} bytes in all, "
                        f"got {size}")
    elif kind == "grammar":
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > limits.max_grammar_bytes:
            raise _fail(f"{where}: expected at most {limits.max_grammar_bytes} bytes, got {size}")
        rules = len(_RULE.findall(text))
        if rules > limits.max_grammar_rules:
            raise _fail(f"{where}: expected at most {limits.max_grammar_rules} rules, got "
                        f"{rules}")
        _check_repeats(text, limits, where)


def _check_regex(regex: str, limits: GrammarLimits, where: str, what: str = "a regex") -> None:
    size = len(regex.encode("utf-8", "surrogatepass"))
    if size > limits.max_regex_bytes:
        raise _fail(f"{where}: expected {what} of at most {limits.max_regex_bytes} bytes, "
                    f"got {size}")
    _check_repeats(regex, limits, where, f" in {what}" if what != "a regex" else "")


def _check_repeats(text: str, limits: GrammarLimits, where: str, inside: str = "") -> None:
    for match in _REPEAT.finditer(text):
        for count in match.groups():
            # Compared as text first: a 5000-digit count must not meet int()'s digit limit.
            if count and (len(count) > 9 or int(count) > limits.max_repeat):
                raise _fail(f"{where}: expected repetition counts of at most "
                            f"{limits.max_repeat}{inside}, got {match.group(0)[:40]!r}")


def _check_schema(schema: Any, text: str, limits: GrammarLimits, where: str) -> None:
    """Size, document depth, node count, numbers, branches, patterns, then ``$ref`` depth."""
    if isinstance(schema, str):   # checked to be JSON by StructuredOutputsParams
        import json

        schema = json.loads(text)
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_schema_bytes:
        raise _fail(f"{where}: expected a schema of at most {limits.max_schema_bytes} bytes, "
                    f"got {size}")
    nodes = 0
    stack: list[tuple[Any, int, str | None]] = [(schema, 1, None)]
    while stack:
        value, depth, key = stack.pop()
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            if not -INT64_MAX - 1 <= value <= INT64_MAX:
                raise _fail(f"{where}: expected integers that fit 64 bits, got one of "
                            f"{len(str(abs(value))) if abs(value) < 10 ** 4000 else 'over 4000'}"
                            " digits")
            if key in _FORCED_COUNT_KEYS and value > limits.max_repeat:
                raise _fail(f"{where}: expected {key} <= {limits.max_repeat}, got {value}")
            continue
        if isinstance(value, float):
            if not math.isfinite(value):
                raise _fail(f"{where}: expected finite numbers, got {value}")
            continue
        if isinstance(value, str):
            if key == "pattern":
                _check_regex(value, limits, where, "a pattern")
            continue
        if not isinstance(value, (dict, list)):
            continue
        nodes += 1
        if nodes > limits.max_schema_nodes:
            raise _fail(f"{where}: expected at most {limits.max_schema_nodes} objects and "
                        "arrays in the schema, got more")
        if depth > limits.max_schema_depth:
            raise _fail(f"{where}: expected a schema nested at most {limits.max_schema_depth} "
                        "levels deep, got more")
        if isinstance(value, dict):
            for k, v in value.items():
                if (k in _BRANCH_KEYS and isinstance(v, list)
                        and len(v) > limits.max_branches):
                    raise _fail(f"{where}: expected at most {limits.max_branches} entries in "
                                f"{k}, got {len(v)}")
                if k == "patternProperties" and isinstance(v, dict):
                    for pattern in v:
                        _check_regex(pattern, limits, where, "a patternProperties key")
                stack.append((v, depth + 1, k))
        else:
            stack.extend((v, depth + 1, None) for v in value)
    from .schema_refs import check_refs

    check_refs(schema, limits.max_ref_depth, where)


__all__ = ["DEFAULT_LIMITS", "GrammarLimits", "check_limits"]
