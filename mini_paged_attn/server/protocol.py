"""Request schemas of the OpenAI-compatible API, their validation, and the mapping to SamplingParams.

Requests are parsed strictly: a field of the wrong type (``"max_tokens": "5"``) or a field this
server does not know is a 400, as the OpenAI API answers, rather than a silent coercion or a
parameter quietly ignored. Every rejection is an :class:`APIError` that renders as OpenAI's error
body ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from ..engine import SamplingParams
from ..engine.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PENALTY
from ..engine.structured.params import StructuredOutputsParams
from .errors import bad_request, clip
from .json_body import MAX_INT_DIGITS, HugeInt, parse_json, preview

# OpenAI caps `logprobs` of completions at 5 and `top_logprobs` of chat at 20.
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20
MAX_PROMPT_LOGPROBS = MAX_LOGPROBS
# OpenAI's default for /v1/completions; chat defaults to "as long as the context allows".
DEFAULT_COMPLETION_MAX_TOKENS = 16
class _Strict(BaseModel):
    # strict: no "5" -> 5 coercion; forbid: an unknown field is an error, not ignored;
    # no inf/nan: 1e999 parses to inf, which no sampling parameter means.
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaSpec(_Strict):
    """``response_format.json_schema``: OpenAI's named schema."""

    model_config = ConfigDict(populate_by_name=True)
    name: str
    description: str | None = None
    # "schema" would shadow a BaseModel attribute.
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """``response_format``: plain text, any JSON object, or JSON valid against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema: give it exactly when type is "json_schema"')
        return self


class StructuredOutputsField(_Strict):
    """``structured_outputs`` (an extension, vLLM's name): exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _SamplingFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)  # its upper bound is ServerLimits.max_n
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    # Token ids (as strings: JSON keys) -> a bias in [-100, 100].
    logit_bias: dict[str, float] | None = None
    # Extensions (vLLM's names).
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    ignore_eos: bool = False
    repetition_penalty: float = Field(1.0, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v < -1:
            raise ValueError("must be -1 or 0 (off) or at least 1")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        stops = [v] if isinstance(v, str) else v
        if stops is not None and any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops or None

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= MAX_INT_DIGITS):
                raise ValueError(f"keys must be token ids, got {key[:40]!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"biases must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                 f"got {bias!r} for token {key}")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v

    def token_biases(self) -> dict[int, float] | None:
        """``logit_bias`` with int token ids (the keys were checked to be digits)."""
        return {int(k): b for k, b in self.logit_bias.items()} if self.logit_bias else None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    # A string, a list of strings, a list of token ids or a list of lists of token ids.
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    # The prompt's text before each choice's text; with logprobs, the prompt tokens' logprobs
    # before the choice's (the first one's null).
    echo: bool = False
    # vLLM's extension: each choice's `prompt_logprobs`, the top-k per prompt position.
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_PROMPT_LOGPROBS)

    def prompts(self) -> list[str | list[int]]:
        """The prompts as separate items: a string or a list of token ids each."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt: must not be empty", param="prompt")
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCallParam(_Strict):
    """A tool call of an earlier assistant message, as the client sends it back."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionSpec(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class ToolChoiceFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    # The newer OpenAI name of max_tokens; either may be given, not both.
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template wants them (see :func:`template_messages`)."""
        return template_messages(self.messages)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """``tools`` as the chat template wants them (OpenAI's shape), or None."""
        return template_tools(self.tools)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """``messages`` as the chat template wants them: role and plain text content, and the
    tool calls of assistant messages with their arguments decoded (templates write them with
    ``tojson``) and the ``tool_call_id`` of tool results."""
    out = []
    for m in messages:
        message: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name,
                              "arguments": _decoded(c.function.arguments)}}
                for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def template_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """``tools`` as the chat template wants them (OpenAI's shape), or None."""
    if not tools:
        return None
    return [tool.model_dump(exclude_none=True) for tool in tools]


def _decoded(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:       # not JSON: the template gets the text
        return arguments


# What a field of several accepted shapes takes, for errors (pydantic would name one shape).
_UNION_FIELDS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts",
    "tool_choice": '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
    "json": "a JSON schema object or its text",
}
_NOT_A_FIELD = ("str", "int", "float", "bool", "none", "function-after", "function-before")


def _param_name(loc: tuple[Any, ...]) -> tuple[str, bool]:
    """``('messages', 0, 'content', 'str')`` -> ``("messages[0].content", True)``.

    The flag says whether pydantic was trying one member of a union (named in ``loc``).
    """
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in _NOT_A_FIELD:
            return out, True
        else:
            out += f".{part}" if out else part
    return out, False


RequestT = TypeVar("RequestT", bound=_Strict)


def parse_request(raw: bytes, model_cls: type[RequestT]) -> RequestT:
    """Parse and validate a request body; :class:`APIError` (400) on anything malformed."""
    return validate_request(parse_json(raw), model_cls)


def validate_request(data: Any, model_cls: type[RequestT]) -> RequestT:
    """Validate a parsed JSON body as ``model_cls``; :class:`APIError` (400) naming the field."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        param, in_union = _param_name(err["loc"])
        if err["type"] == "extra_forbidden":
            raise bad_request(f"Unrecognized request argument supplied: {clip(param)}",
                              param=param) from None
        if err["type"] == "missing":
            raise bad_request(f"Missing required parameter: {param}", param=param) from None
        msg = err["msg"].removeprefix("Value error, ")
        if isinstance(err.get("input"), HugeInt):
            msg = f"expected a number of at most {MAX_INT_DIGITS} digits"
        field_name = param.rsplit(".", 1)[-1].split("[", 1)[0]
        if in_union and field_name in _UNION_FIELDS:
            msg = f"expected {_UNION_FIELDS[field_name]}"
        raise bad_request(f"{param}: {msg} (got {preview(err.get('input'))})",
                          param=param) from None


def to_sampling_params(req: _SamplingFields, *, max_tokens: int, logprobs: int | None,
                       prompt_logprobs: int | None = None,
                       structured_outputs: StructuredOutputsParams | None = None
                       ) -> SamplingParams:
    """The engine's SamplingParams for a validated request.

    Args:
        req: the parsed request.
        max_tokens: resolved by the caller (defaults differ between completions and chat).
        logprobs: number of top log-probabilities per token, or None.
        prompt_logprobs: the same per prompt token, or None.
        structured_outputs: the constraint ``response_format``, ``structured_outputs`` or
            ``tool_choice`` asked for (see ``server/structured.py``), or None.
    """
    try:
        return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                              min_p=req.min_p, max_tokens=max_tokens, stop=req.stop,
                              ignore_eos=req.ignore_eos, n=req.n, seed=req.seed,
                              logprobs=logprobs, presence_penalty=req.presence_penalty,
                              frequency_penalty=req.frequency_penalty,
                              repetition_penalty=req.repetition_penalty,
                              logit_bias=req.token_biases(), min_tokens=req.min_tokens,
                              stop_token_ids=req.stop_token_ids,
                              prompt_logprobs=prompt_logprobs,
                              structured_outputs=structured_outputs,
                              include_stop_str_in_output=req.include_stop_str_in_output,
                              skip_special_tokens=req.skip_special_tokens)
    except ValueError as exc:  # the engine's checks say "<field>: expected ..., got ..."
        field_name = str(exc).split(":", 1)[0]
        raise bad_request(str(exc), param=field_name if field_name.isidentifier() else None
                          ) from None
