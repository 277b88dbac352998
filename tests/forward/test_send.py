"""The sender's parts on their own: its HTTP connection (kept alive, made again when the backend closed it,
cut at shutdown), its rewrite process (what it sends, and a new one after it dies) and its waits between retries."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from collector.config import Exporter
from collector.forward.queue import ForwardStore
from collector.forward.rewrite import THREAD_ATTRIBUTE, rewrite_all
from collector.forward.send import BACKOFF, Answer, Connection, Counters, Rewriter, RewriteFailed, Sender
from collector.metrics import Counter

from ..support.daemon import pool_workers, wait_until
from .test_forward import traces


def read_request(conn: socket.socket) -> bytes:
    """One HTTP request's body (by Content-Length); b"" when the client closed first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += conn.recv(65536)
    return body


@contextmanager
def backend(handle) -> Iterator[tuple[int, list[bytes]]]:  # type: ignore[no-untyped-def]
    """A loopback server running ``handle(conn, received)`` on each connection; (port, bodies received)."""
    srv = socket.create_server(("127.0.0.1", 0))
    received: list[bytes] = []
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            with conn:
                handle(conn, received)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1], received
    finally:
        stop.set()
        t.join(10)
        srv.close()


def test_a_kept_alive_connection_the_backend_closed_is_made_again_without_a_failure() -> None:
    connections = []

    def answer_once_then_close(conn: socket.socket, received: list[bytes]) -> None:
        connections.append(conn)
        received.append(read_request(conn))
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")  # keep-alive, then closed while idle

    with backend(answer_once_then_close) as (port, received):
        http = Connection(timeout=30)
        url = f"http://127.0.0.1:{port}/v1/traces"
        assert http.post(url, b"first", {}) == Answer(200, None, None)
        assert http.post(url, b"second", {}) == Answer(200, None, None)
        http.close()
    assert received == [b"first", b"second"] and len(connections) == 2


def test_close_cuts_an_exchange_the_backend_never_answers() -> None:
    got = threading.Event()
    release = threading.Event()

    def never_answer(conn: socket.socket, received: list[bytes]) -> None:
        received.append(read_request(conn))
        got.set()
        release.wait(60)

    with backend(never_answer) as (port, _):
        http = Connection(timeout=600)
        outcome: list[BaseException | tuple[int, str | None]] = []

        def post() -> None:
            try:
                outcome.append(http.post(f"http://127.0.0.1:{port}/v1/traces", b"body", {}))
            except BaseException as exc:
                outcome.append(exc)

        t = threading.Thread(target=post)
        t.start()
        assert got.wait(30)
        http.close()
        t.join(30)
        release.set()
    assert not t.is_alive()
    assert isinstance(outcome[0], (OSError, ConnectionError)) or type(outcome[0]).__module__ == "http.client"


def test_retries_back_off_with_jitter_and_wait_as_retry_after_says_up_to_5_minutes(tmp_path: Path) -> None:
    answers = [b"503 Service Unavailable\r\nRetry-After: 3600", b"503 Service Unavailable", b"429 Too Many Requests",
               b"503 Service Unavailable\r\nRetry-After: 7", b"502 Bad Gateway", b"200 OK"]

    def scripted(conn: socket.socket, received: list[bytes]) -> None:
        received.append(read_request(conn))
        conn.sendall(b"HTTP/1.1 " + answers[len(received) - 1] + b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    async def send_all(sender: Sender) -> None:
        task = asyncio.create_task(sender.run())
        await asyncio.to_thread(wait_until, lambda: not sender.queue.requests, "the queue to be sent")
        task.cancel()

    store = ForwardStore(tmp_path, [("raw", ("traces",), 1 << 30)])
    counters = Counters(*(Counter(f"c{n}", "", ("exporter", label)) for n, label in
                          enumerate(("signal", "reason", "reason", "reason"))))
    with backend(scripted) as (port, received):
        exp = Exporter(type="otlphttp", endpoint=f"http://127.0.0.1:{port}/v1/traces")
        # Jitter fixed at a quarter off each wait: rand() 0.5 of at most half.
        sender = Sender("raw", exp, store.queues["raw"], thread_from=(), key=b"", counters=counters,
                        backoff=replace(BACKOFF, rand=lambda: 0.5), sleep=sleep)
        try:
            store.put("traces", b"request").result(timeout=30)
            asyncio.run(send_all(sender))
        finally:
            sender.close()
            store.close()
    assert received == [b"request"] * 6  # retried until delivered, never dropped
    # 3600 s asked, 300 s waited; the backoff's 1, 2 and 8 s a quarter short; 7 s as asked.
    assert waits == [300.0, 0.75, 1.5, 7.0, 6.0]
    assert sender.status.counts["retried"] == 5 and sender.status.counts["sent"] == 1


def children() -> list[int]:
    return pool_workers(os.getpid())


def test_the_rewrite_process_sends_what_the_rewrite_gives_and_is_started_again_after_it_dies() -> None:
    bodies = [traces(1), traces(2)]
    keys = ("gen_ai.conversation.id",)
    rewriter = Rewriter("ls", keys, None, 30.0)
    try:
        before = set(children())
        out = rewriter("traces", bodies)
        assert out == rewrite_all("traces", bodies, keys, None)
        request = ExportTraceServiceRequest.FromString(out)
        assert len(request.resource_spans) == 2 and all(
            any(kv.key == THREAD_ATTRIBUTE for kv in sp.attributes)
            for rs in request.resource_spans for ss in rs.scope_spans for sp in ss.spans)
        child, = set(children()) - before
        os.kill(child, signal.SIGKILL)  # as the kernel's OOM killer would
        with pytest.raises(RewriteFailed, match="died") as failed:
            rewriter("traces", bodies)
        assert failed.value.reason == "died"
        assert rewriter("traces", bodies) == out
    finally:
        rewriter.close()
    assert not set(children()) - before


def test_an_exporter_that_changes_nothing_starts_no_process() -> None:
    rewriter = Rewriter("raw", (), None, 30.0)
    before = set(children())
    assert rewriter("traces", [b"a", b"b"]) == b"ab"
    assert set(children()) == before
    rewriter.close()
