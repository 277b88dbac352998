"""Listening: where a listener binds, its TLS, and HTTP servers that no client holds for ever.

``start_site`` serves an aiohttp app (the OTLP/HTTP receiver, the API) on a
``Listener`` of the config: idle and unfinished connections are closed after
``idle_timeout`` / ``read_timeout``, and a client that goes away or sends what
is not HTTP is a debug line, not an ERROR traceback. ``ssl_context`` is the TLS
of any listener, gRPC's included.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler, Middleware

from ..config import TLS, Listener
from ..errors import UserError

log = logging.getLogger("tracejudge.listen")


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def address(endpoint: str, port: int) -> str:
    """``host:port`` of a listener at its actual port, an IPv6 host in brackets (``[::]:8318``)."""
    host = split_endpoint(endpoint)[0]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def start_site(app: web.Application, listener: Listener, what: str) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``listener``; returns the runner and the actual port (port 0 picks one).

    No client holds a connection for ever: one with no request in flight, or still
    sending headers, is closed after ``idle_timeout`` (aiohttp's keep-alive timer
    runs from the connection's start and from each answer); a request body still
    arriving ``read_timeout`` after its headers has its connection closed. A client
    that goes away mid-request, or sends what is not HTTP, is logged at debug, not as
    an error.
    """
    app.middlewares.insert(0, _unfinished_requests(listener.read_timeout))  # outermost: sees every handler
    # Bodies are inflated by us, with a size bound, not by aiohttp.
    runner = web.AppRunner(app, access_log=None, auto_decompress=False, handle_signals=False,
                           keepalive_timeout=listener.idle_timeout, logger=_ServerLog(_aiohttp_log, {}))
    await runner.setup()
    host, port = split_endpoint(listener.endpoint)
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context(listener.tls))
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise UserError(f"cannot listen on {listener.endpoint} ({what}): {exc.strerror or exc}") from None
    server = site._server
    sockets = getattr(server, "sockets", None) or []
    actual = sockets[0].getsockname()[1] if sockets else port
    return runner, actual


_aiohttp_log = logging.getLogger("aiohttp.server")


class _ServerLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's server log, where a request it cannot parse (answered 400) is the client's
    mistake: one debug line, not an ERROR traceback. Anything else is logged as aiohttp does."""

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        if isinstance(exc_info, HttpProcessingError):
            self.debug("%s: %s", str(msg) % args, " ".join(str(exc_info.message).split()))
        else:
            super().exception(msg, *args, exc_info=exc_info, **kwargs)


def _unfinished_requests(read_timeout: float) -> Middleware:
    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        timer = None
        if not request.content.is_eof():
            timer = asyncio.get_running_loop().call_later(read_timeout, _close_if_unread, request, read_timeout)
        try:
            return await handler(request)
        except ConnectionResetError:
            if request.transport is not None and not request.transport.is_closing():
                raise  # not this client's connection
            log.debug("client %s went away during %s %s", request.remote, request.method, request.path)
            return web.Response(status=400)  # nobody reads it: aiohttp drops it quietly
        finally:
            if timer is not None:
                timer.cancel()

    return guard


def _close_if_unread(request: web.Request, read_timeout: float) -> None:
    if not request.content.is_eof() and request.transport is not None:
        log.debug("closing the connection of %s: the body of %s %s did not arrive within read_timeout (%gs)",
                  request.remote, request.method, request.path, read_timeout)
        request.transport.close()


def ssl_context(tls: TLS) -> ssl.SSLContext | None:
    """The server-side TLS of a listener whose ``tls`` names a certificate and key; None without."""
    if not tls.enabled:
        return None
    assert tls.cert_file is not None and tls.key_file is not None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(tls.cert_file), str(tls.key_file))
    return ctx
