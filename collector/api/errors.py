"""The API's one error shape: ``{"error": {"code": "...", "message": "..."}}`` with the matching status.

Handlers raise ``APIError``; ``error_middleware`` answers it, turns aiohttp's own
HTTP errors into the same shape, and answers anything unexpected with a 500
``internal_error``, logged once here with its traceback.
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable

from typing import Any

from aiohttp import web

log = logging.getLogger("tracejudge.api")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "too_large"}


class APIError(Exception):
    """An error answered with the one JSON error shape."""

    def __init__(self, status: int, code: str, message: str, details: dict[str, Any] | None = None) -> None:
        self.status = status
        self.code = code
        self.details = details or {}
        """More keys of the error object (a label import's ``problems``)."""
        super().__init__(message)


def error_response(status: int, code: str, message: str, details: dict[str, Any] | None = None) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message, **(details or {})}}, status=status)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error in the one JSON shape; anything unexpected is a 500, logged here once with its traceback."""
    try:
        return await handler(request)
    except APIError as exc:
        return error_response(exc.status, exc.code, str(exc), exc.details)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, _HTTP_CODES.get(exc.status, "http_error"), exc.reason)
    except ConnectionResetError:
        raise  # the client left: nobody to answer
    except Exception:
        log.exception("unexpected error answering %s %s", request.method, request.path)
        return error_response(500, "internal_error",
                              f"unexpected error ({request.method} {request.path}); the daemon's log has the details")
