"""The one bearer-token check, for the OTLP receivers and the API alike, and the signature of alert webhooks.

Compared in constant time, so a wrong token's answer says nothing of how much of it
was right.
"""

from __future__ import annotations

import hashlib
import hmac


def same_secret(given: str | None, secret: str) -> bool:
    """Whether ``given`` is ``secret`` (a token from a cookie or a link)."""
    return given is not None and hmac.compare_digest(given.encode(), secret.encode())


def bearer(header: str | None) -> str | None:
    """The token an ``Authorization: Bearer <token>`` header carries, or None."""
    scheme, _, secret = (header or "").strip().partition(" ")
    return secret.strip() if scheme == "Bearer" and secret.strip() else None


def bearer_ok(header: str | None, token: str | None) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <token>``; always, when no token is set."""
    if not token:
        return True
    return same_secret(header.strip() if header is not None else None, f"Bearer {token}")


def signature(secret: str, body: bytes) -> str:
    """``sha256=`` and the hex HMAC-SHA256 of ``body`` with ``secret``: what an alert webhook's receiver checks."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
