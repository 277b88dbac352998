"""Delivery that is bounded and loses nothing: a send bounded in time, redirects, credentials in the URL, a
request that cannot be redacted in time, and a client that gives up during its commit. The real daemon,
real OTLP in, backends on loopback."""

from __future__ import annotations

import base64
import os
import re
import signal
import socket
import threading
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from ..support.daemon import DaemonProcess, base_config, pool_workers, run_cli, wait_until
from ..support.wire import add_attributes
from .test_forward import forwarded, send, sink, traces
from .test_send import backend, read_request

pytestmark = pytest.mark.slow  # each test forwards through the daemon to a misbehaving backend


def spans_in(bodies: list[bytes]) -> int:
    return sum(len(ss.spans) for b in bodies for rs in ExportTraceServiceRequest.FromString(b).resource_spans
               for ss in rs.scope_spans)


def test_a_backend_that_drips_its_answer_is_cut_at_the_timeout_and_the_request_sent_again(tmp_path: Path) -> None:
    connections: list[int] = []
    stop = threading.Event()

    def drip_first_then_answer(conn: socket.socket, received: list[bytes]) -> None:
        connections.append(1)
        received.append(read_request(conn))
        if len(connections) == 1:  # one byte of the answer at a time, each well within any read timeout
            for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n" * 1000:
                if stop.wait(0.2):
                    return
                try:
                    conn.sendall(bytes([byte]))
                except OSError:
                    return  # cut by the exporter
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    with backend(drip_first_then_answer) as (port, received):
        cfg = base_config(tmp_path, exporters={"drip": {"type": "otlphttp", "timeout": "1s",
                                                        "endpoint": f"http://127.0.0.1:{port}/v1/traces"}})
        daemon = DaemonProcess(tmp_path, cfg).start()
        try:
            first, second = traces(1), traces(2)
            assert send(daemon, first) == 200
            wait_until(lambda: forwarded(daemon, "drip")["retried"] >= 1, "the dripped exchange cut and retried")
            assert "no whole answer within the timeout of 1s" in forwarded(daemon, "drip")["last_error"]
            assert send(daemon, second) == 200
            wait_until(lambda: forwarded(daemon, "drip")["queued_requests"] == 0, "the queue emptied")
            assert received[0] == first and b"".join(received[1:]) in (first + second, first + first + second)
            assert daemon.metric('tracejudge_forward_retried_total{exporter="drip",reason="timeout"}') >= 1
            assert daemon.stop() == 0
        finally:
            stop.set()
            daemon.end()


def test_a_redirect_within_the_origin_is_followed_with_the_same_post(tmp_path: Path) -> None:
    with sink() as s:
        s.answer = lambda r: (307, {"Location": "/moved/v1/traces"}) if r.path == "/v1/traces" else \
            (308, {"Location": f"{s.base}/final/v1/traces"}) if r.path == "/moved/v1/traces" else (200, {})
        cfg = base_config(tmp_path, exporters={"raw": {"type": "otlphttp", "endpoint": f"{s.base}/v1/traces"}})
        daemon = DaemonProcess(tmp_path, cfg).start()
        try:
            sent = [traces(seed) for seed in range(1, 21)]
            for body in sent:
                assert send(daemon, body) == 200
            wait_until(lambda: forwarded(daemon, "raw")["queued_requests"] == 0, "the queue emptied")
            assert b"".join(s.delivered("/final/v1/traces")) == b"".join(sent), "all 20, once, in order"
            assert forwarded(daemon, "raw")["dropped"] == 0
            assert daemon.stop() == 0
        finally:
            daemon.end()


def test_a_redirect_to_another_origin_stops_the_exporter_and_keeps_its_queue(tmp_path: Path) -> None:
    with sink() as s, sink() as elsewhere:
        # As an http -> https move would: the same host, another scheme (here another port).
        s.answer = lambda r: (308, {"Location": f"{elsewhere.base}/v1/traces"})
        cfg = base_config(tmp_path, exporters={"raw": {"type": "otlphttp", "endpoint": f"{s.base}/v1/traces"}})
        daemon = DaemonProcess(tmp_path, cfg).start()
        sent = [traces(seed) for seed in range(1, 21)]
        try:
            for body in sent:
                assert send(daemon, body) == 200
            wait_until(lambda: forwarded(daemon, "raw")["state"] == "stopped", "the exporter stopped")
            st = forwarded(daemon, "raw")
            assert st["dropped"] == 0 and "redirecting to another origin" in st["last_error"]
            assert elsewhere.base in st["last_error"] and not elsewhere.received
            assert "exporter raw stopped" in daemon.output()
            assert daemon.stop() == 0
        finally:
            daemon.end()
        # The operator follows the advice: the new endpoint, a restart, and everything arrives.
        cfg["exporters"]["raw"]["endpoint"] = f"{elsewhere.base}/v1/traces"
        daemon = DaemonProcess(tmp_path, cfg).start()
        try:
            wait_until(lambda: forwarded(daemon, "raw")["queued_requests"] == 0, "the queue emptied")
            assert spans_in(elsewhere.delivered()) == spans_in(sent)
            assert daemon.stop() == 0
        finally:
            daemon.end()


def test_credentials_in_the_exporter_url_are_used_and_never_printed(tmp_path: Path) -> None:
    with sink() as s:
        failing = True
        s.answer = lambda r: (503, {}) if failing else (200, {})
        url = s.base.replace("http://", "http://bob:s3cr3t-pw@") + "/v1/traces?token=t0ps3cr3t&debug"
        cfg = base_config(tmp_path, exporters={"raw": {"type": "otlphttp", "endpoint": url}})
        daemon = DaemonProcess(tmp_path, cfg).start()
        try:
            assert send(daemon, traces(1)) == 200
            wait_until(lambda: forwarded(daemon, "raw")["retried"] >= 1, "a retry warning")
            daemon.wait_output("retried with backoff")
            status = str(daemon.get("/api/status")[1])
            for secret in ("s3cr3t-pw", "t0ps3cr3t", "bob"):
                assert secret not in daemon.output() and secret not in status
            assert forwarded(daemon, "raw")["endpoint"].endswith("/v1/traces?token=***&***")
            failing = False
            wait_until(lambda: s.delivered(), "the request delivered")
            got = s.received[-1]
            assert got.headers["authorization"] == "Basic " + base64.b64encode(b"bob:s3cr3t-pw").decode()
            assert daemon.stop() == 0
        finally:
            daemon.end()


def test_a_request_that_cannot_be_redacted_in_time_is_held_back_and_the_rest_goes_on(tmp_path: Path) -> None:
    with sink() as s:
        # A pattern that backtracks for ever on a long run of "a" without a "b": the rewrite cannot finish.
        cfg = base_config(tmp_path, exporters={"lw": {
            "type": "langwatch", "endpoint": f"{s.base}/api/otel/v1/traces", "api_key": "k",
            "redact": {"mode": "content", "timeout": "500ms", "patterns": {"stuck": "(a|aa)+b"}}}})
        daemon = DaemonProcess(tmp_path, cfg).start()
        try:
            stuck = ExportTraceServiceRequest.FromString(traces(1, n=1))
            add_attributes(stuck.resource_spans[0].scope_spans[0].spans[0].attributes,
                           {"gen_ai.input.messages": "a" * 60 + "!"})
            later = [traces(seed) for seed in range(2, 6)]
            assert send(daemon, stuck.SerializeToString()) == 200
            for body in later:
                assert send(daemon, body) == 200
            wait_until(lambda: forwarded(daemon, "lw")["queued_requests"] == 0, "the queue emptied")
            st = forwarded(daemon, "lw")
            assert st["held"] == 1 and st["held_last"]["reason"] == "timeout" and st["dropped"] == 0
            assert spans_in(s.delivered("/api/otel/v1/traces")) == spans_in(later), "the rest, and not the stuck one"
            assert not any(b"a" * 60 in r.body for r in s.received)
            held = Path(st["held_last"]["file"])
            assert held.read_bytes() == stuck.SerializeToString() and "held back" in daemon.output()
            assert daemon.metric('tracejudge_forward_held_total{exporter="lw",reason="timeout"}') == 1
            assert daemon.stop() == 0
            daemon.start()  # a restart does not try it again
            assert forwarded(daemon, "lw")["queued_requests"] == 0
            assert daemon.stop() == 0
        finally:
            daemon.end()


def test_a_request_whose_client_gave_up_during_its_commit_is_forwarded_too(tmp_path: Path) -> None:
    with sink() as s:
        cfg = base_config(tmp_path, exporters={"raw": {"type": "otlphttp", "endpoint": f"{s.base}/v1/traces"}})
        daemon = DaemonProcess(tmp_path, cfg).start()
        try:
            export = grpc.insecure_channel(daemon.grpc).unary_unary(
                "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
                request_serializer=lambda b: b, response_deserializer=lambda b: b)
            # Deadlines shorter than a commit: many calls end on the client while the server commits them.
            gave_up = 0
            for seed in range(1, 201):
                try:
                    export(traces(seed), timeout=0.002)
                except grpc.RpcError as err:
                    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                    gave_up += 1
            assert gave_up
            # The writer commits in order: once this last one is stored, every earlier one that will be is.
            assert send(daemon, traces(999)) == 200
            wait_until(lambda: forwarded(daemon, "raw")["queued_requests"] == 0 and
                       spans_in(s.delivered()) == daemon.metric("tracejudge_spans_stored_total"),
                       "every stored span forwarded")
            assert daemon.stop() == 0
        finally:
            daemon.end()



def test_a_stop_during_a_stuck_rewrite_does_not_wait_for_it_and_the_request_stays_queued(tmp_path: Path) -> None:
    with sink() as s:
        cfg = base_config(tmp_path, exporters={"lw": {"type": "langwatch", "endpoint": f"{s.base}/api/otel/v1/traces",
                                                      "api_key": "k", "redact": {"mode": "content", "timeout": "1h"}}})
        daemon = DaemonProcess(tmp_path, cfg).start()
        try:
            assert send(daemon, traces(1)) == 200
            wait_until(lambda: s.delivered(), "the first request, through the rewrite process")
            assert daemon.proc is not None
            stage = daemon.get("/api/status")[1]["conversations_process"]["pid"]
            rewriter, = (pid for pid in pool_workers(daemon.proc.pid) if pid != stage)
            os.kill(rewriter, signal.SIGSTOP)  # a rewrite that never ends, whatever the machine's speed
            assert send(daemon, traces(2)) == 200
            wait_until(lambda: forwarded(daemon, "lw")["state"] == "sending", "the second rewrite under way")
            assert daemon.stop() == 0  # within the helper's bound: the rewrite is not waited for
            assert len(s.received) == 1
            daemon.start()  # the request stayed queued: sent now, once
            wait_until(lambda: forwarded(daemon, "lw")["queued_requests"] == 0, "the queue emptied")
            assert len(s.delivered()) == 2 and forwarded(daemon, "lw")["held"] == 0
            assert daemon.stop() == 0
        finally:
            daemon.end()


def test_the_banner_and_status_show_each_exporter_and_the_log_says_when_a_backend_is_back(tmp_path: Path) -> None:
    with sink() as s:
        failing = True
        s.answer = lambda r: (503, {}) if failing else (200, {})
        cfg = base_config(tmp_path, exporters={
            "backend": {"type": "otlphttp", "endpoint": f"{s.base}/v1/traces?token=t0ps3cr3t"},
            "quiet": {"type": "otlphttp", "endpoint": f"{s.base}/quiet/v1/traces", "signals": ["logs"],
                      "redact": "content"}})
        daemon = DaemonProcess(tmp_path, cfg).start()
        try:
            banner = daemon.output()
            assert f"  exporter    backend: otlphttp {s.base}/v1/traces?token=*** (traces, logs; redact none)" in banner
            assert f"  exporter    quiet: otlphttp {s.base}/quiet/v1/traces (logs; redact content)" in banner
            assert "t0ps3cr3t" not in banner

            def status_of(name: str) -> str:
                res = run_cli("status", "--config", str(daemon.config_path))
                assert res.returncode == 0, res.stderr
                return next(line for line in res.stdout.splitlines() if line.startswith(f"exporter {name} "))

            assert send(daemon, traces(1)) == 200
            wait_until(lambda: forwarded(daemon, "backend")["retried"] >= 2, "two failed attempts")
            down = status_of("backend")
            assert f"otlphttp {s.base}/v1/traces?token=*** (traces, logs): retrying (next try in" in down
            assert "1 request queued (" in down and down.endswith("; last error: answered 503")
            assert "t0ps3cr3t" not in down

            failing = False
            daemon.wait_output("exporter backend: delivered again after")
            wait_until(lambda: forwarded(daemon, "backend")["queued_requests"] == 0, "the queue emptied")
            back = re.findall(r"exporter backend: delivered again after (\d+) failed attempts? over \d+\.\d s",
                              daemon.output())
            assert back == [str(forwarded(daemon, "backend")["retried"])]  # once, counting every failed attempt
            up = status_of("backend")
            assert up.endswith("(traces, logs): idle; nothing queued; 1 sent, "
                               f"{forwarded(daemon, 'backend')['retried']} retried, 0 dropped, 0 held")
            assert status_of("quiet").endswith("(logs): idle; nothing queued; 0 sent, 0 retried, 0 dropped, 0 held")
            assert daemon.stop() == 0
        finally:
            daemon.end()
