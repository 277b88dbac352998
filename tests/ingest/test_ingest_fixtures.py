"""Every recorded request of every captured case, over its recorded transport, is stored whole."""

from __future__ import annotations

import json

import pytest

from collector.ingest import decode as otlp

from ..support.wire import fixture_cases, fixture_requests, replay, wire_body

CASES = fixture_cases()


def test_there_are_fixtures() -> None:
    assert len(CASES) >= 10


def _expected_ids(case: str) -> tuple[set[tuple[str, str]], int]:
    spans: set[tuple[str, str]] = set()
    logs = 0
    for req in fixture_requests(case):
        json_body = req["content_type"] == "application/json"
        if req["signal"] == "traces":
            batch, rejected, _ = otlp.span_batch(otlp.parse_traces(wire_body(req), json_body))
            assert rejected == 0
            assert len(batch) == req["spans"]
            spans |= {(r["trace_id"], r["span_id"]) for r in batch.rows()}
        else:
            batch2, _, _ = otlp.log_batch(otlp.parse_logs(wire_body(req), json_body))
            assert len(batch2) == req["log_records"]
            logs += len(batch2)
    return spans, logs


@pytest.mark.slow
def test_all_cases_over_the_wire(daemon) -> None:  # type: ignore[no-untyped-def]
    expected_spans: set[tuple[str, str]] = set()
    expected_logs = 0
    for case in CASES:
        ids, logs = _expected_ids(case)
        expected_spans |= ids
        expected_logs += logs
        for req in fixture_requests(case):
            resp = replay(req, daemon.grpc, daemon.http)
            if req["transport"] == "grpc":
                assert not resp.HasField("partial_success"), case
            elif req["content_type"] == "application/json":
                assert json.loads(resp) == {}, case
    counts = daemon.counts()
    assert counts["spans"] == len(expected_spans)
    assert counts["log_records"] == expected_logs
    assert daemon.metric("tracejudge_spans_stored_total") == len(expected_spans)
    assert daemon.metric("tracejudge_log_records_stored_total") == expected_logs

    # The same requests again (an OTLP retry) store nothing twice.
    for case in CASES[:3]:
        for req in fixture_requests(case):
            replay(req, daemon.grpc, daemon.http)
    assert daemon.counts() == counts

    assert daemon.stop() == 0
    stored = set(daemon.query("SELECT trace_id, span_id FROM spans"))
    assert stored == expected_spans
    # Kept whole: the JS exporter's hex ids decoded right, attributes and resource as JSON.
    row = daemon.query(
        "SELECT attributes->>'gen_ai.conversation.id', resource->>'service.name', scope_name "
        "FROM spans WHERE name = 'invoke_agent ShopBot' AND service = 'shopbot-support-node' LIMIT 1")
    assert row and row[0][0] and row[0][1] == "shopbot-support-node"
    logs = daemon.query("SELECT count(*) FROM logs WHERE event_name IS NOT NULL AND trace_id IS NOT NULL")
    assert logs[0][0] == expected_logs


@pytest.mark.parametrize("case", [c for c in CASES if "json" in c])
def test_json_ids_are_hex_not_base64(case: str) -> None:
    """json_format would silently base64-decode hex ids into 24 wrong bytes."""
    for req in fixture_requests(case):
        doc = json.loads(req["body"])
        first = doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
        batch, _, _ = otlp.span_batch(otlp.parse_traces(req["body"], json_body=True))
        assert batch.rows()[0]["trace_id"] == first["traceId"].lower()
        assert batch.rows()[0]["span_id"] == first["spanId"].lower()
