"""What every request passes before a handler sees it, and the headers of every page.

Each request passes, in order:

1. The Host check (DNS rebinding): a page at ``attacker.example`` whose name
   now resolves to this address sends ``Host: attacker.example``. Only this
   API's own address (a loopback name or address, the endpoint's host, or the
   address the client connected to, at the listening port) and the names of
   ``api.allowed_hosts`` are answered; any other Host gets 421
   ``host_not_allowed``. /healthz and /readyz answer any Host: probes name the
   pod IP or whatever their orchestrator chose, and health tells a rebinding
   page nothing.
2. The Origin check (CSRF) on requests that change state (POST and the like):
   an ``Origin`` other than this API's own (``null`` included) is refused, 403
   ``cross_origin`` (the review page's form gets an HTML page saying so).
   Browsers send an Origin with every POST; the review page is served with
   ``Referrer-Policy: same-origin``, under which its own form posts carry its
   real origin rather than ``null``. The JSON API also takes only
   ``Content-Type: application/json`` bodies (415 otherwise): a browser cannot
   send that to another site without a CORS preflight, which this API never
   grants, so a request without an Origin cannot come from a page elsewhere
   either.
3. The token: with ``api.auth.bearer_token`` set, everything but /healthz and
   /readyz needs ``Authorization: Bearer <token>``; a browser opens the review
   page once as ``/review?token=<token>``, or types the token into the
   sign-in page (``POST /review/sign-in``); either sets an HttpOnly,
   SameSite=Strict cookie in place of the header. With ``review.reviewers``,
   each reviewer's own token opens the pages and the review stage's JSON API
   (/api/review..., /api/calibration..., and /api/alerts...) the same ways, and
   names the reviewer every claim, decision, label and acknowledgement of the
   request records
   (``review.identity``); the pages then need a token even with no API token.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from .. import config
from ..auth import bearer, same_secret
from ..review import page as review_page
from ..review.identity import Identity
from .errors import APIError, Handler

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class HostCheck:
    """Which ``Host`` headers name this API (see the module docstring)."""

    def __init__(self, endpoint: str, allowed_hosts: Sequence[str]) -> None:
        self.bound = config.split_host(endpoint)[0]
        self.allowed = [config.split_host(h) for h in allowed_hosts]

    def allows(self, header: str | None, local: Any, secure: bool) -> bool:
        """``header`` names this API, reached at the socket address ``local`` (None when unknown)."""
        try:
            host, port = config.split_host(header or "")
        except ValueError:
            return False
        port = port if port is not None else (443 if secure else 80)
        if any(host == name and allowed_port in (None, port) for name, allowed_port in self.allowed):
            return True
        if not isinstance(local, tuple) or len(local) < 2 or port != local[1]:
            return False
        return host in (self.bound, _ip_text(local[0])) or config.is_loopback(host)


def _ip_text(address: str) -> str:
    """A socket's IP as ``split_host`` writes it (an IPv4 client of a dual-stack socket as IPv4)."""
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return address
    return str(ip.ipv4_mapped) if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped else str(ip)


def host_check(hosts: HostCheck) -> Any:
    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        local = request.transport.get_extra_info("sockname") if request.transport is not None else None
        header = request.headers.get("Host")
        if not hosts.allows(header, local, request.secure):
            raise APIError(421, "host_not_allowed",
                           f"Host {header!r} does not name this API; to serve it under that name, add the name "
                           "to api.allowed_hosts")
        return await handler(request)

    return check


def _own_origin(request: web.Request) -> bool:
    origin = urlsplit(request.headers["Origin"])
    return origin.scheme in ("http", "https") and origin.netloc.lower() == request.headers.get("Host", "").lower()


@web.middleware
async def origin_check(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.method in _SAFE_METHODS or "Origin" not in request.headers or _own_origin(request):
        return await handler(request)
    if request.path.startswith("/review/"):
        return html_response(review_page.render_message("Refused", "This form was sent from another site."), status=403)
    raise APIError(403, "cross_origin", f"a {request.method} from another site (Origin {request.headers['Origin']!r}) "
                                        "is refused: only pages of this API may change its state")


COOKIE = "tracejudge_token"
SIGN_IN = "/review/sign-in"
PAGES = frozenset({"/review", "/calibration"})
"""The pages a browser opens (and everything under ``/review/``): the token cookie stands in for the header."""


def _signed_in(request: web.Request, token: str, after: str) -> web.HTTPSeeOther:
    response = web.HTTPSeeOther(after)
    response.set_cookie(COOKIE, token, httponly=True, samesite="Strict", path="/", secure=request.secure)
    return response


REVIEWER = "reviewer"
"""The request key naming the reviewer whose token the request carries (``review.reviewers``)."""
REVIEW_API = ("/api/review", "/api/calibration", "/api/alerts")
"""The JSON API of the review stage, and the alerts reviewers acknowledge: a reviewer's token opens it, as it
opens the pages."""


def _reviews(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in REVIEW_API)


def token_check(token: str | None, identity: Identity) -> Any:
    """The token check (see the module docstring); with reviewer tokens (``review.reviewers``), a reviewer's
    own token opens the pages and the review stage's JSON API (``REVIEW_API``), as a cookie or a bearer
    header, and the request carries that reviewer's name (``request[REVIEWER]``)."""

    def who(secret: str | None) -> tuple[bool, str | None]:
        """Whether ``secret`` opens the pages, and the reviewer it names."""
        if token and same_secret(secret, token):
            return True, None
        name = identity.of_token(secret)
        return name is not None, name

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if (not token and not identity.checked) or request.path in OPEN_PATHS:
            return await handler(request)
        page = request.path in PAGES or request.path.startswith("/review/")
        header = request.headers.get("Authorization")
        if header is not None:
            ok, name = who(bearer(header))
            if ok and (name is None or page or _reviews(request.path) or not token):
                if name is not None:
                    request[REVIEWER] = name
                return await handler(request)
        if not page:
            if not token and header is None:
                # Loopback without an API token: the JSON API is open to read; what records a reviewer asks
                # for a reviewer's token (``review.identity``).
                return await handler(request)
            raise APIError(401, "unauthorized", "missing or wrong bearer token: api.auth.bearer_token opens the "
                                                "API; a reviewer's token (review.reviewers) opens /api/review, "
                                                "/api/calibration and /api/alerts")
        if request.path == SIGN_IN:  # also when signed in already: to sign in with another token
            if request.method != "POST":
                return html_response(review_page.render_sign_in(), status=200 if who(_cookie(request))[0] else 401)
            form = await request.post()
            after = str(form.get("next") or "/review")
            after = after if after.startswith("/review") and not after.startswith("//") else "/review"
            typed = str(form.get("token") or "")
            if who(typed)[0]:
                raise _signed_in(request, typed, after)
            return html_response(review_page.render_sign_in(
                error="That token is not the daemon's: check it and try again.", next_url=after), status=401)
        ok, name = who(_cookie(request))
        if ok:
            if name is not None:
                request[REVIEWER] = name
            return await handler(request)
        secret = request.query.get("token")
        if who(secret)[0]:
            # Once from a link; the token then lives in a cookie, not in the address bar.
            raise _signed_in(request, str(secret), request.path)
        # Returned, not raised: error_middleware turns a raised HTTPException into JSON.
        after = request.path_qs if request.method == "GET" else "/review"
        return html_response(review_page.render_sign_in(next_url=after), status=401)

    return check


def _cookie(request: web.Request) -> str | None:
    return request.cookies.get(COOKIE)


def html_response(text: str, status: int = 200) -> web.Response:
    # Referrer-Policy same-origin, not no-referrer: under no-referrer browsers send the page's own form
    # posts with "Origin: null", which the CSRF check must refuse; other sites still get no address.
    return web.Response(text=text, status=status, content_type="text/html", charset="utf-8",
                        headers={"X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY",
                                 "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; "
                                                            "script-src 'self'; form-action 'self'; "
                                                            "frame-ancestors 'none'",
                                 "Referrer-Policy": "same-origin"})
