"""Fuzz every receiver of one real daemon with damaged real bodies (the Collector's
``receiver/otlpreceiver/fuzz_test.go``, with hypothesis).

The bodies start from the captured fixtures and from requests built with the
opentelemetry-proto messages (each also as OTLP/JSON). They are truncated,
bit-flipped, given a JSON value of the wrong type or a field value at the edge of
its column, or nested deep, then sent as HTTP protobuf or JSON (maybe compressed,
maybe in two gzip members, maybe with the compressed bytes cut short) or gRPC,
each beside a good request that may share its commit. Every answer must be one a
client can act on, the daemon must stay up, and at the end every span of every
request acknowledged in full must be in the DuckDB file. Each example's trace ids
are its own, so a span lost there is not hidden by the same span stored earlier.
"""

from __future__ import annotations

import base64
import gzip
import itertools
import json
import re
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator

import grpc
import pytest
from google.protobuf import json_format
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from ..support.wire import (
    GRPC_METHODS,
    fixture_cases,
    fixture_requests,
    nested_value_json,
    nested_value_request,
    post,
    span_request_bytes,
    wire_body,
)

pytestmark = pytest.mark.slow  # it sends hundreds of mutated requests to each receiver

PB = "application/x-protobuf"
JS = "application/json"
HTTP_ANSWERS = {200, 400, 413, 415}
GRPC_ANSWERS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
REQUESTS = {"traces": ExportTraceServiceRequest, "logs": ExportLogsServiceRequest,
            "metrics": ExportMetricsServiceRequest}
# Errors logged by the wire or the store (later stages are not what this test drives).
WIRE_ERROR = re.compile(r" (ERROR|CRITICAL) (aiohttp|grpc|asyncio|tracejudge\.(receiver|store|daemon))\b")

# Values at and beyond the edges of the protobuf fields and of the store's columns (int8 for
# kind and status code, int32 for severity, uint32, uint64).
ENUM = [-2**31 - 1, -2**31, -129, -128, 127, 128, 2**31 - 1]
U32 = [-1, 0, 2**32 - 1, 2**32]
U64 = [-1, 0, 2**63, 2**64 - 1, 2**64]
ITEM_FIELDS: dict[str, tuple[str, dict[str, list[int]]]] = {
    "traces": ("spans", {"kind": ENUM, "status.code": ENUM, "startTimeUnixNano": U64, "endTimeUnixNano": U64,
                         "flags": U32, "droppedAttributesCount": U32}),
    "logs": ("logRecords", {"severityNumber": ENUM, "timeUnixNano": U64, "observedTimeUnixNano": U64,
                            "flags": U32, "droppedAttributesCount": U32}),
}
JSON_TOKEN = re.compile(rb'-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|"(?:[^"\\]|\\.)*"')  # a number or a string
ODD_JSON_VALUES = [b"1099511627776", b"18446744073709551616", b"-1", b"1.5", b"1e400", b"9" * 5000, b"true",
                   b"null", b"[]", b"{}", b'"str"', b'"\\ud800"', b"[" * 2000 + b"]" * 2000]


def _snake(name: str) -> str:
    return re.sub("([A-Z])", r"_\1", name).lower()


def _items(signal: str, doc: Any) -> list[Any]:
    """The spans or log records of a request, as protobuf messages or OTLP/JSON dicts."""
    top, scopes = ("resourceSpans", "scopeSpans") if signal == "traces" else ("resourceLogs", "scopeLogs")
    key = ITEM_FIELDS[signal][0]
    if isinstance(doc, dict):
        return [it for r in doc.get(top, ()) for sc in r.get(scopes, ()) for it in sc.get(key, ())]
    return [it for r in getattr(doc, _snake(top)) for sc in getattr(r, _snake(scopes)) for it in getattr(sc, _snake(key))]


def _as_json(signal: str, body: bytes) -> bytes:
    """OTLP/JSON of a protobuf body (MessageToDict writes ids in base64, OTLP/JSON in hex)."""
    doc = json_format.MessageToDict(REQUESTS[signal].FromString(body))
    if signal in ITEM_FIELDS:
        for item in _items(signal, doc):
            for holder in [item, *item.get("links", ())]:
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in holder:
                        holder[key] = base64.b64decode(holder[key]).hex()
    return json.dumps(doc).encode()


def _built() -> Iterator[tuple[str, bytes]]:
    yield "traces", span_request_bytes(6, trace_seed=77, attr_bytes=200)[0]
    logs = ExportLogsServiceRequest()
    scope = logs.resource_logs.add().scope_logs.add()
    for i in range(4):
        rec = scope.log_records.add()
        rec.trace_id, rec.span_id = bytes([i + 1]) * 16, bytes([i + 1]) * 8
        rec.time_unix_nano, rec.severity_number, rec.event_name = 1_764_478_800_000_000_000 + i, 9, "gen_ai.choice"
        rec.body.kvlist_value.values.add(key="message").value.string_value = f"answer {i}"
    yield "logs", logs.SerializeToString()
    metrics = ExportMetricsServiceRequest()
    metric = metrics.resource_metrics.add().scope_metrics.add().metrics.add(name="gen_ai.client.token.usage")
    point = metric.sum.data_points.add(as_int=42, time_unix_nano=1_764_478_800_000_000_000)
    point.attributes.add(key="gen_ai.token.type").value.string_value = "input"
    yield "metrics", metrics.SerializeToString()


def _seeds() -> dict[bool, list[tuple[str, bytes]]]:
    """(signal, uncompressed body) of every starting body: protobuf (False) and OTLP/JSON (True)."""
    protobuf = [*_built()]
    as_json = []
    for case in fixture_cases():
        for req in fixture_requests(case):
            (as_json if req["content_type"] == JS else protobuf).append((req["signal"], wire_body(req)))
    # Every protobuf body in OTLP/JSON too, so that both decoders get the same material.
    as_json += [(signal, _as_json(signal, body)) for signal, body in protobuf]
    return {False: protobuf, True: as_json}


SEEDS = _seeds()


def _trace_ids(signal: str, body: bytes, is_json: bool) -> list[bytes]:
    """The trace ids a body holds, as they appear in it (raw bytes, or hex text in JSON)."""
    if signal not in ITEM_FIELDS:
        return []
    if is_json:
        return sorted({m.group(1) for m in re.finditer(rb'"traceId": ?"([0-9a-f]{32})"', body)})
    ids = set()
    for item in _items(signal, REQUESTS[signal].FromString(body)):
        ids.update(h.trace_id for h in [item, *getattr(item, "links", ())] if len(h.trace_id) == 16)
    return sorted(ids)


def _with_trace_ids_of(n: int, body: bytes, trace_ids: list[bytes]) -> bytes:
    """``body`` with each trace id's last four bytes xor-ed with ``n``, in place (same length)."""
    for tid in trace_ids:
        raw = bytes.fromhex(tid.decode()) if len(tid) == 32 else tid
        new = raw[:12] + bytes(a ^ b for a, b in zip(raw[12:], n.to_bytes(4, "big")))
        body = body.replace(tid, new.hex().encode() if len(tid) == 32 else new)
    return body


@dataclass
class Case:
    """One request to send: ``body`` is what the daemon decodes (before its trace ids are made fresh)."""

    transport: str  # http | grpc
    signal: str
    body: bytes
    trace_ids: list[bytes]
    is_json: bool
    encoding: str | None
    second_member: bytes | None  # gzip: ``body`` was sent as two members, this is where the second starts
    cut_at: float | None  # the compressed bytes were cut short at this fraction of their length

    def wire(self, n: int) -> tuple[bytes, bytes]:
        """The body the daemon decodes and the bytes sent, with trace ids of example ``n``."""
        body = _with_trace_ids_of(n, self.body, self.trace_ids)
        if self.second_member is not None:
            cut = len(body) - len(self.second_member)
            wire = gzip.compress(body[:cut]) + gzip.compress(body[cut:])
        elif self.encoding:
            wire = gzip.compress(body) if self.encoding == "gzip" else zlib.compress(body)
        else:
            wire = body
        if self.cut_at is not None:
            wire = wire[:int(len(wire) * self.cut_at)]
        return body, wire

    def __repr__(self) -> str:  # bodies are up to 175 KB: show where one starts and how long it is
        return (f"Case({self.transport}, {self.signal}, json={self.is_json}, encoding={self.encoding}, "
                f"second_member={self.second_member is not None}, cut_at={self.cut_at}, "
                f"body={self.body[:300]!r}... ({len(self.body)} bytes))")

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # what hypothesis prints a failing case with
        printer.text(repr(self))


def _set_edge_value(draw: Any, signal: str, body: bytes, is_json: bool) -> bytes:
    """Give one numeric field of one span or log record a value at or beyond its column's edge."""
    doc: Any = json.loads(body) if is_json else REQUESTS[signal].FromString(body)
    items = _items(signal, doc)
    if not items:
        return body
    item = draw(st.sampled_from(items))
    field, edges = draw(st.sampled_from(sorted(ITEM_FIELDS[signal][1].items())))
    *path, name = field.split(".")
    value = draw(st.sampled_from(edges))
    if is_json:
        for part in path:
            item = item.setdefault(part, {})
        item[name] = value if draw(st.booleans()) else str(value)  # OTLP/JSON allows both
        return json.dumps(doc).encode()
    for part in path:
        item = getattr(item, part)
    try:
        setattr(item, _snake(name), value)
    except ValueError:
        return body  # beyond the protobuf field's own range: not something protobuf can carry
    return doc.SerializeToString()  # type: ignore[no-any-return]


def _damage(draw: Any, signal: str, body: bytes, is_json: bool) -> tuple[str, bytes]:
    damage = draw(st.sampled_from(["none", "truncate", "flip", "flip", "json value", "edge", "edge", "nest"]))
    if damage == "truncate":
        return signal, body[:draw(st.integers(0, max(0, len(body) - 1)))]
    if damage == "flip" and body:
        flipped = bytearray(body)
        for _ in range(draw(st.integers(1, 8))):
            flipped[draw(st.integers(0, len(body) - 1))] ^= 1 << draw(st.integers(0, 7))
        return signal, bytes(flipped)
    if damage == "json value" and is_json:
        tokens = list(JSON_TOKEN.finditer(body))
        if tokens:
            tok = draw(st.sampled_from(tokens))
            return signal, body[:tok.start()] + draw(st.sampled_from(ODD_JSON_VALUES)) + body[tok.end():]
    if damage == "edge" and signal in ITEM_FIELDS:
        return signal, _set_edge_value(draw, signal, body, is_json)
    if damage == "nest":
        depth = draw(st.sampled_from([1, 40, 47, 48, 100, 300, 1000]))
        if not is_json:
            return "traces", nested_value_request(depth, trace_seed=depth)[0]
        req = ExportTraceServiceRequest.FromString(nested_value_request(0, trace_seed=depth)[0])
        req.resource_spans[0].scope_spans[0].spans[0].attributes[-1].value.string_value = "__nested__"
        # The nesting goes in as text: json.dumps would recurse that deep.
        return "traces", _as_json("traces", req.SerializeToString()).replace(
            b'{"stringValue": "__nested__"}', nested_value_json(depth).encode())
    return signal, body


@st.composite
def cases(draw: Any) -> Case:
    transport, is_json = draw(st.sampled_from([("http", False), ("http", True), ("grpc", False)]))
    signal, body = draw(st.sampled_from(SEEDS[is_json]))
    signal, body = _damage(draw, signal, body, is_json)
    plans = ["plain", "gzip", "two gzip members", "deflate", "gzip, cut short", "deflate, cut short"]
    plan = draw(st.sampled_from(plans)) if transport == "http" else "plain"
    encoding = "gzip" if plan.startswith(("gzip", "two")) else "deflate" if plan.startswith("deflate") else None
    second = None
    if plan == "two gzip members" and not is_json:
        # A second gzip member holding a second request: protobuf messages concatenate into one.
        second = draw(st.sampled_from([b for sig, b in SEEDS[False] if sig == signal]))
        body += second
    cut_at = draw(st.integers(0, 99)) / 100 if plan.endswith("cut short") else None
    return Case(transport, signal, body, _trace_ids(signal, body, is_json) if cut_at is None and _decodes(
        signal, body, is_json) else [], is_json, encoding, second, cut_at)


def _decodes(signal: str, body: bytes, is_json: bool) -> bool:
    """Whether the trace ids of ``body`` can be read (and so made fresh)."""
    try:
        if is_json:
            json.loads(body or b"null")
        else:
            REQUESTS[signal].FromString(body)
    except Exception:
        return False
    return True


def _span_ids(signal: str, body: bytes, is_json: bool) -> set[tuple[str, str]]:
    """The spans of an acknowledged request, read from what was sent (not through the daemon's decoder)."""
    if signal != "traces":
        return set()
    if not is_json:
        return {(sp.trace_id.hex(), sp.span_id.hex()) for sp in _items("traces", ExportTraceServiceRequest.FromString(body))}
    if not body.strip():
        return set()  # an empty OTLP/JSON body is an empty export
    doc = json.loads(body)
    return {(str(sp.get("traceId") or sp.get("trace_id")).lower(), str(sp.get("spanId") or sp.get("span_id")).lower())
            for rs in doc.get("resourceSpans") or doc.get("resource_spans") or ()
            for ss in rs.get("scopeSpans") or rs.get("scope_spans") or ()
            for sp in ss.get("spans") or ()}


def _send(daemon: Any, case: Case, wire: bytes, channel: grpc.Channel) -> int | None:
    """Send one case and check its answer; returns the spans rejected when it was acknowledged."""
    if case.transport == "grpc":
        method, resp_type = GRPC_METHODS[case.signal]
        export = channel.unary_unary(method, request_serializer=None, response_deserializer=resp_type.FromString)
        try:
            resp = export(wire, timeout=60)
        except grpc.RpcError as err:
            assert err.code() in GRPC_ANSWERS, (err.code(), err.details())  # type: ignore[attr-defined]
            return None
        return resp.partial_success.rejected_spans if case.signal == "traces" else None
    status, _, reply = post(daemon.http, f"/v1/{case.signal}", wire, JS if case.is_json else PB, case.encoding)
    assert status in HTTP_ANSWERS, (status, reply[:500])
    if status != 200 or case.signal != "traces":
        return None
    resp = ExportTraceServiceResponse()
    if case.is_json:
        json_format.Parse(reply, resp)
    else:
        resp.ParseFromString(reply)
    return resp.partial_success.rejected_spans


def test_fuzz_every_receiver_keeps_what_it_acknowledged(daemon: Any) -> None:
    acknowledged: set[tuple[str, str]] = set()
    examples = itertools.count(1)
    with (grpc.insecure_channel(daemon.grpc, options=[("grpc.max_send_message_length", 64 * 1024 * 1024)])
          as channel, ThreadPoolExecutor(1) as pool):

        @settings(max_examples=400, deadline=None, derandomize=True, database=None,
                  phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                         HealthCheck.data_too_large, HealthCheck.large_base_example])
        @given(case=cases())
        def one(case: Case) -> None:
            n = next(examples)
            # A good request alongside, often in the same commit: nothing the case carries may fail it.
            innocent, ids = span_request_bytes(2, trace_seed=1_000_000 + n, attr_bytes=100)
            beside = pool.submit(post, daemon.http, "/v1/traces", innocent)
            body, wire = case.wire(n)
            rejected = _send(daemon, case, wire, channel)
            if rejected == 0 and case.cut_at is None:
                acknowledged.update(_span_ids(case.signal, body, case.is_json))
            assert beside.result()[0] == 200
            acknowledged.update(ids)
            assert daemon.get("/healthz")[0] == 200

        one()
    assert daemon.counts()["spans"] >= len(acknowledged)
    assert daemon.stop() == 0
    stored = set(daemon.query("SELECT trace_id, span_id FROM span_records"))
    assert acknowledged <= stored, sorted(acknowledged - stored)[:10]
    errors = [line for line in daemon.output().splitlines() if WIRE_ERROR.search(line)]
    assert not errors, errors[:5]
