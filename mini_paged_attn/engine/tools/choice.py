"""Tools of a chat request (OpenAI's ``tools`` / ``tool_choice``): the function specs checked,
and what ``tool_choice`` asks of the engine, one :class:`StructuredOutputsParams` (or none) and
how the calls are read back (:class:`~mini_paged_attn.engine.tools.parsers.ToolCallMode`).

Shared by :meth:`LLM.chat <mini_paged_attn.engine.llm.LLM.chat>` and the server, which turns
the :class:`ToolArgumentError` raised here into a 400 naming the same parameter.

- "none": no constraint, no calls read back.
- "auto" (the default): no constraint; a parser finds calls in the free text.
- "required": the grammar makes the output a JSON list of ``{"name", "arguments"}``, each
  ``arguments`` valid for its function's ``parameters`` schema.
- ``{"type": "function", "function": {"name": NAME}}``: the output is NAME's arguments.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from ..structured import INSTALL_HINT, GrammarCompiler, StructuredOutputsParams, check_grammar
from .parsers import PARSERS, ToolCallMode

# OpenAI's rule for function names.
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# A function without ``parameters`` takes none.
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
TOOL_CHOICE_HELP = ('"none", "auto", "required" or {"type": "function", "function": '
                    '{"name": ...}}')


class ToolArgumentError(ValueError):
    """A bad ``tools`` / ``tool_choice`` (the message starts with ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def checked_constraint(make: Callable[[], StructuredOutputsParams], param: str,
                       compiler: GrammarCompiler | None = None) -> StructuredOutputsParams:
    """``make()``, checked to compile; :class:`ToolArgumentError` naming ``param`` if not.

    ``compiler``: the engine's; the constraint is then compiled for good (within the limits
    and budget, into its cache), so admitting the request costs the engine only a copy. None:
    checked without a tokenizer (:func:`check_grammar`).
    """
    try:
        params = make()
        if compiler is not None:
            compiler.compile(params)
        else:
            check_grammar(params)
    except ValueError as exc:
        message = str(exc)
        if INSTALL_HINT in message:
            message = f"structured outputs need llguidance ({INSTALL_HINT})"
        else:
            # The engine names its own field (structured_outputs.json: ...): drop it.
            message = message.removeprefix(f"{param}: ")
            if message.startswith("structured_outputs"):
                message = message.split(": ", 1)[-1]
        raise ToolArgumentError(param, message) from None
    return params


def tool_functions(tools: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Function name -> its parameters JSON schema, of OpenAI-style ``tools``
    (``[{"type": "function", "function": {"name", "description"?, "parameters"?}}]``)."""
    if not isinstance(tools, (list, tuple)):
        raise ToolArgumentError("tools", "expected a list of {'type': 'function', 'function': "
                                f"{{...}}}} dicts, got {type(tools).__name__}")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        if not (isinstance(tool, dict) and tool.get("type") == "function"
                and isinstance(tool.get("function"), dict)):
            raise ToolArgumentError(f"tools[{i}]", "expected {'type': 'function', 'function': "
                                    f"{{'name': ..., 'parameters': ...}}}}, got {tool!r:.120}")
        spec = tool["function"]
        name, param = spec.get("name"), f"tools[{i}].function.name"
        if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
            raise ToolArgumentError(param, "expected 1-64 letters, digits, '_' or '-', got "
                                    f"{str(name)[:80]!r}")
        if name in functions:
            raise ToolArgumentError(param, f"{name!r} is defined twice")
        schema = spec.get("parameters")
        if schema is not None and not isinstance(schema, dict):
            raise ToolArgumentError(f"tools[{i}].function.parameters", "expected a JSON schema "
                                    f"(a dict), got {type(schema).__name__}")
        functions[name] = schema or _NO_PARAMETERS
    return functions


def tool_constraint(tools: Sequence[dict[str, Any]] | None, tool_choice: str | dict | None, *,
                    parser: str, parallel_tool_calls: bool = True,
                    constrained_by: str | None = None, compiler: GrammarCompiler | None = None
                    ) -> tuple[StructuredOutputsParams | None, ToolCallMode | None]:
    """The constraint ``tool_choice`` puts on the output and how its calls are read.

    Args:
        tools: OpenAI-style function specs (see :func:`tool_functions`), or None.
        tool_choice: "none", "auto", "required", ``{"type": "function", "function":
            {"name": ...}}``, or None ("auto" when there are tools).
        parser: the format "auto" looks for (a :data:`~mini_paged_attn.engine.tools.parsers.PARSERS` key).
        parallel_tool_calls: False: "required" allows one call only.
        constrained_by: the name of a constraint the request already has (it cannot be
            combined with "required" or a named function), or None.
        compiler: the engine's grammar compiler, to compile the constraint for good (see
            :func:`checked_constraint`), or None.

    Returns:
        ``(constraint or None, mode or None)``; mode None: no tool calls are read back.

    Raises:
        ToolArgumentError: naming the bad argument, before anything is compiled for good.
    """
    if tool_choice is not None and not tools:
        raise ToolArgumentError("tool_choice", "only allowed when tools are given")
    functions = tool_functions(tools or [])
    name = None
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise ToolArgumentError("tool_choice", f"expected {TOOL_CHOICE_HELP}, got "
                                    f"{tool_choice!r:.120}")
    elif tool_choice not in (None, "none", "auto", "required"):
        raise ToolArgumentError("tool_choice", f"expected {TOOL_CHOICE_HELP}, got "
                                f"{tool_choice!r:.120}")
    if parser not in PARSERS:
        raise ValueError(f"parser: expected one of {sorted(PARSERS)}, got {parser!r}")
    if not functions or tool_choice == "none":
        return None, None
    if tool_choice in (None, "auto"):
        return None, ToolCallMode("auto", parser=PARSERS[parser])
    if constrained_by is not None:
        raise ToolArgumentError("tool_choice", "a required or named tool call cannot be "
                                f"combined with {constrained_by}")
    if tool_choice == "required":
        return _required(functions, parallel_tool_calls, compiler), ToolCallMode("required")
    if name not in functions:
        raise ToolArgumentError("tool_choice", f"no function named {name[:80]!r} in tools "
                                f"(there are {', '.join(sorted(functions))})")
    index = list(functions).index(name)
    return checked_constraint(lambda: StructuredOutputsParams(json=functions[name]),
                              f"tools[{index}].function.parameters", compiler), \
        ToolCallMode("named", function=name)


def _required(functions: dict[str, dict[str, Any]], parallel: bool,
              compiler: GrammarCompiler | None) -> StructuredOutputsParams:
    """A JSON list of calls, each of one of ``functions`` with valid arguments.

    Each function's schema moves to the combined schema's ``$defs`` (as ``f<i>``, its own
    ``$defs`` / ``definitions`` beside it as ``f<i>.<name>``), its local ``$ref``s rewritten to
    match, so pydantic-style schemas resolve inside the list as they do alone."""
    for i, schema in enumerate(functions.values()):
        # Checked one by one first, so a bad schema is named by its own index (and the
        # combined one is known to be within the limits' depth before it is rewritten).
        checked_constraint(lambda: StructuredOutputsParams(json=schema),
                           f"tools[{i}].function.parameters")
    defs: dict[str, Any] = {}
    for i, schema in enumerate(functions.values()):
        defs.update(_hoisted(schema, f"f{i}"))
    calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"const": name},
                                          "arguments": {"$ref": f"#/$defs/f{i}"}},
         "required": ["name", "arguments"], "additionalProperties": False}
        for i, name in enumerate(functions)]}, "$defs": defs}
    if not parallel:
        calls["maxItems"] = 1
    return checked_constraint(lambda: StructuredOutputsParams(json=calls), "tools", compiler)


def _hoisted(schema: dict[str, Any], name: str) -> dict[str, Any]:
    """``{name: schema without its definitions, f"{name}.{d}": each definition}``, every local
    ``$ref`` rewritten to point into the combined schema's ``$defs``."""
    own = {}
    for key in ("$defs", "definitions"):
        if isinstance(schema.get(key), dict):
            own.update({d: (key, value) for d, value in schema[key].items()})

    def target(ref: str) -> str:
        if not ref.startswith("#"):
            return ref
        for key in ("$defs", "definitions"):
            prefix = f"#/{key}/"
            if ref.startswith(prefix):
                head, _, rest = ref[len(prefix):].partition("/")
                if head in own:
                    return f"#/$defs/{_escape(f'{name}.{head}')}" + (f"/{rest}" if rest else "")
        return f"#/$defs/{_escape(name)}{ref[1:]}"

    def rewrite(value: Any) -> Any:
        # Depth is within the limits' max_schema_depth: checked_constraint ran first.
        if isinstance(value, dict):
            return {k: (target(v) if k == "$ref" and isinstance(v, str) else rewrite(v))
                    for k, v in value.items()}
        if isinstance(value, list):
            return [rewrite(v) for v in value]
        return value

    body = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}
    out = {name: rewrite(body)}
    out.update({f"{name}.{d}": rewrite(value) for d, (_, value) in own.items()})
    return out


def _escape(name: str) -> str:
    """``name`` as one JSON pointer segment."""
    return name.replace("~", "~0").replace("/", "~1")


__all__ = ["TOOL_CHOICE_HELP", "ToolArgumentError", "checked_constraint", "tool_constraint",
           "tool_functions"]
