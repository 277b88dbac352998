"""Prometheus metrics for /metrics: counters, gauges and one histogram, thread-safe.

A handful of instruments does not justify a client library; the text format
is small and stable (https://prometheus.io/docs/instrumenting/exposition_formats/).
"""

from __future__ import annotations

import bisect
import threading
from typing import Callable


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class _Instrument:
    kind = ""

    def __init__(self, name: str, help: str, labelnames: tuple[str, ...] = ()) -> None:
        self.name = name
        self.help = help
        self.labelnames = labelnames
        self._lock = threading.Lock()
        self._values: dict[tuple[str, ...], float] = {} if labelnames else {(): 0.0}

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {tuple(labels)}")
        return tuple(labels[n] for n in self.labelnames)

    def value(self, **labels: str) -> float:
        return self._values.get(self._key(labels), 0.0)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        with self._lock:
            items = sorted(self._values.items())
        for key, val in items:
            lines.append(f"{self.name}{_labels(dict(zip(self.labelnames, key)))} {_num(val)}")
        return lines


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(v)


class Counter(_Instrument):
    kind = "counter"

    def declare(self, **labels: str) -> None:
        """Show this label set as 0 before anything happens, so dashboards see the series."""
        with self._lock:
            self._values.setdefault(self._key(labels), 0.0)

    def inc(self, amount: float = 1, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount


class Gauge(_Instrument):
    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        with self._lock:
            self._values[self._key(labels)] = value

    def remove(self, **labels: str) -> None:
        """Drop this label set from /metrics: a value that cannot be had now is absent, never a stale one."""
        with self._lock:
            self._values.pop(self._key(labels), None)


class Histogram(_Instrument):
    kind = "histogram"
    BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

    def __init__(self, name: str, help: str) -> None:
        super().__init__(name, help)
        self._counts = [0] * (len(self.BUCKETS) + 1)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.BUCKETS, value)] += 1
            self._sum += value

    @property
    def count(self) -> int:
        return sum(self._counts)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        with self._lock:
            counts = list(self._counts)
            total = self._sum
        cum = 0
        for bound, c in zip(self.BUCKETS, counts):
            cum += c
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {cum}')
        cum += counts[-1]
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {cum}')
        lines.append(f"{self.name}_sum {total!r}")
        lines.append(f"{self.name}_count {cum}")
        return lines


REJECT_REASONS = ("invalid", "too_large", "unauthenticated", "backpressure", "storage_error")


class Metrics:
    """Every instrument of the daemon; one instance per process."""

    def __init__(self) -> None:
        self.spans_received = Counter("tracejudge_spans_received_total", "Spans received in OTLP requests.")
        self.spans_stored = Counter("tracejudge_spans_stored_total", "Spans committed to DuckDB (retries stored once).")
        self.spans_rejected = Counter(
            "tracejudge_spans_rejected_total", "Spans refused, by reason: " + ", ".join(REJECT_REASONS) + ".", ("reason",))
        self.logs_received = Counter("tracejudge_log_records_received_total", "Log records received.")
        self.logs_stored = Counter("tracejudge_log_records_stored_total", "Log records committed to DuckDB.")
        self.logs_rejected = Counter("tracejudge_log_records_rejected_total", "Log records refused, by reason.",
                                     ("reason",))
        self.metric_points = Counter("tracejudge_metric_points_received_total",
                                     "Metric data points received and discarded.")
        self.requests = Counter("tracejudge_requests_total", "OTLP requests by transport, signal and outcome.",
                                ("transport", "signal", "outcome"))
        self.queue_depth = Gauge("tracejudge_ingest_queue_depth",
                                 "Spans and log records waiting for the writer.")
        self.commit_seconds = Histogram("tracejudge_commit_seconds", "Time of one DuckDB insert+commit.")
        self.conversations_ended = Counter("tracejudge_conversations_ended_total",
                                           "Conversations ended, by how (idle or an end rule).", ("ended_by",))
        self.conversations_reopened = Counter("tracejudge_conversations_reopened_total",
                                              "Ended conversations reopened by a new trace.")
        self.genai_traces_without_content = Counter(
            "tracejudge_genai_traces_without_content_total",
            "Traces with LLM calls but neither a conversation id nor message content: their spans are stored, "
            "they make no conversation (turn content capture on, e.g. "
            "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY).")
        self.stage_errors = Counter("tracejudge_stage_errors_total",
                                    "Failures a background stage logged with their traceback and went on from, "
                                    "by stage.", ("stage",))
        self.stage_running = Gauge("tracejudge_stage_running",
                                   "1 while a background stage runs, 0 once it stopped for good (/readyz names it): "
                                   "restart the daemon.", ("stage",))
        self.stage_held = Gauge("tracejudge_stage_held",
                                "What a background stage holds in memory, by stage and structure (rows or entries).",
                                ("stage", "what"))
        for reason in REJECT_REASONS:
            self.spans_rejected.declare(reason=reason)
            self.logs_rejected.declare(reason=reason)
        self._extra: list[Callable[[], list[str]]] = []
        self._refresh: list[Callable[[], None]] = []

    def on_scrape(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` before each render (to set gauges read at scrape time)."""
        self._refresh.append(fn)

    def add_collector(self, fn: Callable[[], list[str]]) -> None:
        """Add lines computed at scrape time (for example counts read from DuckDB)."""
        self._extra.append(fn)

    def add_instruments(self, *instruments: _Instrument) -> None:
        """Render a stage's own instruments after the daemon's."""
        self._extra.append(lambda: [line for i in instruments for line in i.render()])

    def render(self) -> str:
        for fn in self._refresh:
            fn()
        lines: list[str] = []
        for inst in (self.spans_received, self.spans_stored, self.spans_rejected, self.logs_received,
                     self.logs_stored, self.logs_rejected, self.metric_points, self.requests,
                     self.queue_depth, self.commit_seconds, self.conversations_ended,
                     self.conversations_reopened, self.genai_traces_without_content, self.stage_errors,
                     self.stage_running, self.stage_held):
            lines.extend(inst.render())
        for collect in self._extra:
            lines.extend(collect())
        return "\n".join(lines) + "\n"
