"""The real OpenTelemetry exporters, as bots use them, against the real daemon."""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any

import pytest
from opentelemetry._logs import LogRecord as ApiLogRecord
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import set_span_in_context

from ..support.daemon import REPO

pytestmark = pytest.mark.slow  # each test starts the daemon and a real exporter

JS_DIR = REPO / "tests" / "js"


def _send_spans(exporter: Any, turns: int = 4) -> set[tuple[str, str]]:
    provider = TracerProvider(resource=Resource.create({"service.name": "exporter-test"}))
    provider.add_span_processor(BatchSpanProcessor(exporter, max_export_batch_size=3))
    tracer = provider.get_tracer("tests")
    ids = set()
    for i in range(turns):
        with tracer.start_as_current_span("invoke_agent ShopBot", attributes={
                "gen_ai.operation.name": "invoke_agent", "gen_ai.conversation.id": "conv-1"}) as root:
            with tracer.start_as_current_span("chat gpt-4o-mini", attributes={
                    "gen_ai.input.messages": json.dumps(
                        [{"role": "user", "parts": [{"type": "text", "content": f"مرحبا {i} 📦"}]}],
                        ensure_ascii=False),
                    "gen_ai.usage.input_tokens": 10 + i}) as chat:
                ids.add((format(chat.get_span_context().trace_id, "032x"), format(chat.get_span_context().span_id, "016x")))
            ids.add((format(root.get_span_context().trace_id, "032x"), format(root.get_span_context().span_id, "016x")))
    assert provider.force_flush(30_000)
    provider.shutdown()
    return ids


def _assert_stored(daemon: Any, ids: set[tuple[str, str]]) -> None:
    assert daemon.counts()["spans"] == len(ids)
    trace_id = next(iter(ids))[0]
    body = daemon.get(f"/api/traces/{trace_id}")[1]
    assert {s["span_id"] for s in body["spans"]} == {s for t, s in ids if t == trace_id}
    chat = next(s for s in body["spans"] if s["name"].startswith("chat"))
    assert "مرحبا" in chat["attributes"]["gen_ai.input.messages"]
    assert chat["resource"]["service.name"] == "exporter-test"


def test_sdk_grpc_exporter(daemon: Any) -> None:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    ids = _send_spans(OTLPSpanExporter(endpoint=daemon.grpc, insecure=True))
    _assert_stored(daemon, ids)


@pytest.mark.parametrize("compression", ["none", "gzip", "deflate"])
def test_sdk_http_protobuf_exporter(daemon: Any, compression: str) -> None:
    from opentelemetry.exporter.otlp.proto.http import Compression
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    comp = {"none": Compression.NoCompression, "gzip": Compression.Gzip, "deflate": Compression.Deflate}
    ids = _send_spans(OTLPSpanExporter(endpoint=f"{daemon.http}/v1/traces", compression=comp[compression]))
    _assert_stored(daemon, ids)


@pytest.mark.skipif(shutil.which("node") is None or not (JS_DIR / "node_modules").exists(),
                    reason="node and `npm ci` in tests/js are needed (.ci/run installs them)")
def test_js_http_json_exporter(daemon: Any) -> None:
    """OTLP/JSON from the JavaScript exporter (hex ids, chunked body), as Node bots send it."""
    out = subprocess.run(["node", str(JS_DIR / "send_spans.mjs"), f"{daemon.http}/v1/traces", "3"],
                         capture_output=True, text=True, timeout=120, check=True)
    sent = json.loads(out.stdout)
    counts = daemon.counts()
    assert counts["spans"] == 6 and counts["traces"] == 3
    body = daemon.get(f"/api/traces/{sent['trace_ids'][0]}")[1]
    assert {s["span_id"] for s in body["spans"]} <= set(sent["span_ids"])
    assert any("dov'è il mio ordine? 📦" in (s["attributes"].get("gen_ai.input.messages") or "") for s in body["spans"])


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_sdk_log_exporter_links_records_to_spans(daemon: Any, transport: str) -> None:
    """Content that arrives only as log records (GenAI events) is stored whole with its span link."""
    if transport == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter
        exporter = OTLPLogExporter(endpoint=daemon.grpc, insecure=True)
    else:
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter as HttpLogExporter
        exporter = HttpLogExporter(endpoint=f"{daemon.http}/v1/logs")
    provider = LoggerProvider(resource=Resource.create({"service.name": "exporter-test"}))
    provider.add_log_record_processor(SimpleLogRecordProcessor(exporter))
    logger = provider.get_logger("opentelemetry.instrumentation.openai_v2")
    tracer_provider = TracerProvider()
    tracer = tracer_provider.get_tracer("tests")
    with tracer.start_as_current_span("chat gpt-4o-mini") as span:
        ctx = set_span_in_context(span)
        logger.emit(ApiLogRecord(event_name="gen_ai.user.message", body={"content": "Ciao, dov'è il mio ordine?"},
                                 attributes={"gen_ai.system": "openai"}, context=ctx))
        logger.emit(ApiLogRecord(event_name="gen_ai.choice", body={
            "index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "È in viaggio."}},
            context=ctx))
    provider.shutdown()
    tracer_provider.shutdown()
    trace_id = format(span.get_span_context().trace_id, "032x")
    body = daemon.get(f"/api/traces/{trace_id}")[1]
    by_name = {r["event_name"]: r for r in body["logs"]}
    assert sorted(by_name) == ["gen_ai.choice", "gen_ai.user.message"]
    assert by_name["gen_ai.user.message"]["body"] == {"content": "Ciao, dov'è il mio ordine?"}
    assert by_name["gen_ai.choice"]["body"]["message"]["content"] == "È in viaggio."
    assert {r["span_id"] for r in body["logs"]} == {format(span.get_span_context().span_id, "016x")}


def test_metrics_are_accepted_counted_and_discarded(daemon: Any) -> None:
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=f"{daemon.http}/v1/metrics"),
                                           export_interval_millis=3_600_000)
    provider = MeterProvider(metric_readers=[reader])
    counter = provider.get_meter("tests").create_counter("gen_ai.client.operation.count")
    counter.add(3, {"model": "a"})
    counter.add(1, {"model": "b"})
    provider.shutdown()
    assert daemon.metric("tracejudge_metric_points_received_total") == 2
    assert daemon.counts()["spans"] == 0

