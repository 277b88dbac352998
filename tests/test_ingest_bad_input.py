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

from .wire import grpc_export, post, retry_info, span_request_bytes

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
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

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
