"""The OpenAI-compatible HTTP server: ``build_app(engine, model_name=...)`` is an ASGI app.

``app.py`` (routes, API key, error bodies), ``openai_api.py`` (the completion and chat
endpoints), ``protocol.py`` (request schemas -> SamplingParams), ``formats.py`` (response
objects), ``engine_loop.py`` (the one engine thread and its asyncio bridge), ``metrics.py``
(/metrics). ``mini-paged-attn serve`` runs it with uvicorn.
"""

from .app import build_app

__all__ = ["build_app"]
