"""Nothing acknowledged is lost: kill -9 mid-stream, a writer that falls behind, clients that give up,
SIGTERM with work queued, and a disk that fills up."""

from __future__ import annotations

import contextlib
import os
import re
import resource
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from ..support.daemon import wait_until
from ..support.wire import GRPC_METHODS, grpc_export, post, retry_info, span_request_bytes

pytestmark = pytest.mark.slow  # each test loads the daemon until it refuses, or kills it


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
    wait_until(lambda: len(acked_http) + len(acked_grpc) >= 3000, "3000 acknowledged spans", interval=0.05)
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


# ------------------------------------------------------------------ clients that give up


def _export_with_deadline(target: str, body: bytes, timeout: float) -> grpc.StatusCode:
    method, resp_type = GRPC_METHODS["traces"]
    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 256 * 1024 * 1024)]) as ch:
        call = ch.unary_unary(method, request_serializer=None, response_deserializer=resp_type.FromString)
        try:
            call(body, timeout=timeout)
        except grpc.RpcError as err:
            return err.code()  # type: ignore[attr-defined, no-any-return]
    return grpc.StatusCode.OK


def _wait_received(daemon: Any, spans: int, timeout: float = 60) -> None:
    """Wait until the daemon has taken in ``spans`` spans (decoded and handed to the store)."""
    wait_until(lambda: daemon.metric("tracejudge_spans_received_total") >= spans, f"the daemon to receive {spans} spans",
               timeout, interval=0.02)


def test_grpc_deadline_while_waiting_for_the_commit_leaves_ingestion_working(make_daemon: Any) -> None:
    """30,000 spans with a 0.2 s deadline, then any export: the writer must still run."""
    daemon = make_daemon()
    big, big_ids = span_request_bytes(30_000, attr_bytes=300)
    assert _export_with_deadline(daemon.grpc, big, timeout=0.2) == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_received(daemon, 30_000)
    body, ids = span_request_bytes(16, trace_seed=7)
    grpc_export(daemon.grpc, "traces", body)
    body2, ids2 = span_request_bytes(16, trace_seed=9)
    assert post(daemon.http, "/v1/traces", body2)[0] == 200
    assert daemon.get("/readyz")[1]["status"] == "ready"
    assert daemon.stop() == 0
    stored = set(daemon.query("SELECT trace_id, span_id FROM spans"))
    # The request whose client gave up is committed all the same: its retry stores nothing twice.
    assert set(big_ids) | set(ids) | set(ids2) == stored


def test_sigterm_commits_everything_queued_and_says_how_much(make_daemon: Any) -> None:
    """A request given up on (deadline) and requests queued behind it: SIGTERM commits them all."""
    daemon = make_daemon()
    big, _ = span_request_bytes(30_000, attr_bytes=300)
    assert _export_with_deadline(daemon.grpc, big, timeout=0.2) == grpc.StatusCode.DEADLINE_EXCEEDED
    answers: list[int] = []

    def send(seed: int) -> None:
        answers.append(post(daemon.http, "/v1/traces", span_request_bytes(256, trace_seed=seed)[0])[0])

    senders = [threading.Thread(target=send, args=(seed,)) for seed in range(10, 18)]
    for t in senders:
        t.start()
    _wait_received(daemon, 30_000 + 8 * 256)
    assert daemon.stop() == 0
    for t in senders:
        t.join(timeout=60)
    assert answers == [200] * 8  # in flight at SIGTERM: answered after their commit
    total = 30_000 + 8 * 256
    assert daemon.query("SELECT count(*) FROM spans") == [(total,)]
    last = daemon.output().strip().splitlines()[-1]
    m = re.search(r"stopped cleanly; (\d+) spans stored this run; while stopping (\d+) spans and 0 log records "
                  r"were committed, 0 refused", last)
    assert m, last
    assert int(m.group(1)) == total and int(m.group(2)) <= total


# ------------------------------------------------------------------ disk full


def _random_spans(seed: int, n: int = 512, size: int = 1000) -> tuple[bytes, list[tuple[str, str]]]:
    """Spans with incompressible payloads, so that the file grows as much as the data."""
    req = ExportTraceServiceRequest()
    ss = req.resource_spans.add().scope_spans.add()
    ids = []
    for i in range(n):
        sp = ss.spans.add()
        sp.trace_id = seed.to_bytes(8, "big") + i.to_bytes(8, "big")
        sp.span_id = (i + 1).to_bytes(8, "big")
        sp.name = "work"
        kv = sp.attributes.add()
        kv.key, kv.value.string_value = "payload", os.urandom(size // 2).hex()
        ids.append((sp.trace_id.hex(), sp.span_id.hex()))
    return req.SerializeToString(), ids


@contextlib.contextmanager
def _file_size_limit(pid: int, limit: int) -> Iterator[None]:
    """No file of ``pid`` may grow beyond ``limit`` bytes (writes fail with EFBIG, as on a full disk)."""
    old = resource.prlimit(pid, resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    try:
        yield
    finally:
        resource.prlimit(pid, resource.RLIMIT_FSIZE, old)  # space freed


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _readyz_refusal(daemon: Any) -> str:
    status, body = daemon.get("/readyz", check=False)
    assert status == 503 and set(body) == {"error"} and body["error"]["code"] == "store_unavailable", body
    return str(body["error"]["message"])


def test_disk_full_refuses_retryably_then_recovers_once_space_is_freed(make_daemon: Any) -> None:
    """A checkpoint that cannot write invalidates the file: the daemon attaches it again once it can."""
    daemon = make_daemon()
    acked: set[tuple[str, str]] = set()
    seed = 1
    while _size(daemon.duckdb) < 20_000_000:  # a file larger than the WAL that a checkpoint writes out
        body, ids = _random_spans(seed)
        assert post(daemon.http, "/v1/traces", body)[0] == 200
        acked.update(ids)
        seed += 1
    assert daemon.stop() == 0  # the last checkpoint empties the WAL
    daemon.start()
    with _file_size_limit(daemon.proc.pid, _size(daemon.duckdb)):
        for _ in range(100):  # the WAL fills up to DuckDB's checkpoint, which cannot grow the file
            body, ids = _random_spans(seed)
            seed += 1
            status, headers, answer = post(daemon.http, "/v1/traces", body)
            if status != 200:
                break
            acked.update(ids)
        assert status == 503 and headers["retry-after"] == "5", answer
        assert "File too large" in _readyz_refusal(daemon)
        assert daemon.get("/healthz")[0] == 200  # alive: it recovers by itself
        for path in ("/api/spans/count", "/api/conversations", "/api/status", "/metrics"):
            assert daemon.get(path, check=False)[0] in (200, 503), path  # never a 500
        assert daemon.metric('tracejudge_spans_rejected_total{reason="storage_error"}') >= 512
        with pytest.raises(grpc.RpcError) as refused:
            grpc_export(daemon.grpc, "traces", _random_spans(seed)[0])
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and retry_info(refused.value) == 5.0
    body, ids = _random_spans(seed + 1)
    assert post(daemon.http, "/v1/traces", body)[0] == 200
    acked.update(ids)
    assert daemon.get("/readyz")[1]["status"] == "ready"
    assert "attached" in daemon.output() and "again after DuckDB invalidated it" in daemon.output()
    daemon.kill9()  # what was acknowledged is in the WAL or the file: a restart replays it
    daemon.start()
    assert daemon.stop() == 0
    stored = set(daemon.query("SELECT trace_id, span_id FROM spans"))
    assert acked <= stored, f"{len(acked - stored)} acknowledged spans lost"


def test_a_wal_that_cannot_grow_fails_readiness_until_a_commit_succeeds(make_daemon: Any) -> None:
    daemon = make_daemon()
    body, ids = _random_spans(1)
    assert post(daemon.http, "/v1/traces", body)[0] == 200
    with _file_size_limit(daemon.proc.pid, _size(Path(f"{daemon.duckdb}.wal"))):
        status, headers, _ = post(daemon.http, "/v1/traces", _random_spans(2)[0])
        assert status == 503 and headers["retry-after"] == "5"
        assert "File too large" in _readyz_refusal(daemon)
    body3, ids3 = _random_spans(3)
    assert post(daemon.http, "/v1/traces", body3)[0] == 200
    assert daemon.get("/readyz")[1]["status"] == "ready"
    daemon.kill9()  # the WAL left by the failed append replays
    daemon.start()
    assert daemon.stop() == 0
    assert set(ids) | set(ids3) <= set(daemon.query("SELECT trace_id, span_id FROM spans"))
