"""Plain HTTP to the daemon's API for tests: every header as sent, redirects not followed."""

from __future__ import annotations

import http.client
import json
import urllib.parse
from dataclasses import dataclass
from typing import Any


@dataclass
class Reply:
    status: int
    headers: list[tuple[str, str]]
    body: str

    def header(self, name: str) -> str | None:
        values = self.headers_named(name)
        return values[0] if values else None

    def headers_named(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name.lower()]

    def json(self) -> Any:
        return json.loads(self.body)


def call(base: str, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> Reply:
    """One HTTP request to ``base`` (a ``Host`` in ``headers`` replaces the real one)."""
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return Reply(resp.status, resp.getheaders(), resp.read().decode("utf-8"))
    finally:
        conn.close()


def post_json(base: str, path: str, body: Any, headers: dict[str, str] | None = None) -> Reply:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return call(base, "POST", path, raw, {"Content-Type": "application/json", **(headers or {})})


def post_form(base: str, path: str, fields: dict[str, str], headers: dict[str, str] | None = None) -> Reply:
    return call(base, "POST", path, urllib.parse.urlencode(fields).encode(),
                {"Content-Type": "application/x-www-form-urlencoded", **(headers or {})})


def origin(base: str) -> str:
    """The Origin header a browser sends for a page of the daemon's own API address."""
    url = urllib.parse.urlsplit(base)
    return f"{url.scheme}://{url.netloc}"


def assert_error(reply: Reply, status: int, code: str, *words: str) -> str:
    """The one JSON error shape; returns the message, which names each of ``words``."""
    assert reply.status == status, (reply.status, reply.body)
    assert reply.header("Content-Type").startswith("application/json")  # type: ignore[union-attr]
    body = reply.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}, body
    assert body["error"]["code"] == code, body
    message: str = body["error"]["message"]
    for word in words:
        assert word in message, (word, message)
    return message
