"""What a request's ``response_format``, ``structured_outputs`` and ``tools`` / ``tool_choice``
ask the engine for: one :class:`StructuredOutputsParams` (or none) and how tool calls are read
back (:class:`ToolCallMode`). Everything is checked here, before the request is queued: a schema
or grammar that does not compile, a function that does not exist, a ``tool_choice`` without
``tools`` are 400s naming the parameter.
"""

from __future__ import annotations

import re
from typing import Any

from ..engine.structured import INSTALL_HINT, StructuredOutputsParams, check_grammar
from .errors import bad_request
from .protocol import ChatCompletionRequest, _SamplingFields
from .tool_parsers import PARSERS, ToolCallMode

# OpenAI's rule for function names.
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# A function without ``parameters`` takes none.
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def _checked(make: Any, param: str) -> StructuredOutputsParams:
    """``make()`` checked to compile; a 400 naming ``param`` if it does not."""
    try:
        params = make()
        check_grammar(params)
    except ValueError as exc:
        message = str(exc)
        if INSTALL_HINT in message:
            message = f"{param}: structured outputs need llguidance on the server ({INSTALL_HINT})"
        elif not message.startswith(param):
            # The engine names its own field (structured_outputs.json: ...): name the request's.
            if message.startswith("structured_outputs"):
                message = message.split(": ", 1)[-1]
            message = f"{param}: {message}"
        raise bad_request(message, param=param) from None
    return params


def _from_response_format(req: _SamplingFields) -> StructuredOutputsParams | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return _checked(lambda: StructuredOutputsParams(json_object=True), "response_format")
    schema = fmt.json_schema.schema_
    return _checked(lambda: StructuredOutputsParams(json=schema),
                    "response_format.json_schema.schema")


def _from_extension(req: _SamplingFields) -> StructuredOutputsParams | None:
    ext = req.structured_outputs
    if ext is None:
        return None
    fields = {"json": ext.json_, "json_object": ext.json_object, "regex": ext.regex,
              "choice": ext.choice, "grammar": ext.grammar}
    given = [k for k, v in fields.items() if v not in (None, False)]
    param = f"structured_outputs.{given[0]}" if len(given) == 1 else "structured_outputs"
    return _checked(lambda: StructuredOutputsParams(**fields), param)


def _one_of(*found: tuple[str, StructuredOutputsParams | None]) -> StructuredOutputsParams | None:
    given = [(name, params) for name, params in found if params is not None]
    if len(given) > 1:
        raise bad_request(f"{given[1][0]}: cannot be combined with {given[0][0]} (each "
                          "constrains the whole output)", param=given[1][0])
    return given[0][1] if given else None


def completion_constraint(req: _SamplingFields) -> StructuredOutputsParams | None:
    """The constraint of a /v1/completions request (APIError 400 on a bad one)."""
    return _one_of(("response_format", _from_response_format(req)),
                   ("structured_outputs", _from_extension(req)))


def _check_tools(req: ChatCompletionRequest) -> dict[str, dict[str, Any]]:
    """Function name -> its parameters schema."""
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(req.tools or ()):
        name = tool.function.name
        param = f"tools[{i}].function.name"
        if not _FUNCTION_NAME.fullmatch(name):
            raise bad_request(f"{param}: expected 1-64 letters, digits, '_' or '-', got "
                              f"{name[:80]!r}", param=param)
        if name in functions:
            raise bad_request(f"{param}: {name!r} is defined twice", param=param)
        functions[name] = tool.function.parameters or _NO_PARAMETERS
    return functions


def chat_constraint(req: ChatCompletionRequest, default_parser: str
                    ) -> tuple[StructuredOutputsParams | None, ToolCallMode | None]:
    """The constraint of a chat request and how its tool calls are read (APIError 400 on a
    bad one). ``default_parser``: the tool-call format "auto" looks for (``PARSERS`` key)."""
    choice = req.tool_choice
    if choice is not None and not req.tools:
        raise bad_request("tool_choice: only allowed when tools are given", param="tool_choice")
    functions = _check_tools(req)
    constraint = _one_of(("response_format", _from_response_format(req)),
                         ("structured_outputs", _from_extension(req)))
    if not functions or choice == "none":
        return constraint, None
    if choice is None or choice == "auto":
        return constraint, ToolCallMode("auto", parser=PARSERS[default_parser])
    if constraint is not None:
        raise bad_request("tool_choice: a required or named tool call cannot be combined with "
                          "response_format or structured_outputs", param="tool_choice")
    if choice == "required":
        for i, (name, schema) in enumerate(functions.items()):
            _checked(lambda: StructuredOutputsParams(json=schema),
                     f"tools[{i}].function.parameters")
        calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
             "required": ["name", "arguments"], "additionalProperties": False}
            for name, schema in functions.items()]}}
        if req.parallel_tool_calls is False:
            calls["maxItems"] = 1
        return _checked(lambda: StructuredOutputsParams(json=calls), "tools"), \
            ToolCallMode("required")
    name = choice.function.name
    if name not in functions:
        raise bad_request(f"tool_choice: no function named {name[:80]!r} in tools (there are "
                          f"{', '.join(sorted(functions))})", param="tool_choice")
    index = list(functions).index(name)
    return _checked(lambda: StructuredOutputsParams(json=functions[name]),
                    f"tools[{index}].function.parameters"), ToolCallMode("named", function=name)


__all__ = ["chat_constraint", "completion_constraint"]
