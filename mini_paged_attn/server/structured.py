"""What a request's ``response_format``, ``structured_outputs`` and ``tools`` / ``tool_choice``
ask the engine for: one :class:`StructuredOutputsParams` (or none) and how tool calls are read
back (:class:`ToolCallMode`). Everything is checked here, on a request worker before the request
is queued: a schema or grammar over the limits (``GrammarLimits``) or that does not compile
within its budget, a function that does not exist, a ``tool_choice`` without ``tools``, a
``min_tokens`` the constraint must end before are 400s naming the parameter. Given the engine's
``GrammarCompiler`` the constraint is compiled here for good, into the engine's cache (the
engine's stepping thread then only copies it). What ``tools`` / ``tool_choice`` mean is
``engine/tools/choice.py``'s, shared with ``LLM.chat``.
"""

from __future__ import annotations

from typing import Any

from ..engine.admission import check_min_tokens
from ..engine.structured import GrammarCompiler, StructuredOutputsParams
from ..engine.tools.choice import ToolArgumentError, checked_constraint, tool_constraint
from ..engine.tools.parsers import ToolCallMode
from .errors import bad_request
from .protocol import ChatCompletionRequest, _SamplingFields


def _checked(make: Any, param: str, compiler: GrammarCompiler | None
             ) -> StructuredOutputsParams:
    """``make()`` checked to compile; a 400 naming ``param`` if it does not."""
    try:
        return checked_constraint(make, param, compiler)
    except ToolArgumentError as exc:
        raise bad_request(_on_the_server(str(exc)), param=exc.param) from None


def _on_the_server(message: str) -> str:
    return message.replace("need llguidance (", "need llguidance on the server (")


def _from_response_format(req: _SamplingFields, compiler: GrammarCompiler | None
                          ) -> StructuredOutputsParams | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return _checked(lambda: StructuredOutputsParams(json_object=True), "response_format",
                        compiler)
    schema = fmt.json_schema.schema_
    return _checked(lambda: StructuredOutputsParams(json=schema),
                    "response_format.json_schema.schema", compiler)


def _from_extension(req: _SamplingFields, compiler: GrammarCompiler | None
                    ) -> StructuredOutputsParams | None:
    ext = req.structured_outputs
    if ext is None:
        return None
    fields = {"json": ext.json_, "json_object": ext.json_object, "regex": ext.regex,
              "choice": ext.choice, "grammar": ext.grammar}
    given = [k for k, v in fields.items() if v not in (None, False)]
    param = f"structured_outputs.{given[0]}" if len(given) == 1 else "structured_outputs"
    return _checked(lambda: StructuredOutputsParams(**fields), param, compiler)


def _one_of(*found: tuple[str, StructuredOutputsParams | None]) -> StructuredOutputsParams | None:
    given = [(name, params) for name, params in found if params is not None]
    if len(given) > 1:
        raise bad_request(f"{given[1][0]}: cannot be combined with {given[0][0]} (each "
                          "constrains the whole output)", param=given[1][0])
    return given[0][1] if given else None


def _min_tokens_fit(req: _SamplingFields, constraint: StructuredOutputsParams | None) -> None:
    try:
        check_min_tokens(constraint, req.min_tokens)
    except ValueError as exc:
        raise bad_request(str(exc), param="min_tokens") from None


def completion_constraint(req: _SamplingFields, compiler: GrammarCompiler | None = None
                          ) -> StructuredOutputsParams | None:
    """The constraint of a /v1/completions request (APIError 400 on a bad one).
    ``compiler``: the engine's, to compile it for good here (None: checked only)."""
    constraint = _one_of(("response_format", _from_response_format(req, compiler)),
                         ("structured_outputs", _from_extension(req, compiler)))
    _min_tokens_fit(req, constraint)
    return constraint


def chat_constraint(req: ChatCompletionRequest, default_parser: str,
                    compiler: GrammarCompiler | None = None
                    ) -> tuple[StructuredOutputsParams | None, ToolCallMode | None]:
    """The constraint of a chat request and how its tool calls are read (APIError 400 on a
    bad one). ``default_parser``: the tool-call format "auto" looks for (``PARSERS`` key);
    ``compiler``: the engine's, to compile the constraint for good here (None: checked only)."""
    choice = req.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = choice.model_dump()
    constraint = _one_of(("response_format", _from_response_format(req, compiler)),
                         ("structured_outputs", _from_extension(req, compiler)))
    named = ("response_format" if req.response_format is not None
             and req.response_format.type != "text" else "structured_outputs")
    try:
        tools_constraint, mode = tool_constraint(
            req.template_tools(), choice, parser=default_parser,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            constrained_by=None if constraint is None else named, compiler=compiler)
    except ToolArgumentError as exc:
        raise bad_request(_on_the_server(str(exc)), param=exc.param) from None
    constraint = constraint if tools_constraint is None else tools_constraint
    _min_tokens_fit(req, constraint)
    return constraint, mode


__all__ = ["chat_constraint", "completion_constraint"]
