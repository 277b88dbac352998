"""Send OTLP bodies over the real wire (raw HTTP and raw gRPC), for tests and benches."""

from __future__ import annotations

import gzip
import http.client
import json
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit

import grpc
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceResponse
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from .daemon import FIXTURES

GRPC_METHODS = {
    "traces": ("/opentelemetry.proto.collector.trace.v1.TraceService/Export", ExportTraceServiceResponse),
    "logs": ("/opentelemetry.proto.collector.logs.v1.LogsService/Export", ExportLogsServiceResponse),
    "metrics": ("/opentelemetry.proto.collector.metrics.v1.MetricsService/Export", ExportMetricsServiceResponse),
}


def post(base: str, path: str, body: bytes, content_type: str = "application/x-protobuf",
         encoding: str | None = None, headers: dict[str, str] | None = None, chunked: bool = False,
         method: str = "POST") -> tuple[int, dict[str, str], bytes]:
    """One HTTP request; returns status, headers (lowercase names) and body."""
    url = urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    hdrs = {"Content-Type": content_type, **(headers or {})}
    if encoding:
        hdrs["Content-Encoding"] = encoding
    try:
        if chunked:
            hdrs["Transfer-Encoding"] = "chunked"
            conn.putrequest(method, path)
            for k, v in hdrs.items():
                conn.putheader(k, v)
            conn.endheaders()
            for i in range(0, len(body), 65536):
                part = body[i:i + 65536]
                conn.send(f"{len(part):x}\r\n".encode() + part + b"\r\n")
            conn.send(b"0\r\n\r\n")
        else:
            conn.request(method, path, body=body, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def grpc_export(target: str, signal: str, body: bytes, metadata: tuple[tuple[str, str], ...] = (),
                max_send: int = 256 * 1024 * 1024) -> Any:
    """Send serialized request bytes to the OTLP gRPC service; returns the decoded response."""
    method, resp_type = GRPC_METHODS[signal]
    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", max_send)]) as ch:
        call = ch.unary_unary(method, request_serializer=None, response_deserializer=resp_type.FromString)
        return call(body, metadata=metadata, timeout=60)


def retry_info(err: grpc.RpcError) -> float | None:
    """RetryInfo delay carried by a gRPC error, if any."""
    for key, value in err.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key == "grpc-status-details-bin":
            st = status_pb2.Status.FromString(value)
            for d in st.details:
                if d.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                    info = error_details_pb2.RetryInfo()
                    d.Unpack(info)
                    return info.retry_delay.seconds + info.retry_delay.nanos / 1e9
    return None


def fixture_cases() -> list[str]:
    return sorted(p.name.removesuffix(".meta.json") for p in FIXTURES.glob("*.meta.json"))


def fixture_requests(case: str, directory: Path = FIXTURES) -> Iterator[dict[str, Any]]:
    """The export requests of a case in arrival order, each with its body as sent on the wire."""
    meta = json.loads((directory / f"{case}.meta.json").read_text())
    for req in meta["export_requests"]:
        body = (directory / req["file"]).read_bytes()
        if req.get("stored_gzip_compressed"):  # compressed for the repository, not on the wire
            body = gzip.decompress(body)
        yield {**req, "body": body}


def wire_body(req: dict[str, Any]) -> bytes:
    """The uncompressed request body (what gRPC carries)."""
    body: bytes = req["body"]
    return gzip.decompress(body) if req.get("content_encoding") == "gzip" else body


def replay(req: dict[str, Any], grpc_target: str, http_base: str) -> Any:
    """Send one recorded request over its recorded transport and encoding."""
    if req["transport"] == "grpc":
        return grpc_export(grpc_target, req["signal"], wire_body(req))
    status, _, body = post(http_base, req["path"], req["body"], req["content_type"], req.get("content_encoding"))
    assert status == 200, f"{req['file']}: HTTP {status}: {body[:300]!r}"
    return body


def add_attributes(kvs: Any, values: dict[str, Any]) -> None:
    """Append ``values`` to a repeated KeyValue field (ints as int_value, everything else as text)."""
    for key, value in values.items():
        a = kvs.add()
        a.key = key
        if isinstance(value, int):
            a.value.int_value = value
        else:
            a.value.string_value = value


def span_request_bytes(n_spans: int, trace_seed: int = 1, attr_bytes: int = 1200) -> tuple[bytes, list[tuple[str, str]]]:
    """A protobuf ExportTraceServiceRequest with ``n_spans`` chat-like spans; returns body and (trace, span) ids."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    kv = rs.resource.attributes.add()
    kv.key, kv.value.string_value = "service.name", "wire-test"
    ss = rs.scope_spans.add()
    ss.scope.name = "tests.wire"
    ids = []
    text = json.dumps([{"role": "user", "parts": [{"type": "text", "content": "x" * attr_bytes}]}])
    for i in range(n_spans):
        sp = ss.spans.add()
        sp.trace_id = trace_seed.to_bytes(8, "big") + (i // 4 + 1).to_bytes(8, "big")
        sp.span_id = (trace_seed * 1_000_003 + i + 1).to_bytes(8, "big")
        sp.name = "chat gpt-4o-mini"
        sp.start_time_unix_nano = 1_764_478_800_000_000_000 + i
        sp.end_time_unix_nano = sp.start_time_unix_nano + 1000
        a = sp.attributes.add()
        a.key, a.value.string_value = "gen_ai.input.messages", text
        ids.append((sp.trace_id.hex(), sp.span_id.hex()))
    return req.SerializeToString(), ids


def json_traces(spans: list[dict[str, Any]], service: str = "wire-test") -> dict[str, Any]:
    """An OTLP/JSON ExportTraceServiceRequest document holding ``spans`` (hex ids, as exporters send them)."""
    return {"resourceSpans": [{
        "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": service}}]},
        "scopeSpans": [{"scope": {"name": "tests.wire"}, "spans": spans}],
    }]}


def nested_value_json(depth: int) -> str:
    """OTLP/JSON text of an AnyValue holding arrays ``depth`` levels deep (as text: json.dumps would recurse)."""
    return '{"arrayValue": {"values": [' * depth + '{"stringValue": "x"}' + "]}}" * depth


def nested_value_request(depth: int, trace_seed: int = 1) -> tuple[bytes, list[tuple[str, str]]]:
    """A protobuf ExportTraceServiceRequest of one span whose attribute nests arrays ``depth`` levels deep."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    req = ExportTraceServiceRequest.FromString(span_request_bytes(1, trace_seed=trace_seed, attr_bytes=10)[0])
    span = req.resource_spans[0].scope_spans[0].spans[0]
    kv = span.attributes.add()
    kv.key = "nested"
    value = kv.value
    for _ in range(depth):
        value = value.array_value.values.add()
    value.string_value = "x"
    return req.SerializeToString(), [(span.trace_id.hex(), span.span_id.hex())]
