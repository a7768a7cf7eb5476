"""The OpenAI-compatible HTTP server: ``build_app(engine, model_name=...)`` is an ASGI app over
an ``engine.EngineClient``; the engine steps in its core, never here. ``mini-paged-attn serve``
runs it with uvicorn. The files: docs/architecture.md, ``server/``.
"""

from .app import build_app

__all__ = ["build_app"]
