"""DuckDB store: the one writer, group commit, and acknowledgement after commit.

Lifecycle: ``Store(...)`` -> ``open()`` (connects, creates the schema, starts the
writer thread) -> ``submit()`` from any thread, any number of times ->
``drain()`` (refuses new work, commits everything queued, stops the thread) ->
``close()`` (drains, closes the file). Reads take their own cursor with ``cursor()``;
background stages give way to ingestion with a ``pacing()`` of their own.

Why a thread: DuckDB calls block. Receivers hand column batches to ``submit``,
which returns a future the writer resolves after the transaction that holds
them has committed; many requests share one insert and one commit. The queue
is bounded in spans and log records (``max_queue_spans``): when it is full
``submit`` raises ``StoreUnavailable`` and the receiver answers with a
retryable status, so nothing is dropped silently.

Once the writer takes a request its future can no longer be cancelled (a gRPC
deadline, a client that went away): the data is committed either way, and only
a caller still waiting is answered. A request whose caller gave up while it was
queued is committed all the same; its retry stores nothing twice.

When a commit fails (disk full) every request in it is refused retryably and
``failure`` says why until a commit succeeds again (``/readyz`` reports it).
DuckDB invalidates the database when a checkpoint fails; the writer then
detaches the file and attaches it again (every ``retry_after`` seconds until it
can), which replays the WAL. Cursors name the attached database, not the
attachment, so every reader's cursor reads the new one. A read that still holds
the old file (DuckDB ran out of memory in a commit while every stage was busy)
keeps it attached, and then only a restart frees it: after ``pinned_give_up``
seconds of that the writer stops, as below. If the writer itself
stops (a bug, a fatal DuckDB error), everything queued is refused, ``broken``
says why and the ``on_broken`` listeners are told, so that the daemon exits
non-zero for its supervisor to restart it; nothing acknowledged is lost, since
only committed data is acknowledged.

A record whose ids (a span's trace and span id, a log record's digest) are among
the newest ``keys_kept`` stored (``recent_keys``) is left out, so an OTLP retry of
an acknowledged request stores nothing twice.
"""

from __future__ import annotations

import collections
import concurrent.futures
import datetime as dt
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import duckdb

from ..errors import StoreUnavailable
from ..ingest.batches import LogBatch, SpanBatch
from ..metrics import Metrics
from .arrow import UINT32, UINT64, Table
from .files import ATTACHED, ROW_GROUP_SIZE, attach_sql, connect, file_fault, first_line, unreadable
from .pacing import Pacing
from .schema import KEY_IDS, KEYS_KEPT, LOG_ARROW, SPAN_ARROW, create_schema, record_keys
from .transactions import Committed, Transaction, registered

log = logging.getLogger("tracejudge.store")


@dataclass
class _Item:
    spans: SpanBatch | None
    logs: LogBatch | None
    size: int
    future: concurrent.futures.Future[tuple[int, int]] = field(default_factory=concurrent.futures.Future)
    waited: bool = False  # the caller still waited when the writer took it (its future is running)

    def take(self) -> None:
        """The writer has it: from now on the future cannot be cancelled under the writer."""
        self.waited = self.future.set_running_or_notify_cancel()


_STOP = object()
# DuckDB's answer to attaching a file that an instance a read still holds has open.
_HELD = "Unique file handle conflict"
PINNED_GIVE_UP = 30.0  # seconds: a read holding the old file lets go within one of its statements, or never


class StorePinned(RuntimeError):
    """The invalidated file cannot be attached again: a read holds it (see the module docstring)."""


@dataclass
class _Fatal:
    """Queued by ``Store.fatal``: the writer stops with this error, as if its own commit had met it."""

    exc: BaseException


class Store:
    """The DuckDB file and its single writer thread."""

    def __init__(self, path: Path, *, memory_limit: str = "128MB", max_queue_spans: int = 200_000,
                 max_batch_spans: int = 8192, retry_after: float = 1.0, metrics: Metrics | None = None,
                 clock: Callable[[], float] = time.time, keys_kept: int = KEYS_KEPT,
                 pinned_give_up: float = PINNED_GIVE_UP) -> None:
        self.path = path
        self.pinned_give_up = pinned_give_up
        self.keys_kept = keys_kept  # the newest records a retry of which stores nothing (``recent_keys``)
        self.clock = clock  # the arrival time of each commit (``received_at``)
        self.memory_limit = memory_limit
        self.max_queue = max_queue_spans
        self.max_batch = max_batch_spans
        self.retry_after = retry_after
        self.metrics = metrics or Metrics()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending = 0
        self._lock = threading.Lock()
        # Held by the background stages' scans over every stored conversation (the evaluator's, retention's
        # windows): each joins several tables, 24-32 MB of DuckDB's memory at 40,000 conversations however
        # small its answer, and two at once with a commit and the key indexes ran out of the 128MB.
        self.large_reads = threading.Lock()
        self._accepting = False
        self._thread: threading.Thread | None = None
        self._con: duckdb.DuckDBPyConnection | None = None
        self._admin: duckdb.DuckDBPyConnection | None = None  # the writer's cursor outside the file: re-attaches it
        self._opening: duckdb.DuckDBPyConnection | None = None  # while ``open`` runs (``interrupt_open``)
        self._batch_id = 0
        self._opened_batch = 0
        self._emptied_at = 0.0  # time.monotonic() when the queue last became empty
        self._listeners: list[Callable[[Committed], None]] = []
        self._broken_listeners: list[Callable[[str], object]] = []
        self._failure: str | None = None
        self._broken: str | None = None
        self._invalid = False  # DuckDB invalidated the attached file: attach it again before writing
        self._pinned_since: float | None = None  # time.monotonic() when a re-attach first met the old file held
        self._taken: list[_Item] = []  # what the writer is committing now
        # The commits whose records' keys ``recent_keys`` holds, oldest first: (commit, keys).
        self._keys: collections.deque[tuple[int, int]] = collections.deque()
        self._keys_total = 0
        self._keys_added = 0  # keys the commit being written adds

    # ------------------------------------------------------------ lifecycle

    def open(self, prepare: Callable[[duckdb.DuckDBPyConnection], object] | None = None) -> None:
        """Connect, create the schema and start the writer.

        ``prepare``: more of the schema (another package's tables), made on the same connection and on the
        same terms: ``interrupt_open`` cuts it short.

        Raises:
            DatabaseLocked: another process holds the file.
            UserError: the file cannot be read (one line naming it and what is wrong).
        """
        con = connect(self.path, memory_limit=self.memory_limit, row_group_size=ROW_GROUP_SIZE)
        self._opening = con
        try:
            create_schema(con)
            if prepare is not None:
                prepare(con)
            self._batch_id = self._opened_batch = self._last_batch(con)
            self._keys = collections.deque(
                con.execute("SELECT batch_id, count(*) FROM recent_keys GROUP BY batch_id ORDER BY batch_id").fetchall())
            self._keys_total = sum(n for _, n in self._keys)
            self._admin = con.cursor()  # its catalog is the in-memory one, never the file
        except duckdb.Error as exc:
            con.close()
            if file_fault(exc) and not isinstance(exc, duckdb.InterruptException):
                raise unreadable(self.path, exc) from None
            raise
        finally:
            self._opening = None
        self._con = con
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="tracejudge-writer", daemon=True)
        self._thread.start()

    def interrupt_open(self) -> None:
        """Cut a running ``open`` short (from another thread): it raises ``duckdb.InterruptException``,
        and the file stays as it was (a rebuild of an older file's tables is one transaction)."""
        con = self._opening
        if con is not None:
            con.interrupt()

    def drain(self) -> None:
        """Stop taking work and commit everything already queued; the file stays open for reads."""
        with self._lock:
            self._accepting = False
            if self._thread is not None:
                self._queue.put(_STOP)
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """``drain``, then close the file."""
        self.drain()
        if self._admin is not None:
            self._admin.close()
            self._admin = None
        if self._con is not None:
            self._con.close()
            self._con = None

    def on_commit(self, listener: Callable[[Committed], None]) -> None:
        """Call ``listener`` in the writer thread after each commit (keep it quick)."""
        self._listeners.append(listener)

    def on_broken(self, listener: Callable[[str], object]) -> None:
        """Call ``listener(reason)`` in the writer thread if the writer stops for good."""
        self._broken_listeners.append(listener)

    def fatal(self, exc: BaseException) -> bool:
        """A reader's cursor met ``exc``; True if it was a fatal DuckDB error.

        One (out of memory while a stage commits, say) invalidates the attached file for every
        cursor, and only a restart helps (it replays the WAL): the writer stops with it, as if its
        own commit had met it (``on_broken``: the daemon exits for its supervisor to restart it).
        Without this, a daemon with nothing to ingest would go on with every stage failing.
        """
        if not isinstance(exc, duckdb.FatalException):
            return False
        with self._lock:
            if self._thread is not None and self._broken is None:
                self._queue.put(_Fatal(exc))
        return True

    # ------------------------------------------------------------ state

    @property
    def queue_depth(self) -> int:
        return self._pending

    @property
    def idle_seconds(self) -> float:
        """How long nothing has been waiting to be stored (0 while something is)."""
        with self._lock:
            return 0.0 if self._pending else time.monotonic() - self._emptied_at

    def pacing(self, *, idle_gap: float, share: float, max_wait: float, poll: float,
               piece: float = math.inf) -> Pacing:
        """A pace of its own for one background stage, over this store's notion of busy ingestion."""
        return Pacing(lambda: self.idle_seconds, idle_gap=idle_gap, share=share, max_wait=max_wait, piece=piece,
                      poll=poll)

    @property
    def batch_id(self) -> int:
        """The id of the last committed transaction."""
        return self._batch_id

    @property
    def opened_batch(self) -> int:
        """The id of the last transaction committed before ``open``: by earlier runs."""
        return self._opened_batch

    @property
    def failure(self) -> str | None:
        """Why the store cannot commit now (its last commit failed, or the writer stopped); None while it can."""
        return self._broken or self._failure

    @property
    def broken(self) -> str | None:
        """Why the writer stopped for good, if it did; the store refuses everything from then on."""
        return self._broken

    # ------------------------------------------------------------ writing

    def submit(self, spans: SpanBatch | None = None, logs: LogBatch | None = None
               ) -> concurrent.futures.Future[tuple[int, int]]:
        """Queue spans and/or log records; the future resolves to (spans, logs) stored after commit.

        Raises:
            StoreUnavailable: the queue is full, the store is closing, or its writer stopped (retryable).
        """
        size = (len(spans) if spans else 0) + (len(logs) if logs else 0)
        item = _Item(spans, logs, size)
        if size == 0:
            item.future.set_result((0, 0))
            return item.future
        with self._lock:
            if self._broken is not None:
                raise StoreUnavailable(f"the store cannot commit: {self._broken}", retry_after=5.0,
                                       reason="storage_error")
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
            # Under the lock: once ``drain`` or a broken writer has refused new work, nothing
            # can be queued behind it and wait for ever.
            self._queue.put(item)
        return item.future

    def _run(self) -> None:
        try:
            self._write()
        except BaseException as exc:  # not one bad batch: a bug, or DuckDB's instance is gone
            self._break(exc)

    def _write(self) -> None:
        while True:
            try:
                # While the file is invalidated, try to attach it again now and then, so that
                # readers work again once space is freed, without waiting for a request.
                first = self._queue.get(timeout=self.retry_after if self._invalid else None)
            except queue.Empty:
                self._reopen()
                continue
            if first is _STOP:
                return
            if isinstance(first, _Fatal):
                raise first.exc
            items = [first]
            size = first.size
            while size < self.max_batch:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is _STOP or isinstance(nxt, _Fatal):
                    self._queue.put(nxt)  # after this commit (a fatal error fails it anyway)
                    break
                items.append(nxt)
                size += nxt.size
            self._commit(items)

    def _commit(self, items: list[_Item]) -> None:
        assert self._con is not None
        self._taken = items
        for it in items:
            it.take()
        if self._invalid and not self._reopen():
            self._finish(items, exc=StoreUnavailable(f"storage commit failed: {self._failure}", retry_after=5.0,
                                                     reason="storage_error"))
            return
        spans = SpanBatch()
        logs = LogBatch()
        for it in items:
            if it.spans:
                spans.extend(it.spans)
            if it.logs:
                logs.extend(it.logs)
        self._batch_id += 1
        # The arrival time, to the microsecond DuckDB stores: what the stage and a reindex read agree.
        stamp = dt.datetime.fromtimestamp(self.clock(), dt.timezone.utc)
        now = stamp.timestamp()
        started = time.perf_counter()
        con = self._con
        try:
            self._keys_added = 0
            with Transaction(con):
                stored_spans = self._insert(con, "span_records", spans, SPAN_ARROW, stamp)
                stored_logs = self._insert(con, "log_records", logs, LOG_ARROW, stamp)
                pruned = self._prune_keys(con)
        except duckdb.FatalException:
            raise  # the whole DuckDB instance is gone: only a restart helps
        except Exception as exc:  # a failed commit fails every request in it, retryably
            log.error("commit of %d spans and %d log records failed: %s", len(spans), len(logs), exc)
            self._batch_id -= 1
            if isinstance(exc, duckdb.Error):  # the storage failed, not this batch's data
                self._failure = first_line(exc)
                if not self._usable():
                    self._invalid = True
                    log.error("DuckDB invalidated %s; attaching it again before the next commit", self.path)
            self._finish(items, exc=StoreUnavailable(f"storage commit failed: {exc}", retry_after=5.0,
                                                     reason="storage_error"))
            return
        self._kept_keys(pruned)
        if self._failure is not None:
            log.warning("storage commits again (after: %s)", self._failure)
            self._failure = None
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

    def _insert(self, con: duckdb.DuckDBPyConnection, table: str, batch: SpanBatch | LogBatch,
                types: dict[str, Any], stamp: dt.datetime) -> int:
        """Store the records of ``batch`` that are not retries of kept ones (``recent_keys``), each once."""
        if not len(batch):
            return 0
        columns: dict[str, Any] = dict(zip(types, batch.columns))
        keys = record_keys(table, [columns[c] for c in KEY_IDS[table]])
        # Joined, not looked up by an IN list of parameters: binding and planning those made ingest a
        # third slower (bench/ingest.py).
        with registered(con, "incoming_keys", Table({"key": keys}, {"key": UINT64})) as view:
            seen = {k for (k,) in con.execute(
                f"SELECT key FROM recent_keys WHERE key IN (SELECT key FROM {view})").fetchall()}
        if seen or len(set(keys)) < len(keys):  # a retry, or one record twice in the commit: the first only
            keep = []
            for i, k in enumerate(keys):
                if k not in seen:
                    seen.add(k)
                    keep.append(i)
            columns = {c: [v[i] for i in keep] for c, v in columns.items()}
            keys = [keys[i] for i in keep]
            if not keys:
                return 0
        if table == "log_records":
            columns["seq"] = range(len(keys))
        rows = Table({**columns, "record_key": keys}, {**types, "seq": UINT32, "record_key": UINT64})
        with registered(con, f"incoming_{table}", rows) as view:
            con.execute(f"INSERT INTO {table} BY NAME SELECT * EXCLUDE (record_key), ?::TIMESTAMPTZ AS received_at, "
                        f"? AS batch_id FROM {view}", [stamp, self._batch_id]).fetchall()
            con.execute(f"INSERT INTO recent_keys SELECT record_key, ? FROM {view}", [self._batch_id]).fetchall()
        self._keys_added += len(keys)
        return len(keys)

    def _prune_keys(self, con: duckdb.DuckDBPyConnection) -> int:
        """Delete the oldest commits' keys down to ``keys_kept`` once there are a tenth more (one delete
        every 50,000 records by default); how many commits' keys went (``_kept_keys`` takes them off
        once the transaction commits)."""
        extra = self._keys_total + self._keys_added - self.keys_kept
        if extra <= self.keys_kept // 10:
            return 0
        dropped, commits, last = 0, 0, 0
        for batch_id, count in self._keys:  # oldest first
            if dropped + count > extra:
                break
            dropped, commits, last = dropped + count, commits + 1, batch_id
        if commits:
            con.execute("DELETE FROM recent_keys WHERE batch_id <= ?", [last]).fetchall()
        return commits

    def _kept_keys(self, pruned: int) -> None:
        """After a commit: its keys are kept, the ``pruned`` oldest commits' are not."""
        for _ in range(pruned):
            self._keys_total -= self._keys.popleft()[1]
        if self._keys_added:
            self._keys.append((self._batch_id, self._keys_added))
            self._keys_total += self._keys_added

    def _finish(self, items: list[_Item], exc: Exception | None = None) -> None:
        with self._lock:
            self._pending -= sum(it.size for it in items)
            self.metrics.queue_depth.set(self._pending)
            if not self._pending:
                self._emptied_at = time.monotonic()
        for it in items:
            if not it.waited:  # its caller gave up before the writer took it: nobody to answer
                continue
            if exc is not None:
                it.future.set_exception(exc)
            else:
                it.future.set_result((len(it.spans or ()), len(it.logs or ())))
        self._taken = []

    # ------------------------------------------------------------ failures

    @staticmethod
    def _last_batch(con: duckdb.DuckDBPyConnection) -> int:
        # fetchall, not fetchone: a result left unfinished on the connection every cursor comes from
        # keeps a transaction open, and once anything changes the catalog (a reindex creates its
        # schema) DuckDB refuses to checkpoint until it ends, so the WAL and memory grow without bound.
        rows = con.execute(
            f"SELECT greatest((SELECT max(batch_id) FROM {ATTACHED}.span_records), "
            f"(SELECT max(batch_id) FROM {ATTACHED}.log_records))"
        ).fetchall()
        return int(rows[0][0] or 0) if rows else 0

    def _usable(self) -> bool:
        """Whether the attached file still answers (DuckDB invalidates it when a checkpoint fails)."""
        assert self._con is not None
        try:
            self._con.execute("SELECT 1 FROM span_records LIMIT 0").fetchall()
        except duckdb.FatalException:
            raise
        except duckdb.Error:
            return False
        return True

    def _reopen(self) -> bool:
        """Detach the invalidated file and attach it again (DuckDB replays its WAL); True once it is back."""
        assert self._admin is not None
        try:
            self._admin.execute(f"DETACH DATABASE IF EXISTS {ATTACHED}")
            self._admin.execute(attach_sql(self.path, ROW_GROUP_SIZE, read_only=False))
            self._batch_id = self._last_batch(self._admin)  # what the replayed WAL holds
        except duckdb.FatalException:
            raise
        except duckdb.Error as exc:
            reason = f"cannot attach {self.path} again: {first_line(exc)}"
            if reason != self._failure:  # once per new reason, not every retry
                log.error("%s; retrying every %gs", reason, self.retry_after)
            self._failure = reason
            if _HELD in str(exc):
                now = time.monotonic()
                self._pinned_since = self._pinned_since or now
                if now - self._pinned_since >= self.pinned_give_up:
                    raise StorePinned(f"{reason} for {self.pinned_give_up:g}s: a read still holds the "
                                      "invalidated file, and only a restart frees it") from exc
            return False
        self._invalid = False
        self._pinned_since = None
        log.warning("attached %s again after DuckDB invalidated it", self.path)
        return True

    def _break(self, exc: BaseException) -> None:
        reason = f"the store's writer stopped ({type(exc).__name__}: {first_line(exc)})"
        log.critical("%s: refusing all data; the daemon must be restarted", reason, exc_info=exc)
        refusal = StoreUnavailable(f"the store cannot commit: {reason}", retry_after=5.0, reason="storage_error")
        with self._lock:
            self._broken = reason
            self._accepting = False
            stranded = list(self._taken)
            while True:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if isinstance(nxt, _Item):
                    stranded.append(nxt)
            self._pending = 0
            self.metrics.queue_depth.set(0)
        for it in stranded:  # answer every caller still waiting, taken or not
            fut = it.future
            if fut.running() or (not fut.done() and fut.set_running_or_notify_cancel()):
                fut.set_exception(refusal)
        for listener in self._broken_listeners:
            try:
                listener(reason)
            except Exception:
                log.exception("listener of the broken writer failed")

    # ------------------------------------------------------------ reading

    def cursor(self, schema: str | None = None) -> duckdb.DuckDBPyConnection:
        """A cursor of its own for one reader (not shared across threads).

        With ``schema``, names resolve there first, then in the main schema, and new tables go there
        (a reindex builds its conversations beside the live ones this way). Read each result to its
        end (``fetchall``): one left open pins the attached file, and attaching it again after a full
        disk then fails.
        """
        if self._con is None:
            raise StoreUnavailable("store is closed")
        cur = self._con.cursor()
        cur.execute(f"USE {ATTACHED}")
        if schema is not None:
            cur.execute(f"SET search_path = '{ATTACHED}.{schema},{ATTACHED}.main'")
        return cur
