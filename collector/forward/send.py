"""One exporter's sender: its queue's front to its backend, in order, until delivered or refused for good.

One request (or several queued ones of a signal, concatenated: protobuf's
concatenation of two export requests is the request holding both) is in
flight at a time, so the backend receives them in the order they were
acknowledged. Answers:

- 2xx: delivered; removed from the queue.
- a connection error, a timeout, 408, 429, 5xx: retried after an exponential
  backoff (0.5 s doubling to 30 s), or after ``Retry-After`` when the backend
  says so (at most 5 minutes); never dropped.
- any other answer (400, 401, LangWatch's 402 over plan limits, 413...): a
  permanent refusal. A batch of several is sent again one request at a time,
  so that only the request refused is dropped; it is counted by reason
  (``http_400``) and never retried.

An exporter that changes requests (LangSmith's thread attribute, ``redact:
content``) does it in a process of its own (``Rewriter``): the rewrite is
Python work on every span, and in the daemon it would hold the GIL the
receivers need (measured: two exporters, one of them LangSmith, took ingest
from 95% to 77% of its throughput without exporters).

The reads from the queue and the HTTP exchange run on a thread
of the sender's own, with ``http.client`` on a kept-alive connection: a body
of megabytes goes out in one ``sendall`` that releases the GIL, where an
asyncio client copies it on the event loop the receivers run on (measured:
0.5-1 ms of the loop's time per 600 KB request). A hung backend holds only that
thread, for at most ``timeout``; ``close`` cuts the connection at shutdown.
"""

from __future__ import annotations

import asyncio
import email.utils
import http.client
import logging
import signal as unix_signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from ..config import Exporter
from ..metrics import Counter
from .queue import ExporterQueue, Item
from .rewrite import rewrite_all

log = logging.getLogger("tracejudge.forward")

MAX_BATCH_BYTES = 4 * 1024 * 1024
"""Queued requests sent together, at most (LangWatch takes bodies up to 10 MiB)."""
BACKOFF_FIRST, BACKOFF_MAX, RETRY_AFTER_MAX = 0.5, 30.0, 300.0


def logs_url(traces_url: str) -> str:
    """The logs URL beside a traces URL (``/v1/traces`` -> ``/v1/logs``)."""
    u = urlsplit(traces_url)
    path = u.path.rstrip("/")
    return urlunsplit((u.scheme, u.netloc, path[: -len("/v1/traces")] + "/v1/logs", u.query, ""))


def auth_headers(exp: Exporter) -> dict[str, str]:
    """The headers of the exporter's backend type (``../reference/backends.md``), then its own."""
    h = {"Content-Type": "application/x-protobuf"}
    key = (exp.api_key or "").strip()
    if exp.type == "opik":
        if key:
            h["Authorization"] = key  # the raw key, no "Bearer"
        if exp.workspace:
            h["Comet-Workspace"] = exp.workspace
        if exp.project:
            h["projectName"] = exp.project
    elif exp.type == "langsmith":
        h["x-api-key"] = key
        if exp.project:
            h["Langsmith-Project"] = exp.project
    elif key:  # langwatch, and an otlphttp collector that takes a bearer token
        h["Authorization"] = f"Bearer {key}"
    h.update(exp.headers)
    return h


@dataclass
class SenderState:
    """What ``/api/status`` shows of one exporter."""

    state: str = "idle"
    """idle (nothing queued), sending, retrying (the backend answered retryably or not at all), stopped."""
    last_error: str | None = None
    last_sent_at: float | None = None
    retry_in: float = 0.0
    counts: dict[str, int] = field(default_factory=lambda: {"sent": 0, "retried": 0, "dropped": 0,
                                                             "resent_after_restart": 0})


T = TypeVar("T")


class Connection:
    """One kept-alive HTTP(S) connection to an exporter's backend, used from the sender's thread."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()  # ``post`` on the sender's thread, ``close`` from the loop's

    def post(self, url: str, body: bytes, headers: dict[str, str]) -> tuple[int, str | None]:
        """POST ``body``; the status and the ``Retry-After`` header.

        Raises:
            OSError, http.client.HTTPException: no answer (the connection is closed, a new one is made next time).
        """
        u = urlsplit(url)
        target = u.path + (f"?{u.query}" if u.query else "")
        kept = self._conn is not None
        try:
            return self._once(u.scheme, u.hostname or "", u.port, target, body, headers)
        except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
            if not kept:
                raise
            # The backend closed a kept-alive connection while it was idle: once more, on a new one.
            return self._once(u.scheme, u.hostname or "", u.port, target, body, headers)

    def _once(self, scheme: str, host: str, port: int | None, target: str, body: bytes,
              headers: dict[str, str]) -> tuple[int, str | None]:
        with self._lock:
            if self._conn is None:
                cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
                self._conn = cls(host, port, timeout=self.timeout)
            conn = self._conn
        try:
            conn.request("POST", target, body=body, headers=headers)
            resp = conn.getresponse()
            resp.read()
        except BaseException:
            self.close()
            raise
        if resp.will_close:
            self.close()
        return resp.status, resp.getheader("Retry-After")

    def close(self) -> None:
        """Close the connection; an exchange under way on another thread fails at once."""
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            if conn.sock is not None:
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            conn.close()


def _start_rewrite_process() -> None:
    """In the rewrite process: leave Ctrl-C to the daemon, and end when the daemon is gone.

    Ctrl-C reaches the whole process group; the daemon stops the child itself. A daemon killed with
    ``kill -9`` cannot: the child's end of the pool's queue never closes (it holds the writing end too), so
    it watches for its parent to change.
    """
    unix_signal.signal(unix_signal.SIGINT, unix_signal.SIG_IGN)
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class Rewriter:
    """``rewrite_all`` in a child process, started at the first request and started again if it dies."""

    def __init__(self, name: str, thread_from: Sequence[str], redact: bool) -> None:
        self.name, self.thread_from, self.redact = name, tuple(thread_from), redact
        self._pool: ProcessPoolExecutor | None = None

    def __call__(self, signal: str, bodies: list[bytes]) -> bytes:
        """The body to send, from the queued ``bodies`` of ``signal`` (on the sender's thread)."""
        if not self.thread_from and not self.redact:
            return b"".join(bodies)
        if self._pool is None:
            # spawn, not fork: the daemon has threads (gRPC, DuckDB) a forked child would inherit half-way
            self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_start_rewrite_process)
        try:
            return self._pool.submit(rewrite_all, signal, bodies, self.thread_from, self.redact).result()
        except BrokenProcessPool:
            log.error("exporter %s: the rewrite process died; a new one is started", self.name)
            self.close()
            raise

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


class Sender:
    """Sends one exporter's queue (see the module docstring); ``run`` until cancelled, then ``close``."""

    def __init__(self, name: str, exp: Exporter, queue: ExporterQueue, *, thread_from: Sequence[str],
                 sent: Counter, retried: Counter, dropped: Counter) -> None:
        self.name, self.exp, self.queue = name, exp, queue
        self.headers = auth_headers(exp)
        self.urls = {"traces": exp.url, "logs": logs_url(exp.url)}
        self.sent, self.retried, self.dropped = sent, retried, dropped
        self.status = SenderState()
        self.wake = asyncio.Event()
        self._alone: set[int] = set()  # seqs of a refused batch, now sent one at a time
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"forward-{name}")
        self._http = Connection(exp.timeout)
        self._rewrite = Rewriter(name, thread_from if exp.type == "langsmith" else (), exp.redact == "content")

    async def _on_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def run(self) -> None:
        failures = 0
        while True:
            items = await self._on_thread(self._front)
            if not items:
                self.status.state = "idle"
                self.wake.clear()
                if self.queue.requests == 0:
                    await self.wake.wait()
                continue
            self.status.state = "sending" if not failures else "retrying"
            delay = await self._send(items)
            if delay is None:
                failures = 0
                continue
            failures += 1
            wait = delay if delay > 0 else min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** (failures - 1))
            self.status.state, self.status.retry_in = "retrying", wait
            await asyncio.sleep(wait)

    def close(self) -> None:
        """After ``run`` was cancelled: cut an exchange under way and wait for the thread."""
        self._http.close()
        self._pool.shutdown(wait=True)
        self._rewrite.close()

    def _front(self) -> list[Item]:
        items = self.queue.peek(MAX_BATCH_BYTES)
        if items and items[0].seq in self._alone:
            return items[:1]
        return items

    def _exchange(self, items: list[Item]) -> tuple[int, str | None, int]:
        """On the sender's thread: the body as this exporter sends it, the send noted, then the POST."""
        signal = items[0].signal
        body = self._rewrite(signal, [i.body for i in items])
        self.queue.attempted(items)
        status, retry_after = self._http.post(self.urls[signal], body, self.headers)
        return status, retry_after, len(body)

    async def _send(self, items: list[Item]) -> float | None:
        """One attempt; None when the items left the queue (delivered or dropped), else the delay the backend
        asked for (0: back off)."""
        signal = items[0].signal
        resent = sum(1 for i in items if i.attempts and i.seq not in self._alone)
        try:
            status, retry_after, size = await self._on_thread(self._exchange, items)
        except BrokenProcessPool:
            return self._retry(items, "rewrite", "the rewrite process died")
        except (OSError, http.client.HTTPException) as exc:
            what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            return self._retry(items, "connection", what)
        if 200 <= status < 300:
            # Counted before the queue shrinks, so whoever sees an empty queue also sees them sent.
            self.sent.inc(len(items), exporter=self.name, signal=signal)
            self.status.counts["sent"] += len(items)
            self.status.counts["resent_after_restart"] += resent
            self.status.last_sent_at, self.status.last_error = time.time(), None
            await self._on_thread(self.queue.remove, items)
            self._alone.difference_update(i.seq for i in items)
            return None
        if status in (408, 429) or status >= 500:
            return self._retry(items, f"http_{status}", f"answered {status}", _retry_after(retry_after))
        if len(items) > 1:  # find the one refused: each is sent alone
            self._alone.update(i.seq for i in items)
            return None
        self.dropped.inc(exporter=self.name, reason=f"http_{status}")
        self.status.counts["dropped"] += 1
        self.status.last_error = f"answered {status}: a permanent refusal, the request was dropped"
        log.warning("exporter %s: %s answered %d for a %s request of %d bytes: dropped, not retried",
                    self.name, self.urls[signal], status, signal, size)
        await self._on_thread(self.queue.remove, items)
        self._alone.discard(items[0].seq)
        return None

    def _retry(self, items: list[Item], reason: str, what: str, delay: float = 0.0) -> float:
        self.retried.inc(len(items), exporter=self.name, reason=reason)
        self.status.counts["retried"] += len(items)
        if self.status.last_error != what:
            log.warning("exporter %s: %s %s; %d queued requests wait, retried with backoff",
                        self.name, self.urls[items[0].signal], what, self.queue.requests)
        self.status.last_error = what
        return delay


def _retry_after(value: str | None) -> float:
    """Seconds from a ``Retry-After`` header (seconds or an HTTP date); 0 when absent or unreadable."""
    if not value:
        return 0.0
    try:
        return min(RETRY_AFTER_MAX, max(0.0, float(value)))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return 0.0
    return min(RETRY_AFTER_MAX, max(0.0, when.timestamp() - time.time()))


def state_of(sender: Sender) -> dict[str, Any]:
    """One exporter's entry in ``/api/status``."""
    q = sender.queue
    return {"type": sender.exp.type, "endpoint": sender.exp.url, "signals": list(sender.exp.sends),
            "state": sender.status.state, "queued_requests": q.requests, "queued_bytes": q.bytes,
            "max_bytes": q.max_bytes, "oldest_age_s": round(q.oldest_age(), 3), "last_error": sender.status.last_error,
            "retry_in_s": sender.status.retry_in if sender.status.state == "retrying" else 0, **sender.status.counts}
