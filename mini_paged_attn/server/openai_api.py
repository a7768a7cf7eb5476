"""The two generation endpoints: POST /v1/completions and POST /v1/chat/completions.

Both follow one path: parse and validate -> token ids -> ``AsyncEngine.submit`` -> either collect
the final outputs into one JSON response, or stream Server-Sent Events, one chunk per text delta
and choice, then ``data: [DONE]``. A streamed response starts once the first token exists, so a
failure before it is still a plain HTTP error. A task watches the connection the whole time: a
client that goes away has its requests aborted at once (blocks freed at the next step boundary).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..engine.engine_client import EngineDeadError
from .async_engine import (AsyncEngine, ClientGoneError, QueueFullError, RequestFailedError,
                           Submission)
from .formats import Logprobs, ResponseFormat, usage
from .protocol import (DEFAULT_COMPLETION_MAX_TOKENS, APIError, ChatCompletionRequest,
                       CompletionRequest, bad_request, parse_request, to_sampling_params)

logger = logging.getLogger(__name__)

# Not an HTTP status anyone receives: the client is gone when a handler returns it.
_CLIENT_CLOSED = 499


@dataclass(frozen=True)
class ServedModel:
    """What the endpoints need: the served name and the engine (``engine``: its client, for the
    tokenizer, model_config and max_model_len)."""

    name: str
    async_engine: AsyncEngine

    @property
    def engine(self) -> Any:
        return self.async_engine.client


def _check_model(served: ServedModel, name: str) -> None:
    if name != served.name:
        raise APIError(400, f"The model `{name}` does not exist; this server serves "
                            f"`{served.name}`", param="model", code="model_not_found")


def _check_prompt_ids(served: ServedModel, ids: list[int], param: str) -> list[int]:
    if not ids:
        raise bad_request(f"{param}: must contain at least one token", param=param)
    vocab = served.engine.model_config.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"{param}: token id {bad} is outside the vocabulary [0, {vocab})",
                          param=param)
    limit = served.engine.max_model_len
    if len(ids) >= limit:
        raise bad_request(f"{param}: the prompt has {len(ids)} tokens but the model's context "
                          f"is {limit} tokens (max_model_len), with at least one to generate",
                          param=param, code="context_length_exceeded")
    return ids


def _check_fits(served: ServedModel, prompts: list[list[int]], max_tokens: int, param: str) -> None:
    limit = served.engine.max_model_len
    longest = max(len(ids) for ids in prompts)
    if longest + max_tokens > limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens, but "
                          f"{longest + max_tokens} were requested ({longest} in the prompt, "
                          f"{max_tokens} in the completion): reduce the prompt or max_tokens",
                          param=param, code="context_length_exceeded")


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
        return served.async_engine.submit(prompts, params)
    except QueueFullError as exc:
        raise APIError(429, str(exc), type="rate_limit_error", code="queue_full") from None
    except EngineDeadError as exc:
        raise APIError(503, str(exc), type="server_error", code="engine_dead") from None
    except ValueError as exc:  # the engine's admission checks (e.g. prompt + max_tokens too long)
        raise bad_request(str(exc)) from None


async def _serve(request: Request, submission: Submission, fmt: ResponseFormat, *, n: int,
                 stream: bool, include_usage: bool) -> Response:
    watcher = asyncio.create_task(_watch_disconnect(request, submission))
    streaming = False
    try:
        if not stream:
            final: dict[int, Any] = {}
            async for index, out in submission:
                final[index] = out
            choices = [(i * n + c.index, c) for i in sorted(final) for c in final[i].outputs]
            return JSONResponse(fmt.response(choices, _usage_of(final)))
        first = await anext(submission)
        streaming = True
        return StreamingResponse(_stream(submission, first, fmt, n, include_usage, watcher),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    except ClientGoneError:
        return Response(status_code=_CLIENT_CLOSED)
    except RequestFailedError as exc:
        raise APIError(500, str(exc), type="server_error", code="internal_error") from None
    except StopAsyncIteration:  # cannot happen: a submission always ends with a finished output
        raise APIError(500, "the engine returned no output", type="server_error") from None
    finally:
        if not streaming:  # otherwise the stream owns them
            watcher.cancel()
            submission.abort()


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
        events = []
        for comp in out.outputs:
            index = prompt_index * self.n + comp.index
            token_start = self.tokens_sent.get(index, 0)
            if index in self.finished or (len(comp.token_ids) == token_start
                                          and comp.finish_reason is None):
                continue
            events.append(_sse(self.fmt.chunk(index, comp,
                                              text_start=self.text_sent.get(index, 0),
                                              token_start=token_start,
                                              usage_field=self.include_usage)))
            self.text_sent[index] = len(comp.text)
            self.tokens_sent[index] = len(comp.token_ids)
            if comp.finish_reason is not None:
                self.finished.add(index)
        return events


async def _stream(submission: Submission, first: tuple[int, Any], fmt: ResponseFormat, n: int,
                  include_usage: bool, watcher: asyncio.Task) -> AsyncIterator[str]:
    """SSE events: a chunk per choice per step that gave it tokens, then usage and [DONE]."""
    state = _StreamState(fmt, n, include_usage)
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
        yield _sse("[DONE]")
    except RequestFailedError as exc:
        # The status line is long gone: report it the way OpenAI streams report errors.
        yield _sse(APIError(500, str(exc), type="server_error", code="internal_error").body())
    except ClientGoneError:
        pass
    finally:
        watcher.cancel()
        submission.abort()


# ---- the endpoints ---------------------------------------------------------------------------
def _logprobs_format(served: ServedModel, top: int | None) -> Logprobs | None:
    if top is None:
        return None
    tokenizer = served.engine.tokenizer
    return Logprobs(lambda tid: tokenizer.decode([tid], skip_special_tokens=False), top)


async def create_completion(request: Request, served: ServedModel) -> Response:
    req = parse_request(await request.body(), CompletionRequest)
    _check_model(served, req.model)
    tokenizer = served.engine.tokenizer
    prompts = []
    items = req.prompts()
    for i, p in enumerate(items):
        param = "prompt" if len(items) == 1 else f"prompt[{i}]"
        ids = tokenizer.encode(p) if isinstance(p, str) else p
        prompts.append(_check_prompt_ids(served, ids, param))
    max_tokens = req.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
    _check_fits(served, prompts, max_tokens, "max_tokens")
    params = to_sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs)
    fmt = ResponseFormat(False, f"cmpl-{uuid.uuid4().hex}", served.name, int(time.time()),
                         _logprobs_format(served, req.logprobs))
    submission = _submit(served, prompts, params)
    return await _serve(request, submission, fmt, n=req.n, stream=req.stream,
                        include_usage=req.include_usage)


async def create_chat_completion(request: Request, served: ServedModel) -> Response:
    req = parse_request(await request.body(), ChatCompletionRequest)
    _check_model(served, req.model)
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise bad_request("give max_tokens or max_completion_tokens, not both",
                          param="max_completion_tokens")
    try:
        ids = served.engine.tokenizer.apply_chat_template(req.template_messages(),
                                                          add_generation_prompt=True)
    except Exception as exc:  # jinja templates raise on what they do not accept (roles, order)
        raise bad_request(f"messages: the chat template rejected them: {exc}",
                          param="messages") from None
    if isinstance(ids, str):
        ids = served.engine.tokenizer.encode(ids)
    ids = _check_prompt_ids(served, list(ids), "messages")
    max_tokens = req.max_tokens or req.max_completion_tokens
    if max_tokens is None:  # OpenAI's default: whatever the context (and the KV pool) leaves
        stats = served.async_engine.stats()
        room = min(served.engine.max_model_len, stats.kv_blocks_total * stats.block_size)
        max_tokens = max(1, room - len(ids))
    _check_fits(served, [ids], max_tokens,
                "max_tokens" if req.max_tokens is not None else "max_completion_tokens")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = to_sampling_params(req, max_tokens=max_tokens, logprobs=logprobs)
    fmt = ResponseFormat(True, f"chatcmpl-{uuid.uuid4().hex}", served.name, int(time.time()),
                         _logprobs_format(served, logprobs))
    submission = _submit(served, [ids], params)
    return await _serve(request, submission, fmt, n=req.n, stream=req.stream,
                        include_usage=req.include_usage)
