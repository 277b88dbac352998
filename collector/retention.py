"""Retention: what ``storage.retention`` lets go, deleted in small transactions that give way to ingestion.

A background ``Stage`` (``collector.background``) after all the others, since it
deletes what each of them wrote. Each sweep, once a minute or at once while
something is due:

1. **spans of expired conversations**: an ended conversation whose last row
   arrived before ``now - retention.spans`` loses all its span and log rows at
   once (a conversation has all its spans or none). Its transcript, verdicts and
   review items stay; ``reindex`` keeps it as stored. The sweep goes in order of
   last arrival and stops at the first conversation still open or without a
   sampling decision (the rules read its spans), so none is passed over.
2. **traces of no conversation** (other services' spans, traceless logs): by
   commit, a few commits at a time, once every row of the commit is older than
   the horizon.
3. **expired conversations**: ended, last arrival before ``now -
   retention.conversations``, nothing due for the evaluator (a sampling
   decision, a judgement of its current revision, a retry: ``JUDGEMENT_DUE``),
   and with ``keep_reviewed`` no review item: its row, messages, sampling
   decision, verdicts, not-run records, progress row, trace map rows and spans go
   in one transaction, so a kill -9 leaves it whole or gone.

Nothing the conversation stage has not taken in yet is touched: every delete is
bounded by its stored batch mark. Each transaction waits for a pause in
ingestion (``store.pacing``) and deletes at most ``chunk`` conversations or
``CHUNK_COMMITS`` commits. Forwarding keeps its own copy of every request it has
still to send (``collector.forward.queue``), so no delete here takes one from it.

DuckDB marks deleted rows and, at its next checkpoint, frees row groups left
empty and rewrites ones mostly deleted; the freed blocks are reused by later
writes, so the file stops growing once deletion keeps up with arrival, but it
never shrinks (docs/operations.md, "Disk").
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import duckdb

from .background import Stage
from .config import Retention as Settings, size_bytes
from .conversations.writes import delete_messages
from .evals.judging import JUDGEMENT_DUE, RETRY_DUE, utc
from .listing import iso_utc
from .memory import INDEX_WARNING, duckdb_memory, index_eighths
from .metrics import Counter, Gauge, Metrics
from .store import Store, Transaction
from .store.transactions import COMMIT_TRACES, batch_filter, conversation_traces, mapped_traces, registered_rows
from .words import size_text

log = logging.getLogger("tracejudge.retention")

INTERVAL = 60.0  # seconds between sweeps when nothing was due
# Conversations per transaction. Each transaction waits for a pause in ingestion, and pauses are what
# retention runs short of: at 100, a soak at 3,000 spans/s (about 190 conversations/s) deleted slower
# than data arrived, for minutes at a time.
CHUNK = 400
# Commits (up to max_batch_spans rows each) looked through for traces of no conversation per transaction.
# At 4, the same soak spent most of its turns walking commits whose every trace had a conversation.
CHUNK_COMMITS = 64
# Expired conversations looked at per chunk deleted: those still due for the evaluator are passed over, a
# window at a time, so that a sweep reads all of them in a few queries, each with bounded memory.
WINDOW = 10
# Its pace: deleting holds DuckDB's writer for a few ms per statement; it waits for the same pause
# as the conversation stage and takes at most a tenth of the time when none comes. Under 6,000 spans/s,
# which never pauses, a tenth deleted about 2,000 spans/s: after a sweep that took longer than the
# interval between two (slower than data expires), the next takes half.
IDLE_GAP = 0.1
SHARE = 0.1
SHARE_BEHIND = 0.5
MAX_WAIT = 30.0
POLL = 0.05

_TABLES = ("span_records", "log_records")
# The next conversations past a horizon (parameters: the horizon; the last one passed: arrival, arrival, id;
# how many), limited before they are joined: joined first, every one past the horizon went through DuckDB's
# hash tables, and a sweep after a backlog (hundreds of thousands past it) ran out of DuckDB's memory.
_NEXT = ("SELECT conversation_id, last_arrival_at, {columns} FROM conversations WHERE last_arrival_at < ? {ended}"
         "AND (last_arrival_at > ? OR (last_arrival_at = ? AND conversation_id > ?)) "
         "ORDER BY last_arrival_at, conversation_id LIMIT ?")
_OLDEST = {"spans": "SELECT min(received_at) FROM span_records",
           "log_records": "SELECT min(received_at) FROM log_records",
           "conversations": "SELECT min(last_arrival_at) FROM conversations"}


class RetentionMetrics:
    def __init__(self, metrics: Metrics) -> None:
        self.deleted = Counter("tracejudge_retention_deleted_total",
                               "Rows deleted by storage.retention, by kind (spans, log_records, conversations).",
                               ("what",))
        self.oldest = Gauge("tracejudge_retention_oldest_timestamp_seconds",
                            "Arrival time (unix seconds) of the oldest row kept, by kind; absent when none.",
                            ("what",))
        for what in _OLDEST:
            self.deleted.declare(what=what)
        metrics.add_instruments(self.deleted, self.oldest)


class Retention(Stage):
    """Deletes what ``storage.retention`` lets go (see the module docstring)."""

    name = "retention"

    def __init__(self, store: Store, settings: Settings, metrics: Metrics, *,
                 clock: Callable[[], float] = time.time, interval: float = INTERVAL, chunk: int = CHUNK,
                 max_wait: float = MAX_WAIT) -> None:
        super().__init__(store, metrics)
        self.settings = settings
        self.clock = clock
        self.interval = interval
        self.chunk = chunk
        self.pacing = store.pacing(idle_gap=IDLE_GAP, share=SHARE, max_wait=max_wait, poll=POLL)
        self.m = RetentionMetrics(metrics)
        self.oldest: dict[str, dt.datetime | None] = {}
        self.sweeps = 0  # sweeps completed (tests wait on it through /api/status)
        self._indexes_warned = 0  # eighths of the memory limit the key indexes held at the last warning

    # ------------------------------------------------------------ the loop

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.sweep()
                self.cycle_ok()
                delay = self.interval
            except _Stopping:
                return
            except Exception:  # noqa: BLE001 - a conflict with another stage's write, a full disk: next sweep
                delay = self.cycle_failed("a retention sweep failed")
            self.stopping.wait(delay)

    def sweep(self) -> dict[str, int]:
        """Delete everything due now, a transaction at a time; what was deleted, by kind."""
        began = time.monotonic()
        try:
            return self._sweep()
        finally:
            # The last piece ends here: ended by the next sweep's first turn instead, it took in the
            # interval between sweeps, and under steady ingestion the share made that sweep wait nine.
            self.pacing.rest()
            self.pacing.share = SHARE_BEHIND if time.monotonic() - began > self.interval else SHARE

    def _sweep(self) -> dict[str, int]:
        assert self.cur is not None
        deleted = {what: 0 for what in _OLDEST}
        now = self.clock()
        # The conversation stage's stored batch mark: later commits are not taken in yet.
        mark = int(self._state("conversations.batch", "0"))
        if self.settings.spans is not None:
            horizon = utc(now - self.settings.spans)
            while self._turn() and self._expire_conversation_spans(horizon, mark, deleted):
                pass
            while self._turn() and self._expire_commits(horizon, mark, deleted):
                pass
        if self.settings.conversations is not None:
            horizon = utc(now - self.settings.conversations)
            after: list[Any] = [utc(0), ""]
            while self._turn() and self._expire_conversations(horizon, mark, deleted, after):
                pass
        self._measure()
        self._check_indexes()
        self.sweeps += 1
        if any(deleted.values()):
            log.info("retention deleted %s", ", ".join(f"{n} {what.replace('_', ' ')}"
                                                       for what, n in deleted.items() if n))
        return deleted

    def _turn(self) -> bool:
        self.pacing.done()
        if not self.pacing.wait(self.stopping):
            raise _Stopping
        return True

    def _state(self, key: str, default: Any) -> Any:
        assert self.cur is not None
        rows = self.cur.execute("SELECT value FROM tracejudge_state WHERE key = ?", [key]).fetchall()
        return rows[0][0] if rows else default

    def _set_state(self, key: str, value: str) -> None:
        assert self.cur is not None
        self.cur.execute("INSERT OR REPLACE INTO tracejudge_state VALUES (?, ?)", [key, value])

    # ------------------------------------------------------------ the three deletes

    def _expire_conversation_spans(self, horizon: dt.datetime, mark: int, deleted: dict[str, int]) -> bool:
        """One chunk of step 1; True when a full chunk was done (more may be due)."""
        cur = self.cur
        assert cur is not None
        at, after = self._state("retention.spans_at", ""), self._state("retention.spans_after", "")
        since = dt.datetime.fromisoformat(at) if at else utc(0)
        with self.store.large_reads:
            rows = cur.execute(
                f"WITH c AS ({_NEXT.format(columns='state, first_batch', ended='')}) "
                "SELECT c.conversation_id, c.state, c.last_arrival_at, s.conversation_id IS NOT NULL, c.first_batch "
                "FROM c LEFT JOIN sampling_decisions s ON s.conversation_id = c.conversation_id "
                "ORDER BY c.last_arrival_at, c.conversation_id",
                [horizon, since, since, after, self.chunk]).fetchall()
        ids: list[str] = []
        firsts: list[int | None] = []
        last: tuple[dt.datetime, str] | None = None
        for cid, state, arrived, decided, first in rows:
            if state != "ended" or not decided:
                break  # it may end with this arrival time, or its sampling rules read its spans: wait for it
            ids.append(cid)
            firsts.append(first)
            last = (arrived, cid)
        if last is None:
            return False
        with Transaction(cur):
            n = self._delete_rows(ids, last[0], mark, firsts)
            self._set_state("retention.spans_at", last[0].isoformat())
            self._set_state("retention.spans_after", last[1])
        self._count(deleted, n)
        return len(ids) == self.chunk

    def _expire_commits(self, horizon: dt.datetime, mark: int, deleted: dict[str, int]) -> bool:
        """One chunk of step 2; True when more commits may be due."""
        cur = self.cur
        assert cur is not None
        done = int(self._state("retention.commits", "0"))
        # One commit has one arrival time and commits are numbered in arrival order, so every
        # commit up to the last one before the horizon is wholly expired (only older row groups are read).
        [(last,)] = cur.execute(
            "SELECT greatest((SELECT max(batch_id) FROM span_records WHERE received_at < ? AND batch_id > ?), "
            "(SELECT max(batch_id) FROM log_records WHERE received_at < ? AND batch_id > ?))",
            [horizon, done, horizon, done]).fetchall()
        if last is None:
            return False
        upto = min(mark, int(last))
        if upto <= done:
            return False
        hi = min(upto, done + CHUNK_COMMITS)
        # The commits' traces, then those of them the map holds: a semi-join with the whole map would
        # hash every trace id it holds (tens of MB of DuckDB's memory at 250,000 traces).
        traces = [t for (t,) in cur.execute(COMMIT_TRACES, [done + 1, hi, done + 1, hi]).fetchall() if t is not None]
        mapped = mapped_traces(cur, traces)
        with Transaction(cur), registered_rows(cur, "kept_traces", ("trace_id",), [(t,) for t in mapped]):
            n = {}
            for table in _TABLES:
                [(n[table],)] = cur.execute(
                    f"DELETE FROM {table} WHERE batch_id BETWEEN ? AND ? AND (trace_id IS NULL OR trace_id NOT IN "
                    "(SELECT trace_id FROM kept_traces))", [done + 1, hi]).fetchall()
            self._set_state("retention.commits", str(hi))
        self._count(deleted, (n["span_records"], n["log_records"]))
        return hi < upto

    def _expire_conversations(self, horizon: dt.datetime, mark: int, deleted: dict[str, int],
                              after: list[Any]) -> bool:
        """One chunk of step 3: the first ``chunk`` with nothing due among the next ``chunk * WINDOW`` ended
        conversations past the horizon (``after``: the last one passed this sweep, moved on here); True
        when more may be due."""
        cur = self.cur
        assert cur is not None
        reviewed = ("AND NOT EXISTS (SELECT 1 FROM review_items r WHERE r.conversation_id = c.conversation_id) "
                    if self.settings.keep_reviewed else "")
        ended = _NEXT.format(columns="first_batch, revision", ended="AND state = 'ended' ")
        with self.store.large_reads:
            window = cur.execute(
                f"WITH c AS ({ended}) "
                f"SELECT c.conversation_id, c.last_arrival_at, c.first_batch, NOT {JUDGEMENT_DUE} AND NOT {RETRY_DUE} "
                f"{reviewed}FROM c LEFT JOIN sampling_decisions s ON s.conversation_id = c.conversation_id "
                "LEFT JOIN eval_progress p ON p.conversation_id = c.conversation_id "
                "ORDER BY c.last_arrival_at, c.conversation_id",
                [horizon, after[0], after[0], after[1], self.chunk * WINDOW]).fetchall()
        free = [(cid, at, first) for cid, at, first, deletable in window if deletable]
        rows = free[:self.chunk]
        # The next chunk starts after the last one deleted, or else after the window.
        last = rows[-1] if len(free) > self.chunk else window[-1] if window else None
        if last is None:
            return False
        after[:] = last[1], last[0]
        more = len(window) == self.chunk * WINDOW or len(free) > self.chunk
        if not rows:
            return more
        ids = [cid for cid, _, _ in rows]
        with Transaction(cur):
            newest = max(at for _, at, _ in rows)
            spans = self._delete_rows(ids, newest, mark, [first for _, _, first in rows])
            delete_messages(cur, ids, ids, newest)  # within where their messages were written; most are archived
            for table in ("sampling_decisions", "verdicts", "not_run", "eval_progress"):
                cur.execute(f"DELETE FROM {table} WHERE conversation_id IN (SELECT unnest(?::VARCHAR[]))", [ids])
            if not self.settings.keep_reviewed:
                cur.execute("DELETE FROM review_history WHERE item_id IN (SELECT id FROM review_items "
                            "WHERE conversation_id IN (SELECT unnest(?::VARCHAR[])))", [ids])
                cur.execute("DELETE FROM review_items WHERE conversation_id IN (SELECT unnest(?::VARCHAR[]))", [ids])
            for table in ("trace_conversations", "trace_archive"):
                cur.execute(f"DELETE FROM {table} WHERE conversation_id IN (SELECT unnest(?::VARCHAR[]))", [ids])
            # A conversation the conversation stage reopens meanwhile makes this commit conflict:
            # all of it rolls back, and the next sweep finds it open.
            [(live,)] = cur.execute("DELETE FROM live_conversations WHERE conversation_id IN "
                                    "(SELECT unnest(?::VARCHAR[]))", [ids]).fetchall()
            # The archive has no key: the last arrival bounds the row groups read (moves append the oldest first).
            [(archived,)] = cur.execute("DELETE FROM archived_conversations WHERE last_arrival_at <= ? AND "
                                        "conversation_id IN (SELECT unnest(?::VARCHAR[]))", [newest, ids]).fetchall()
            gone = live + archived
        self._count(deleted, spans)
        deleted["conversations"] += gone
        self.m.deleted.inc(gone, what="conversations")
        return more

    def _delete_rows(self, conversations: list[str], newest: dt.datetime, mark: int,
                     firsts: list[int | None]) -> tuple[int, int]:
        """Span and log rows of these conversations' traces; (spans, logs) deleted.

        ``firsts`` are their ``first_batch`` values (None where not known yet).
        """
        cur = self.cur
        assert cur is not None
        # Rows are stored in arrival order, so these bounds let DuckDB skip row groups: received_at the
        # newer ones, the first commit of the conversations the older ones (the spans deleted before),
        # and the commits of their traces those between (a conversation that ran for days among them).
        since = 0 if any(f is None for f in firsts) else min(f for f in firsts if f is not None)
        traces = conversation_traces(cur, conversations)
        within, bounds = batch_filter([(first, last) for _, _, first, last in traces])
        out = []
        with registered_rows(cur, "expired_traces", ("trace_id",), [(t,) for t, *_ in traces]):
            for table in _TABLES:
                [(found,)] = cur.execute(
                    f"DELETE FROM {table} WHERE received_at <= ? AND batch_id BETWEEN ? AND ?{within} "
                    "AND trace_id IN (SELECT trace_id FROM expired_traces)",
                    [newest + dt.timedelta(seconds=1), since, mark, *bounds]).fetchall()
                out.append(int(found))
        return out[0], out[1]

    def _count(self, deleted: dict[str, int], rows: tuple[int, int]) -> None:
        deleted["spans"] += rows[0]
        deleted["log_records"] += rows[1]
        self.m.deleted.inc(rows[0], what="spans")
        self.m.deleted.inc(rows[1], what="log_records")

    def _measure(self) -> None:
        assert self.cur is not None
        self.oldest = oldest_rows(self.cur)
        for what, value in self.oldest.items():
            if value is not None:
                self.m.oldest.set(value.timestamp(), what=what)

    def _check_indexes(self) -> None:
        """Warn once the key indexes pass half of DuckDB's memory limit, and at each further eighth."""
        assert self.cur is not None
        used, limit = duckdb_memory(self.cur).get("ART_INDEX", (0, 0))[0], size_bytes(self.store.memory_limit)
        eighths = index_eighths(used, limit)
        if eighths >= 4 and eighths > self._indexes_warned:
            self._indexes_warned = eighths
            log.warning("%s (%s of %s now)", INDEX_WARNING, size_text(used), size_text(limit))

    # ------------------------------------------------------------ what it says

    def status(self) -> dict[str, Any]:
        return {"storage": storage_status(self.store.path, self.settings, self.clock(), self.oldest,
                                          deleted={what: int(self.m.deleted.value(what=what)) for what in _OLDEST},
                                          sweeps=self.sweeps)}


class _Stopping(Exception):
    """``stop`` came while a sweep waited for its turn: the rest waits for the next start."""


def oldest_rows(cur: duckdb.DuckDBPyConnection) -> dict[str, dt.datetime | None]:
    """When the oldest kept row of each kind arrived (``None``: none kept)."""
    out: dict[str, dt.datetime | None] = {}
    for what, sql in _OLDEST.items():
        [(out[what],)] = cur.execute(sql).fetchall()  # fetchall: a result left open would pin the file
    return out


def storage_status(path: Path, settings: Settings, now: float, oldest: dict[str, dt.datetime | None], *,
                   deleted: dict[str, int] | None = None, sweeps: int | None = None) -> dict[str, Any]:
    """The file's size and what retention keeps, for /api/status and ``tracejudge status``."""
    def size(p: Path) -> int:
        try:
            return os.stat(p).st_size
        except OSError:
            return 0

    def kept(keep: float | None, what: str) -> dict[str, Any]:
        return {"keep_seconds": keep, "horizon": None if keep is None else iso_utc(utc(now - keep)),
                "oldest": iso_utc(oldest.get(what))}

    out: dict[str, Any] = {
        "path": str(path), "file_bytes": size(path), "wal_bytes": size(Path(f"{path}.wal")),
        "retention": {"spans": kept(settings.spans, "spans"), "log_records": kept(settings.spans, "log_records"),
                      "conversations": kept(settings.conversations, "conversations"),
                      "keep_reviewed": settings.keep_reviewed},
    }
    if deleted is not None:
        out["retention"]["deleted"] = deleted
        out["retention"]["sweeps"] = sweeps
    return out
