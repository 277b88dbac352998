"""One exporter's sender: its queue's front to its backend, in order, until delivered or refused for good.

One request (or several queued ones of a signal, concatenated: protobuf's
concatenation of two export requests is the request holding both) is in
flight at a time, so the backend receives them in the order they were
acknowledged. Answers:

- 2xx: delivered; removed from the queue.
- a connection error, a timeout, 408, 429, 5xx: retried after an exponential
  backoff (0.5 s doubling to 30 s, each wait cut by up to half at random so that
  a fleet of daemons does not retry in step), or after ``Retry-After`` when the
  backend says so (at most 5 minutes); never dropped. The log says so once per
  new reason, and once when the backend delivers again, with how many attempts
  failed over how long.
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
import base64
import http.client
import logging
import multiprocessing
import os
import signal as unix_signal
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection as Connection_
from typing import Any, NamedTuple, TypeVar
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit

from judges import Backoff, parse_retry_after

from ..config import Exporter
from ..metrics import Counter
from ..words import masked_url, plural
from .queue import ExporterQueue, Item
from .rewrite import Redaction, rewrite_all

log = logging.getLogger("tracejudge.forward")

MAX_BATCH_BYTES = 4 * 1024 * 1024
"""Queued requests sent together, at most (LangWatch takes bodies up to 10 MiB)."""
BACKOFF = Backoff(0.5, 30.0, jitter=0.5)
"""The wait before a retry the backend did not time."""
RETRY_AFTER_MAX = 300.0
"""The longest ``Retry-After`` honoured; a longer one is cut to it."""
MAX_REDIRECTS = 5
START_LIMIT = 120.0
"""Seconds a rewrite process may take to start (its imports) before it counts as dead."""
FOLLOWED = (301, 302, 307, 308)
"""Redirects followed, with the same POST, within the backend's origin (scheme, host and port)."""


def logs_url(traces_url: str) -> str:
    """The logs URL beside a traces URL (``/v1/traces`` -> ``/v1/logs``)."""
    u = urlsplit(traces_url)
    path = u.path.rstrip("/")
    return urlunsplit((u.scheme, u.netloc, path[: -len("/v1/traces")] + "/v1/logs", u.query, ""))


def auth_headers(exp: Exporter) -> dict[str, str]:
    """The headers of the exporter's backend type (``collector.backends``), then its own."""
    h = {"Content-Type": "application/x-protobuf", **exp.backend.headers(exp)}
    u = urlsplit(exp.url)
    if u.username is not None and "Authorization" not in h:  # credentials in the URL, as curl takes them
        pair = f"{unquote(u.username)}:{unquote(u.password or '')}"
        h["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
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
    counts: dict[str, int] = field(default_factory=lambda: {"sent": 0, "retried": 0, "dropped": 0, "held": 0,
                                                             "resent_after_restart": 0})
    held_last: dict[str, Any] | None = None
    """The last request held back (its seq, signal, size, reason and the file it is kept in)."""


@dataclass(frozen=True)
class Counters:
    """The forwarding counters on ``/metrics`` that senders add to."""

    sent: Counter
    retried: Counter
    dropped: Counter
    held: Counter


T = TypeVar("T")


class Answer(NamedTuple):
    status: int
    retry_after: float | None
    """Seconds the backend asked to wait (``Retry-After``, at most ``RETRY_AFTER_MAX``), if it did."""
    location: str | None


class Connection:
    """One kept-alive HTTP(S) connection to an exporter's backend, used from the sender's thread.

    ``timeout`` bounds a whole exchange, the answer's body included: a backend that drips its answer a
    byte at a time (each read within any per-read timeout) has its connection cut when the time is up.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()  # ``post`` on the sender's thread, ``close`` from the loop's or the timer's

    def post(self, url: str, body: bytes, headers: dict[str, str]) -> Answer:
        """POST ``body``; the status, the wait ``Retry-After`` asks for and the ``Location`` header.

        Raises:
            TimeoutError: no whole answer within ``timeout``.
            OSError, http.client.HTTPException: no answer (the connection is closed, a new one is made next time).
        """
        u = urlsplit(url)
        target = u.path + (f"?{u.query}" if u.query else "")
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            self.close()

        timer = threading.Timer(self.timeout, expire)
        timer.daemon = True
        timer.start()
        kept = self._conn is not None
        try:
            try:
                return self._once(u.scheme, u.hostname or "", u.port, target, body, headers)
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                if not kept or expired.is_set():
                    raise
                # The backend closed a kept-alive connection while it was idle: once more, on a new one.
                return self._once(u.scheme, u.hostname or "", u.port, target, body, headers)
        except (OSError, http.client.HTTPException) as exc:
            if expired.is_set():
                raise TimeoutError(f"no whole answer within the timeout of {self.timeout:g}s") from exc
            raise
        finally:
            timer.cancel()

    def _once(self, scheme: str, host: str, port: int | None, target: str, body: bytes,
              headers: dict[str, str]) -> Answer:
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
        headers = {name.lower(): value for name, value in resp.getheaders()}
        return Answer(resp.status, parse_retry_after(headers, most=RETRY_AFTER_MAX), headers.get("location"))

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


def _rewrite_process(conn: Connection_, thread_from: tuple[str, ...], redact: Redaction | None) -> None:
    """The rewrite process: each (signal, bodies) it receives answered with ("ok", body) or ("error", why).

    It leaves Ctrl-C to the daemon (Ctrl-C reaches the whole process group; the daemon stops the child
    itself), and ends when the daemon is gone: one killed with ``kill -9`` cannot stop it.
    """
    unix_signal.signal(unix_signal.SIGINT, unix_signal.SIG_IGN)
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    conn.send(("ready", None))  # imports done: the caller's limit is for rewriting only
    while True:
        try:
            signal, bodies = conn.recv()
        except (EOFError, OSError):
            return
        try:
            answer: tuple[str, Any] = ("ok", rewrite_all(signal, bodies, thread_from, redact))
        except Exception as exc:  # a config pattern that times out, a request that does not parse
            answer = ("error", f"{type(exc).__name__}: {exc}")
        conn.send(answer)


class RewriteFailed(Exception):
    """The rewrite of a request did not give a body to send."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        """timeout (not done within the exporter's ``redact.timeout``), error (it raised) or died."""


class Rewriter:
    """``rewrite_all`` in a child process of its own, started at the first request and again after it died
    or was killed for taking longer than ``limit`` seconds."""

    def __init__(self, name: str, thread_from: Sequence[str], redact: Redaction | None, limit: float) -> None:
        self.name, self.thread_from, self.redact, self.limit = name, tuple(thread_from), redact, limit
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection_ | None = None
        self._ready = False  # the process said it is ready (only the sender's thread reads and sets it)
        self._lock = threading.Lock()  # calls on the sender's thread, ``close`` from the loop's
        self.stopping = False
        """Set at shutdown: a rewrite cut then is no death to log."""

    def __call__(self, signal: str, bodies: list[bytes]) -> bytes:
        """The body to send, from the queued ``bodies`` of ``signal`` (on the sender's thread).

        Raises:
            RewriteFailed: no body to send; the request must not leave as it is.
        """
        if not self.thread_from and self.redact is None:
            return b"".join(bodies)
        try:
            conn = self._start()
            conn.send((signal, bodies))
            if not conn.poll(self.limit):
                self.close()
                raise RewriteFailed("timeout", f"the rewrite took longer than {self.limit:g}s: the process was "
                                               "stopped, and the request was not sent")
            kind, out = conn.recv()
        except (EOFError, OSError):
            if not self.stopping:
                log.error("exporter %s: the rewrite process died; a new one is started", self.name)
            self.close()
            raise RewriteFailed("died", "the rewrite process died") from None
        if kind != "ok":
            raise RewriteFailed("error", f"the rewrite failed: {out}")
        return out  # type: ignore[no-any-return]

    def _start(self) -> Connection_:
        with self._lock:
            if self._conn is None:
                # spawn, not fork: the daemon has threads (gRPC, DuckDB) a forked child would inherit half-way
                ctx = multiprocessing.get_context("spawn")
                mine, theirs = ctx.Pipe()
                self._proc = ctx.Process(target=_rewrite_process, args=(theirs, self.thread_from, self.redact),
                                         name=f"tracejudge-rewrite-{self.name}", daemon=True)
                self._proc.start()
                theirs.close()
                self._conn, self._ready = mine, False
            conn = self._conn
        if not self._ready:  # outside the lock: ``close`` must be able to cut the wait
            if not conn.poll(START_LIMIT) or conn.recv()[0] != "ready":
                raise EOFError("the rewrite process did not start")
            self._ready = True
        return conn

    def close(self) -> None:
        """Stop the process now (a rewrite under way is cut: its caller gets ``RewriteFailed``)."""
        with self._lock:
            proc, conn, self._proc, self._conn = self._proc, self._conn, None, None
        if proc is not None:
            proc.kill()
            proc.join(10)
        if conn is not None:
            conn.close()


class ExporterStopped(Exception):
    """The exporter cannot go on without a change to its configuration; its queue is kept."""


class Sender:
    """Sends one exporter's queue (see the module docstring); ``run`` until cancelled, then ``close``."""

    def __init__(self, name: str, exp: Exporter, queue: ExporterQueue, *, thread_from: Sequence[str],
                 key: bytes, counters: Counters, backoff: Backoff = BACKOFF,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.name, self.exp, self.queue = name, exp, queue
        self.backoff, self.sleep = backoff, sleep  # tests pass a fixed jitter and a recorder
        self.headers = auth_headers(exp)
        self.urls = {"traces": exp.url, "logs": logs_url(exp.url)}
        self.counters = counters
        self.status = SenderState()
        self.wake = asyncio.Event()
        self._alone: set[int] = set()  # seqs of a refused batch, now sent one at a time
        self._failed = 0  # attempts retried since the last delivery
        self._failing_since = 0.0  # time.monotonic() of the first of them
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"forward-{name}")
        self._http = Connection(exp.timeout)
        r = exp.redact
        redaction = Redaction(tuple(r.keep_attributes), tuple(thread_from), dict(r.patterns), key) \
            if r.mode == "content" else None
        self._rewrite = Rewriter(name, thread_from if exp.backend.thread_attribute else (), redaction, r.timeout)

    async def _on_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def run(self) -> None:
        """Send until cancelled.

        Raises:
            ExporterStopped: the backend redirects to another origin.
        """
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
            wait = delay if delay > 0 else self.backoff.delay(failures)
            self.status.state, self.status.retry_in = "retrying", wait
            await self.sleep(wait)

    def close(self) -> None:
        """After ``run`` was cancelled: cut an exchange or a rewrite under way and wait for the thread."""
        self._http.close()
        self._rewrite.stopping = True
        self._rewrite.close()
        self._pool.shutdown(wait=True)
        self._rewrite.close()  # one the thread started while it was being cut

    def _front(self) -> list[Item]:
        items = self.queue.peek(MAX_BATCH_BYTES)
        if items and items[0].seq in self._alone:
            return items[:1]
        return items

    def _exchange(self, items: list[Item]) -> tuple[Answer, str, int]:
        """On the sender's thread: the body as this exporter sends it, the send noted, then the POST, following
        redirects within the backend's origin; the last answer, the URL that gave it, and the body's size.

        Raises:
            RewriteFailed: the request has no body that may be sent.
        """
        signal = items[0].signal
        body = self._rewrite(signal, [i.body for i in items])
        self.queue.attempted(items)
        url = self.urls[signal]
        for _ in range(MAX_REDIRECTS + 1):
            answer = self._http.post(url, body, self.headers)
            if answer.status not in FOLLOWED or not answer.location:
                break
            target = urljoin(url, answer.location)
            if _origin(target) != _origin(url):
                break
            url = target
        return answer, url, len(body)

    async def _send(self, items: list[Item]) -> float | None:
        """One attempt; None when the items left the queue (delivered, dropped or held back), else the delay
        the backend asked for (0: back off).

        Raises:
            ExporterStopped: the backend redirects to another origin.
        """
        signal = items[0].signal
        resent = sum(1 for i in items if i.attempts and i.seq not in self._alone)
        try:
            answer, url, size = await self._on_thread(self._exchange, items)
        except RewriteFailed as exc:
            return await self._unrewritable(items, exc)
        except (OSError, http.client.HTTPException) as exc:
            what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            return self._retry(items, "timeout" if isinstance(exc, TimeoutError) else "connection", what)
        status = answer.status
        if 200 <= status < 300:
            # Counted before the queue shrinks, so whoever sees an empty queue also sees them sent.
            self.counters.sent.inc(len(items), exporter=self.name, signal=signal)
            self.status.counts["sent"] += len(items)
            self.status.counts["resent_after_restart"] += resent
            self.status.last_sent_at, self.status.last_error = time.time(), None
            if self._failed:
                log.warning("exporter %s: delivered again after %s over %.1f s", self.name,
                            plural(self._failed, "failed attempt"), time.monotonic() - self._failing_since)
                self._failed = 0
            await self._on_thread(self.queue.remove, items)
            self._alone.difference_update(i.seq for i in items)
            return None
        if 300 <= status < 400:
            return self._redirected(items, url, answer)
        if status in (408, 429) or status >= 500:
            return self._retry(items, f"http_{status}", f"answered {status}", answer.retry_after or 0.0)
        if len(items) > 1:  # find the one refused: each is sent alone
            self._alone.update(i.seq for i in items)
            return None
        self.counters.dropped.inc(exporter=self.name, reason=f"http_{status}")
        self.status.counts["dropped"] += 1
        self.status.last_error = f"answered {status}: a permanent refusal, the request was dropped"
        log.warning("exporter %s: %s answered %d for a %s request of %d bytes: dropped, not retried",
                    self.name, masked_url(url), status, signal, size)
        await self._on_thread(self.queue.remove, items)
        self._alone.discard(items[0].seq)
        return None

    def _redirected(self, items: list[Item], url: str, answer: Answer) -> float:
        """A 3xx not followed: to another origin, the exporter stops; else (too many, or one not for a POST)
        it is retried. Nothing is dropped."""
        target = urljoin(url, answer.location) if answer.location else None
        if target is not None and _origin(target) != _origin(url):
            message = (f"{masked_url(url)} answered {answer.status} redirecting to another origin, "
                       f"{masked_url(target)}: not followed (the request would leave for a host not configured); "
                       f"set the exporter's endpoint to where the backend is now and restart. "
                       f"{self.queue.requests} requests stay queued")
            self.status.last_error = message
            raise ExporterStopped(message)
        what = (f"answered {answer.status}" + (f" redirecting to {masked_url(target)}" if target else "") +
                (f" after {MAX_REDIRECTS} redirects" if answer.status in FOLLOWED and target else ""))
        return self._retry(items, f"http_{answer.status}", what)

    async def _unrewritable(self, items: list[Item], exc: RewriteFailed) -> float | None:
        """A batch is tried again one request at a time; a request alone is held back, never sent as it is."""
        if len(items) > 1:
            self._alone.update(i.seq for i in items)
            return None
        item = items[0]
        path = await self._on_thread(self.queue.hold, item, exc.reason)
        self.counters.held.inc(exporter=self.name, reason=exc.reason)
        self.status.counts["held"] += 1
        self.status.last_error = f"request {item.seq} held back: {exc}"
        self.status.held_last = {"seq": item.seq, "signal": item.signal, "bytes": len(item.body),
                                 "reason": exc.reason, "file": str(path)}
        log.error("exporter %s: a %s request of %d bytes was held back, not sent: %s; it is kept in %s",
                  self.name, item.signal, len(item.body), exc, path)
        self._alone.discard(item.seq)
        return None

    def _retry(self, items: list[Item], reason: str, what: str, delay: float = 0.0) -> float:
        if not self._failed:
            self._failing_since = time.monotonic()
        self._failed += 1
        self.counters.retried.inc(len(items), exporter=self.name, reason=reason)
        self.status.counts["retried"] += len(items)
        if self.status.last_error != what:
            log.warning("exporter %s: %s %s; %d queued requests wait, retried with backoff",
                        self.name, masked_url(self.urls[items[0].signal]), what, self.queue.requests)
        self.status.last_error = what
        return delay


def _origin(url: str) -> tuple[str, str, int | None]:
    u = urlsplit(url)
    return u.scheme.lower(), (u.hostname or "").lower(), u.port or {"http": 80, "https": 443}.get(u.scheme.lower())


def state_of(sender: Sender) -> dict[str, Any]:
    """One exporter's entry in ``/api/status``."""
    q = sender.queue
    return {"type": sender.exp.type, "endpoint": masked_url(sender.exp.url), "signals": list(sender.exp.sends),
            "state": sender.status.state, "queued_requests": q.requests, "queued_bytes": q.bytes,
            "max_bytes": q.max_bytes, "oldest_age_s": round(q.oldest_age(), 3), "last_error": sender.status.last_error,
            "retry_in_s": sender.status.retry_in if sender.status.state == "retrying" else 0,
            "held_last": sender.status.held_last, **sender.status.counts}
