"""What one request may ask for, so that no single request can stall the server for everyone.

:class:`ServerLimits` holds the caps (``build_app(limits=...)``; ``serve --max-request-bytes``
and friends). :class:`RequestSizeLimit` is the ASGI middleware that refuses a body over
``max_request_bytes`` with 413 before any of it is parsed, and :func:`check_request` applies the
other caps to a parsed request before anything is tokenized or queued; each of those is a 400
whose ``param`` names the field. :func:`check_response_size` bounds the log-probability entries
a response may hold (known once the prompts are tokenized, still before queueing); the time
budgets are applied by :mod:`.timeouts`.

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
    """Per-request caps and per-connection time budgets (seconds); every one an int >= 1.

    The defaults: a 4 MiB body (a prompt of about a million tokens, beyond any context this
    engine serves); OpenAI's n <= 128; 16 stop strings (OpenAI allows 4, vLLM any number: every
    stop string is searched in every new piece of text, every step) of at most 256 characters;
    256 prompts per request and 256 completions (n x prompts) per request, the engine's default
    batch (--max-num-seqs); 64 stop_token_ids and 1024 logit_bias entries (OpenAI's cap): the
    sampler scatters each of them every step. 20 log-probabilities per token (vLLM's
    ``max_logprobs``) and 262,144 log-probability entries per response: an entry is ~60-100
    bytes of JSON, so a response stays under ~25 MB (one choice of 12k tokens with 20
    alternatives fits; 128 choices of 250 tokens with 20 do not: that was 65 MB). A 30 s budget
    for a body to arrive and for a client to take each piece of a response: a stalled upload
    or a client that never reads holds a connection and its buffers, nothing more, and not for
    long; and 32 tokens a stream may run ahead of its client: past them (the socket's and the
    server's write buffers are full by then) the request is paused, so a client that does not
    read is given no compute while the send budget runs out.
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
    max_logprobs: int = _cap(20, "most log-probabilities per token (logprobs, top_logprobs, "
                                 "prompt_logprobs)")
    max_response_logprob_entries: int = _cap(
        262144, "most log-probability entries one response may hold (n x prompts x tokens x "
                "(logprobs + 1)); a request that could ask for more gets 400")
    body_timeout_s: int = _cap(30, "seconds a request body may take to arrive; slower gets 408")
    send_timeout_s: int = _cap(30, "seconds the server waits for a client to take a piece of "
                                   "its response; a client that reads none for that long is "
                                   "dropped and its requests aborted")
    max_unsent_tokens: int = _cap(32, "tokens a request's output may run ahead of what its "
                                      "client has taken (a stream whose client does not read); "
                                      "past it the request gets no compute until the client "
                                      "reads again")

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


@dataclass(frozen=True)
class LogprobDemand:
    """How many log-probability entries a request's response may hold, by field.

    ``output``: per choice, max_tokens x (logprobs + 1) (the sampled token and its
    alternatives); ``prompt``: per choice, prompt tokens x (k + 1) for prompt_logprobs k or
    echo with logprobs. Choices of one prompt repeat its prompt part.
    """

    n: int
    max_tokens: int
    logprobs: int | None
    logprobs_param: str
    prompt_lens: list[int]
    prompt_ks: list[tuple[str, int]]    # (field, k) of each prompt-side logprobs field asked for

    def entries(self) -> tuple[int, str | None]:
        """``(entries, the field that asks for the most of them)``."""
        output = 0 if self.logprobs is None else self.max_tokens * (self.logprobs + 1)
        per_field = {self.logprobs_param: output * self.n * len(self.prompt_lens)}
        for name, k in self.prompt_ks:
            per_field[name] = per_field.get(name, 0) + self.n * sum(self.prompt_lens) * (k + 1)
        total = sum(per_field.values())
        return total, (max(per_field, key=per_field.get) if total else None)


def check_response_size(limits: ServerLimits, demand: LogprobDemand) -> None:
    """Raise a 400 naming the field if the response could hold more log-probability entries
    than ``limits.max_response_logprob_entries`` (checked before the request is queued)."""
    total, param = demand.entries()
    cap = limits.max_response_logprob_entries
    if total > cap:
        raise bad_request(
            f"{param}: the response could hold {total} log-probability entries (n={demand.n}, "
            f"{len(demand.prompt_lens)} prompt(s) of up to {max(demand.prompt_lens)} tokens, "
            f"max_tokens={demand.max_tokens}, each entry the token and its alternatives), and "
            f"at most {cap} are allowed: ask for fewer alternatives, tokens or choices",
            param=param)


def check_logprobs(limits: ServerLimits, **given: int | None) -> None:
    """Raise a 400 naming the field if one asks for more alternatives than ``max_logprobs``."""
    for name, value in given.items():
        if value is not None and value > limits.max_logprobs:
            raise bad_request(f"{name}: expected at most {limits.max_logprobs} (the server's "
                              f"--max-logprobs), got {value}", param=name)


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
