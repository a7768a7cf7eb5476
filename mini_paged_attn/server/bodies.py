"""Whole (non-streamed) JSON responses, built and encoded off the event loop and sent in pieces.

A response with many log-probabilities is tens of megabytes of JSON, and building and encoding
it takes seconds of Python: on the event loop that would stall every other connection, /health
included. :func:`json_body` does both on a request worker, and a body over ``CHUNK_BYTES`` goes
out as a stream of pieces of that size, so the loop serves others between them and a slow
reader holds the sender back (each piece waits for the transport) instead of the server
buffering the whole body for it at once.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import Response, StreamingResponse

# Bodies up to this size go out in one piece; larger ones in pieces of this size.
CHUNK_BYTES = 256 * 1024


def encode_json(obj: Any) -> bytes:
    """``obj`` as compact UTF-8 JSON (what a JSONResponse sends)."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


async def json_body(build: Callable[[], Any], off_loop: Callable[..., Any]) -> Response:
    """The 200 response of ``build()``'s object.

    Args:
        build: makes the response object (a dict); called on a worker thread.
        off_loop: runs a function on a worker thread (``ServedModel.off_loop``).
    """
    body = await off_loop(lambda: encode_json(build()))
    if len(body) <= CHUNK_BYTES:
        return Response(body, media_type="application/json")
    return StreamingResponse(_pieces(body), media_type="application/json",
                             headers={"Content-Length": str(len(body))})


async def _pieces(body: bytes) -> AsyncIterator[bytes]:
    view = memoryview(body)
    for start in range(0, len(body), CHUNK_BYTES):
        yield bytes(view[start:start + CHUNK_BYTES])
