"""vLLM's tokenizer endpoints: POST /tokenize, POST /detokenize, and GET /version.

Shaped like vLLM's, so that clients written for it work unchanged:

- ``/tokenize`` takes ``{"model"?, "prompt", "add_special_tokens"?: true, "return_token_strs"?}``
  or ``{"model"?, "messages", "add_generation_prompt"?: true, "continue_final_message"?: false,
  "add_special_tokens"?: false, "return_token_strs"?, "tools"?}`` (the chat template renders the
  messages as /v1/chat/completions does) and answers ``{"count", "max_model_len", "tokens",
  "token_strs"}`` (``token_strs``: null unless asked for).
- ``/detokenize`` takes ``{"model"?, "tokens": [int, ...]}`` and answers ``{"prompt": str}``.
- ``/version`` answers ``{"version": str}``, the package's version.

``model``, when given, must be a name the server serves (404 otherwise); vLLM lets it out too.
Requests are parsed as strictly as the generation endpoints' (an unknown field is a 400 naming
it) and get the same caps: the body size, the prompt's bytes against the context, token ids
inside the vocabulary. The tokenizer runs on a request worker, off the event loop.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from .bodies import json_body
from .errors import bad_request
from .json_body import parse_json
from .prepare import ServedModel, check_model_name, render_chat
from .prompt_bytes import check_prompt_bytes
from .protocol import ChatMessage, Tool, _Strict, template_messages, template_tools, \
    validate_request

# What a client that is gone before its body arrived gets (nobody reads it).
_CLIENT_CLOSED = 499


class TokenizeCompletionRequest(_Strict):
    """POST /tokenize with a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    """POST /tokenize with messages, rendered by the chat template."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # The template writes the special tokens itself: adding them again would double the bos.
    add_special_tokens: bool = False
    return_token_strs: bool = False
    tools: list[Tool] | None = None

    @model_validator(mode="after")
    def _one_ending(self) -> TokenizeChatRequest:
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("give add_generation_prompt or continue_final_message, not both "
                             "(a reply cannot both start and continue the last message)")
        return self


class DetokenizeRequest(_Strict):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]


def tokenize(served: ServedModel, raw: bytes) -> dict[str, Any]:
    """The /tokenize response for body ``raw`` (on a worker thread); APIError on bad input."""
    data = parse_json(raw)
    chat = isinstance(data, dict) and "messages" in data
    req = validate_request(data, TokenizeChatRequest if chat else TokenizeCompletionRequest)
    if req.model is not None:
        check_model_name(served, req.model)
    tokenizer = served.engine.tokenizer
    max_model_len = served.engine.max_model_len
    if isinstance(req, TokenizeChatRequest):
        check_prompt_bytes(served.max_prompt_bytes, [m.text() for m in req.messages],
                           "messages", max_model_len)
        text = render_chat(served, template_messages(req.messages),
                           tools=template_tools(req.tools), tokenize=False,
                           add_generation_prompt=req.add_generation_prompt,
                           continue_final_message=req.continue_final_message)
    else:
        check_prompt_bytes(served.max_prompt_bytes, [req.prompt], "prompt", max_model_len)
        text = req.prompt
    ids = tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
            "token_strs": tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs
            else None}


def detokenize(served: ServedModel, raw: bytes) -> dict[str, Any]:
    """The /detokenize response for body ``raw`` (on a worker thread); APIError on bad input."""
    req = validate_request(parse_json(raw), DetokenizeRequest)
    if req.model is not None:
        check_model_name(served, req.model)
    vocab = served.engine.model_config.vocab_size
    bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"tokens[{bad}]: token id {req.tokens[bad]} is outside the "
                          f"vocabulary [0, {vocab})", param="tokens")
    return {"prompt": served.engine.tokenizer.decode(req.tokens)}


async def _answer(request: Request, served: ServedModel, build) -> Response:
    try:
        raw = await request.body()
    except ClientDisconnect:
        return Response(status_code=_CLIENT_CLOSED)
    # The response is built and encoded on a worker, like the generation endpoints'.
    return await json_body(lambda: build(served, raw), served.off_loop)


async def create_tokenize(request: Request, served: ServedModel) -> Response:
    return await _answer(request, served, tokenize)


async def create_detokenize(request: Request, served: ServedModel) -> Response:
    return await _answer(request, served, detokenize)


def version_endpoint(version: str):
    """GET /version: ``{"version": version}``."""
    async def show(request: Request, served: ServedModel) -> Response:
        return JSONResponse({"version": version})
    return show


__all__ = ["DetokenizeRequest", "TokenizeChatRequest", "TokenizeCompletionRequest",
           "create_detokenize", "create_tokenize", "detokenize", "tokenize", "version_endpoint"]
