"""OTLP receivers: gRPC and HTTP on one asyncio loop, feeding a ``Consumer`` (the store).

A handler only checks, parses, hands off and answers: ``Intake.export`` turns
one request body into column batches, submits them to the consumer and awaits
the commit; the transports map its ``Outcome`` to their status codes:

    outcome        HTTP                      gRPC
    ok             200 (+ partial_success)   OK (+ partial_success)
    invalid        400                       INVALID_ARGUMENT
    too_large      413                       RESOURCE_EXHAUSTED (no RetryInfo: not retryable)
    unavailable    503 + Retry-After         UNAVAILABLE + RetryInfo
    unauthorized   401                       UNAUTHENTICATED

An HTTP request whose body never arrives whole (the client went away, or was
closed at ``read_timeout``) gets no answer; it is counted as ``incomplete``.

grpc's own message limit is set above ours so that our check answers, and
counts, an oversized request.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Protocol

import grpc
from aiohttp import web
from google.protobuf import duration_pb2, json_format
from google.protobuf.any_pb2 import Any as AnyProto
from google.rpc import code_pb2, error_details_pb2, status_pb2
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceResponse
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from ..auth import bearer_ok
from ..config import TLS, Listener
from ..errors import StoreUnavailable
from ..metrics import Metrics
from . import decode
from .batches import Consumer

log = logging.getLogger("tracejudge.receiver")

SIGNALS = ("traces", "logs", "metrics")
MiB = 1024 * 1024


@dataclass
class Outcome:
    kind: str  # ok | invalid | too_large | unavailable | unauthorized (| incomplete: counted, never answered)
    message: str = ""
    reason: str = ""  # for unavailable: backpressure | storage_error
    response: Any = None
    retry_after: float = 0.0


def _response(signal: str, rejected: int, message: str) -> Any:
    if signal == "traces":
        resp = ExportTraceServiceResponse()
        if rejected or message:
            resp.partial_success.rejected_spans = rejected
            resp.partial_success.error_message = message
    elif signal == "logs":
        resp = ExportLogsServiceResponse()
        if rejected or message:
            resp.partial_success.rejected_log_records = rejected
            resp.partial_success.error_message = message
    else:
        resp = ExportMetricsServiceResponse()
    return resp


class Forward(Protocol):
    """What the receivers need of the forwarding stage (``collector.forward.Forwarder``)."""

    def refusal(self, signal: str, size: int) -> str | None: ...

    async def accept(self, signal: str, body: bytes) -> None: ...


class Intake:
    """Transport-independent handling of one OTLP export request."""

    def __init__(self, consumer: Consumer, metrics: Metrics, max_request_bytes: int,
                 bearer_token: str | None, forward: Forward | None = None, retry_after: float = 1.0) -> None:
        self.consumer = consumer
        self.metrics = metrics
        self.max_bytes = max_request_bytes
        self.token = bearer_token or None
        self.forward = forward
        """Queues each committed request for the exporters before it is answered (``collector.forward``)."""
        self.retry_after = retry_after
        self._committing: set[asyncio.Future[Outcome]] = set()

    def authorized(self, header: str | None) -> bool:
        return bearer_ok(header, self.token)

    def refuse(self, transport: str, signal: str, outcome: Outcome, items: int = 0) -> Outcome:
        """Count a refusal before it is answered."""
        self.metrics.requests.inc(transport=transport, signal=signal, outcome=outcome.kind)
        reason = {"invalid": "invalid", "too_large": "too_large", "unauthorized": "unauthenticated"}.get(
            outcome.kind, outcome.reason)
        if items:
            rejected = self.metrics.spans_rejected if signal == "traces" else self.metrics.logs_rejected
            rejected.inc(items, reason=reason)
        return outcome

    async def export(self, signal: str, body: bytes, json_body: bool, transport: str) -> Outcome:
        if len(body) > self.max_bytes:
            return self.refuse(transport, signal, Outcome(
                "too_large", f"request of {len(body)} bytes exceeds max_request_size_mib "
                             f"({self.max_bytes / MiB:g} MiB)"))
        m = self.metrics
        try:
            if signal == "metrics":
                m.metric_points.inc(decode.count_data_points(decode.parse_metrics(body, json_body)))
                m.requests.inc(transport=transport, signal=signal, outcome="ok")
                return Outcome("ok", response=_response(signal, 0, ""))
            request = decode.parse_traces(body, json_body) if signal == "traces" else decode.parse_logs(body, json_body)
            if signal == "traces":
                batch, rejected, reason = decode.span_batch(request)  # type: ignore[arg-type]
            else:
                batch, rejected, reason = decode.log_batch(request)  # type: ignore[assignment, arg-type]
        except decode.DecodeFailure as exc:
            return self.refuse(transport, signal, Outcome("invalid", str(exc)))
        full = self.forward.refusal(signal, len(body)) if self.forward is not None else None
        if full is not None:
            return self.refuse(transport, signal, Outcome("unavailable", full, reason="backpressure",
                                                         retry_after=self.retry_after), items=len(batch))
        received, refused = (m.spans_received, m.spans_rejected) if signal == "traces" else (
            m.logs_received, m.logs_rejected)
        received.inc(len(batch) + rejected)
        if rejected:
            refused.inc(rejected, reason="invalid")
        # Shielded: a client that gives up (a cancelled gRPC call, a closed connection) does not stop what
        # follows its commit, so whatever is stored is also queued for the exporters.
        task = asyncio.ensure_future(self._commit(signal, batch, request.SerializeToString() if json_body else body,
                                                  transport))
        self._committing.add(task)
        task.add_done_callback(self._committing.discard)
        outcome = await asyncio.shield(task)
        if outcome.kind != "ok":
            return outcome
        message = f"{rejected} rejected: {reason}" if rejected else ""
        return Outcome("ok", response=_response(signal, rejected, message))

    async def _commit(self, signal: str, batch: Any, body: bytes, transport: str) -> Outcome:
        """Store ``batch``, then queue ``body`` (protobuf) for the exporters; the outcome to answer."""
        try:
            await asyncio.wrap_future(self.consumer.submit(
                batch if signal == "traces" else None, batch if signal == "logs" else None))
        except StoreUnavailable as exc:
            return self.refuse(transport, signal, Outcome("unavailable", str(exc), reason=exc.reason,
                                                             retry_after=exc.retry_after),
                               items=len(batch))
        if self.forward is not None:
            try:
                await self.forward.accept(signal, body)
            except Exception as exc:  # committed, not queued: the client's retry is stored once and queued
                log.error("a committed request could not be queued for forwarding: %s", exc)
                return self.refuse(transport, signal, Outcome(
                    "unavailable", f"the forward queue cannot be written: {exc}", reason="storage_error",
                    retry_after=self.retry_after), items=len(batch))
        self.metrics.requests.inc(transport=transport, signal=signal, outcome="ok")
        return Outcome("ok")

    async def drain(self) -> None:
        """Wait for the commits of requests whose clients went away (after the listeners stopped)."""
        while self._committing:
            await asyncio.gather(*list(self._committing), return_exceptions=True)


# ------------------------------------------------------------------ gRPC

_GRPC_SERVICES = {
    "traces": "opentelemetry.proto.collector.trace.v1.TraceService",
    "logs": "opentelemetry.proto.collector.logs.v1.LogsService",
    "metrics": "opentelemetry.proto.collector.metrics.v1.MetricsService",
}
_GRPC_CODES = {
    "invalid": (grpc.StatusCode.INVALID_ARGUMENT, code_pb2.INVALID_ARGUMENT),
    "too_large": (grpc.StatusCode.RESOURCE_EXHAUSTED, code_pb2.RESOURCE_EXHAUSTED),
    "unavailable": (grpc.StatusCode.UNAVAILABLE, code_pb2.UNAVAILABLE),
    "unauthorized": (grpc.StatusCode.UNAUTHENTICATED, code_pb2.UNAUTHENTICATED),
}


def _grpc_handler(intake: Intake, signal: str) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[Any]]:
    async def export(request: bytes, context: grpc.aio.ServicerContext) -> Any:
        auth = dict(context.invocation_metadata() or ()).get("authorization")
        if not intake.authorized(auth if isinstance(auth, str) else None):
            outcome = intake.refuse("grpc", signal, Outcome("unauthorized", "missing or wrong bearer token"))
        else:
            outcome = await intake.export(signal, request, False, "grpc")
        if outcome.kind == "ok":
            return outcome.response
        code, rpc_code = _GRPC_CODES[outcome.kind]
        status = status_pb2.Status(code=rpc_code, message=outcome.message)
        if outcome.kind == "unavailable":
            info = error_details_pb2.RetryInfo(
                retry_delay=duration_pb2.Duration(seconds=int(outcome.retry_after),
                                                  nanos=int(outcome.retry_after % 1 * 1e9)))
            detail = AnyProto()
            detail.Pack(info)
            status.details.append(detail)
        await context.abort(code, outcome.message,
                            trailing_metadata=(("grpc-status-details-bin", status.SerializeToString()),))

    return export


# A connection is closed (GOAWAY, then the grace for calls in flight) at this age: the
# one bound on a call whose client sends half a message, with no deadline, for ever.
# Clients move to a new connection without failing a call.
GRPC_MAX_CONNECTION_AGE = 600.0
GRPC_MAX_CONNECTION_AGE_GRACE = 60.0


def grpc_server(intake: Intake, listener: Listener) -> grpc.aio.Server:
    """A grpc.aio server with the three OTLP services (ports added by the caller).

    Connections: one with no call in flight is closed after ``idle_timeout`` (grpc
    keeps it for ever by default; an exporter's channel reconnects for its next
    export), one that has not finished its handshake after ``read_timeout``, and
    any after ``GRPC_MAX_CONNECTION_AGE``.
    """
    limit = intake.max_bytes * 2 + MiB
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", 4 * MiB),
        ("grpc.max_connection_idle_ms", int(listener.idle_timeout * 1000)),
        ("grpc.server_handshake_timeout_ms", int(listener.read_timeout * 1000)),
        ("grpc.max_connection_age_ms", int(GRPC_MAX_CONNECTION_AGE * 1000)),
        ("grpc.max_connection_age_grace_ms", int(GRPC_MAX_CONNECTION_AGE_GRACE * 1000)),
    ])
    handlers = [
        grpc.method_handlers_generic_handler(service, {
            "Export": grpc.unary_unary_rpc_method_handler(
                _grpc_handler(intake, signal), request_deserializer=None,
                response_serializer=lambda m: m.SerializeToString()),
        })
        for signal, service in _GRPC_SERVICES.items()
    ]
    server.add_generic_rpc_handlers(handlers)
    return server


def add_grpc_port(server: grpc.aio.Server, endpoint: str, tls: TLS) -> int:
    """Bind ``endpoint``; returns the actual port (port 0 picks one)."""
    if tls.enabled:
        assert tls.cert_file is not None and tls.key_file is not None
        creds = grpc.ssl_server_credentials([(tls.key_file.read_bytes(), tls.cert_file.read_bytes())])
        port = server.add_secure_port(endpoint, creds)
    else:
        port = server.add_insecure_port(endpoint)
    if port == 0:
        raise OSError(f"cannot listen on {endpoint} (OTLP/gRPC): address in use or not available")
    return port


# ------------------------------------------------------------------ HTTP

_HTTP_STATUS = {"invalid": 400, "too_large": 413, "unavailable": 503, "unauthorized": 401}
_PROTOBUF = "application/x-protobuf"
_JSON = "application/json"


def _signal_of(path: str) -> str | None:
    for signal in SIGNALS:
        if path.rstrip("/").endswith(f"/v1/{signal}"):
            return signal
    return None


class _TooLarge(Exception):
    pass


async def _read_body(request: web.Request, limit: int, encoding: str) -> bytes:
    """Read a body (chunked or not) while counting, and inflate it with a bounded buffer."""
    length = request.content_length
    if length is not None and length > limit and not encoding:
        raise _TooLarge(f"body of {length} bytes exceeds the {limit / MiB:g} MiB limit")
    raw = bytearray()
    # Compressed bodies are bounded by the decompressed limit too: a body larger
    # than that on the wire cannot hold a request we accept, except a tiny margin.
    wire_limit = limit + 64 * 1024
    async for chunk in request.content.iter_chunked(64 * 1024):
        raw += chunk
        if len(raw) > wire_limit:
            raise _TooLarge(f"body exceeds the {limit / MiB:g} MiB limit")
    return _inflate(bytes(raw), limit, encoding) if encoding else bytes(raw)


_GZIP_MAGIC = b"\x1f\x8b"


def _inflate(data: bytes, limit: int, encoding: str) -> bytes:
    """Inflate a gzip body member by member (RFC 1952 allows several) or one deflate stream.

    Data after the end of the stream is refused, never ignored: what it held would be lost.
    """
    out = bytearray()
    member = 0
    while True:
        member += 1
        # deflate: 32 + 15 auto-detects a zlib or gzip header
        d = zlib.decompressobj(wbits=31 if encoding == "gzip" else 47)
        try:
            out += d.decompress(data, limit + 1 - len(out))  # never 0 (unbounded): checked below
            if len(out) <= limit:
                out += d.flush()
        except zlib.error as exc:
            where = f"member {member} of " if member > 1 else ""
            raise ValueError(f"cannot {encoding}-decode {where}the body: {exc}") from None
        if len(out) > limit:
            raise _TooLarge(f"decompressed body exceeds the {limit / MiB:g} MiB limit")
        if not d.eof:
            raise ValueError(f"cannot {encoding}-decode the body: the compressed stream is truncated")
        data = d.unused_data
        if not data:
            return bytes(out)
        if encoding != "gzip" or not data.startswith(_GZIP_MAGIC):
            raise ValueError(f"cannot {encoding}-decode the body: {len(data)} bytes of trailing data "
                             f"after the compressed stream")


def _http_error(status: int, message: str, json_reply: bool, retry_after: float = 0.0) -> web.Response:
    headers = {"Retry-After": str(max(1, round(retry_after)))} if status == 503 else {}
    code = {400: 3, 401: 16, 404: 5, 405: 12, 413: 8, 415: 3, 503: 14}.get(status, 2)
    st = status_pb2.Status(code=code, message=message)
    if json_reply:
        return web.Response(status=status, text=json_format.MessageToJson(st, indent=None),
                            content_type=_JSON, headers=headers)
    return web.Response(status=status, body=st.SerializeToString(), content_type=_PROTOBUF, headers=headers)


def http_app(intake: Intake) -> web.Application:
    """aiohttp app answering OTLP/HTTP on any path ending in /v1/traces, /v1/logs or /v1/metrics."""

    async def handle(request: web.Request) -> web.StreamResponse:
        signal = _signal_of(request.path)
        json_reply = request.content_type == _JSON
        if signal is None:
            return _http_error(404, f"no OTLP endpoint at {request.path}; paths end in "
                                    "/v1/traces, /v1/logs or /v1/metrics", json_reply)
        if request.method != "POST":
            return _http_error(405, f"{request.method} not allowed; OTLP/HTTP uses POST", json_reply)
        if not intake.authorized(request.headers.get("Authorization")):
            intake.refuse("http", signal, Outcome("unauthorized"))
            return _http_error(401, "missing or wrong bearer token", json_reply)
        if request.content_type not in (_PROTOBUF, _JSON):
            intake.refuse("http", signal, Outcome("invalid"))
            return _http_error(415, f"unsupported Content-Type {request.content_type!r}; "
                                    f"use {_PROTOBUF} or {_JSON}", False)
        encoding = request.headers.get("Content-Encoding", "").strip().lower()
        if encoding in ("identity", ""):
            encoding = ""
        elif encoding not in ("gzip", "deflate"):
            intake.refuse("http", signal, Outcome("invalid"))
            return _http_error(415, f"unsupported Content-Encoding {encoding!r}; use gzip, deflate or none",
                               json_reply)
        try:
            body = await _read_body(request, intake.max_bytes, encoding)
        except ConnectionResetError:  # the client went away, or was too slow (read_timeout)
            intake.refuse("http", signal, Outcome("incomplete"))
            raise  # the listener logs it at debug
        except _TooLarge as exc:
            intake.refuse("http", signal, Outcome("too_large"))
            return _http_error(413, str(exc), json_reply)
        except ValueError as exc:
            intake.refuse("http", signal, Outcome("invalid"))
            return _http_error(400, str(exc), json_reply)
        outcome = await intake.export(signal, body, json_reply, "http")
        if outcome.kind != "ok":
            return _http_error(_HTTP_STATUS[outcome.kind], outcome.message, json_reply, outcome.retry_after)
        if json_reply:
            return web.Response(text=json_format.MessageToJson(outcome.response, indent=None), content_type=_JSON)
        return web.Response(body=outcome.response.SerializeToString(), content_type=_PROTOBUF)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    return app
