"""Nothing acknowledged is lost: kill -9 mid-stream, and a writer that falls behind."""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc

from .wire import grpc_export, post, retry_info, span_request_bytes


def _sender(send: Any, seed0: int, acked: list[tuple[str, str]], stop: threading.Event) -> None:
    seed = seed0
    while not stop.is_set():
        body, ids = span_request_bytes(64, trace_seed=seed, attr_bytes=300)
        seed += 2
        try:
            if send(body):
                acked.extend(ids)
        except Exception:  # the daemon died under us: stop sending
            return


def test_kill9_while_two_clients_send_loses_no_acknowledged_span(make_daemon: Any) -> None:
    daemon = make_daemon()
    acked_http: list[tuple[str, str]] = []
    acked_grpc: list[tuple[str, str]] = []
    stop = threading.Event()

    def via_http(body: bytes) -> bool:
        return post(daemon.http, "/v1/traces", body)[0] == 200

    def via_grpc(body: bytes) -> bool:
        grpc_export(daemon.grpc, "traces", body)
        return True

    threads = [threading.Thread(target=_sender, args=(via_http, 1, acked_http, stop)),
               threading.Thread(target=_sender, args=(via_grpc, 2, acked_grpc, stop))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(acked_http) + len(acked_grpc) < 3000 and time.monotonic() < deadline:
        time.sleep(0.05)
    daemon.kill9()  # no chance to flush anything
    stop.set()
    for t in threads:
        t.join(timeout=60)
    acked = set(acked_http) | set(acked_grpc)
    assert len(acked_http) > 0 and len(acked_grpc) > 0

    daemon.start()  # restart on the same file: the WAL is replayed
    assert daemon.stop() == 0
    stored = set(daemon.query("SELECT trace_id, span_id FROM spans"))
    assert acked <= stored, f"{len(acked - stored)} acknowledged spans lost"


def test_writer_behind_answers_retryable_and_loses_nothing(make_daemon: Any) -> None:
    """A queue of 600 spans with eight senders of 512: most requests find it full."""
    daemon = make_daemon(storage={"max_queue_spans": 600, "max_batch_spans": 512, "retry_after": "200ms"})
    results: dict[str, list[Any]] = {"http_503": [], "grpc_unavailable": [], "retry_after": [], "delays": []}
    acked: set[tuple[str, str]] = set()
    lock = threading.Lock()

    def client(n: int) -> None:
        for k in range(6):
            body, ids = span_request_bytes(512, trace_seed=n * 100 + k, attr_bytes=1000)
            while True:  # the client's retry loop, honouring the server's hint
                if n % 2:
                    status, headers, _ = post(daemon.http, "/v1/traces", body)
                    if status == 503:
                        with lock:
                            results["http_503"].append(1)
                            results["retry_after"].append(headers.get("retry-after"))
                        time.sleep(0.05)
                        continue
                    assert status == 200
                else:
                    try:
                        grpc_export(daemon.grpc, "traces", body)
                    except grpc.RpcError as err:
                        assert err.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
                        with lock:
                            results["grpc_unavailable"].append(1)
                            results["delays"].append(retry_info(err))
                        time.sleep(0.05)
                        continue
                with lock:
                    acked.update(ids)
                break

    threads = [threading.Thread(target=client, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert results["http_503"] and results["grpc_unavailable"], results
    assert set(results["retry_after"]) == {"1"}  # whole seconds; never below one
    assert set(results["delays"]) == {0.2}
    refused = daemon.metric('tracejudge_spans_rejected_total{reason="backpressure"}')
    assert refused == 512 * (len(results["http_503"]) + len(results["grpc_unavailable"]))
    assert len(acked) == 8 * 6 * 512
    assert daemon.counts()["spans"] == len(acked)
    assert daemon.metric("tracejudge_ingest_queue_depth") == 0
