"""Time limits on a connection's I/O, so a stalled or non-reading peer costs little and briefly.

:class:`IOTimeouts` is ASGI middleware with two budgets:

- ``body_timeout_s``: the whole request body must arrive within it, counted from the first
  read of it. A client that sends headers and part of a body and then stalls gets 408 (and
  ``Connection: close``) instead of holding a request worker's caller and its buffers forever.
- ``send_timeout_s``: each piece of a response must be taken within it. uvicorn applies write
  flow control, so a client that stops reading makes ``send`` wait; past the budget the
  response is abandoned, the connection closed, and the request's engine requests aborted
  (the handler's disconnect watcher sees the closed connection).
"""

from __future__ import annotations

import asyncio
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError

logger = logging.getLogger(__name__)


class BodyTimeoutError(APIError):
    """The request body did not arrive in time (408)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, f"The request body did not arrive within {timeout_s:g} s",
                         code="request_timeout")

    def response(self):
        response = super().response()
        response.headers["Connection"] = "close"    # what is left of the body is not read
        return response


class _SendTimeout(Exception):
    """The client took no piece of the response within ``send_timeout_s``."""


class IOTimeouts:
    """ASGI middleware: the body and send budgets of the module doc (seconds > 0)."""

    def __init__(self, app: ASGIApp, *, body_timeout_s: float, send_timeout_s: float) -> None:
        self.app = app
        self.body_timeout_s = body_timeout_s
        self.send_timeout_s = send_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        body_done = False

        async def timed_receive() -> Message:
            nonlocal deadline, body_done
            if body_done:       # only the disconnect is left to hear: no budget on waiting
                return await receive()
            if deadline is None:
                deadline = loop.time() + self.body_timeout_s
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                logger.info("a request body did not arrive within %g s; dropping the client",
                            self.body_timeout_s)
                raise BodyTimeoutError(self.body_timeout_s) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        async def timed_send(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), self.send_timeout_s)
            except asyncio.TimeoutError:
                raise _SendTimeout from None

        try:
            await self.app(scope, timed_receive, timed_send)
        except _SendTimeout:
            # Returning without finishing the response makes the server close the connection.
            logger.warning("a client took nothing of its response for %g s; closing its "
                           "connection", self.send_timeout_s)
