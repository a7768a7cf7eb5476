"""The OpenAI-compatible HTTP server: ``build_app(engine, model_name=...)`` is an ASGI app.

``app.py`` (routes, API key, error bodies), ``openai_api.py`` (the completion and chat
endpoints), ``prepare.py`` (a body -> token ids, on worker threads), ``json_body.py`` (what a
body must be), ``protocol.py`` (request schemas -> SamplingParams), ``errors.py`` (OpenAI's
error body, the logged 500s), ``limits.py`` (per-request caps, the response-size cap, the
body-size middleware), ``prompt_bytes.py`` (too long for the context, before tokenizing),
``timeouts.py`` (body and send time limits), ``cross_site.py`` (Content-Type and Host checks),
``formats.py`` (response objects), ``bodies.py`` (whole responses off the event loop, in
pieces), ``async_client.py``
(per-request output queues over an ``engine.EngineClient``; the engine steps in its core, never
here), ``metrics.py`` (/metrics). ``mini-paged-attn serve`` runs it with uvicorn.
"""

from .app import build_app

__all__ = ["build_app"]
