"""What a request becomes: column batches of spans and log records, and who takes them.

``SpanBatch`` and ``LogBatch`` hold the rows of one or more requests column by
column, in ``SPAN_COLUMNS`` / ``LOG_COLUMNS`` order, exactly as the store inserts
them. The receivers hand them to a ``Consumer`` (the store in the daemon) and
answer once its future resolves: after the commit.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Any, Protocol

SPAN_COLUMNS = (
    "trace_id", "span_id", "parent_span_id", "trace_state", "flags", "name", "kind",
    "start_time_unix_nano", "end_time_unix_nano", "attributes", "events", "links",
    "status_code", "status_message", "dropped", "resource", "resource_schema_url",
    "scope_name", "scope_version", "scope_attributes", "service",
)

LOG_COLUMNS = (
    "log_id", "trace_id", "span_id", "time_unix_nano", "observed_time_unix_nano",
    "severity_number", "severity_text", "event_name", "body", "attributes", "flags",
    "dropped_attributes_count", "resource", "scope_name", "scope_version", "service",
)


@dataclass
class SpanBatch:
    """Spans of one or more requests, column by column, in ``SPAN_COLUMNS`` order."""

    columns: list[list[Any]] = field(default_factory=lambda: [[] for _ in SPAN_COLUMNS])

    def __len__(self) -> int:
        return len(self.columns[0])

    def extend(self, other: "SpanBatch") -> None:
        for mine, theirs in zip(self.columns, other.columns):
            mine.extend(theirs)

    def rows(self) -> list[dict[str, Any]]:
        """Row view, for tests and small reads; the store never uses it."""
        return [dict(zip(SPAN_COLUMNS, r)) for r in zip(*self.columns)]


@dataclass
class LogBatch:
    """Log records of one or more requests, column by column, in ``LOG_COLUMNS`` order."""

    columns: list[list[Any]] = field(default_factory=lambda: [[] for _ in LOG_COLUMNS])

    def __len__(self) -> int:
        return len(self.columns[0])

    def extend(self, other: "LogBatch") -> None:
        for mine, theirs in zip(self.columns, other.columns):
            mine.extend(theirs)

    def rows(self) -> list[dict[str, Any]]:
        return [dict(zip(LOG_COLUMNS, r)) for r in zip(*self.columns)]


class Consumer(Protocol):
    """Takes a request's batches; the future resolves to (spans, logs) once they are stored.

    Raises ``StoreUnavailable`` (retryable: queue full, shutting down, storage failing)
    instead of taking them.
    """

    def submit(self, spans: SpanBatch | None = None, logs: LogBatch | None = None
               ) -> concurrent.futures.Future[tuple[int, int]]: ...
