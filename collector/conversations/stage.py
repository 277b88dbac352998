"""Conversations kept current as data arrives: the trace map, transcripts, ends and reopenings.

Lifecycle: ``Conversations(store, settings, metrics)`` -> ``start()`` (creates its
tables, starts its thread, which first catches up on commits it has not seen) ->
``on_commit`` (the store calls it after each commit; it only enqueues) ->
``stop()`` (writes what is rebuilt, records how far it got and leaves the rest,
commits queued or conversations not rebuilt yet, to the catch-up of the next start).

How far it got is the batch mark (``tracejudge_state``): the last commit whose
conversations are all rebuilt and written. It is written with them, in one
transaction, so a crash or a stop at any point leaves it true. A conversation
that cannot be rebuilt (a bug meeting odd data) keeps its stored version (one
never stored is stored without messages, with the reason) and is counted
(``conversations_failed``); it never stops the others.

Its own thread, so ingestion never waits for it; while requests keep coming
it waits for a pause in them (at most ``max_wait``). Each cycle it takes the
commits queued since the last one, resolves every touched trace to a
conversation (``conversations.id_attributes``, else ``trace:<trace id>``),
rebuilds each touched conversation's transcript from all of its rows, writes
``conversations`` and ``messages``, applies the end rules to the newest trace
(the one that starts last),
and ends conversations idle for ``idle_timeout``. Time is the daemon's clock at
commit, never span timestamps. A conversation that ended is reopened only by a
trace it did not have; late rows of a trace it has update the transcript, and a
changed transcript gets a new ``revision`` (to be judged again).

Recent traces' rows are cached (bounded); anything else is read back from DuckDB.
Log rows carry their ``arrival`` (commit, place in it: the position in the
commit for rows handed over, the stored ``seq`` for rows read back), so records
sharing a timestamp keep the order they were sent in.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import duckdb
import orjson

from ..config import Conversations as Settings
from ..config import EndRule
from ..ingest.batches import LOG_COLUMNS, SPAN_COLUMNS
from ..metrics import Metrics
from ..normalize import Attrs, span_kind
from ..store import Committed, Store, Transaction, insert_rows
from .assemble import ParseMemo, build_transcript
from .keys import conversation_key, load_json_column, response_links
from .tables import CONVERSATION_COLUMNS, MESSAGE_COLUMNS, SCHEMA
from .transcript import Transcript

log = logging.getLogger("tracejudge.conversations")

_UTC = dt.timezone.utc
_STOP = object()
CATCH_UP_CHUNK = 500  # traces resolved, rebuilt and written together when catching up


class _Stopping(Exception):
    """Raised inside a cycle once ``stop`` is called: the rest is left to the next start."""


def _json_text(value: Any) -> str:
    """JSON text of a column (orjson; json where orjson refuses, e.g. integers past 64 bits)."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return json.dumps(value, ensure_ascii=False, default=str)


def _ts(seconds: float | None) -> dt.datetime | None:
    return dt.datetime.fromtimestamp(seconds, _UTC) if seconds is not None else None


def _matches(rule: EndRule, value: Any) -> bool:
    if value is None:
        return False
    if value == rule.equals and type(value) is type(rule.equals):
        return True
    # "true" set as a string, 1 for True: compare as text, booleans case-insensitively.
    return str(value).lower() == str(rule.equals).lower()


def _trace_start(rows: "_TraceRows") -> int:
    starts = [r["start_time_unix_nano"] for r in rows.spans if r.get("start_time_unix_nano")]
    starts += [r["time_unix_nano"] or r["observed_time_unix_nano"] or 0 for r in rows.logs]
    return min(starts) if starts else 0


@dataclass
class _Conv:
    id: str
    traces: list[str]
    state: str = "open"
    ended_by: str | None = None
    first_arrival: float = 0.0
    last_arrival: float = 0.0
    closed_at: float | None = None
    newest_trace: str | None = None
    hash: str | None = None
    revision: int = 0
    stored: bool = False  # has rows in the conversations/messages tables
    last_span_end: dt.datetime | None = None
    rebuilt_at: float = 0.0
    row: list[Any] | None = None  # the conversations row last written


@dataclass
class _Light:
    """A commit queued while the stage is behind: which traces it touched, not its rows."""

    batch_id: int
    received_at: float
    trace_ids: list[str]
    rows: int = 0  # spans and log records in the commit

    @classmethod
    def of(cls, committed: Committed) -> "_Light":
        traces = set(committed.spans.columns[0]) | {t for t in committed.logs.columns[1] if t}
        return cls(committed.batch_id, committed.received_at, sorted(traces),
                   len(committed.spans) + len(committed.logs))


# Rows of light commits read back from DuckDB at once (by batch, a range read), and
# processed before the next: bounded memory, and their conversations' rows still cached
# when they are rebuilt.
LIGHT_GROUP_ROWS = 4096


@dataclass
class _Writes:
    """What one cycle changes, written together by ``_flush``."""

    conversations: dict[str, list[Any]] = field(default_factory=dict)
    messages: dict[str, list[tuple[Any, ...]]] = field(default_factory=dict)
    replace: set[str] = field(default_factory=set)  # conversations whose old messages go
    deleted: set[str] = field(default_factory=set)
    moves: dict[str, str] = field(default_factory=dict)  # trace -> conversation

    def delete(self, cid: str) -> None:
        self.deleted.add(cid)
        self.conversations.pop(cid, None)
        self.messages.pop(cid, None)


@dataclass
class _TraceRows:
    spans: list[dict[str, Any]] = field(default_factory=list)
    logs: list[dict[str, Any]] = field(default_factory=list)


class Conversations:
    """The conversation stage of the daemon (also used by ``tracejudge reindex``)."""

    def __init__(self, store: Store, settings: Settings, metrics: Metrics | None = None,
                 clock: Callable[[], float] = time.time, cache_spans: int = 10_000,
                 rebuild_interval: float = 1.0, max_queued_commits: int = 2, memo_rows: int = 5000,
                 max_wait: float = 30.0, idle_gap: float = 0.1) -> None:
        self.store = store
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.clock = clock
        self.cache_spans = cache_spans
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._cur: duckdb.DuckDBPyConnection | None = None
        self._cache: OrderedDict[str, _TraceRows] = OrderedDict()
        # trace -> (first, last) batch holding its rows, for traces first seen by this stage whole
        # (the same premise as the cache's); bounded, the oldest go first.
        self._bounds: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self.max_bounds = 200_000
        self._cached_spans = 0
        self._trace_map: dict[str, str] = {}  # trace -> conversation, for traces of loaded conversations
        self._convs: dict[str, _Conv] = {}  # open conversations, and ended ones touched recently
        self._pending: dict[str, float] = {}  # traces with no conversation yet (no GenAI span so far)
        self._responses: OrderedDict[str, str] = OrderedDict()  # response id -> conversation, for chaining
        self._warned_no_content: set[str] = set()
        # Parsed rows of recently rebuilt conversations, so a rebuild parses only new rows.
        # Bounded in rows parsed, not conversations: a long conversation's memo holds all of them.
        self._memos: OrderedDict[str, tuple[ParseMemo, int]] = OrderedDict()  # conversation -> (memo, rows)
        self._memo_rows = 0
        self.memo_rows = memo_rows
        self._work_started = 0.0
        self._processed_batch = 0
        self._resume_from = 0
        self._resume_to = 0
        self.tick = min(1.0, settings.idle_timeout / 4)
        self.rebuild_interval = rebuild_interval
        self.max_queued_commits = max_queued_commits
        # While requests keep arriving, work waits for a pause in ingestion (``idle_gap``
        # with nothing queued), for at most ``max_wait`` seconds; then it works a quarter of the time.
        self.max_wait = max_wait
        self.idle_gap = idle_gap
        self._behind_since: float | None = None  # time.monotonic() since which work has been waiting
        self._waiting = False  # for ingestion to pause: commits are queued without their rows
        self._hurry = False  # someone waits for this cycle (tests): no pauses
        self._dirty: dict[str, float] = {}  # conversation -> when its rebuild is due
        self._since: dict[str, int] = {}  # conversation -> the first commit its rebuild waits for
        self._writes = _Writes()
        self._idle_event = threading.Event()
        self._stopping = threading.Event()
        self._retry_delay = 0.0  # after a failed cycle, doubling up to a minute
        self.failed = 0  # rebuilds that failed (the conversation keeps its stored version)

    # ------------------------------------------------------------ lifecycle

    def open(self) -> None:
        """Create tables and load state (no thread); ``start`` also runs the thread."""
        self._cur = self.store.cursor()
        self._cur.execute(SCHEMA)
        self._load_state()

    def _load_state(self) -> None:
        """Where the stored conversations stand: the batch mark and the open conversations."""
        assert self._cur is not None
        self._processed_batch = self._stored_mark()
        self._resume_from = self._processed_batch
        self._resume_to = self.store.batch_id  # the last commit made before now
        for conv in self._read_convs("state = 'open'", []):
            self._keep(conv)

    def _stored_mark(self) -> int:
        assert self._cur is not None
        row = self._cur.execute("SELECT value FROM tracejudge_state WHERE key = 'conversations.batch'").fetchone()
        return int(row[0]) if row else 0

    def start(self) -> None:
        self.open()
        # Commits this stage never saw (a crash between commit and processing) come back from DuckDB.
        self._queue.put(("catch_up", None))
        self._thread = threading.Thread(target=self._run, name="tracejudge-conversations", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop soon: write what is rebuilt and the batch mark; the next start catches up on the rest."""
        if self._thread is not None:
            self._stopping.set()
            self._queue.put(_STOP)
            self._thread.join()
            self._thread = None
        if self._cur is not None:
            self._cur.close()
            self._cur = None

    @property
    def processed_batch(self) -> int:
        """The last commit this stage has taken in (its conversations may await their rebuild)."""
        return self._processed_batch

    def status(self) -> dict[str, int]:
        """How far the stage has got, for /api/status."""
        w = self._writes
        return {"conversations_batch": self._processed_batch,
                "conversations_pending": len(self._dirty) + len(w.conversations) + len(w.deleted),
                "conversations_failed": self.failed}

    def on_commit(self, committed: Committed) -> None:
        """Called by the store's writer thread after each commit: hand off, return.

        While the stage is behind, only the touched trace ids are queued (it reads
        the rows back from DuckDB), so a lagging stage cannot hold every span in memory.
        """
        if not self._waiting and self._queue.qsize() < self.max_queued_commits:
            self._queue.put(committed)
        else:
            self._queue.put(_Light.of(committed))

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block until everything queued so far is processed (tests)."""
        self._idle_event.clear()
        self._queue.put(("idle", None))
        return self._idle_event.wait(timeout)

    # ------------------------------------------------------------ the loop

    def _run(self) -> None:
        items: list[Any] = []  # taken from the queue, not processed yet
        while True:
            try:
                first = self._queue.get(timeout=0.05 if self._waiting else self.tick)
            except queue.Empty:
                first = None
            if first is not None:
                items.append(first)
                time.sleep(0.05)  # let a burst of commits gather into one cycle
            while True:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if self._stopping.is_set():
                break
            waiters = any(isinstance(it, tuple) and it[0] == "idle" for it in items)
            if self._behind_since is None:
                self._behind_since = time.monotonic()
            if not waiters and self._ingest_busy() and time.monotonic() - self._behind_since < self.max_wait:
                # Requests first: hold only which traces the waiting commits touched.
                self._waiting = True
                items = [_Light.of(it) if isinstance(it, Committed) else it for it in items]
                continue
            self._waiting = False
            try:
                self._cycle(items)
                self._retry_delay = 0.0
            except _Stopping:
                break
            except Exception:  # one bad cycle must not stop the stage
                self._retry_delay = min(60.0, max(1.0, 2 * self._retry_delay))
                log.exception("conversation update failed; retried from the stored state in %.0f s",
                              self._retry_delay)
                self._resync()
                if waiters:  # they wait for the retry
                    self._queue.put(("idle", None))
                self._stopping.wait(self._retry_delay)  # a store that cannot write now may later
            items = []
            self._behind_since = None
        self._finish()

    def _finish(self) -> None:
        """At stop: write what is rebuilt with the batch mark, and say what the next start takes up."""
        try:
            self._flush()
            mark = self._safe_batch()
            left = len(self._traces_since(mark))
        except Exception:
            log.exception("writing conversations at stop failed; the next start catches up from the stored mark")
            return
        if left:
            log.info("stopped before catching up: %d traces left for the next start (committed after batch %d)",
                     left, mark)

    def _check_stop(self) -> None:
        if self._stopping.is_set():
            raise _Stopping

    def _resync(self) -> None:
        """After a failed cycle memory may be ahead of what is stored: start again from the stored
        state (the batch mark and the open conversations) and catch up from there."""
        self._convs.clear()
        self._trace_map.clear()
        self._dirty.clear()
        self._since.clear()
        self._writes = _Writes()
        self._memos.clear()
        self._memo_rows = 0
        try:
            self._load_state()
        except Exception:
            log.exception("reading the stored conversations failed; retrying on the next data")
        self._queue.put(("catch_up", None))

    def _safe_batch(self) -> int:
        """The batch mark to store now: every commit up to it has its conversations rebuilt
        and written (with this write), so the next start may catch up from there."""
        if self._since:
            return min(self._processed_batch, min(self._since.values()) - 1)
        return self._processed_batch

    def _ingest_busy(self) -> bool:
        return self.store.idle_seconds < self.idle_gap

    def _cycle(self, items: list[Any]) -> None:
        committed = [it for it in items if isinstance(it, (Committed, _Light))]
        idle_waiters = [it for it in items if isinstance(it, tuple) and it[0] == "idle"]
        if any(isinstance(it, tuple) and it[0] == "catch_up" for it in items):
            self._catch_up()
        # Waiters (tests) want everything current: no debounce for them.
        self._hurry = bool(idle_waiters)
        previous: set[str] = set()
        for group in self._groups(committed):
            self._check_stop()
            touched = self._ingest(group)
            # A backlog: rebuild what the previous group touched and this one did not (done
            # for now, as far as the backlog goes), while its rows are still cached.
            if previous:
                self._rebuild_due(only=previous - touched)
                self._flush()  # the stored trace map is current again (an ended conversation leaves memory)
            previous = touched
        self._rebuild_due(force=self._hurry)
        self._sweep_idle()
        self._flush()
        if idle_waiters:
            self._idle_event.set()

    def _catch_up(self) -> None:
        """Rebuild what commits after the batch mark touched (a stop or a crash came between).

        Traces go in order of their last commit, a chunk at a time, each chunk
        written with the mark it reaches: every trace with a later commit is then
        still after the mark, so a stop here loses nothing and keeps what is done.
        """
        # Only commits made before this stage opened (or resynced): later ones reach it through
        # ``on_commit``, and reading them here too would rebuild a burst that arrived meanwhile twice.
        traces = self._traces_since(self._resume_from, upto=self._resume_to)
        if traces:
            log.info("catching up on %d traces committed before the last stop", len(traces))
        for i in range(0, len(traces), CATCH_UP_CHUNK):
            part = traces[i:i + CATCH_UP_CHUNK]
            self._touch({t: at for t, at, _ in part}, since=self._processed_batch + 1)
            self._rebuild_due(force=True)
            nxt = traces[i + CATCH_UP_CHUNK][2] - 1 if i + CATCH_UP_CHUNK < len(traces) else self._resume_to
            self._processed_batch = max(self._processed_batch, nxt)
            self._flush()
        # Every commit made before this stage opened is now taken in, traceless logs included.
        self._processed_batch = max(self._processed_batch, self._resume_to)

    def _traces_since(self, batch: int, upto: int | None = None) -> list[tuple[str, float, int]]:
        """Traces with rows committed after ``batch`` (and up to ``upto``): (trace, last arrival, last
        commit), by last commit."""
        assert self._cur is not None
        last = 2**63 - 1 if upto is None else upto
        return [(t, at, int(b)) for t, at, b in self._cur.execute(
            "SELECT trace_id, epoch(max(received_at)), max(batch_id) FROM ("
            " SELECT trace_id, received_at, batch_id FROM span_records WHERE batch_id BETWEEN ? AND ? UNION ALL"
            " SELECT trace_id, received_at, batch_id FROM log_records WHERE batch_id BETWEEN ? AND ?"
            " AND trace_id IS NOT NULL) "
            "GROUP BY trace_id ORDER BY 3, 2, 1", [batch + 1, last, batch + 1, last]).fetchall()]

    def reindex(self, progress: Callable[[int, int], None] | None = None, chunk: int = 500) -> int:
        """Rebuild the trace map, conversations and messages from every stored span and log record.

        Runs in the caller's thread on a stage that was ``open``ed but not started.
        All in one transaction: the old rows go only when the new ones are
        written, and anything that stops it half way (an error, Ctrl-C) leaves
        the old ones whole. Returns the number of conversations.
        """
        assert self._cur is not None and self._thread is None
        cur = self._cur
        with Transaction(cur):
            for table in ("trace_conversations", "conversations", "messages"):
                cur.execute(f"DELETE FROM {table}")
            self._convs.clear()
            self._trace_map.clear()
            self._pending.clear()
            row = cur.execute("SELECT greatest((SELECT max(batch_id) FROM span_records), "
                              "(SELECT max(batch_id) FROM log_records))").fetchone()
            last_batch = int(row[0] or 0) if row else 0
            touched = self._traces_since(0)
            for i in range(0, len(touched), chunk):
                self._touch({t: at for t, at, _ in touched[i:i + chunk]})
                self._rebuild_due(force=True)
                self._flush()
                if progress:
                    progress(min(i + chunk, len(touched)), len(touched))
            self._processed_batch = last_batch
            self._sweep_idle()
            self._flush()
            count = cur.execute("SELECT count(*) FROM conversations").fetchone()
        return int(count[0]) if count else 0

    # ------------------------------------------------------------ ingestion

    def _groups(self, committed: list[Committed | _Light]) -> list[list[Committed | _Light]]:
        """Commits in order, cut so that each group's light commits hold at most ``LIGHT_GROUP_ROWS`` rows."""
        groups: list[list[Committed | _Light]] = []
        group: list[Committed | _Light] = []
        rows = 0
        for c in committed:
            if isinstance(c, _Light):
                if group and rows + c.rows > LIGHT_GROUP_ROWS and rows:
                    groups.append(group)
                    group, rows = [], 0
                rows += c.rows
            group.append(c)
        if group:
            groups.append(group)
        return groups

    def _light_rows(self, lights: list[_Light]) -> dict[int, tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
        """The stored rows of these commits, by batch: one range read on ``batch_id`` per table
        (commits are stored in batch order, so the read skips every other row group)."""
        assert self._cur is not None
        out: dict[int, tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {c.batch_id: ([], []) for c in lights}
        lo = min(out)
        hi = max(out)
        for i, (table, columns) in enumerate((("span_records", SPAN_COLUMNS), ("log_records", LOG_COLUMNS))):
            n = len(columns)
            res = self._cur.execute(f"SELECT {', '.join(columns)}, batch_id{', seq' if i else ''} FROM {table} "
                                    "WHERE batch_id BETWEEN ? AND ? AND trace_id IS NOT NULL", [lo, hi])
            while recs := res.fetchmany(1024):  # bounded memory: not every row twice at once
                for rec in recs:
                    got = out.get(rec[n])
                    if got is not None:
                        row = dict(zip(columns, rec))
                        if i:
                            row["arrival"] = (rec[n], rec[n + 1] or 0)
                        got[i].append(row)
        return out

    def _ingest(self, committed: list[Committed | _Light]) -> set[str]:
        """Take these commits in; returns the conversations they touched."""
        touched: dict[str, float] = {}
        fresh: dict[str, _TraceRows] = {}
        first: dict[str, int] = {}  # trace -> the first and last of these commits with its rows
        last: dict[str, int] = {}
        lights = [c for c in committed if isinstance(c, _Light)]
        # A light commit's rows are read back by batch, and taken in like a queued commit's.
        stored = self._light_rows(lights) if lights else {}
        for c in committed:
            if isinstance(c, _Light):
                span_rows, log_rows = stored[c.batch_id]
                for tid in c.trace_ids:
                    touched[tid] = c.received_at
                    first.setdefault(tid, c.batch_id)
                    last[tid] = c.batch_id
                for row in span_rows:
                    fresh.setdefault(row["trace_id"], _TraceRows()).spans.append(row)
                for row in log_rows:
                    if row["trace_id"] in touched:
                        fresh.setdefault(row["trace_id"], _TraceRows()).logs.append(row)
                continue
            for row in c.spans.rows():
                tid = row["trace_id"]
                fresh.setdefault(tid, _TraceRows()).spans.append(row)
                touched[tid] = c.received_at
                first.setdefault(tid, c.batch_id)
                last[tid] = c.batch_id
            for pos, row in enumerate(c.logs.rows()):
                tid = row["trace_id"]
                if tid is None:
                    continue  # a log record with no trace belongs to no conversation
                row["arrival"] = (c.batch_id, pos)
                fresh.setdefault(tid, _TraceRows()).logs.append(row)
                touched[tid] = c.received_at
                first.setdefault(tid, c.batch_id)
                last[tid] = c.batch_id
        # A trace seen for the first time has all its rows in these commits: cache
        # them, so that only traces with older rows are read back from DuckDB.
        current = self._conversation_of(list(touched))
        known = {t for t, cid in current.items() if cid is not None}
        for tid, rows in fresh.items():
            cached = self._cache.get(tid)
            if cached is not None:
                cached.spans.extend(rows.spans)
                cached.logs.extend(rows.logs)
                self._cache.move_to_end(tid)
            elif tid in known or tid in self._pending:
                continue  # older rows are in DuckDB: read the whole trace when needed
            else:
                self._cache[tid] = rows
                self._bounds[tid] = (first[tid], last[tid])
                self._bounds.move_to_end(tid)
            self._cached_spans += len(rows.spans) + len(rows.logs)
        for tid, hi in last.items():  # rows that went to DuckDB only widen the trace's range
            bounds = self._bounds.get(tid)
            if bounds is not None and hi > bounds[1]:
                self._bounds[tid] = (bounds[0], hi)
        while len(self._bounds) > self.max_bounds:
            self._bounds.popitem(last=False)
        convs = self._touch(touched, current, since=first)
        self._evict()
        self._processed_batch = max(self._processed_batch, *(c.batch_id for c in committed))
        return convs

    def _rows(self, trace_ids: Iterable[str]) -> dict[str, _TraceRows]:
        """Every stored row of these traces: the cache, else one read from DuckDB."""
        out: dict[str, _TraceRows] = {}
        missing = []
        for t in trace_ids:
            rows = self._cache.get(t)
            if rows is not None:
                self._cache.move_to_end(t)
                out[t] = rows
            else:
                missing.append(t)
        if missing:
            assert self._cur is not None
            loaded = {t: _TraceRows() for t in missing}
            # Traces whose rows all lie in a known range of commits are read from that range
            # only (rows are stored in commit order, so the read skips the other row groups).
            where = "trace_id IN (SELECT unnest(?))"
            params: list[Any] = [missing]
            ranges = [self._bounds.get(t) for t in missing]
            if all(r is not None for r in ranges):
                where += " AND batch_id BETWEEN ? AND ?"
                params += [min(r[0] for r in ranges if r), max(r[1] for r in ranges if r)]
            res = self._cur.execute(f"SELECT {', '.join(SPAN_COLUMNS)} FROM span_records WHERE {where}", params)
            for rec in res.fetchall():
                loaded[rec[0]].spans.append(dict(zip(SPAN_COLUMNS, rec)))
            res = self._cur.execute(f"SELECT {', '.join(LOG_COLUMNS)}, batch_id, seq FROM log_records "
                                    f"WHERE {where}", params)
            n = len(LOG_COLUMNS)
            for rec in res.fetchall():
                row = dict(zip(LOG_COLUMNS, rec))
                row["arrival"] = (rec[n], rec[n + 1] or 0)  # NULL: stored before the place was kept
                loaded[rec[1]].logs.append(row)
            for t, rows in loaded.items():
                self._cache[t] = rows
                self._cached_spans += len(rows.spans) + len(rows.logs)
                out[t] = rows
            self._evict()
        return out

    def _evict(self) -> None:
        """Drop the least recently used traces beyond ``cache_spans`` rows."""
        while self._cached_spans > self.cache_spans and self._cache:
            _, rows = self._cache.popitem(last=False)
            self._cached_spans -= len(rows.spans) + len(rows.logs)

    def _conversation_of(self, trace_ids: list[str]) -> dict[str, str | None]:
        """The current map for these traces (memory, else the table)."""
        out: dict[str, str | None] = {t: self._trace_map.get(t) for t in trace_ids}
        unknown = [t for t, c in out.items() if c is None]
        if unknown:
            assert self._cur is not None
            for t, c in self._cur.execute("SELECT trace_id, conversation_id FROM trace_conversations "
                                          "WHERE trace_id IN (SELECT unnest(?))", [unknown]).fetchall():
                out[t] = c
        return out

    def _load_convs(self, cids: Iterable[str]) -> None:
        """Bring these conversations into memory (one read for those not there yet)."""
        missing = sorted({c for c in cids if c not in self._convs})
        if not missing:
            return
        found = {c.id: c for c in self._read_convs("conversation_id IN (SELECT unnest(?))", [missing])}
        for cid in missing:
            self._keep(found.get(cid) or _Conv(cid, []))

    def _read_convs(self, where: str, params: list[Any]) -> list[_Conv]:
        """Stored conversations as the stage tracks them."""
        assert self._cur is not None
        return [_Conv(rec[0], list(orjson.loads(rec[3] or "[]")), rec[1], rec[2], rec[7] or 0.0, rec[8] or 0.0,
                      rec[9], rec[4], rec[5], rec[6] or 0, stored=True)
                for rec in self._cur.execute(
                    "SELECT conversation_id, state, ended_by, trace_ids, newest_trace_id, transcript_hash, revision, "
                    "epoch(first_arrival_at), epoch(last_arrival_at), epoch(closed_at) FROM conversations "
                    f"WHERE {where}", params).fetchall()]

    def _keep(self, conv: _Conv) -> None:
        self._convs[conv.id] = conv
        for t in conv.traces:
            self._trace_map[t] = conv.id

    def _touch(self, touched: dict[str, float], current: dict[str, str | None] | None = None,
               since: Mapping[str, int] | int = 0) -> set[str]:
        """Resolve each touched trace to its conversation and mark those conversations for a rebuild.

        ``current`` is the trace map for these traces when the caller has read it already;
        ``since`` the first commit with a trace's new rows (for the batch mark), per trace or for all.
        """
        if not touched:
            return set()
        traces = list(touched)
        if current is None:
            current = self._conversation_of(traces)
        keys: dict[str, str] = {}
        self._work_started = time.perf_counter()
        for i in range(0, len(traces), 500):  # bounded memory: rows of at most 500 traces at once
            chunk = traces[i:i + 500]
            rows = self._rows(chunk)
            for tid in chunk:
                self._check_stop()
                self._yield_to_ingest()
                key = conversation_key(rows[tid].spans, self.settings.id_attributes)
                if key is None and current.get(tid) is None and not self._is_genai(rows[tid]):
                    self._pending[tid] = touched[tid]  # nothing conversational yet
                    continue
                self._pending.pop(tid, None)
                if key is None:
                    key = self._chained(tid, rows[tid])
                keys[tid] = key or f"trace:{tid}"
            del rows
        self._load_convs([*keys.values(), *(c for c in current.values() if c is not None)])
        now = self.clock()
        for tid, cid in keys.items():
            conv = self._convs[cid]
            old = current.get(tid)
            first = since if isinstance(since, int) else since[tid]
            if old != cid:
                if old is not None:  # the span carrying the id arrived after its children
                    prev = self._convs[old]
                    if tid in prev.traces:
                        prev.traces.remove(tid)
                    self._dirty.setdefault(old, now)
                    self._since.setdefault(old, first)
                self._writes.moves[tid] = cid
                self._trace_map[tid] = cid
            # Also when the map has it already: a stop can come between writing the map and the
            # conversation (its rebuild waits for the next interval), and the catch-up mends it.
            if tid not in conv.traces:
                conv.traces.append(tid)
                if conv.state == "ended":  # a new trace reopens an ended conversation
                    conv.state, conv.ended_by, conv.closed_at = "open", None, None
                    self.metrics.conversations_reopened.inc()
            if not conv.first_arrival:
                conv.first_arrival = touched[tid]
            conv.last_arrival = max(conv.last_arrival, touched[tid])
            # At most one rebuild per conversation per interval while data streams in.
            self._dirty.setdefault(cid, max(now, conv.rebuilt_at + self.rebuild_interval))
            self._since.setdefault(cid, first)
        return set(keys.values())

    def _chained(self, tid: str, rows: _TraceRows) -> str | None:
        """A trace with no id continues the conversation whose response its call names as previous
        (``gen_ai.request.previous_response.id``); its own responses can be continued in turn."""
        ids, previous = response_links(rows.spans)
        cid = next((self._responses[p] for p in sorted(previous) if p in self._responses), None)
        for rid in ids:
            self._responses[rid] = cid or f"trace:{tid}"
            self._responses.move_to_end(rid)
        while len(self._responses) > 100_000:  # bounded: chains are continued within minutes
            self._responses.popitem(last=False)
        return cid

    def _yield_to_ingest(self) -> None:
        """Every 20 ms of work, let requests go first: wait for a pause in ingestion,
        or, once work has waited ``max_wait``, sleep three times as long as it worked.

        Ingestion and this stage share one interpreter lock and two cores; the
        receivers come first, and conversations catch up when the stream slows down.
        """
        worked = time.perf_counter() - self._work_started
        if self._hurry or worked < 0.02:
            return
        deadline = (self._behind_since or time.monotonic()) + self.max_wait
        while self._ingest_busy():
            self._check_stop()
            if time.monotonic() >= deadline:
                time.sleep(3 * worked)
                break
            time.sleep(0.02)
        self._work_started = time.perf_counter()

    def _rebuild_due(self, force: bool = False, only: set[str] | None = None) -> None:
        now = self.clock()
        due = sorted(c for c, at in self._dirty.items() if (force or at <= now) and (only is None or c in only))
        self._work_started = time.perf_counter()
        for i in range(0, len(due), 200):  # bounded memory: rows of at most 200 conversations at once
            part = [self._convs[c] for c in due[i:i + 200] if c in self._convs]
            rows = self._rows({t for conv in part for t in conv.traces})
            for conv in part:
                self._check_stop()
                self._rebuild_one(conv, rows)
                self._yield_to_ingest()
            del rows
            if i + 200 < len(due):
                self._flush()  # bounded memory: transcripts of at most 200 conversations wait to be written
        for cid in due:
            self._done(cid)

    def _done(self, cid: str) -> None:
        """The conversation's rebuild is no longer waited for (written with the next flush)."""
        self._dirty.pop(cid, None)
        self._since.pop(cid, None)

    def _rebuild_one(self, conv: _Conv, rows: dict[str, _TraceRows] | None = None) -> None:
        """``_rebuild``, where a failure costs this conversation its update, never the others theirs.

        The conversation keeps its stored version; one never stored is stored
        without messages, with the reason, so that it is listed and counted.
        """
        try:
            self._rebuild(conv, rows)
        except Exception as exc:  # noqa: BLE001 - odd data meeting a bug: counted, logged, the rest goes on
            self.failed += 1
            log.warning("conversation %s could not be rebuilt (%s: %s); %s", conv.id, type(exc).__name__, exc,
                        "its stored version is kept" if conv.stored else "it is stored without messages",
                        exc_info=log.isEnabledFor(logging.DEBUG))
            if not conv.stored:
                self._write(conv, Transcript(trace_ids=tuple(conv.traces), no_content_reason=(
                    f"could not be rebuilt ({type(exc).__name__}: {exc}); the log has the details")))
        self._done(conv.id)

    @staticmethod
    def _is_genai(rows: _TraceRows) -> bool:
        """A trace without an id is a conversation once the normalizer finds an LLM call or agent span
        in it, or a GenAI event; any other trace (health checks, plain HTTP) is not."""
        if any((r.get("event_name") or "").startswith("gen_ai") for r in rows.logs):
            return True
        for r in rows.spans:
            try:
                attrs = load_json_column(r.get("attributes"))
            except (ValueError, RecursionError):
                continue
            if isinstance(attrs, dict) and span_kind(Attrs(attrs), str(r.get("name") or "")) in ("llm", "agent"):
                return True
        return False

    # ------------------------------------------------------------ transcripts

    def _rebuild(self, conv: _Conv, rows: dict[str, _TraceRows] | None = None) -> None:
        conv.rebuilt_at = self.clock()
        if not conv.traces:  # every trace moved to a keyed conversation
            self._writes.delete(conv.id)
            self._convs.pop(conv.id, None)
            return
        if rows is None or any(t not in rows for t in conv.traces):
            rows = self._rows(conv.traces)
        spans = [r for t in conv.traces for r in rows[t].spans]
        logs = [r for t in conv.traces for r in rows[t].logs]
        memo = self._drop_memo(conv.id) or ParseMemo()
        tr = build_transcript(spans, logs, memo)
        self._memos[conv.id] = (memo, len(spans) + len(logs))  # most recently rebuilt last
        self._memo_rows += len(spans) + len(logs)
        while self._memo_rows > self.memo_rows and len(self._memos) > 1:  # the newest stays, however long
            self._drop_memo(next(iter(self._memos)))
        conv.newest_trace = max(conv.traces, key=lambda t: (_trace_start(rows[t]), t))
        digest = tr.content_hash()
        if digest != conv.hash:
            conv.revision += 1
            conv.hash = digest
        self._apply_end_rules(conv, rows)
        self._write(conv, tr)

    def _drop_memo(self, cid: str) -> ParseMemo | None:
        memo, rows = self._memos.pop(cid, (None, 0))
        self._memo_rows -= rows
        return memo

    def _apply_end_rules(self, conv: _Conv, rows: dict[str, _TraceRows]) -> None:
        if conv.state != "open" or not self.settings.end_rules or conv.newest_trace not in rows:
            return
        for span in rows[conv.newest_trace].spans:
            try:
                attrs = load_json_column(span.get("attributes")) or {}
                resource = load_json_column(span.get("resource")) or {}
            except (ValueError, RecursionError):  # a row that does not parse ends nothing
                continue
            if not isinstance(attrs, dict) or not isinstance(resource, dict):
                continue
            for rule in self.settings.end_rules:
                if _matches(rule, attrs.get(rule.attribute)) or _matches(rule, resource.get(rule.attribute)):
                    self._end(conv, rule.ended_by)
                    return

    def _end(self, conv: _Conv, ended_by: str) -> None:
        conv.state = "ended"
        conv.ended_by = ended_by
        conv.closed_at = self.clock()
        self.metrics.conversations_ended.inc(ended_by=ended_by)

    def _write(self, conv: _Conv, tr: Transcript) -> None:
        conv.last_span_end = tr.ended_at
        if not tr.content_captured and tr.llm_calls and (tr.service or "") not in self._warned_no_content:
            self._warned_no_content.add(tr.service or "")
            log.warning("conversation %s of service %s carries no message content, so it cannot be judged: %s",
                        conv.id, tr.service or "(unknown)", tr.no_content_reason)
        tokens = (None, None) if tr.usage is None else (tr.usage.input_tokens, tr.usage.output_tokens)
        conv.row = [
            conv.id, tr.service, tr.started_at, tr.ended_at if conv.state == "ended" else None,
            conv.ended_by, conv.state, tr.user_turns, *tokens,
            tr.llm_calls, len(tr.messages), orjson.dumps(list(tr.models)).decode(), tr.system,
            tr.content_captured, tr.no_content_reason, conv.hash, conv.revision,
            orjson.dumps(conv.traces).decode(), conv.newest_trace, _ts(conv.first_arrival),
            _ts(conv.last_arrival), _ts(conv.closed_at), _ts(self.clock()), tr.unparsed_spans, tr.unparsed_logs,
            orjson.dumps(list(tr.sources)).decode()]
        self._writes.conversations[conv.id] = conv.row
        self._writes.messages[conv.id] = [
            (conv.id, i, m.role, m.content, _json_text(m.to_dict()["tool_calls"]) if m.tool_calls else None,
             m.tool_call_id, m.name, m.at, m.span_id, m.source, m.truncated)
            for i, m in enumerate(tr.messages)]
        if conv.stored:
            self._writes.replace.add(conv.id)
        conv.stored = True
        if conv.state == "ended":
            self._forget(conv)

    def _flush(self) -> None:
        """Write everything this cycle changed in one transaction, column-wise, with the batch mark."""
        assert self._cur is not None
        w = self._writes
        cur = self._cur
        try:
            with Transaction(cur):
                gone = sorted(w.deleted | w.replace)
                if gone:
                    cur.execute("DELETE FROM messages WHERE conversation_id IN (SELECT unnest(?))", [gone])
                if w.deleted:
                    cur.execute("DELETE FROM conversations WHERE conversation_id IN (SELECT unnest(?))",
                                [sorted(w.deleted)])
                insert_rows(cur, "INSERT OR REPLACE INTO trace_conversations", ("trace_id", "conversation_id"),
                            list(w.moves.items()))
                insert_rows(cur, "INSERT INTO messages", MESSAGE_COLUMNS,
                            [m for cid, msgs in w.messages.items() if cid not in w.deleted for m in msgs])
                insert_rows(cur, "INSERT OR REPLACE INTO conversations", CONVERSATION_COLUMNS,
                            [row for cid, row in w.conversations.items() if cid not in w.deleted])
                cur.execute("INSERT OR REPLACE INTO tracejudge_state VALUES ('conversations.batch', ?)",
                            [str(self._safe_batch())])
        finally:
            self._writes = _Writes()

    def _forget(self, conv: _Conv) -> None:
        """An ended conversation leaves memory; late data reads it back from DuckDB."""
        self._convs.pop(conv.id, None)
        self._drop_memo(conv.id)
        for t in conv.traces:
            self._trace_map.pop(t, None)
            rows = self._cache.pop(t, None)
            if rows is not None:
                self._cached_spans -= len(rows.spans) + len(rows.logs)

    # ------------------------------------------------------------ idle

    def _sweep_idle(self) -> None:
        now = self.clock()
        limit = self.settings.idle_timeout
        for conv in [c for c in self._convs.values() if c.state == "open" and now - c.last_arrival >= limit]:
            self._end(conv, "idle")
            if conv.row is None or conv.id in self._dirty:  # loaded at start, or new rows: rebuild
                self._rebuild_one(conv)
                continue
            self._done(conv.id)
            row = list(conv.row)
            row[3], row[4], row[5], row[21], row[22] = (conv.last_span_end, "idle", "ended",
                                                        _ts(conv.closed_at), _ts(now))
            self._writes.conversations[conv.id] = row
            self._forget(conv)
        for tid in [t for t, at in self._pending.items() if now - at >= limit]:
            del self._pending[tid]
