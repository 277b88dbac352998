"""Daemon lifecycle, the runtime file, the JSON API and its error shape, TLS, signals, damaged files."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import random
import shutil
import signal
import socket
import sqlite3
import ssl
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from collector.config import is_loopback, load_config
from collector.daemon import Daemon
from collector.errors import StoreUnavailable
from collector.system.shutdown import StopSignals

from ..support.daemon import REPO, DaemonProcess, base_config, clean_env, run_cli, wait_conversations, wait_until
from ..support.wire import grpc_export, post, span_request_bytes

pytestmark = pytest.mark.slow  # whole-daemon tests: starts, signals, TLS, damaged files


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


def test_ipv6_listeners_are_written_as_addresses_clients_can_use(make_daemon: Any) -> None:
    d = make_daemon(receivers={"otlp": {"protocols": {"grpc": {"endpoint": "[::1]:0"},
                                                      "http": {"endpoint": "[::1]:0"}}}},
                    api={"endpoint": "[::1]:0"})
    assert d.api.startswith("http://[::1]:") and d.info["http"].startswith("[::1]:")
    assert d.get("/api/status")[0] == 200  # the runtime file's URL is one a client reaches
    body, _ = span_request_bytes(3, trace_seed=21)
    grpc_export(d.grpc, "traces", body)
    assert post(d.http, "/v1/traces", body)[0] == 200


def test_receivers_beyond_loopback_without_a_token_are_warned_about(make_daemon: Any) -> None:
    d = make_daemon(receivers={"otlp": {"protocols": {"http": {"endpoint": "0.0.0.0:0"}}}})
    d.wait_output("OTLP receivers listen beyond loopback (0.0.0.0:0) without receivers.otlp.auth.bearer_token")


def test_second_daemon_on_same_file_is_refused(make_daemon: Any, tmp_path: Path) -> None:
    daemon = make_daemon()
    res = run_cli("serve", "--config", str(daemon.config_path))
    assert res.returncode == 2
    assert f"pid {daemon.proc.pid}" in res.stderr and "already serves" in res.stderr
    assert "Traceback" not in res.stderr


def test_file_locked_by_a_process_that_does_not_answer(make_daemon: Any) -> None:
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
    assert daemon.get("/api/spans/count")[1] == {"spans": 8, "log_records": 0}  # the same time at any size
    assert daemon.get("/api/spans/count?traces=true")[1] == {"spans": 8, "traces": 2, "log_records": 0}
    status, err = daemon.get("/api/spans/count?traces=yes", check=False)
    assert status == 400 and err["error"]["code"] == "bad_parameter" and "traces" in err["error"]["message"]
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
    daemon.runtime_file.unlink(missing_ok=True)
    daemon.log = open(daemon.data_dir / "daemon.log", "a", encoding="utf-8")
    daemon.proc = subprocess.Popen([sys.executable, "-m", "collector", "serve", "--config", str(daemon.config_path)],
                                   stdout=daemon.log, stderr=subprocess.STDOUT, env=daemon.env)
    wait_until(daemon.runtime_file.exists, "the runtime file", timeout=30, interval=0.05)
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
    req = urllib.request.Request(info["api"] + "/api/spans/count?traces=1")
    with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
        # one span sent by two exporters: stored once
        assert json.loads(resp.read()) == {"spans": 1, "traces": 1, "log_records": 0}
    assert daemon.stop() == 0


# ------------------------------------------------------------------ signals


def _spawn(daemon: DaemonProcess) -> subprocess.Popen[str]:
    """``tracejudge serve`` without waiting for it to be ready (DaemonProcess.start waits)."""
    daemon.log = open(daemon.data_dir / "daemon.log", "a", encoding="utf-8")
    daemon.proc = subprocess.Popen([sys.executable, "-m", "collector", "serve", "--config", str(daemon.config_path)],
                                   stdout=daemon.log, stderr=subprocess.STDOUT, env=daemon.env, cwd=REPO, text=True)
    return daemon.proc


def test_second_signal_during_shutdown_does_not_cut_it_short(make_daemon: Any) -> None:
    """Ctrl-C reaches every process of the group, then `demo` forwards SIGTERM: both arrive."""
    daemon = make_daemon()
    body, _ = span_request_bytes(64)
    post(daemon.http, "/v1/traces", body)
    daemon.proc.send_signal(signal.SIGINT)
    daemon.wait_output("stopping (SIGINT)")  # the second one lands while the first one's shutdown runs
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(timeout=60) == 0
    assert "stopped cleanly" in daemon.output()
    assert not daemon.runtime_file.exists()


def test_a_signal_after_the_shutdown_has_finished_changes_nothing(make_daemon: Any) -> None:
    """The loop has closed and the interpreter is exiting: the exit status stays 0."""
    daemon = make_daemon()
    daemon.proc.send_signal(signal.SIGTERM)
    daemon.wait_output("stopped cleanly")
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(timeout=60) == 0


def test_signal_during_start_up_stops_it_cleanly(make_daemon: Any) -> None:
    """Start-up waits on a stale runtime file whose process does not answer: a SIGTERM then stops it."""
    daemon = make_daemon(start=False)
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        stale = {"pid": os.getpid(), "version": "0", "duckdb": str(daemon.duckdb), "grpc": None, "http": None,
                 "api": f"http://127.0.0.1:{silent.getsockname()[1]}", "started_at": "2025-01-01T00:00:00+00:00"}
        daemon.runtime_file.write_text(json.dumps(stale), encoding="utf-8")
        proc = _spawn(daemon)
        silent.settimeout(60)
        conn, _ = silent.accept()  # the daemon asks whether that process is a daemon: it is starting up
        proc.send_signal(signal.SIGTERM)
        conn.close()
    assert proc.wait(timeout=60) == 0
    out = daemon.output()
    assert "stopped during start-up (SIGTERM)" in out and "is running" not in out
    assert json.loads(daemon.runtime_file.read_text()) == stale  # not ours: left alone
    daemon.runtime_file.unlink()
    daemon.start()  # nothing was left half-open
    assert daemon.stop() == 0


def test_signal_at_any_point_of_start_up_exits_0_and_leaves_nothing_behind(make_daemon: Any) -> None:
    daemon = make_daemon(start=False, env=clean_env(TRACEJUDGE_LOG_LEVEL="debug"))
    proc = _spawn(daemon)
    daemon.wait_output("starting (pid")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    out = daemon.output()
    assert "stopped during start-up (SIGTERM)" in out or "stopped cleanly" in out
    assert not daemon.runtime_file.exists()
    daemon.start()
    assert daemon.stop() == 0


# ------------------------------------------------------------------ a writer that stops for good


class Crash(BaseException):
    """Not one bad batch: something that ends the writer thread."""


def test_a_broken_writer_fails_readiness_and_the_daemon_exits_1(tmp_path: Path) -> None:
    """In process: the store's writer stops for good (here a commit listener that raises BaseException)."""
    config_path = tmp_path / "otel-config.yaml"
    config_path.write_text(json.dumps(base_config(tmp_path)), encoding="utf-8")
    cfg, _ = load_config(config_path)
    daemon = Daemon(cfg, out=io.StringIO())
    result: list[Any] = []
    runner = threading.Thread(target=lambda: result.append(asyncio.run(daemon.run(StopSignals()))))
    runner.start()
    try:
        def written() -> bool:
            assert runner.is_alive(), "the daemon ended before writing its runtime file"
            return cfg.runtime_file.exists()

        wait_until(written, "the runtime file", interval=0.02)
        info = json.loads(cfg.runtime_file.read_text())
        assert daemon.parts is not None and daemon.parts.store is not None
        store = daemon.parts.store
        broken, probed = threading.Event(), threading.Event()

        def crash(committed: Any) -> None:
            raise Crash("a bug beyond one batch")

        def hold(reason: str) -> None:  # keeps the shutdown from closing the API while the test looks
            broken.set()
            probed.wait(60)

        store.on_commit(crash)
        store.on_broken(hold)
        assert post(f"http://{info['http']}", "/v1/traces", span_request_bytes(4)[0])[0] == 200  # committed
        assert broken.wait(30)
        with pytest.raises(StoreUnavailable):
            store.submit(store_batch())
        for path, code in (("/readyz", "store_unavailable"), ("/healthz", "store_broken")):
            try:
                urllib.request.urlopen(info["api"] + path, timeout=10)
                raise AssertionError(f"{path} answered 200")
            except urllib.error.HTTPError as exc:
                assert exc.code == 503 and json.loads(exc.read())["error"]["code"] == code
        probed.set()
        runner.join(timeout=60)
    finally:
        probed.set()
        runner.join(timeout=60)
    (stopped,) = result
    assert stopped.status == 1 and "writer stopped (Crash: a bug beyond one batch)" in stopped.message
    assert not cfg.runtime_file.exists()


def store_batch() -> Any:
    from collector.ingest.decode import parse_traces, span_batch

    return span_batch(parse_traces(span_request_bytes(4, trace_seed=5)[0], False))[0]


def test_loopback_is_an_address_or_localhost() -> None:
    for host in ("127.0.0.1", "127.8.9.1", "localhost", "::1", "[::1]", "::ffff:127.0.0.1"):
        assert is_loopback(host), host
    for host in ("127.evil.example", "localhost.evil.example", "0.0.0.0", "::", "10.0.0.1", "example.com", ""):
        assert not is_loopback(host), host


# ------------------------------------------------------------------ damaged DuckDB files


@pytest.fixture(scope="module")
def made_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A real daemon's file closed cleanly, the same daemon's file and WAL after kill -9, another file's WAL."""
    d = tmp_path_factory.mktemp("made")
    daemon = DaemonProcess(d, base_config(d)).start()
    try:
        for seed in range(1, 9):
            assert post(daemon.http, "/v1/traces", span_request_bytes(500, trace_seed=seed, attr_bytes=300)[0])[0] == 200
        wait_conversations(daemon)
        assert daemon.stop() == 0
        shutil.copy(daemon.duckdb, d / "clean.duckdb")
        daemon.start()
        assert post(daemon.http, "/v1/traces", span_request_bytes(500, trace_seed=20, attr_bytes=300)[0])[0] == 200
        daemon.kill9()
    finally:
        daemon.log.close()
    shutil.copy(daemon.duckdb, d / "killed.duckdb")
    shutil.copy(f"{daemon.duckdb}.wal", d / "killed.duckdb.wal")
    other = d / "other.duckdb"
    subprocess.run([sys.executable, "-c", "import duckdb, os, sys; c = duckdb.connect(sys.argv[1]); "
                    "c.execute('CREATE TABLE t AS SELECT range AS x FROM range(1000)'); os._exit(0)", str(other)],
                   check=True)
    return {"clean": d / "clean.duckdb", "killed": d / "killed.duckdb", "other_wal": Path(f"{other}.wal")}


def _damage(data: bytes, start: int, length: int) -> bytes:
    out = bytearray(data)
    out[start:start + length] = random.Random(start).randbytes(length)
    return bytes(out)


def _write(made: dict[str, Path], db: Path, kind: str) -> None:
    clean = made["clean"].read_bytes()
    wal = Path(f"{db}.wal")
    if kind == "empty":
        db.write_bytes(b"")
    elif kind == "truncated":
        db.write_bytes(clean[: len(clean) * 2 // 5])
    elif kind == "random bytes":
        db.write_bytes(random.Random(1).randbytes(1 << 20))
    elif kind == "damaged header":
        db.write_bytes(_damage(clean, 4096, 8192))  # both database headers, behind the magic bytes
    elif kind == "damaged blocks":
        db.write_bytes(_damage(clean, 12288, 262144))  # the first block: the catalog
    elif kind == "corrupted WAL":
        db.write_bytes(made["killed"].read_bytes())
        wal.write_bytes(_damage(Path(f"{made['killed']}.wal").read_bytes(), 100, 4000))
    elif kind == "WAL of another file":
        db.write_bytes(clean)
        wal.write_bytes(made["other_wal"].read_bytes())
    elif kind == "directory":
        db.mkdir()
    elif kind == "SQLite file":
        with sqlite3.connect(db) as con:
            con.execute("CREATE TABLE spans (x)")
    else:
        raise AssertionError(kind)


def _digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


@pytest.mark.parametrize("kind, says", [
    ("empty", "the file is empty"),
    ("truncated", "the file is truncated"),
    ("random bytes", "it is not a DuckDB database file"),
    ("damaged header", "the file is damaged"),
    ("damaged blocks", "the file is damaged"),
    ("corrupted WAL", "tracejudge.duckdb.wal is damaged"),
    ("WAL of another file", "tracejudge.duckdb.wal belongs to another database file"),
    ("directory", "it is a directory"),
    ("SQLite file", "it is not a DuckDB database file"),
])
def test_damaged_file_stops_the_start_with_one_line(make_daemon: Any, made_files: dict[str, Path],
                                                     kind: str, says: str) -> None:
    daemon = make_daemon(start=False)
    _write(made_files, daemon.duckdb, kind)
    wal = Path(f"{daemon.duckdb}.wal")
    before = (_digest(daemon.duckdb), _digest(wal))
    res = run_cli("serve", "--config", str(daemon.config_path), timeout=60)
    assert res.returncode == 2, res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith(f"tracejudge: error: cannot open {daemon.duckdb}: ") and says in line, line
    assert "restore it from a backup" in line
    assert (_digest(daemon.duckdb), _digest(wal)) == before  # left as it was, for whoever repairs it
    assert not daemon.runtime_file.exists()


def test_sigusr1_writes_every_threads_stack_to_the_log_and_the_daemon_goes_on(daemon: DaemonProcess) -> None:
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGUSR1)
    # One thread after another: the loop, the writer, the stages (the log may be read mid-way).
    wait_until(lambda: daemon.output().count("Thread 0x") >= 4, "the stack of every thread in the log")
    assert daemon.get("/healthz")[0] == 200
    assert daemon.stop() == 0
