"""A request body -> what the engine gets: validation, the per-request caps, token ids.

:func:`prepare_completion` and :func:`prepare_chat` do everything a request needs before it is
queued, and raise :class:`APIError` (4xx) on anything wrong with it. They run on a worker thread
(:meth:`ServedModel.off_loop`): tokenizing a big prompt or rendering a long chat takes seconds.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..engine.tools.parsers import parser_for_template
from .async_client import AsyncClient
from .errors import APIError, bad_request, clip
from .formats import Logprobs, ResponseFormat
from .limits import (LogprobDemand, ServerLimits, check_logprobs, check_request,
                     check_response_size)
from .prompt_bytes import check_prompt_bytes
from .protocol import (DEFAULT_COMPLETION_MAX_TOKENS, ChatCompletionRequest, CompletionRequest,
                       parse_request, to_sampling_params)
from .structured import chat_constraint, completion_constraint

T = TypeVar("T")


@dataclass(frozen=True)
class ServedModel:
    """What the endpoints need: the served name, the engine (``engine``: its client, for the
    tokenizer, model_config and max_model_len), and the request workers.

    ``workers`` runs the CPU-heavy part of a request (JSON, validation, tokenizer and chat
    template) off the event loop; ``max_queue`` is the engine's queue limit, for requests that
    could never be admitted; ``max_prompt_bytes``: prompts of more bytes cannot fit the context
    and are refused before they are tokenized (``prompt_bytes.prompt_byte_cap``; None: no cap).
    ``tool_call_parser``: the format of tool calls ``tool_choice`` "auto" looks for (a
    ``engine.tools.parsers.PARSERS`` key); None: the one the chat template shows.
    ``aliases``: more names requests may use for the model (responses carry ``name``);
    ``chat_template``: the Jinja template chats render with, instead of the tokenizer's.
    """

    name: str
    async_client: AsyncClient
    workers: ThreadPoolExecutor
    limits: ServerLimits = field(default_factory=ServerLimits)
    max_queue: int | None = None
    tool_call_parser: str | None = None
    max_prompt_bytes: int | None = None
    aliases: tuple[str, ...] = ()
    chat_template: str | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """Every name requests may use, ``name`` first."""
        return (self.name, *self.aliases)

    @property
    def engine(self) -> Any:
        return self.async_client.client

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker thread; the event loop serves other requests meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.workers, fn, *args)


def model_not_found(served: ServedModel, name: str, param: str | None) -> APIError:
    """OpenAI's 404 for a model it does not serve."""
    serves = ", ".join(f"`{n}`" for n in served.names)
    return APIError(404, f"The model `{clip(name)}` does not exist; this server serves "
                         f"{serves}", param=param, code="model_not_found")


def check_model_name(served: ServedModel, name: str) -> None:
    """404 (``param`` "model") unless ``name`` is one of the served names."""
    if name not in served.names:
        raise model_not_found(served, name, "model")


_check_model = check_model_name


def render_chat(served: ServedModel, messages: list[dict[str, Any]], *,
                tools: list[dict[str, Any]] | None, tokenize: bool = True,
                **template_kwargs: Any) -> list[int] | str:
    """``messages`` through the served chat template (token ids, or the text with
    ``tokenize=False``); a 400 naming ``messages`` when the template refuses them."""
    if served.chat_template is not None:
        template_kwargs["chat_template"] = served.chat_template
    try:
        return served.engine.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=tokenize, **template_kwargs)
    except Exception as exc:  # jinja templates raise on what they do not accept (roles, order)
        raise bad_request(f"messages: the chat template rejected them: {exc}",
                          param="messages") from None


def served_template(served: ServedModel) -> str | None:
    """The chat template chats render with: the server's, else the tokenizer's."""
    if served.chat_template is not None:
        return served.chat_template
    return getattr(getattr(served.engine.tokenizer, "hf", None), "chat_template", None)


def _check_logit_bias(served: ServedModel, req: Any) -> None:
    vocab = served.engine.model_config.vocab_size
    bad = next((k for k in req.logit_bias or () if int(k) >= vocab), None)
    if bad is not None:
        raise bad_request(f"logit_bias: token id {bad} is outside the vocabulary [0, {vocab})",
                          param="logit_bias")


def _check_sampling(served: ServedModel, req: Any, num_prompts: int) -> None:
    """The per-request caps and the token ids of logit_bias (before any tokenizing)."""
    check_request(served.limits, n=req.n, stop=req.stop, num_prompts=num_prompts,
                  max_queue=served.max_queue, stop_token_ids=req.stop_token_ids,
                  logit_bias=req.logit_bias)
    _check_logit_bias(served, req)


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


def _grammar_compiler(served: ServedModel) -> Any:
    """The engine's GrammarCompiler (constraints compile on this worker thread, into its
    cache), or None for an engine client without one (then only checked here)."""
    return getattr(getattr(served.engine, "admission", None), "grammar", None)


def _logprobs_format(served: ServedModel, top: int | None) -> Logprobs | None:
    if top is None:
        return None
    tokenizer = served.engine.tokenizer
    return Logprobs(lambda tid: tokenizer.decode([tid], skip_special_tokens=False), top)


@dataclass(frozen=True)
class Prepared:
    """A validated, tokenized request, ready for ``AsyncClient.submit``."""

    prompts: list[list[int]]
    params: Any  # SamplingParams
    fmt: ResponseFormat
    n: int
    stream: bool
    include_usage: bool


def prepare_completion(served: ServedModel, raw: bytes) -> Prepared:
    """Body -> token ids and SamplingParams (on a worker thread); APIError on bad input."""
    req = parse_request(raw, CompletionRequest)
    _check_model(served, req.model)
    items = req.prompts()
    _check_sampling(served, req, len(items))
    check_logprobs(served.limits, logprobs=req.logprobs, prompt_logprobs=req.prompt_logprobs)
    constraint = completion_constraint(req, _grammar_compiler(served))
    tokenizer = served.engine.tokenizer
    names = ["prompt" if len(items) == 1 else f"prompt[{i}]" for i in range(len(items))]
    for p, param in zip(items, names):   # all of them before any is tokenized
        if isinstance(p, str):
            check_prompt_bytes(served.max_prompt_bytes, [p], param, served.engine.max_model_len)
    prompts = []
    for p, param in zip(items, names):
        ids = tokenizer.encode(p) if isinstance(p, str) else p
        prompts.append(_check_prompt_ids(served, ids, param))
    max_tokens = req.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
    _check_fits(served, prompts, max_tokens, "max_tokens")
    # echo + logprobs: the prompt tokens' logprobs too, as many alternatives as the output's.
    echoed = req.logprobs if req.echo else None
    wanted = [k for k in (echoed, req.prompt_logprobs) if k is not None]
    check_response_size(served.limits, LogprobDemand(
        req.n, max_tokens, req.logprobs, "logprobs", [len(ids) for ids in prompts],
        [(name, k) for name, k in (("echo", echoed), ("prompt_logprobs", req.prompt_logprobs))
         if k is not None]))
    params = to_sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs,
                                prompt_logprobs=max(wanted) if wanted else None,
                                structured_outputs=constraint)
    echo = None
    if req.echo:   # a prompt given as token ids echoes as their text
        echo = [p if isinstance(p, str) else tokenizer.decode(ids)
                for p, ids in zip(items, prompts)]
    fmt = ResponseFormat(False, f"cmpl-{uuid.uuid4().hex}", served.name, int(time.time()),
                         _logprobs_format(served, req.logprobs), echo=echo, n=req.n,
                         prompt_logprobs=_logprobs_format(served, req.prompt_logprobs))
    return Prepared(prompts, params, fmt, req.n, req.stream, req.include_usage)


def prepare_chat(served: ServedModel, raw: bytes) -> Prepared:
    """Body -> the chat template's token ids and SamplingParams (on a worker thread)."""
    req = parse_request(raw, ChatCompletionRequest)
    _check_model(served, req.model)
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise bad_request("give max_tokens or max_completion_tokens, not both",
                          param="max_completion_tokens")
    _check_sampling(served, req, 1)
    check_logprobs(served.limits, top_logprobs=req.top_logprobs)
    check_prompt_bytes(served.max_prompt_bytes, [m.text() for m in req.messages], "messages",
                       served.engine.max_model_len)
    tokenizer = served.engine.tokenizer
    parser = served.tool_call_parser or parser_for_template(served_template(served))
    constraint, tools = chat_constraint(req, parser, _grammar_compiler(served))
    ids = render_chat(served, req.template_messages(), tools=req.template_tools(),
                      add_generation_prompt=True)
    if isinstance(ids, str):
        ids = served.engine.tokenizer.encode(ids)
    ids = _check_prompt_ids(served, list(ids), "messages")
    max_tokens = req.max_tokens or req.max_completion_tokens
    if max_tokens is None:  # OpenAI's default: whatever the context (and the KV pool) leaves
        stats = served.async_client.stats()
        room = min(served.engine.max_model_len, stats.kv_blocks_total * stats.block_size)
        max_tokens = max(1, room - len(ids))
    _check_fits(served, [ids], max_tokens,
                "max_tokens" if req.max_tokens is not None else "max_completion_tokens")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    check_response_size(served.limits, LogprobDemand(req.n, max_tokens, logprobs, "top_logprobs",
                                                     [len(ids)], []))
    params = to_sampling_params(req, max_tokens=max_tokens, logprobs=logprobs,
                                structured_outputs=constraint)
    fmt = ResponseFormat(True, f"chatcmpl-{uuid.uuid4().hex}", served.name, int(time.time()),
                         _logprobs_format(served, logprobs), tools=tools)
    return Prepared([ids], params, fmt, req.n, req.stream, req.include_usage)
