"""The OpenAI-compatible HTTP server: ``build_app(engine, model_name=...)`` is an ASGI app.

``app.py`` (routes, API key, error bodies), ``openai_api.py`` (the completion and chat
endpoints), ``protocol.py`` (request schemas -> SamplingParams), ``formats.py`` (response
objects), ``async_engine.py`` (per-request output queues over an ``engine.EngineClient``; the
engine steps in its core, never here), ``metrics.py`` (/metrics). ``mini-paged-attn serve`` runs
it with uvicorn.
"""

from .app import build_app

__all__ = ["build_app"]
