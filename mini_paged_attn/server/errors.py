"""The errors the server answers with: :class:`APIError`, rendered as OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import logging
import re
import uuid
from typing import Any

from starlette.responses import JSONResponse

# A str holding one of these came from a lone "\udXXX" escape (json pairs the others): it
# cannot be encoded as UTF-8, so no tokenizer, template or response can take it.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")

# What a client sees of a failure inside the server (the details go to the server's log only).
ENGINE_FAILED = "The engine failed while serving this request; the server's log has the details"
ENGINE_DEAD = "The engine has stopped; the server's log has the details"


logger = logging.getLogger(__name__)

# Longest piece of a request an error message quotes (a model name, a path, a field name):
# a client that sends a megabyte of name gets a short answer, not its megabyte back.
MAX_ECHO_CHARS = 200
# A safety net over whole messages and params, whatever they quote.
_MAX_MESSAGE_CHARS = 4000


def clip(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was when cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


class APIError(Exception):
    """A request the server answers with an error status and OpenAI's error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """``{"error": {...}}``; its strings always encode as UTF-8 (a message that quotes the
        request may hold a lone surrogate: it becomes U+FFFD)."""
        param = None if self.param is None else clip(self.param)
        return {"error": {"message": _utf8_safe(clip(self.message, _MAX_MESSAGE_CHARS)),
                          "type": self.type, "param": _utf8_safe(param), "code": self.code}}

    def response(self) -> JSONResponse:
        """The HTTP response: the body, and Retry-After where retrying may help (429, 503)."""
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _utf8_safe(text: str | None) -> str | None:
    return None if text is None else LONE_SURROGATE.sub("\ufffd", text)


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def internal_error(message: str, *, what: str, cause: str | None = None,
                   code: str = "internal_error") -> APIError:
    """A 500 whose body says ``message`` and an error id, and nothing of the failure itself,
    which goes to the log under that id: ``what`` failed, then ``cause`` if given, else the
    exception being handled (its traceback)."""
    error_id = uuid.uuid4().hex[:12]
    logger.error("%s (error id %s)%s", what, error_id, f": {cause}" if cause else "",
                 exc_info=cause is None)
    return APIError(500, f"{message} (error id {error_id})", type="server_error", code=code)
