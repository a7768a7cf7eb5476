"""The ASGI application: routes, API-key check, error bodies, and the engine loop's lifetime.

>>> app = build_app(llm.engine, model_name="my-model")      # doctest: +SKIP
>>> uvicorn.run(app, host="127.0.0.1", port=8000)            # doctest: +SKIP

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (behind the
API key when one is set), ``GET /health`` and ``GET /metrics`` (open, for probes and scrapers).
Every error, a 404 included, carries OpenAI's body ``{"error": {"message", "type", "param",
"code"}}``.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from .engine_loop import EngineLoop
from .metrics import CONTENT_TYPE, render_metrics
from .openai_api import ServedModel, create_chat_completion, create_completion
from .protocol import APIError

logger = logging.getLogger(__name__)

Handler = Callable[[Request, ServedModel], Awaitable[Response]]


def _error_response(exc: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


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
            return _error_response(exc)
        except Exception as exc:  # this request fails; the server and the engine go on
            logger.exception("request to %s failed", request.url.path)
            return _error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                                            type="server_error", code="internal_error"))

    return endpoint


async def _models(request: Request, served: ServedModel) -> Response:
    return JSONResponse({"object": "list", "data": [{
        "id": served.name, "object": "model", "created": int(time.time()),
        "owned_by": "mini_paged_attn", "max_model_len": served.engine.max_model_len}]})


async def _health(request: Request, served: ServedModel) -> Response:
    loop = served.engine_loop
    if not loop.alive:
        raise APIError(503, loop.dead_reason or "the engine loop is not running",
                       type="server_error", code="engine_dead")
    return JSONResponse({"status": "ok"})


async def _metrics(request: Request, served: ServedModel) -> Response:
    return PlainTextResponse(render_metrics(served.engine_loop), media_type=CONTENT_TYPE)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found" if exc.status_code == 404 else None
    return _error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: "
                                                     f"{exc.detail}", code=kind))


def build_app(engine: Any, *, model_name: str, api_key: str | None = None,
              max_queue: int | None = None, max_consecutive_failures: int = 3) -> Starlette:
    """The server for ``engine`` (an ``LLMEngine``), served under ``model_name``.

    The engine loop thread starts with the application (ASGI lifespan) and stops with it; it is
    ``app.state.engine_loop``.

    Args:
        engine: the LLMEngine every request goes to (one continuous batch for all clients).
        model_name: the id clients pass as ``model``; anything else is a 400.
        api_key: if set, /v1/* requires ``Authorization: Bearer <api_key>`` (401 otherwise).
        max_queue: at most this many requests wait for their first token; more get 429.
        max_consecutive_failures: failed engine steps in a row after which the loop is dead.
    """
    if not model_name:
        raise ValueError(f"model_name: expected a non-empty string, got {model_name!r}")
    if api_key is not None and not api_key:
        raise ValueError("api_key: expected None or a non-empty string, got ''")
    engine_loop = EngineLoop(engine, max_queue=max_queue,
                             max_consecutive_failures=max_consecutive_failures)
    served = ServedModel(model_name, engine_loop)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine_loop.start()
        try:
            yield
        finally:
            engine_loop.shutdown()

    routes = [
        Route("/v1/models", _endpoint(_models, served, api_key), methods=["GET"]),
        Route("/v1/completions", _endpoint(create_completion, served, api_key),
              methods=["POST"]),
        Route("/v1/chat/completions", _endpoint(create_chat_completion, served, api_key),
              methods=["POST"]),
        Route("/health", _endpoint(_health, served, None), methods=["GET"]),
        Route("/metrics", _endpoint(_metrics, served, None), methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: _http_error})
    app.state.engine_loop = engine_loop
    return app
