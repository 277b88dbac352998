"""DuckDB store: the one writer, group commit, and acknowledgement after commit.

Lifecycle: ``Store(...)`` -> ``open()`` (connects, creates the schema, starts the
writer thread) -> ``submit()`` from any thread, any number of times ->
``close()`` (refuses new work, commits everything queued, stops the thread,
closes the file). Reads take their own cursor with ``cursor()``.

Why a thread: DuckDB calls block. Receivers hand column batches to ``submit``,
which returns a future the writer resolves after the transaction that holds
them has committed; many requests share one insert and one commit. The queue
is bounded in spans and log records (``max_queue_spans``): when it is full
``submit`` raises ``StoreUnavailable`` and the receiver answers with a
retryable status, so nothing is dropped silently.

Spans are unique on (trace_id, span_id) and log records on their digest, so
an OTLP retry of an acknowledged request stores nothing twice.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import duckdb
import pyarrow as pa

from .errors import DatabaseLocked, StoreUnavailable, UserError
from .metrics import Metrics
from .otlp import LOG_COLUMNS, SPAN_COLUMNS, LogBatch, SpanBatch

log = logging.getLogger("tracejudge.store")

SCHEMA = """
CREATE TABLE IF NOT EXISTS span_records (
    trace_id VARCHAR NOT NULL,
    span_id VARCHAR NOT NULL,
    parent_span_id VARCHAR,
    trace_state VARCHAR,
    flags UINTEGER,
    name VARCHAR,
    kind TINYINT,
    start_time_unix_nano UBIGINT,
    end_time_unix_nano UBIGINT,
    attributes VARCHAR,
    events VARCHAR,
    links VARCHAR,
    status_code TINYINT,
    status_message VARCHAR,
    dropped VARCHAR,
    resource VARCHAR,
    resource_schema_url VARCHAR,
    scope_name VARCHAR,
    scope_version VARCHAR,
    scope_attributes VARCHAR,
    service VARCHAR,
    received_at TIMESTAMPTZ NOT NULL,
    batch_id UBIGINT NOT NULL,
    PRIMARY KEY (trace_id, span_id)
);
CREATE TABLE IF NOT EXISTS log_records (
    log_id VARCHAR PRIMARY KEY,
    trace_id VARCHAR,
    span_id VARCHAR,
    time_unix_nano UBIGINT,
    observed_time_unix_nano UBIGINT,
    severity_number INTEGER,
    severity_text VARCHAR,
    event_name VARCHAR,
    body VARCHAR,
    attributes VARCHAR,
    flags UINTEGER,
    dropped_attributes_count UINTEGER,
    resource VARCHAR,
    scope_name VARCHAR,
    scope_version VARCHAR,
    service VARCHAR,
    received_at TIMESTAMPTZ NOT NULL,
    batch_id UBIGINT NOT NULL
);
-- A record's place in its commit: records of one call often share a timestamp, and
-- INSERT OR IGNORE does not store rows in the order given. Added to older files.
ALTER TABLE log_records ADD COLUMN IF NOT EXISTS seq UINTEGER;
-- JSON columns are stored as VARCHAR (we write valid JSON; DuckDB's JSON type
-- would parse every value again on insert, halving throughput) and typed JSON
-- in the views.
-- Which conversation a trace belongs to. The map, not the span row, says where
-- a span belongs, so children that arrive before the span carrying the id
-- move with their trace without rewriting stored rows.
CREATE TABLE IF NOT EXISTS trace_conversations (
    trace_id VARCHAR PRIMARY KEY,
    conversation_id VARCHAR NOT NULL
);
CREATE OR REPLACE VIEW spans AS
SELECT s.trace_id, s.span_id, s.parent_span_id, t.conversation_id, s.name, s.kind,
       make_timestamp_ns(s.start_time_unix_nano::BIGINT) AS start_time,
       make_timestamp_ns(s.end_time_unix_nano::BIGINT) AS end_time,
       s.attributes::JSON AS attributes, s.events::JSON AS events, s.links::JSON AS links,
       s.status_code, s.status_message, s.resource::JSON AS resource, s.scope_name, s.scope_version,
       s.service, s.trace_state, s.flags, s.dropped::JSON AS dropped, s.resource_schema_url,
       s.scope_attributes::JSON AS scope_attributes,
       s.start_time_unix_nano, s.end_time_unix_nano, s.received_at, s.batch_id
FROM span_records s LEFT JOIN trace_conversations t USING (trace_id);
CREATE OR REPLACE VIEW logs AS
SELECT l.log_id, l.trace_id, l.span_id, t.conversation_id, l.event_name,
       make_timestamp_ns(l.time_unix_nano::BIGINT) AS time,
       l.severity_number, l.severity_text, l.body::JSON AS body, l.attributes::JSON AS attributes,
       l.resource::JSON AS resource,
       l.scope_name, l.scope_version, l.service, l.flags, l.dropped_attributes_count,
       l.time_unix_nano, l.observed_time_unix_nano, l.received_at, l.batch_id
FROM log_records l LEFT JOIN trace_conversations t USING (trace_id);
"""

_SPAN_TYPES = {
    "flags": pa.uint32(), "kind": pa.int8(), "start_time_unix_nano": pa.uint64(),
    "end_time_unix_nano": pa.uint64(), "status_code": pa.int8(),
}
_LOG_TYPES = {
    "time_unix_nano": pa.uint64(), "observed_time_unix_nano": pa.uint64(),
    "severity_number": pa.int32(), "flags": pa.uint32(), "dropped_attributes_count": pa.uint32(),
}
_SPAN_SCHEMA = pa.schema([(c, _SPAN_TYPES.get(c, pa.string())) for c in SPAN_COLUMNS])
_LOG_SCHEMA = pa.schema([(c, _LOG_TYPES.get(c, pa.string())) for c in LOG_COLUMNS])


@dataclass
class Committed:
    """What one transaction stored; handed to commit listeners."""

    batch_id: int
    received_at: float
    spans: SpanBatch
    logs: LogBatch
    spans_stored: int
    logs_stored: int


@dataclass
class _Item:
    spans: SpanBatch | None
    logs: LogBatch | None
    size: int
    future: concurrent.futures.Future[tuple[int, int]] = field(default_factory=concurrent.futures.Future)


_STOP = object()
ATTACHED = "tracejudge"
# Rows per row group. A checkpoint rewrites the row group that commits are still
# filling; at DuckDB's default of 122,880 rows of 1-2 KB spans that took up to
# 2.8 s (every request waits for it) and held its memory; 8192 rows take ~0.15 s.
ROW_GROUP_SIZE = 8192


def _lock_holder(message: str) -> str:
    m = re.search(r"PID (\d+)", message)
    return m.group(1) if m else "unknown"


def connect(path: Path, read_only: bool = False, memory_limit: str | None = None,
            row_group_size: int | None = None) -> duckdb.DuckDBPyConnection:
    """Open the DuckDB file, turning a lock conflict into one clear line.

    With ``row_group_size`` the file is attached as ``ATTACHED`` (the only way to set it),
    and every cursor must ``USE`` it (``Store.cursor`` does).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    config: dict[str, str | bool | int | float | list[str]] = {"memory_limit": memory_limit} if memory_limit else {}
    try:
        if row_group_size is None:
            return duckdb.connect(str(path), read_only=read_only, config=config)
        con = duckdb.connect(config={**config, "temp_directory": f"{path}.tmp"})
        try:
            quoted = str(path).replace("'", "''")
            con.execute(f"ATTACH '{quoted}' AS {ATTACHED} (ROW_GROUP_SIZE {int(row_group_size)}"
                        f"{', READ_ONLY' if read_only else ''})")
            con.execute(f"USE {ATTACHED}")
        except BaseException:
            con.close()
            raise
        return con
    except duckdb.IOException as exc:
        msg = str(exc)
        if "lock" in msg.lower():
            raise DatabaseLocked(
                f"{path} is locked by process {_lock_holder(msg)}, which does not answer as a tracejudge daemon"
            ) from None
        raise UserError(f"cannot open {path}: {msg.splitlines()[0]}") from None


class Store:
    """The DuckDB file and its single writer thread."""

    def __init__(self, path: Path, *, memory_limit: str = "256MB", max_queue_spans: int = 200_000,
                 max_batch_spans: int = 8192, retry_after: float = 1.0, metrics: Metrics | None = None) -> None:
        self.path = path
        self.memory_limit = memory_limit
        self.max_queue = max_queue_spans
        self.max_batch = max_batch_spans
        self.retry_after = retry_after
        self.metrics = metrics or Metrics()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending = 0
        self._lock = threading.Lock()
        self._accepting = False
        self._thread: threading.Thread | None = None
        self._con: duckdb.DuckDBPyConnection | None = None
        self._batch_id = 0
        self._emptied_at = 0.0  # time.monotonic() when the queue last became empty
        self._listeners: list[Callable[[Committed], None]] = []

    # ------------------------------------------------------------ lifecycle

    def open(self) -> None:
        con = connect(self.path, memory_limit=self.memory_limit, row_group_size=ROW_GROUP_SIZE)
        con.execute(SCHEMA)
        row = con.execute(
            "SELECT greatest((SELECT max(batch_id) FROM span_records), (SELECT max(batch_id) FROM log_records))"
        ).fetchone()
        self._batch_id = int(row[0] or 0) if row else 0
        self._con = con
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="tracejudge-writer", daemon=True)
        self._thread.start()

    def drain(self) -> None:
        """Stop taking work and commit everything already queued; the file stays open for reads."""
        with self._lock:
            self._accepting = False
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """``drain``, then close the file."""
        self.drain()
        if self._con is not None:
            self._con.close()
            self._con = None

    def on_commit(self, listener: Callable[[Committed], None]) -> None:
        """Call ``listener`` in the writer thread after each commit (keep it quick)."""
        self._listeners.append(listener)

    # ------------------------------------------------------------ writing

    @property
    def queue_depth(self) -> int:
        return self._pending

    @property
    def idle_seconds(self) -> float:
        """How long nothing has been waiting to be stored (0 while something is)."""
        with self._lock:
            return 0.0 if self._pending else time.monotonic() - self._emptied_at

    @property
    def batch_id(self) -> int:
        """The id of the last committed transaction."""
        return self._batch_id

    def submit(self, spans: SpanBatch | None = None, logs: LogBatch | None = None
               ) -> concurrent.futures.Future[tuple[int, int]]:
        """Queue spans and/or log records; the future resolves to (spans, logs) stored after commit.

        Raises:
            StoreUnavailable: the queue is full or the store is closing (retryable).
        """
        size = (len(spans) if spans else 0) + (len(logs) if logs else 0)
        item = _Item(spans, logs, size)
        if size == 0:
            item.future.set_result((0, 0))
            return item.future
        with self._lock:
            if not self._accepting:
                raise StoreUnavailable("tracejudge is shutting down", retry_after=5.0)
            # A request larger than the whole queue is admitted when the queue is
            # empty: otherwise it could never be stored.
            if self._pending and self._pending + size > self.max_queue:
                raise StoreUnavailable(
                    f"ingest queue full ({self._pending} of {self.max_queue} spans and log records waiting)",
                    retry_after=self.retry_after)
            self._pending += size
            self.metrics.queue_depth.set(self._pending)
        self._queue.put(item)
        return item.future

    def _run(self) -> None:
        stop = False
        while not stop:
            first = self._queue.get()
            if first is _STOP:
                break
            items = [first]
            size = first.size
            while size < self.max_batch:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is _STOP:
                    stop = True
                    break
                items.append(nxt)
                size += nxt.size
            self._commit(items)
        # Anything queued after the stop marker (a race with close) is still committed.
        rest = []
        while True:
            try:
                nxt = self._queue.get_nowait()
            except queue.Empty:
                break
            if nxt is not _STOP:
                rest.append(nxt)
        if rest:
            self._commit(rest)

    def _commit(self, items: list[_Item]) -> None:
        assert self._con is not None
        spans = SpanBatch()
        logs = LogBatch()
        for it in items:
            if it.spans:
                spans.extend(it.spans)
            if it.logs:
                logs.extend(it.logs)
        self._batch_id += 1
        now = time.time()
        started = time.perf_counter()
        con = self._con
        try:
            con.begin()
            stored_spans = self._insert(con, "span_records", "incoming_spans", spans, _SPAN_SCHEMA, now)
            stored_logs = self._insert(con, "log_records", "incoming_logs", logs, _LOG_SCHEMA, now)
            con.commit()
        except Exception as exc:  # a failed commit fails every request in it, retryably
            log.error("commit of %d spans and %d log records failed: %s", len(spans), len(logs), exc)
            try:
                con.rollback()
            except duckdb.Error:
                pass
            self._batch_id -= 1
            self._finish(items, exc=StoreUnavailable(f"storage commit failed: {exc}", retry_after=5.0,
                                                          reason="storage_error"))
            return
        self.metrics.commit_seconds.observe(time.perf_counter() - started)
        self.metrics.spans_stored.inc(stored_spans)
        self.metrics.logs_stored.inc(stored_logs)
        self._finish(items)
        committed = Committed(self._batch_id, now, spans, logs, stored_spans, stored_logs)
        for listener in self._listeners:
            try:
                listener(committed)
            except Exception:
                log.exception("commit listener failed")

    def _insert(self, con: duckdb.DuckDBPyConnection, table: str, view: str, batch: SpanBatch | LogBatch,
                schema: pa.Schema, now: float) -> int:
        if not len(batch):
            return 0
        arrow = pa.Table.from_arrays(
            [pa.array(col, type=schema.field(i).type) for i, col in enumerate(batch.columns)], schema=schema)
        if table == "log_records":
            arrow = arrow.append_column("seq", pa.array(range(len(batch)), pa.uint32()))
        con.register(view, arrow)
        try:
            row = con.execute(
                f"INSERT OR IGNORE INTO {table} BY NAME SELECT *, to_timestamp(?) AS received_at, ? AS batch_id "
                f"FROM {view}",
                [now, self._batch_id],
            ).fetchone()
        finally:
            con.unregister(view)
        return int(row[0]) if row else 0

    def _finish(self, items: list[_Item], exc: Exception | None = None) -> None:
        with self._lock:
            self._pending -= sum(it.size for it in items)
            self.metrics.queue_depth.set(self._pending)
            if not self._pending:
                self._emptied_at = time.monotonic()
        for it in items:
            if exc is not None:
                it.future.set_exception(exc)
            else:
                it.future.set_result((len(it.spans or ()), len(it.logs or ())))

    # ------------------------------------------------------------ reading

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """A cursor of its own for one reader (not shared across threads)."""
        if self._con is None:
            raise StoreUnavailable("store is closed")
        cur = self._con.cursor()
        cur.execute(f"USE {ATTACHED}")
        return cur

