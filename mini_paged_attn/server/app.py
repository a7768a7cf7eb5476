"""The ASGI application: routes, API-key check, error bodies, and the engine's lifetime.

>>> app = build_app(llm.engine, model_name="my-model")      # doctest: +SKIP
>>> app = build_app(MPEngineClient("DIR"), model_name="my-model")  # doctest: +SKIP
>>> uvicorn.run(app, host="127.0.0.1", port=8000)            # doctest: +SKIP

Routes: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/completions``,
``POST /v1/chat/completions``, and vLLM's ``POST /tokenize`` and ``POST /detokenize``
(:mod:`.tokenize_api`), behind the API key when one is set; ``GET /health``, ``GET /metrics``
and ``GET /version`` are open, for probes and scrapers. (vLLM checks the key on /v1/* only; the
tokenizer endpoints cost CPU, so here they are behind it too.)
Every error, a 404 included, carries OpenAI's body ``{"error": {"message", "type", "param",
"code"}}``: malformed input of any kind is a 4xx, and a 500 says only that the server failed (the
exception goes to the log, under an id the body quotes). Bodies over ``limits.max_request_bytes``
get 413 before they are read (:mod:`.limits`); a body that takes longer than
``limits.body_timeout_s`` to arrive gets 408, and a client that takes no piece of its response
for ``limits.send_timeout_s`` is dropped (:mod:`.timeouts`). A POST must be
``Content-Type: application/json`` (415), and with ``allowed_hosts`` the Host header must name
one of them (:mod:`.cross_site`: what keeps web pages from using a key-less server on this
machine).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .. import __version__
from ..engine.llm_engine import LLMEngine
from ..engine.process.client import EngineClient, InprocEngineClient
from ..engine.tools.parsers import PARSERS
from .async_client import AsyncClient
from .cross_site import CrossSiteGuard
from .errors import ENGINE_DEAD, APIError, clip, internal_error
from .limits import RequestSizeLimit, ServerLimits
from .metrics import ServerMetrics
from .openai_api import create_chat_completion, create_completion
from .prepare import ServedModel, model_not_found
from .prompt_bytes import prompt_byte_cap
from .timeouts import IOTimeouts
from .tokenize_api import create_detokenize, create_tokenize, version_endpoint

logger = logging.getLogger(__name__)

Handler = Callable[[Request, ServedModel], Awaitable[Response]]

# Threads that parse and tokenize requests: enough that one huge prompt does not hold up the
# others, few enough that they leave the engine its cores.
_REQUEST_WORKERS = 2


def _check_api_key(request: Request, api_key: str) -> None:
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                             api_key.encode()):
        what = "No API key provided" if not given else "Incorrect API key provided"
        raise APIError(401, f"{what}: send the header `Authorization: Bearer <key>`",
                       code="invalid_api_key")


def _endpoint(handler: Handler, served: ServedModel, api_key: str | None
              ) -> Callable[[Request], Awaitable[Response]]:
    """Wrap a handler with the API-key check and the translation of every error into a body."""

    async def endpoint(request: Request) -> Response:
        try:
            if api_key is not None:
                _check_api_key(request, api_key)
            return await handler(request, served)
        except APIError as exc:
            return exc.response()
        except Exception:  # this request fails; the server and the engine go on
            return _internal_error(request)

    return endpoint


def _internal_error(request: Request) -> Response:
    """A 500 that tells the client nothing of the exception being handled, which is logged."""
    return internal_error("The server had an error while processing the request",
                          what=f"request to {clip(request.url.path)} failed").response()


async def _unhandled(request: Request, exc: Exception) -> Response:
    return _internal_error(request)


def _model_object(served: ServedModel, name: str) -> dict:
    return {"id": name, "object": "model", "created": int(time.time()),
            "owned_by": "mini_paged_attn", "root": served.name,
            "max_model_len": served.engine.max_model_len}


async def _models(request: Request, served: ServedModel) -> Response:
    # One entry per served name, the first first, as vLLM lists them.
    return JSONResponse({"object": "list",
                         "data": [_model_object(served, n) for n in served.names]})


async def _model(request: Request, served: ServedModel) -> Response:
    name = request.path_params["model_id"]
    if name not in served.names:
        raise model_not_found(served, name, None)
    return JSONResponse(_model_object(served, name))


async def _health(request: Request, served: ServedModel) -> Response:
    engine = served.async_client
    if not engine.alive:
        raise APIError(503, ENGINE_DEAD, type="server_error", code="engine_dead")
    return JSONResponse({"status": "ok"})


def _metrics_endpoint(metrics: ServerMetrics) -> Handler:
    async def scrape(request: Request, served: ServedModel) -> Response:
        body, content_type = metrics.render(request.headers.get("accept"))
        return Response(body, headers={"Content-Type": content_type})
    return scrape


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found" if exc.status_code == 404 else None
    return APIError(exc.status_code, f"{clip(request.method)} {clip(request.url.path)}: "
                                     f"{clip(str(exc.detail))}",
                    code=kind).response()


def build_app(engine: LLMEngine | EngineClient, *, model_name: str | Sequence[str],
              api_key: str | None = None,
              max_queue: int | None = None, max_consecutive_failures: int | None = None,
              limits: ServerLimits | None = None,
              allowed_hosts: Collection[str] | None = None,
              tool_call_parser: str | None = None,
              chat_template: str | None = None) -> Starlette:
    """The server for ``engine``, served under ``model_name``.

    The app takes the engine's outputs from its startup (ASGI lifespan) to its shutdown;
    ``app.state.async_client`` is what routes them. The server never steps the engine: its
    core does (``engine/process/core.py``).

    Args:
        engine: an ``EngineClient`` (``InprocEngineClient`` or ``MPEngineClient``; the caller
            shuts it down), or an ``LLMEngine``, which the app wraps in an
            ``InprocEngineClient`` of its own, shut down with the app.
        model_name: the id clients pass as ``model``, or several (vLLM's
            ``--served-model-name A B``): a request may name any of them, responses carry the
            first; anything else is a 404 (``model_not_found``).
        api_key: if set, /v1/* requires ``Authorization: Bearer <api_key>`` (401 otherwise).
        max_queue: at most this many requests wait for their first token; more get 429 (a
            request with more prompts than that gets 400: it could never be admitted).
        max_consecutive_failures: with an ``LLMEngine``, failed engine steps in a row after
            which the engine is dead (default 3); an ``EngineClient`` has its own (None here).
        limits: the per-request caps (body size, stop strings, prompts, n); None: the defaults.
        allowed_hosts: if set, a request whose Host header names another host gets 400 (a
            DNS-rebinding web page); ``cross_site.LOOPBACK_HOSTS`` for a server on 127.0.0.1.
        tool_call_parser: the tool-call format ``tool_choice`` "auto" reads
            (``engine.tools.parsers.PARSERS``: "hermes", "llama3_json", "mistral", "pythonic");
            None: the chat template's.
        chat_template: a Jinja chat template chats render with instead of the tokenizer's
            (/v1/chat/completions and /tokenize); None: the tokenizer's.
    """
    names = [model_name] if isinstance(model_name, str) else list(model_name)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"model_name: expected a non-empty string or a non-empty list of "
                         f"them, got {model_name!r}")
    if chat_template is not None and not (isinstance(chat_template, str) and chat_template):
        raise ValueError(f"chat_template: expected None or a non-empty string, got "
                         f"{chat_template!r}")
    if api_key is not None and not api_key.strip():
        raise ValueError(f"api_key: expected None or a non-blank string, got {api_key!r}")
    limits = ServerLimits() if limits is None else limits
    if tool_call_parser is not None and tool_call_parser not in PARSERS:
        raise ValueError(f"tool_call_parser: expected one of {', '.join(PARSERS)} or None, got "
                         f"{tool_call_parser!r}")
    if isinstance(engine, LLMEngine):
        client: EngineClient = InprocEngineClient(
            engine, max_consecutive_failures=3 if max_consecutive_failures is None
            else max_consecutive_failures)
        owns_client = True
    elif isinstance(engine, EngineClient):
        if max_consecutive_failures is not None:
            raise ValueError("max_consecutive_failures: expected None with an EngineClient "
                             "(give it to the client), got "
                             f"{max_consecutive_failures}")
        client, owns_client = engine, False
    else:
        raise ValueError(f"engine: expected an LLMEngine or an EngineClient, got "
                         f"{type(engine).__name__}")
    try:
        async_client = AsyncClient(client, max_queue=max_queue,
                                   max_unsent_tokens=limits.max_unsent_tokens,
                                   owns_client=owns_client)
    except ValueError:
        if owns_client:
            client.shutdown()
        raise
    metrics = ServerMetrics(async_client)
    async_client.on_finished = metrics.observe
    workers = ThreadPoolExecutor(_REQUEST_WORKERS, thread_name_prefix="mini-paged-attn-request")
    aliases = tuple(dict.fromkeys(n for n in names[1:] if n != names[0]))
    served = ServedModel(names[0], async_client, workers, limits=limits, max_queue=max_queue,
                         tool_call_parser=tool_call_parser, aliases=aliases,
                         chat_template=chat_template,
                         max_prompt_bytes=prompt_byte_cap(client.tokenizer, client.max_model_len))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async_client.start()
        try:
            yield
        finally:
            async_client.shutdown()
            workers.shutdown(wait=False, cancel_futures=True)

    routes = [
        Route("/v1/models", _endpoint(_models, served, api_key), methods=["GET"]),
        # :path: served names often hold a slash (org/model).
        Route("/v1/models/{model_id:path}", _endpoint(_model, served, api_key), methods=["GET"]),
        Route("/v1/completions", _endpoint(create_completion, served, api_key),
              methods=["POST"]),
        Route("/v1/chat/completions", _endpoint(create_chat_completion, served, api_key),
              methods=["POST"]),
        Route("/tokenize", _endpoint(create_tokenize, served, api_key), methods=["POST"]),
        Route("/detokenize", _endpoint(create_detokenize, served, api_key), methods=["POST"]),
        Route("/version", _endpoint(version_endpoint(__version__), served, None),
              methods=["GET"]),
        Route("/health", _endpoint(_health, served, None), methods=["GET"]),
        Route("/metrics", _endpoint(_metrics_endpoint(metrics), served, None), methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    middleware=[Middleware(IOTimeouts, body_timeout_s=limits.body_timeout_s,
                                           send_timeout_s=limits.send_timeout_s),
                                Middleware(CrossSiteGuard, allowed_hosts=allowed_hosts),
                                Middleware(RequestSizeLimit, max_bytes=limits.max_request_bytes)],
                    exception_handlers={HTTPException: _http_error, Exception: _unhandled})
    app.state.async_client = async_client
    app.state.metrics = metrics
    app.state.served = served
    return app
