"""The forwarding stage: every accepted request queued on disk for each exporter, then sent (``send``).

The receivers call ``refusal`` before a request goes to the writer (a full
queue with ``on_full: backpressure`` refuses it, as a full writer does) and
``accept`` after its DuckDB commit and before its answer: the request is in
the forward queue on disk (``queue``: written once, read by each exporter
from a cursor of its own) before the client hears it was taken, so
"acknowledged" keeps meaning "will be delivered". A crash between the commit
and the queue leaves the client unanswered; it sends again, the store keeps
its spans once, and the queue gets the request.

A JSON request is queued as its protobuf form (what every backend reads);
a protobuf one as the bytes that came in.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..config import Config
from ..metrics import Counter, Metrics
from .queue import ForwardStore
from .send import Counters, ExporterStopped, Sender, state_of

log = logging.getLogger("tracejudge.forward")


class Forwarder:
    """Each configured exporter's queue and sender."""

    def __init__(self, config: Config, metrics: Metrics) -> None:
        self.metrics = metrics
        self.sent = Counter("tracejudge_forward_sent_total", "Requests delivered, by exporter and signal.",
                            ("exporter", "signal"))
        self.retried = Counter("tracejudge_forward_retried_total",
                               "Request sends retried, by exporter and reason (connection, http_503...).",
                               ("exporter", "reason"))
        self.dropped = Counter("tracejudge_forward_dropped_total",
                               "Requests dropped, by exporter and reason (http_400..., queue_full).",
                               ("exporter", "reason"))
        self.held = Counter("tracejudge_forward_held_total",
                            "Requests held back, never sent: their rewrite (redaction) timed out, failed or died; "
                            "by exporter and reason.", ("exporter", "reason"))
        metrics.add_instruments(self.sent, self.retried, self.dropped, self.held)
        metrics.add_collector(self._gauges)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.store = ForwardStore(config.forward_dir, [(name, exp.sends, exp.queue.max_size)
                                                       for name, exp in config.exporters.items()])
        counters = Counters(self.sent, self.retried, self.dropped, self.held)
        key = self.store.secret() if any(e.redact.mode == "content" for e in config.exporters.values()) else b""
        self.senders = [Sender(name, exp, self.store.queues[name], thread_from=config.conversations.id_attributes,
                               key=key, counters=counters)
                        for name, exp in config.exporters.items()]
        for name, exp in config.exporters.items():
            self.dropped.declare(exporter=name, reason="queue_full")
            for signal in exp.sends:
                self.sent.declare(exporter=name, signal=signal)

    def start(self) -> None:
        """Start every sender on the running loop (each resumes its queue where it stopped)."""
        self._loop = asyncio.get_running_loop()
        for s in self.senders:
            if s.queue.requests:
                log.info("exporter %s: %d requests (%d bytes) queued from before are sent first",
                         s.name, s.queue.requests, s.queue.bytes)
            self._tasks.append(asyncio.get_running_loop().create_task(self._run(s), name=f"forward-{s.name}"))

    async def _run(self, s: Sender) -> None:
        try:
            await s.run()
        except asyncio.CancelledError:
            raise
        except ExporterStopped as exc:
            s.status.state = "stopped"
            log.error("exporter %s stopped: %s; its queue is kept on disk and sent after a restart", s.name, exc)
        except Exception:
            s.status.state = "stopped"
            log.exception("exporter %s stopped; its queue is kept on disk and sent after a restart", s.name)

    def refusal(self, signal: str, size: int) -> str | None:
        """Why a request of ``size`` bytes is refused now (a full queue that pushes back), or None."""
        for s in self.senders:
            if signal in s.exp.sends and s.exp.queue.on_full == "backpressure" and s.queue.full(size):
                return (f"the forward queue of exporter {s.name} is full ({s.queue.bytes} of {s.queue.max_bytes} "
                        f"bytes): its backend takes less than arrives")
        return None

    async def accept(self, signal: str, body: bytes) -> None:
        """Queue a committed request (protobuf) for every exporter that forwards ``signal``; returns once it is
        on disk.

        Raises:
            OSError, sqlite3.Error: the queue could not be written (the receiver answers 503; the client retries).
        """
        chosen = [s for s in self.senders if signal in s.exp.sends]
        if not chosen:
            return
        for s in chosen:
            if s.exp.queue.on_full == "drop_oldest" and s.queue.full(len(body)):
                dropped = await asyncio.to_thread(s.queue.drop_oldest, len(body))
                if dropped:
                    self.dropped.inc(dropped, exporter=s.name, reason="queue_full")
                    s.status.counts["dropped"] += dropped
        await asyncio.wrap_future(self.store.put(signal, body))
        for s in chosen:
            s.wake.set()

    def sends(self, signal: str) -> bool:
        """Whether any exporter forwards ``signal``."""
        return any(signal in s.exp.sends for s in self.senders)

    def put(self, signal: str, body: bytes) -> None:
        """``accept`` from a thread other than the loop's (a stage): returns once the request is on disk.

        Raises:
            OSError, sqlite3.Error: the queue could not be written.
        """
        chosen = [s for s in self.senders if signal in s.exp.sends]
        if not chosen:
            return
        self.store.put(signal, body).result()
        if self._loop is not None:
            for s in chosen:
                self._loop.call_soon_threadsafe(s.wake.set)

    async def stop(self) -> None:
        """Stop the senders (a send in flight is cut: its request stays queued), then close the queue."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        for s in self.senders:
            s.close()
        self.store.close()

    def status(self) -> dict[str, Any]:
        """``exporters`` of ``/api/status``."""
        return {"exporters": {s.name: state_of(s) for s in self.senders}}

    def _gauges(self) -> list[str]:
        lines: list[str] = []
        for metric, help_, value in (
                ("tracejudge_forward_queued_requests", "Requests waiting in an exporter's on-disk queue.",
                 lambda s: s.queue.requests),
                ("tracejudge_forward_queued_bytes", "Bytes waiting in an exporter's on-disk queue.",
                 lambda s: s.queue.bytes),
                ("tracejudge_forward_oldest_age_seconds", "Age of the oldest request in an exporter's queue.",
                 lambda s: round(s.queue.oldest_age(), 3))):
            lines += [f"# HELP {metric} {help_}", f"# TYPE {metric} gauge"]
            lines += [f'{metric}{{exporter="{s.name}"}} {value(s)}' for s in self.senders]
        return lines

