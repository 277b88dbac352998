"""Daemon lifecycle, the runtime file, the JSON API and its error shape, TLS."""

from __future__ import annotations

import json
import ssl
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from .conftest import run_cli
from .wire import post, span_request_bytes


def test_sigterm_commits_in_flight_and_exits_0(make_daemon: Any) -> None:
    daemon = make_daemon()
    assert daemon.runtime_file.exists()
    info = json.loads(daemon.runtime_file.read_text())
    assert info["pid"] == daemon.proc.pid and info["grpc"] and info["http"] and info["api"].startswith("http://")
    acked: list[tuple[str, str]] = []

    def send(seed: int) -> None:
        body, ids = span_request_bytes(256, trace_seed=seed)
        if post(daemon.http, "/v1/traces", body)[0] == 200:
            acked.extend(ids)

    threads = [threading.Thread(target=send, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert daemon.stop() == 0
    assert not daemon.runtime_file.exists()
    assert "stopped cleanly" in daemon.output()
    assert len(daemon.query("SELECT * FROM spans")) == len(acked) == 6 * 256


def test_banner_says_where_to_look(daemon: Any) -> None:
    out = daemon.output()
    for word in ("OTLP/gRPC", "OTLP/HTTP", "API", "DuckDB", daemon.info["grpc"]):
        assert word in out


def test_second_daemon_on_same_file_is_refused(make_daemon: Any, tmp_path: Path) -> None:
    daemon = make_daemon()
    res = run_cli("serve", "--config", str(daemon.config_path))
    assert res.returncode == 2
    assert f"pid {daemon.proc.pid}" in res.stderr and "already serves" in res.stderr
    assert "Traceback" not in res.stderr


def test_file_locked_by_a_process_that_does_not_answer(make_daemon: Any) -> None:
    import subprocess
    import sys

    daemon = make_daemon(start=False)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import duckdb,sys,time; c=duckdb.connect(sys.argv[1]); print('ok', flush=True); time.sleep(60)"),
        str(daemon.duckdb)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ok"
        res = run_cli("serve", "--config", str(daemon.config_path))
        assert res.returncode == 2
        assert f"locked by process {holder.pid}" in res.stderr
    finally:
        holder.kill()
        holder.wait()
        assert holder.stdout is not None
        holder.stdout.close()


def test_api_endpoints_and_error_shape(daemon: Any) -> None:
    assert daemon.get("/healthz")[1] == {"status": "ok"}
    assert daemon.get("/readyz")[1]["status"] == "ready"
    body, ids = span_request_bytes(8)
    post(daemon.http, "/v1/traces", body)
    assert daemon.get("/api/spans/count")[1] == {"spans": 8, "traces": 2, "log_records": 0}
    trace = daemon.get(f"/api/traces/{ids[0][0].upper()}")[1]
    assert [s["span_id"] for s in trace["spans"]] == [s for t, s in ids if t == ids[0][0]]
    assert trace["spans"][0]["start_time"].startswith("2025-11-30T05:00:00")
    for path, status, code in [("/api/traces/" + "ab" * 16, 404, "not_found"),
                               ("/api/traces/xyz", 400, "bad_trace_id"),
                               ("/api/nothing-here", 404, "not_found")]:
        got, err = daemon.get(path, check=False)
        assert got == status
        assert set(err) == {"error"} and err["error"]["code"] == code and err["error"]["message"]
    metrics = daemon.get("/metrics")[1]
    for name in ("tracejudge_spans_received_total", "tracejudge_spans_stored_total",
                 "tracejudge_spans_rejected_total{reason=", "tracejudge_ingest_queue_depth",
                 "tracejudge_commit_seconds_bucket", "tracejudge_commit_seconds_count"):
        assert name in metrics


def test_api_bearer_token(make_daemon: Any) -> None:
    daemon = make_daemon(api={"auth": {"bearer_token": "api-secret"}})
    assert daemon.get("/healthz")[0] == 200  # probes stay open
    status, err = daemon.get("/api/spans/count", check=False)
    assert status == 401 and err["error"]["code"] == "unauthorized"
    assert daemon.get("/metrics", check=False)[0] == 401
    assert daemon.get("/api/spans/count", token="api-secret")[0] == 200


def test_tls_on_every_listener(make_daemon: Any, tmp_path: Path) -> None:
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    tls = {"cert_file": str(tmp_path / "cert.pem"), "key_file": str(tmp_path / "key.pem")}
    daemon = make_daemon(
        receivers={"otlp": {"protocols": {"grpc": {"endpoint": "127.0.0.1:0", "tls": tls},
                                          "http": {"endpoint": "127.0.0.1:0", "tls": tls}}}},
        api={"tls": tls}, start=False)
    daemon.info = {}
    # The helper polls /readyz over plain HTTP; read readiness through TLS here instead.
    import subprocess
    import sys
    import time

    daemon.runtime_file.unlink(missing_ok=True)
    daemon.log = open(daemon.data_dir / "daemon.log", "a", encoding="utf-8")
    daemon.proc = subprocess.Popen([sys.executable, "-m", "collector", "serve", "--config", str(daemon.config_path)],
                                   stdout=daemon.log, stderr=subprocess.STDOUT, env=daemon.env)
    for _ in range(300):
        if daemon.runtime_file.exists():
            break
        time.sleep(0.05)
    info = json.loads(daemon.runtime_file.read_text())
    assert info["api"].startswith("https://")
    ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
    with urllib.request.urlopen(info["api"] + "/healthz", context=ctx, timeout=10) as resp:
        assert resp.status == 200

    import grpc
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    creds = grpc.ssl_channel_credentials(root_certificates=(tmp_path / "ca.pem").read_bytes())
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=info["grpc"], credentials=creds)))
    provider.add_span_processor(SimpleSpanProcessor(HttpExporter(
        endpoint=f"https://{info['http']}/v1/traces", certificate_file=str(tmp_path / "ca.pem"))))
    with provider.get_tracer("t").start_as_current_span("chat over tls"):
        pass
    provider.shutdown()
    req = urllib.request.Request(info["api"] + "/api/spans/count")
    with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
        # one span sent by two exporters: stored once
        assert json.loads(resp.read()) == {"spans": 1, "traces": 1, "log_records": 0}
    assert daemon.stop() == 0


def test_second_signal_during_shutdown_does_not_cut_it_short(make_daemon: Any) -> None:
    """Ctrl-C reaches every process of the group, then `demo` forwards SIGTERM: both arrive."""
    import signal
    import time

    daemon = make_daemon()
    body, _ = span_request_bytes(64)
    post(daemon.http, "/v1/traces", body)
    daemon.proc.send_signal(signal.SIGINT)
    time.sleep(0.05)  # the second one lands while the first one's shutdown runs
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(timeout=60) == 0
    assert "stopped cleanly" in daemon.output()
    assert not daemon.runtime_file.exists()
