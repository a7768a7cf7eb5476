"""The two generation endpoints: POST /v1/completions and POST /v1/chat/completions.

Both follow one path: parse, validate and tokenize (on a worker thread: a big prompt takes
seconds to tokenize, and the event loop must go on serving everyone else meanwhile) ->
``AsyncClient.submit`` -> either collect the final outputs into one JSON response, or stream
Server-Sent Events, one chunk per text delta and choice, then ``data: [DONE]``. A streamed
response starts once the first token exists, so a failure before it is still a plain HTTP error.
A task watches the connection the whole time: a client that goes away has its requests aborted
at once (blocks freed at the next step boundary).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from ..engine.process.client import EngineDeadError
from .async_client import ClientGoneError, QueueFullError, RequestFailedError, Submission
from .bodies import json_body
from .errors import ENGINE_DEAD, ENGINE_FAILED, APIError, bad_request, internal_error
from .formats import ResponseFormat, usage
from .prepare import Prepared, ServedModel, prepare_chat, prepare_completion

logger = logging.getLogger(__name__)

# Fields of a request that an engine admission error may name as its param.
_REQUEST_FIELDS = frozenset({"prompt_logprobs", "logit_bias"})

# Not an HTTP status anyone receives: the client is gone when a handler returns it.
_CLIENT_CLOSED = 499


def _sse(obj: dict[str, Any] | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


# ---- the shared serving path ---------------------------------------------------------------
async def _watch_disconnect(request: Request, submission: Submission) -> None:
    """Cancel ``submission`` when the client disconnects (or the response is complete)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            if not submission.done:
                logger.info("client went away: aborting %d request(s)",
                            len(submission.request_ids))
            submission.cancel()
            return


def _submit(served: ServedModel, prompts: list[list[int]], params: Any) -> Submission:
    try:
        return served.async_client.submit(prompts, params)
    except QueueFullError as exc:
        raise APIError(429, str(exc), type="rate_limit_error", code="queue_full") from None
    except EngineDeadError:
        raise APIError(503, ENGINE_DEAD, type="server_error", code="engine_dead") from None
    except ValueError as exc:  # the engine's admission checks (e.g. prompt + max_tokens too long)
        # They say "<field>: expected ..., got ...".
        name = str(exc).split(":", 1)[0]
        raise bad_request(str(exc), param=name if name in _REQUEST_FIELDS else None) from None


async def _serve(request: Request, served: ServedModel, submission: Submission,
                 fmt: ResponseFormat, *, n: int, stream: bool, include_usage: bool) -> Response:
    watcher = asyncio.create_task(_watch_disconnect(request, submission))
    streaming = False
    try:
        if not stream:
            final: dict[int, Any] = {}
            async for index, out in submission:
                final[index] = out
            for index, out in final.items():
                fmt.note_prompt(index, out)
            choices = [(i * n + c.index, c) for i in sorted(final) for c in final[i].outputs]
            if any(c.finish_reason == "error" for _, c in choices):
                raise _output_failed()
            # Building and encoding a body with many logprobs takes seconds: not on the loop.
            return await json_body(lambda: fmt.response(choices, _usage_of(final)),
                                   served.off_loop)
        first = await anext(submission)
        streaming = True
        return StreamingResponse(_stream(submission, first, fmt, n, include_usage, watcher),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    except ClientGoneError:
        return Response(status_code=_CLIENT_CLOSED)
    except RequestFailedError as exc:  # the engine's reason goes to the log, not the client
        raise _engine_failed(exc) from None
    except StopAsyncIteration:  # cannot happen: a submission always ends with a finished output
        raise internal_error("The engine returned no output for this request",
                             what="a submission ended without a finished output",
                             cause="no output") from None
    finally:
        if not streaming:  # otherwise the stream owns them
            watcher.cancel()
            submission.abort()


def _engine_failed(exc: RequestFailedError) -> APIError:
    return internal_error(ENGINE_FAILED, what="the engine failed a request",
                          cause=str(exc))


class _OutputFailed(Exception):
    """A choice finished with reason "error" (its grammar rejected a token)."""


def _output_failed() -> APIError:
    return internal_error("The engine could not finish an output of this request within its "
                          "grammar; the server's log has the details",
                          what='an output finished with reason "error"',
                          cause="its grammar rejected a token (the engine's log has which)")


def _usage_of(last: dict[int, Any]) -> dict[str, int]:
    prompt = sum(len(out.prompt_token_ids) for out in last.values())
    completion = sum(len(c.token_ids) for out in last.values() for c in out.outputs)
    return usage(prompt, completion)


@dataclass
class _StreamState:
    """What a stream has sent so far, per OpenAI choice index."""

    fmt: ResponseFormat
    n: int
    include_usage: bool
    text_sent: dict[int, int] = field(default_factory=dict)    # characters of text
    tokens_sent: dict[int, int] = field(default_factory=dict)  # tokens
    finished: set[int] = field(default_factory=set)
    last: dict[int, Any] = field(default_factory=dict)  # prompt index -> latest RequestOutput

    def events(self, prompt_index: int, out: Any) -> list[str]:
        """One chunk per choice of ``out`` that gained tokens or finished."""
        self.last[prompt_index] = out
        self.fmt.note_prompt(prompt_index, out)
        events = []
        for comp in out.outputs:
            index = prompt_index * self.n + comp.index
            token_start = self.tokens_sent.get(index, 0)
            text_start = self.text_sent.get(index, 0)
            if index in self.finished:
                continue
            if comp.finish_reason is None and (
                    len(comp.token_ids) == token_start
                    # Text held back as a possible tool call: nothing to send yet.
                    or (self.fmt.tools is not None and self.fmt.text_end(comp) <= text_start)):
                continue
            if comp.finish_reason == "error":
                raise _OutputFailed
            events.append(_sse(self.fmt.chunk(index, comp, text_start=text_start,
                                              token_start=token_start,
                                              usage_field=self.include_usage)))
            self.text_sent[index] = self.fmt.text_end(comp)
            self.tokens_sent[index] = len(comp.token_ids)
            if comp.finish_reason is not None:
                self.finished.add(index)
        return events


async def _stream(submission: Submission, first: tuple[int, Any], fmt: ResponseFormat, n: int,
                  include_usage: bool, watcher: asyncio.Task) -> AsyncIterator[str]:
    """SSE events: a chunk per choice per step that gave it tokens, then usage and [DONE].

    Whatever fails once the stream has started (the engine, a grammar, making a chunk), the
    stream still ends the way OpenAI's do: an ``{"error": ...}`` event, then ``[DONE]``.
    """
    state = _StreamState(fmt, n, include_usage)
    error: APIError | None = None
    try:
        if fmt.chat:
            for index in range(n * len(submission.request_ids)):
                yield _sse(fmt.role_chunk(index, usage_field=include_usage))
        item: tuple[int, Any] | None = first
        while item is not None:
            # Outputs of several steps may be waiting (a slow client): the latest output of a
            # request covers the earlier ones, so one chunk per choice carries them all.
            for prompt_index, out in dict([item, *submission.ready()]).items():
                for event in state.events(prompt_index, out):
                    yield event
            item = await anext(submission, None)
        if include_usage:
            yield _sse(fmt.usage_chunk(_usage_of(state.last)))
    except RequestFailedError as exc:
        error = _engine_failed(exc)
    except _OutputFailed:
        error = _output_failed()
    except ClientGoneError:
        return
    except Exception:  # noqa: BLE001  a bug in making a chunk: this stream fails, no other
        error = internal_error("The server had an error while streaming the response; its "
                               "log has the details",
                               what="a streamed response failed")
    finally:
        watcher.cancel()
        submission.abort()
    if error is not None:
        # The status line is long gone: report it the way OpenAI streams report errors.
        yield _sse(error.body())
    yield _sse("[DONE]")


# ---- the endpoints ---------------------------------------------------------------------------
async def _generate(request: Request, served: ServedModel,
                    prepare: Callable[[ServedModel, bytes], Prepared]) -> Response:
    try:
        raw = await request.body()
    except ClientDisconnect:  # gone before its body arrived: nobody to answer
        return Response(status_code=_CLIENT_CLOSED)
    prepared = await served.off_loop(prepare, served, raw)
    submission = _submit(served, prepared.prompts, prepared.params)
    return await _serve(request, served, submission, prepared.fmt, n=prepared.n,
                        stream=prepared.stream, include_usage=prepared.include_usage)


async def create_completion(request: Request, served: ServedModel) -> Response:
    return await _generate(request, served, prepare_completion)


async def create_chat_completion(request: Request, served: ServedModel) -> Response:
    return await _generate(request, served, prepare_chat)
