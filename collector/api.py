"""The JSON API and health endpoints on ``api.endpoint``.

Every error has one shape: ``{"error": {"code": "...", "message": "..."}}``
with the matching HTTP status. With ``api.auth.bearer_token`` set, everything
but /healthz and /readyz needs ``Authorization: Bearer <token>``.
DuckDB reads run in worker threads, each on a cursor of its own.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
from typing import Any, Awaitable, Callable

from aiohttp import web

from . import queries
from .metrics import Metrics
from .queries import parse_since
from .store import Store

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_HEX_TRACE = re.compile(r"^[0-9a-fA-F]{32}$")


class APIError(Exception):
    """An error answered with the one JSON error shape."""

    def __init__(self, status: int, code: str, message: str) -> None:
        self.status = status
        self.code = code
        super().__init__(message)


def error_response(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as exc:
        return error_response(exc.status, exc.code, str(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status, "http_error")
        return error_response(exc.status, code, exc.reason)


def _auth(token: str | None) -> Any:
    open_paths = {"/healthz", "/readyz"}

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if token and request.path not in open_paths:
            got = request.headers.get("Authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
                raise APIError(401, "unauthorized", "missing or wrong bearer token (api.auth.bearer_token)")
        return await handler(request)

    return check


class API:
    """Routes of the JSON API; ``ready`` flips once every receiver listens."""

    def __init__(self, store: Store, metrics: Metrics, bearer_token: str | None,
                 status: Callable[[], dict[str, Any]] | None = None) -> None:
        self.store = store
        self.status_fn = status or (lambda: {})
        self.metrics = metrics
        self.ready = False
        self.app = web.Application(middlewares=[_errors, _auth(bearer_token or None)])
        r = self.app.router
        r.add_get("/healthz", self.healthz)
        r.add_get("/readyz", self.readyz)
        r.add_get("/metrics", self.prometheus)
        r.add_get("/api/status", self.status)
        r.add_get("/api/spans/count", self.spans_count)
        r.add_get("/api/traces/{trace_id}", self.trace)
        r.add_get("/api/conversations", self.conversations)
        r.add_get("/api/conversations/{conversation_id}", self.conversation)

    async def read(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(cursor)`` in a worker thread on a cursor of its own."""

        def run() -> Any:
            cur = self.store.cursor()
            try:
                return fn(cur)
            finally:
                cur.close()

        return await asyncio.to_thread(run)

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        if not self.ready:
            raise APIError(503, "not_ready", "receivers are not listening yet")
        return web.json_response({"status": "ready", "queue_depth": self.store.queue_depth})

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics.render(), content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})

    async def status(self, request: web.Request) -> web.Response:
        """Progress of each stage: what is committed, and how far conversations have caught up."""
        return web.json_response({"queue_depth": self.store.queue_depth,
                                  "committed_batch": self.store.batch_id, **self.status_fn()})

    async def spans_count(self, request: web.Request) -> web.Response:
        def q(cur: Any) -> dict[str, int]:
            spans, traces = cur.execute("SELECT count(*), count(DISTINCT trace_id) FROM span_records").fetchone()
            logs = cur.execute("SELECT count(*) FROM log_records").fetchone()[0]
            return {"spans": spans, "traces": traces, "log_records": logs}

        return web.json_response(await self.read(q))

    async def trace(self, request: web.Request) -> web.Response:
        trace_id = request.match_info["trace_id"]
        if not _HEX_TRACE.match(trace_id):
            raise APIError(400, "bad_trace_id", f"{trace_id!r} is not a 32-character hex trace id")
        trace_id = trace_id.lower()

        def q(cur: Any) -> dict[str, Any]:
            spans = _dicts(cur.execute(
                "SELECT * EXCLUDE (batch_id) FROM spans WHERE trace_id = ? ORDER BY start_time_unix_nano, span_id",
                [trace_id]))
            logs = _dicts(cur.execute(
                "SELECT * EXCLUDE (batch_id) FROM logs WHERE trace_id = ? ORDER BY coalesce(nullif(time_unix_nano, 0), observed_time_unix_nano), log_id",
                [trace_id]))
            return {"trace_id": trace_id, "spans": spans, "logs": logs}

        result = await self.read(q)
        if not result["spans"] and not result["logs"]:
            raise APIError(404, "not_found", f"no spans or log records stored for trace {trace_id}")
        return web.json_response(result, dumps=_dumps)


    async def conversations(self, request: web.Request) -> web.Response:
        q = request.query
        try:
            limit = int(q.get("limit", "50"))
            since = parse_since(q["since"]) if q.get("since") else None
        except ValueError as exc:
            raise APIError(400, "bad_parameter", str(exc)) from None
        state = q.get("state") or None
        if state not in (None, "open", "ended"):
            raise APIError(400, "bad_parameter", f"state must be open or ended, not {state!r}")
        rows = await self.read(lambda cur: queries.list_conversations(
            cur, since=since, state=state, service=q.get("service") or None, limit=limit))
        return web.json_response({"conversations": rows}, dumps=_dumps)

    async def conversation(self, request: web.Request) -> web.Response:
        cid = request.match_info["conversation_id"]
        record = await self.read(lambda cur: queries.conversation_record(cur, cid))
        if record is None:
            raise APIError(404, "not_found", f"no conversation {cid!r}")
        return web.json_response(record, dumps=_dumps)


_JSON_COLUMNS = {"attributes", "events", "links", "resource", "scope_attributes", "dropped", "body"}


def _dicts(result: Any) -> list[dict[str, Any]]:
    names = [d[0] for d in result.description]
    out = []
    for row in result.fetchall():
        rec = {}
        for name, value in zip(names, row):
            if name in _JSON_COLUMNS and isinstance(value, str):
                value = json.loads(value)
            rec[name] = value
        out.append(rec)
    return out


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, default=lambda v: str(queries.iso_utc(v)))
