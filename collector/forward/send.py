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
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from ..config import Exporter
from ..metrics import Counter
from .queue import DiskQueue, Item
from .rewrite import rewrite

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


class Sender:
    """Sends one exporter's queue (see the module docstring); ``run`` until cancelled."""

    def __init__(self, name: str, exp: Exporter, queue: DiskQueue, *, thread_from: Sequence[str],
                 sent: Counter, retried: Counter, dropped: Counter) -> None:
        self.name, self.exp, self.queue = name, exp, queue
        self.thread_from = tuple(thread_from) if exp.type == "langsmith" else ()
        self.headers = auth_headers(exp)
        self.urls = {"traces": exp.url, "logs": logs_url(exp.url)}
        self.sent, self.retried, self.dropped = sent, retried, dropped
        self.status = SenderState()
        self.wake = asyncio.Event()
        self._alone: set[int] = set()  # seqs of a refused batch, now sent one at a time

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.exp.timeout)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            failures = 0
            while True:
                items = await asyncio.to_thread(self._front)
                if not items:
                    self.status.state = "idle"
                    self.wake.clear()
                    if self.queue.requests == 0:
                        await self.wake.wait()
                    continue
                self.status.state = "sending" if not failures else "retrying"
                delay = await self._send(session, items)
                if delay is None:
                    failures = 0
                    continue
                failures += 1
                wait = delay if delay > 0 else min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** (failures - 1))
                self.status.state, self.status.retry_in = "retrying", wait
                await asyncio.sleep(wait)

    def _front(self) -> list[Item]:
        items = self.queue.peek(MAX_BATCH_BYTES)
        if items and items[0].seq in self._alone:
            return items[:1]
        return items

    async def _send(self, session: aiohttp.ClientSession, items: list[Item]) -> float | None:
        """One attempt; None when the items left the queue (delivered or dropped), else the delay the backend
        asked for (0: back off)."""
        signal = items[0].signal
        body = b"".join(await asyncio.to_thread(
            lambda: [rewrite(i.signal, i.body, thread_from=self.thread_from, redact=self.exp.redact == "content")
                     for i in items]))
        resent = sum(1 for i in items if i.attempts and i.seq not in self._alone)
        await asyncio.to_thread(self.queue.attempted, items)
        try:
            async with session.post(self.urls[signal], data=body, headers=self.headers) as resp:
                await resp.read()
                status, retry_after = resp.status, resp.headers.get("Retry-After")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return self._retry(items, "connection", f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        if 200 <= status < 300:
            await asyncio.to_thread(self.queue.remove, items)
            self._alone.difference_update(i.seq for i in items)
            self.sent.inc(len(items), exporter=self.name, signal=signal)
            self.status.counts["sent"] += len(items)
            self.status.counts["resent_after_restart"] += resent
            self.status.last_sent_at, self.status.last_error = time.time(), None
            return None
        if status in (408, 429) or status >= 500:
            return self._retry(items, f"http_{status}", f"answered {status}", _retry_after(retry_after))
        if len(items) > 1:  # find the one refused: each is sent alone
            self._alone.update(i.seq for i in items)
            return None
        await asyncio.to_thread(self.queue.remove, items)
        self._alone.discard(items[0].seq)
        self.dropped.inc(exporter=self.name, reason=f"http_{status}")
        self.status.counts["dropped"] += 1
        self.status.last_error = f"answered {status}: a permanent refusal, the request was dropped"
        log.warning("exporter %s: %s answered %d for a %s request of %d bytes: dropped, not retried",
                    self.name, self.urls[signal], status, signal, len(body))
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
