"""Bad input gets a clear error, is counted, and harms nothing already accepted."""

from __future__ import annotations

import gzip
import json
import zlib
from typing import Any, Callable

import grpc
import pytest
from google.rpc import status_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from ..support.wire import (
    grpc_export,
    json_traces,
    nested_value_json,
    nested_value_request,
    post,
    retry_info,
    span_request_bytes,
)

pytestmark = pytest.mark.slow  # each test starts the daemon

PB = "application/x-protobuf"
JS = "application/json"


def _good(daemon: Any, seed: int) -> set[tuple[str, str]]:
    body, ids = span_request_bytes(4, trace_seed=seed)
    status, _, _ = post(daemon.http, "/v1/traces", body)
    assert status == 200
    return set(ids)


def _check_then_good(daemon: Any, stored: set[tuple[str, str]], seed: int) -> None:
    """A valid request after the bad one still succeeds, and earlier data is intact."""
    stored |= _good(daemon, seed)
    assert daemon.counts()["spans"] == len(stored)


BAD_HTTP: dict[str, Callable[[], tuple[bytes, str, str | None, int, str]]] = {
    # name: body, content type, encoding, expected status, words in the message
    "garbage protobuf": lambda: (b"\xff\xfe\x00garbage" * 10, PB, None, 400, "not a valid protobuf"),
    "truncated json": lambda: (b'{"resourceSpans": [{"scopeSpans": [', JS, None, 400, "not valid JSON"),
    "wrongly shaped json": lambda: (json.dumps({"resourceSpans": {"spans": 3}}).encode(), JS, None, 400,
                                    "resourceSpans must be a list"),
    "wrong field type json": lambda: (json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [
        {"traceId": "00" * 16, "spanId": "11" * 8, "name": {"x": 1}}]}]}]}).encode(), JS, None, 400,
        "not a valid OTLP/JSON"),
    "bad hex id json": lambda: (json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [
        {"traceId": "zz" * 16, "spanId": "11" * 8, "name": "x"}]}]}]}).encode(), JS, None, 400, "not a hex id"),
    "corrupt gzip": lambda: (b"\x1f\x8b\x08\x00garbage-not-gzip", PB, "gzip", 400, "cannot gzip-decode"),
    "truncated gzip": lambda: (gzip.compress(span_request_bytes(4)[0])[:-20], PB, "gzip", 400, "gzip"),
    "unknown content type": lambda: (b"hello", "text/plain", None, 415, "unsupported Content-Type"),
    "unknown encoding": lambda: (b"hello", PB, "br", 415, "unsupported Content-Encoding"),
}


@pytest.mark.parametrize("case", sorted(BAD_HTTP))
def test_bad_http_input(daemon: Any, case: str) -> None:
    stored = _good(daemon, 1)
    body, ctype, encoding, want, words = BAD_HTTP[case]()
    status, headers, reply = post(daemon.http, "/v1/traces", body, ctype, encoding)
    assert status == want
    if ctype == JS:
        message = json.loads(reply)["message"]
    else:
        message = status_pb2.Status.FromString(reply).message
    assert words in message
    assert daemon.metric("tracejudge_requests_total") >= 2
    _check_then_good(daemon, stored, 2)


def test_json_error_is_json_and_protobuf_error_is_protobuf(daemon: Any) -> None:
    status, headers, reply = post(daemon.http, "/v1/traces", b"{", JS)
    assert status == 400 and headers["content-type"].startswith(JS)
    assert json.loads(reply)["code"] == 3
    status, headers, reply = post(daemon.http, "/v1/traces", b"\xff\xff", PB)
    assert status == 400 and headers["content-type"].startswith(PB)


def test_wrong_method_and_path(daemon: Any) -> None:
    assert post(daemon.http, "/v1/traces", b"", method="GET")[0] == 405
    assert post(daemon.http, "/v2/spans", b"")[0] == 404
    # Any prefix before /v1/traces is accepted (Langfuse posts to /api/public/otel/v1/traces).
    body, _ = span_request_bytes(2)
    assert post(daemon.http, "/api/public/otel/v1/traces", body)[0] == 200
    assert post(daemon.http, "/v1/traces", b"", "application/json; charset=utf-8")[0] == 200


def test_partial_success_for_bad_span_ids(daemon: Any) -> None:
    req = ExportTraceServiceRequest.FromString(span_request_bytes(3)[0])
    spans = req.resource_spans[0].scope_spans[0].spans
    spans[0].trace_id = bytes(16)  # all-zero: invalid
    spans[1].span_id = b"\x01\x02"  # wrong length
    status, _, reply = post(daemon.http, "/v1/traces", req.SerializeToString())
    assert status == 200
    resp = ExportTraceServiceResponse.FromString(reply)
    assert resp.partial_success.rejected_spans == 2
    assert "invalid trace_id/span_id" in resp.partial_success.error_message
    assert daemon.counts()["spans"] == 1
    assert daemon.metric('tracejudge_spans_rejected_total{reason="invalid"}') == 2


def test_oversized_http_body(make_daemon: Any) -> None:
    daemon = make_daemon(receivers={"otlp": {"max_request_size_mib": 1}})
    stored = _good(daemon, 1)
    big, _ = span_request_bytes(1200, attr_bytes=1200)  # ~1.7 MB
    assert len(big) > 1024 * 1024
    for chunked in (False, True):
        status, _, reply = post(daemon.http, "/v1/traces", big, chunked=chunked)
        assert status == 413
        assert "1 MiB" in status_pb2.Status.FromString(reply).message
    # A gzip bomb: small on the wire, too large once inflated.
    bomb = gzip.compress(b"\x00" * (8 * 1024 * 1024))
    assert post(daemon.http, "/v1/traces", bomb, encoding="gzip")[0] == 413
    deflated = zlib.compress(big)
    assert post(daemon.http, "/v1/traces", deflated, encoding="deflate")[0] == 413
    assert daemon.metric('tracejudge_requests_total{outcome="too_large",signal="traces",transport="http"}') == 4
    _check_then_good(daemon, stored, 2)


def test_oversized_grpc_message(make_daemon: Any) -> None:
    daemon = make_daemon(receivers={"otlp": {"max_request_size_mib": 1}})
    stored = _good(daemon, 1)
    big, _ = span_request_bytes(1200, attr_bytes=1200)
    with pytest.raises(grpc.RpcError) as err:
        grpc_export(daemon.grpc, "traces", big)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    assert retry_info(err.value) is None  # no RetryInfo: the client must not retry
    assert "max_request_size_mib" in err.value.details()  # type: ignore[attr-defined]
    assert daemon.metric('tracejudge_requests_total{outcome="too_large",signal="traces",transport="grpc"}') == 1
    _check_then_good(daemon, stored, 2)


def test_garbage_over_grpc(daemon: Any) -> None:
    stored = _good(daemon, 1)
    for signal in ("traces", "logs", "metrics"):
        with pytest.raises(grpc.RpcError) as err:
            grpc_export(daemon.grpc, signal, b"\xff\xfe\x00garbage" * 10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert "not a valid protobuf" in err.value.details()  # type: ignore[attr-defined]
    _check_then_good(daemon, stored, 2)


def test_missing_or_wrong_token(make_daemon: Any) -> None:
    daemon = make_daemon(receivers={"otlp": {"auth": {"bearer_token": "s3cret"}}})
    body, ids = span_request_bytes(3)
    assert post(daemon.http, "/v1/traces", body)[0] == 401
    assert post(daemon.http, "/v1/traces", body, headers={"Authorization": "Bearer nope"})[0] == 401
    with pytest.raises(grpc.RpcError) as err:
        grpc_export(daemon.grpc, "traces", body)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    assert daemon.counts()["spans"] == 0
    assert post(daemon.http, "/v1/traces", body, headers={"Authorization": "Bearer s3cret"})[0] == 200
    body2, _ = span_request_bytes(2, trace_seed=9)
    grpc_export(daemon.grpc, "traces", body2, metadata=(("authorization", "Bearer s3cret"),))
    assert daemon.counts()["spans"] == 5
    assert daemon.metric("tracejudge_requests_total") >= 5


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=st.binary(max_size=2048), ctype=st.sampled_from([PB, JS]),
       encoding=st.sampled_from([None, "gzip", "deflate"]))
def test_fuzz_http_never_crashes(daemon: Any, junk: bytes, ctype: str, encoding: str | None) -> None:
    """Random bytes to the receiver get a 2xx or 4xx answer, never a 5xx or a dead daemon."""
    status, _, _ = post(daemon.http, "/v1/traces", junk, ctype, encoding)
    assert status < 500
    assert daemon.get("/healthz")[0] == 200


def _error_message(reply: bytes, ctype: str) -> str:
    if ctype == JS:
        shape = json.loads(reply)
        assert shape["code"] == 3
        return str(shape["message"])
    return status_pb2.Status.FromString(reply).message


def _span_json(trace: int, span: int, **fields: Any) -> dict[str, Any]:
    return {"traceId": f"{trace:032x}", "spanId": f"{span:016x}", "name": f"span {span}", **fields}


def test_values_the_store_cannot_hold_are_rejected_per_span(daemon: Any) -> None:
    """kind and status.code are int32 enums on the wire but int8 columns in the store: a span
    outside -128..127 is rejected on its own (partial success) before the shared commit."""
    stored = _good(daemon, 1)
    for n, send in enumerate(("http", "grpc")):
        req = ExportTraceServiceRequest.FromString(span_request_bytes(4, trace_seed=2 + n)[0])
        spans = req.resource_spans[0].scope_spans[0].spans
        spans[0].kind = 200
        spans[1].status.code = -1000
        if send == "http":
            status, _, reply = post(daemon.http, "/v1/traces", req.SerializeToString())
            assert status == 200
            resp = ExportTraceServiceResponse.FromString(reply)
        else:
            resp = grpc_export(daemon.grpc, "traces", req.SerializeToString())
        assert resp.partial_success.rejected_spans == 2
        message = resp.partial_success.error_message
        assert f"span {spans[0].span_id.hex()}" in message and "kind 200" in message
        stored |= {(sp.trace_id.hex(), sp.span_id.hex()) for sp in spans[2:]}
    doc = json_traces([_span_json(7, 1, kind=128), _span_json(7, 2, status={"code": -129}), _span_json(7, 3)])
    status, _, reply = post(daemon.http, "/v1/traces", json.dumps(doc).encode(), JS)
    assert status == 200
    partial = json.loads(reply)["partialSuccess"]
    assert partial["rejectedSpans"] == "2"
    assert f"span {1:016x}" in partial["errorMessage"] and "kind 128" in partial["errorMessage"]
    stored.add((f"{7:032x}", f"{3:016x}"))
    assert daemon.counts()["spans"] == len(stored)
    assert daemon.metric('tracejudge_spans_rejected_total{reason="invalid"}') == 6
    assert 'outcome="unavailable"' not in daemon.get("/metrics")[1]
    _check_then_good(daemon, stored, 9)


def test_every_gzip_member_is_inflated(daemon: Any) -> None:
    """RFC 1952 allows a gzip body of several members; each one is part of the request."""
    first, ids1 = span_request_bytes(3, trace_seed=5)
    second, ids2 = span_request_bytes(3, trace_seed=6)
    # Serialized protobuf messages concatenate into one message holding both span lists.
    status, _, _ = post(daemon.http, "/v1/traces", gzip.compress(first) + gzip.compress(second), encoding="gzip")
    assert status == 200
    assert daemon.counts()["spans"] == 6


def test_decompressed_size_is_bounded_across_gzip_members(make_daemon: Any) -> None:
    daemon = make_daemon(receivers={"otlp": {"max_request_size_mib": 1}})
    member = gzip.compress(b"\x00" * (700 * 1024))
    status, _, reply = post(daemon.http, "/v1/traces", member + member, encoding="gzip")
    assert status == 413
    assert "1 MiB" in status_pb2.Status.FromString(reply).message


TRAILING: dict[str, Callable[[bytes], tuple[bytes, str]]] = {
    "gzip, then garbage": lambda body: (gzip.compress(body) + b"garbage", "gzip"),
    "deflate, then garbage": lambda body: (zlib.compress(body) + b"garbage", "deflate"),
    "deflate, then a second stream": lambda body: (zlib.compress(body) * 2, "deflate"),
}


def test_trailing_data_after_the_compressed_stream_is_refused(daemon: Any) -> None:
    body, _ = span_request_bytes(3, trace_seed=4)
    for case, make in TRAILING.items():
        wire, encoding = make(body)
        status, _, reply = post(daemon.http, "/v1/traces", wire, encoding=encoding)
        assert status == 400, case
        assert "trailing data" in status_pb2.Status.FromString(reply).message, case
    assert daemon.counts()["spans"] == 0


def _signal_docs(value: str) -> dict[str, str]:
    """OTLP/JSON text for each signal with ``value`` (AnyValue JSON text) in an attribute or body."""
    trace, span = "01" * 16, "02" * 8
    return {
        "traces": '{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "%s", "spanId": "%s", "name": "n", '
                  '"attributes": [{"key": "k", "value": %s}]}]}]}]}' % (trace, span, value),
        "logs": '{"resourceLogs": [{"scopeLogs": [{"logRecords": [{"body": %s}]}]}]}' % value,
        "metrics": '{"resourceMetrics": [{"scopeMetrics": [{"metrics": [{"name": "m", "gauge": {"dataPoints": '
                   '[{"asInt": "1", "attributes": [{"key": "k", "value": %s}]}]}}]}]}]}' % value,
    }


DEEP_JSON: dict[str, tuple[str, str]] = {
    # name: AnyValue JSON text, words in the message
    "400 AnyValue levels": (nested_value_json(400), "nested too deeply"),
    "100 AnyValue levels": (nested_value_json(100), "too deep"),
    "2000 brackets": ("[" * 2000 + "]" * 2000, "nested too deeply"),
    "a 5000-digit integer": ('{"intValue": ' + "9" * 5000 + "}", "digits"),
}


@pytest.mark.parametrize("signal", ["traces", "logs", "metrics"])
def test_deep_or_huge_json_is_400_on_every_signal(daemon: Any, signal: str) -> None:
    stored = _good(daemon, 1)
    for case, (value, words) in DEEP_JSON.items():
        status, headers, reply = post(daemon.http, f"/v1/{signal}", _signal_docs(value)[signal].encode(), JS)
        assert (status, case) == (400, case)
        assert headers["content-type"].startswith(JS)
        assert words in _error_message(reply, JS), case
    assert "Traceback" not in daemon.output()
    _check_then_good(daemon, stored, 2)


def test_nesting_each_decoder_accepts_is_stored_and_deeper_is_400(daemon: Any) -> None:
    """Both decoders stop at 100 message levels, well inside what the walk and orjson handle."""
    body, ids = nested_value_request(40, trace_seed=3)
    assert post(daemon.http, "/v1/traces", body)[0] == 200
    grpc_export(daemon.grpc, "traces", nested_value_request(40, trace_seed=4)[0])
    doc = _signal_docs(nested_value_json(40))["traces"]
    assert post(daemon.http, "/v1/traces", doc.encode(), JS)[0] == 200
    trace = daemon.get(f"/api/traces/{ids[0][0]}")[1]
    value = trace["spans"][0]["attributes"]["nested"]
    for _ in range(40):
        (value,) = value
    assert value == "x"
    deep, _ = nested_value_request(200, trace_seed=5)
    status, _, reply = post(daemon.http, "/v1/traces", deep)
    assert status == 400 and "not a valid protobuf" in _error_message(reply, PB)
    with pytest.raises(grpc.RpcError) as err:
        grpc_export(daemon.grpc, "traces", deep)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert daemon.counts()["spans"] == 3
    assert "Traceback" not in daemon.output()


BAD_JSON_TYPES: dict[str, tuple[dict[str, Any], str]] = {
    # name: span fields, words in the message
    "kind 2**40": ({"kind": 2**40}, "kind"),
    "kind as a huge numeric string": ({"kind": str(2**40)}, "kind"),
    "kind true": ({"kind": True}, "kind"),
    "kind 1.5": ({"kind": 1.5}, "kind"),
    "status.code 2**32 + 1": ({"status": {"code": 2**32 + 1}}, "code"),
    "attribute value a bare string": ({"attributes": [{"key": "k", "value": "str"}]}, "value"),
    "attribute a bare string": ({"attributes": ["str"]}, "attributes"),
    "status a list": ({"status": ["code"]}, "status"),
    "doubleValue true": ({"attributes": [{"key": "k", "value": {"doubleValue": True}}]}, "doubleValue"),
}


def test_json_of_the_wrong_type_is_400_never_stored_altered(daemon: Any) -> None:
    stored = _good(daemon, 1)
    for n, (case, (fields, words)) in enumerate(BAD_JSON_TYPES.items()):
        doc = json_traces([_span_json(20 + n, 1, **fields)])
        status, _, reply = post(daemon.http, "/v1/traces", json.dumps(doc).encode(), JS)
        assert (status, case) == (400, case)
        message = _error_message(reply, JS)
        assert words in message and "must be" in message, (case, message)
    assert daemon.counts()["spans"] == len(stored)
    _check_then_good(daemon, stored, 2)


def test_lone_surrogates_in_json_strings_become_replacement_characters(daemon: Any) -> None:
    """A JS exporter that cut a string inside a surrogate pair sends a lone surrogate; it is
    stored as U+FFFD, as a UTF-8 encoder (and the protobuf exporter of the same SDK) would."""
    doc = json_traces([_span_json(30, 1, attributes=[{"key": "k", "value": {"stringValue": "cut \ud83d"}}]),
                       _span_json(30, 2, attributes=[{"key": "k", "value": {"stringValue": "kept \U0001f600"}}])])
    status, _, _ = post(daemon.http, "/v1/traces", json.dumps(doc).encode(), JS)  # json.dumps escapes: \ud83d
    assert status == 200
    spans = daemon.get(f"/api/traces/{30:032x}")[1]["spans"]
    assert sorted(sp["attributes"]["k"] for sp in spans) == ["cut \ufffd", "kept \U0001f600"]
