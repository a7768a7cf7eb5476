"""What one request may ask for, so that no single request can stall the server for everyone.

:class:`ServerLimits` holds the caps (``build_app(limits=...)``; ``serve --max-request-bytes``
and friends). :class:`RequestSizeLimit` is the ASGI middleware that refuses a body over
``max_request_bytes`` with 413 before any of it is parsed, and :func:`check_request` applies the
other caps to a parsed request before anything is tokenized or queued; each of those is a 400
whose ``param`` names the field.

>>> limits = ServerLimits(max_stop_strings=4)
>>> limits.max_request_bytes
4194304
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError, bad_request


def _cap(default: int, help_text: str) -> Any:
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class ServerLimits:
    """Per-request caps; every one an int >= 1.

    The defaults: a 4 MiB body (a prompt of about a million tokens, beyond any context this
    engine serves); OpenAI's n <= 128; 16 stop strings (OpenAI allows 4, vLLM any number: every
    stop string is searched in every new piece of text, every step) of at most 256 characters;
    256 prompts per request and 256 completions (n x prompts) per request, the engine's default
    batch (--max-num-seqs); 64 stop_token_ids and 1024 logit_bias entries (OpenAI's cap): the
    sampler scatters each of them every step.
    """

    max_request_bytes: int = _cap(4 * 1024 * 1024,
                                  "largest request body in bytes; a larger one gets 413")
    max_prompts: int = _cap(256, "most prompts in one /v1/completions request")
    max_n: int = _cap(128, "largest n (completions per prompt)")
    max_choices: int = _cap(256, "most completions one request asks for (n x prompts)")
    max_stop_strings: int = _cap(16, "most stop strings in one request")
    max_stop_chars: int = _cap(256, "longest stop string, in characters")
    max_stop_token_ids: int = _cap(64, "most stop_token_ids in one request")
    max_logit_bias: int = _cap(1024, "most logit_bias entries in one request")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{f.name}: expected an int >= 1, got {value!r}")


def check_request(limits: ServerLimits, *, n: int, stop: list[str] | None, num_prompts: int,
                  max_queue: int | None, stop_token_ids: list[int] | None = None,
                  logit_bias: dict[str, float] | None = None) -> None:
    """Raise a 400 :class:`APIError` naming the field if the request exceeds a cap.

    Args:
        n: completions per prompt.
        stop: the stop strings, or None.
        num_prompts: prompts in the request (engine requests it becomes).
        max_queue: the server's --max-queue (None: no limit): a request with more prompts than
            may ever wait at once could only get 429 forever, so it is a 400.
        stop_token_ids, logit_bias: as the request gives them, or None.
    """
    for name, given, cap in (("stop_token_ids", stop_token_ids, limits.max_stop_token_ids),
                             ("logit_bias", logit_bias, limits.max_logit_bias)):
        if given is not None and len(given) > cap:
            raise bad_request(f"{name}: at most {cap} entries are allowed, got {len(given)}",
                              param=name)
    stops = stop or []
    if len(stops) > limits.max_stop_strings:
        raise bad_request(f"stop: at most {limits.max_stop_strings} stop strings are allowed, "
                          f"got {len(stops)}", param="stop")
    for i, s in enumerate(stops):
        if len(s) > limits.max_stop_chars:
            raise bad_request(f"stop[{i}]: a stop string may have at most "
                              f"{limits.max_stop_chars} characters, got {len(s)}", param="stop")
    if num_prompts > limits.max_prompts:
        raise bad_request(f"prompt: at most {limits.max_prompts} prompts per request are "
                          f"allowed, got {num_prompts}", param="prompt")
    if n > limits.max_n:
        raise bad_request(f"n: expected at most {limits.max_n}, got {n}", param="n")
    if n * num_prompts > limits.max_choices:
        raise bad_request(f"n: {n} completions for each of {num_prompts} prompts make "
                          f"{n * num_prompts}, and at most {limits.max_choices} are allowed "
                          "per request", param="n")
    if max_queue is not None and num_prompts > max_queue:
        raise bad_request(f"prompt: {num_prompts} prompts can never wait in a queue of "
                          f"{max_queue} (the server's --max-queue); send at most {max_queue} "
                          "per request", param="prompt", code="exceeds_max_queue")


class RequestTooLargeError(APIError):
    """The body is over ``max_request_bytes`` (413)."""

    def __init__(self, limit: int, what: str) -> None:
        super().__init__(413, f"The request body is too large: {what}, and the limit is "
                              f"{limit} bytes", code="request_too_large")


class RequestSizeLimit:
    """ASGI middleware: bodies over ``max_bytes`` get 413 with OpenAI's error body.

    A Content-Length over the limit is refused before a byte of the body is read. A body
    without one (chunked), or with one the client does not keep to, is counted as it arrives:
    the ``receive`` the application sees raises :class:`RequestTooLargeError` at the first
    chunk past the limit, so at most ``max_bytes`` are ever buffered.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            error = RequestTooLargeError(self.max_bytes, f"Content-Length is {declared}")
            await error.response()(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise RequestTooLargeError(self.max_bytes,
                                               f"more than {self.max_bytes} bytes arrived")
            return message

        await self.app(scope, limited_receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:  # the HTTP server refuses a malformed one before we see it
                return None
    return None
