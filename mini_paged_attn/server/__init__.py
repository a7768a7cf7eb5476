"""The OpenAI-compatible HTTP server: ``build_app(engine, model_name=...)`` is an ASGI app over
an ``engine.EngineClient``; the engine steps in its core, never here. ``mini-paged-attn serve``
runs it with uvicorn. The files: docs/architecture.md, ``server/``.
"""

from ..lazy_exports import lazy_exports

# Imported on first use: ``serve`` reads its limits' defaults (``server.limits``) to build its
# command line, before anything needs the app.
__getattr__ = lazy_exports(__name__, globals(), {"build_app": ".app"})

__all__ = ["build_app"]
