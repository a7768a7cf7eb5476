"""What a request's ``response_format``, ``structured_outputs`` and ``tools`` / ``tool_choice``
ask the engine for: one :class:`StructuredOutputsParams` (or none) and how tool calls are read
back (:class:`ToolCallMode`). Everything is checked here, before the request is queued: a schema
or grammar that does not compile, a function that does not exist, a ``tool_choice`` without
``tools`` are 400s naming the parameter. What ``tools`` / ``tool_choice`` mean is
``engine/tools.py``'s, shared with ``LLM.chat``.
"""

from __future__ import annotations

from typing import Any

from ..engine.structured import StructuredOutputsParams
from ..engine.tool_calls import ToolCallMode
from ..engine.tools import ToolArgumentError, checked_constraint, tool_constraint
from .errors import bad_request
from .protocol import ChatCompletionRequest, _SamplingFields


def _checked(make: Any, param: str) -> StructuredOutputsParams:
    """``make()`` checked to compile; a 400 naming ``param`` if it does not."""
    try:
        return checked_constraint(make, param)
    except ToolArgumentError as exc:
        raise bad_request(_on_the_server(str(exc)), param=exc.param) from None


def _on_the_server(message: str) -> str:
    return message.replace("need llguidance (", "need llguidance on the server (")


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


def chat_constraint(req: ChatCompletionRequest, default_parser: str
                    ) -> tuple[StructuredOutputsParams | None, ToolCallMode | None]:
    """The constraint of a chat request and how its tool calls are read (APIError 400 on a
    bad one). ``default_parser``: the tool-call format "auto" looks for (``PARSERS`` key)."""
    choice = req.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = choice.model_dump()
    constraint = _one_of(("response_format", _from_response_format(req)),
                         ("structured_outputs", _from_extension(req)))
    named = ("response_format" if req.response_format is not None
             and req.response_format.type != "text" else "structured_outputs")
    try:
        tools_constraint, mode = tool_constraint(
            req.template_tools(), choice, parser=default_parser,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            constrained_by=None if constraint is None else named)
    except ToolArgumentError as exc:
        raise bad_request(_on_the_server(str(exc)), param=exc.param) from None
    return (constraint if tools_constraint is None else tools_constraint), mode


__all__ = ["chat_constraint", "completion_constraint"]
