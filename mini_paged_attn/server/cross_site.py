"""Refuses what a web page in the user's browser could send to a server on this machine.

A page on any site can make the browser POST to ``http://127.0.0.1:8000/v1/completions``; two
checks stop it from using a server that has no API key:

- a POST must say ``Content-Type: application/json`` (else 415): a browser sends a cross-site
  request with another type (text/plain, a form, none) without asking first, but for JSON it
  asks the server (a CORS preflight), which this server never allows;
- with ``allowed_hosts`` (``serve`` sets it when bound to a loopback address), the ``Host``
  header must name one of them (else 400): a DNS-rebinding page reaches 127.0.0.1 under its own
  host name.

The official clients and curl with ``-H "Content-Type: application/json"`` pass both.
"""

from __future__ import annotations

from collections.abc import Collection

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import APIError

# What a client on this machine calls it (serve's default for a loopback --host).
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


class CrossSiteGuard:
    """ASGI middleware: the Host and Content-Type checks above, with OpenAI's error body."""

    def __init__(self, app: ASGIApp, allowed_hosts: Collection[str] | None = None) -> None:
        self.app = app
        self.allowed_hosts = (None if allowed_hosts is None
                              else {h.lower().strip("[]") for h in allowed_hosts})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            error = self._check(scope)
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _check(self, scope: Scope) -> APIError | None:
        headers = dict(scope["headers"])  # names are lower-case in ASGI
        host = headers.get(b"host")
        if self.allowed_hosts is not None and host is not None:
            name = _host_name(host.decode("latin-1"))
            if name not in self.allowed_hosts:
                return APIError(400, f"Host {name!r} is not one this server answers to (it "
                                     f"answers to {', '.join(sorted(self.allowed_hosts))}; "
                                     "serve --allowed-host adds names)", code="invalid_host")
        if scope["method"] == "POST":
            content_type = headers.get(b"content-type", b"").decode("latin-1")
            media_type = content_type.split(";", 1)[0].strip().lower()
            if media_type != "application/json":
                return APIError(415, "POST bodies must be JSON, sent with the header "
                                     f"`Content-Type: application/json` (got "
                                     f"{content_type or 'none'!r})",
                                code="unsupported_media_type")
        return None


def _host_name(host: str) -> str:
    """``"LocalHost:8000"`` -> ``"localhost"``; ``"[::1]:8000"`` -> ``"::1"``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host
