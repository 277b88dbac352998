"""Retention: what ``storage.retention`` lets go, deleted as fast as it expires, giving way to ingestion.

A background ``Stage`` (``collector.background``) after all the others, since it
deletes what each of them wrote. A sweep runs when the oldest commit it has not
swept yet expires, or the oldest ended conversation step 3 has not passed yet (at
most ``interval`` apart), and goes on until nothing more is due:

1. **commits**: span and log rows go by ranges of commits (``batch_id``), the
   oldest first, about ``rows`` rows a transaction, once the whole commit is
   older than ``now - retention.spans``: a delete by a range of commit numbers
   reads no ids, and leaves whole row groups empty, which DuckDB frees at its
   next checkpoint without rewriting any. Traces still needed stay behind, held
   (``retention_held``): those of a conversation still open, not sampled yet,
   due for the evaluator (a judgement of its current revision, a retry:
   ``JUDGEMENT_DUE``) or with a later arrival, and a trace with rows in later
   commits (a trace's rows go together: a rebuild finds a trace whole or gone).
   Rows of no conversation (other services' spans, traceless logs) go with
   their commit. The conversation's transcript, verdicts and review items stay;
   ``reindex`` keeps it as stored.
2. **held traces** whose conversation has expired since go, by trace id within
   their commits.
3. **expired conversations**: ended, last arrival before ``now -
   retention.conversations``, nothing due for the evaluator, and with
   ``keep_reviewed`` no review item: its row, messages, sampling decision,
   verdicts, not-run records, progress row, trace map rows and spans go in one
   transaction, so a kill -9 leaves it whole or gone. They go ``chunk`` (4,000)
   a transaction, each table's rows by one statement joining their ids: a
   statement's cost is mostly a read of its table, whatever the chunk. A pass
   comes at most every ``GATHER`` seconds (so that it finds a chunk's worth, not
   the few expired since the last sweep) and goes on from the last conversation
   the previous one passed; those kept (due, reviewed, open) are read again by a
   pass from the oldest every ``RESCAN`` seconds.

A range of step 1 and a chunk of step 3 take turns, so a backlog of either does
not hold the other back.

Nothing the conversation stage has not taken in yet is touched: every delete is
bounded by its stored batch mark. Each transaction waits for a pause in
ingestion (``store.pacing``); once a sweep is more than ``BEHIND`` seconds
behind its horizon (step 3: ``CONVERSATIONS_BEHIND``) it takes half the time
instead of a tenth when none comes.
Forwarding keeps its own copy of every request it has still to send
(``collector.forward.queue``), so no delete here takes one from it. Each
range's rows, the held traces and the place reached commit together: a kill -9
leaves a range deleted and recorded, or neither.

How far behind its horizon retention is (``behind_seconds``): how long before
the horizon the oldest commit not swept yet arrived, 0 when none has expired.
Held traces are not counted: they are kept on purpose. Step 3's own figure
(``conversations_behind_seconds``, in ``/api/status``) likewise leaves out the
conversations it passes over, and includes up to ``GATHER`` seconds by design.

DuckDB marks deleted rows and, at its next checkpoint, frees row groups left
empty and rewrites ones mostly deleted; the freed blocks are reused by later
writes, so the file stops growing once deletion keeps up with arrival, but it
never shrinks (docs/operations.md, "Disk").
"""

from __future__ import annotations

import contextlib
import datetime as dt
import itertools
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import duckdb

from .background import Stage
from .config import Retention as Settings, size_bytes
from .conversations.duck import delete_messages
from .evals.judging import JUDGEMENT_DUE, RETRY_DUE, utc
from .words import iso_utc
from .system.memory import INDEX_WARNING, duckdb_memory, index_eighths
from .metrics import Counter, Gauge, Metrics
from .store import Store, Transaction, insert_rows
from .store.transactions import COMMIT_TRACES, batch_filter, conversation_traces, registered_rows, write_conflict
from .words import size_text

log = logging.getLogger("tracejudge.retention")

INTERVAL = 60.0  # seconds between sweeps at most
SOON = 1.0  # seconds between sweeps at least: what expires within it waits for the next
HELD_AGAIN = 5.0  # seconds before held traces are looked at again (their conversations end, are judged)
SETTLE = 30.0  # seconds a range waits for its conversations to end and be sampled before it holds them
WAITING_AGAIN = 2.0  # seconds before a range that waits for them is looked at again
# Rows (spans and log records) per transaction of step 1. A range's delete costs little by itself; the
# lookups of its traces' conversations cost per trace, and the transaction's turn waits for a pause in
# ingestion: bench/retention.py measured ... (see docs/operations.md, "Disk").
ROWS = 65_536
# Conversations per transaction of step 3 (each waits for a pause in ingestion). Most of a transaction's
# cost is per statement, not per conversation: each of its dozen deletes reads a table's ids whatever the
# chunk's size. On a copy of one settled file of 37,500 conversations, all expired, chunks of 400 (and a
# read from the oldest at every sweep) deleted 3,500/s, chunks of 4,000 12,100/s; under 5,000 spans/s (312
# conversations/s) the former managed about 190/s, and spans waited behind them.
CHUNK = 4_000
# Ended conversations past the horizon read per query (at least a chunk): those kept (due for the evaluator,
# reviewed) are passed over a window at a time, each with bounded memory: joined whole, 300,000 ran DuckDB
# out of it, and at a 24MB limit 8,000 at a time did too (tests/retention).
WINDOW = 4_000
# Seconds expired conversations gather before step 3 deletes them: a pass costs per statement, and one a
# sweep (a second apart under load) paid that for the few hundred expired since the last.
GATHER = 10.0
# Seconds between passes of step 3 from the oldest conversation: in between, each goes on from where the
# last stopped, so what is kept (reviewed, due) is not read again by every pass. A conversation due then
# (or open, the conversation stage behind) is deleted by the next pass from the oldest.
RESCAN = 60.0
# Seconds behind its horizon step 3 may be, GATHER included, before retention takes the larger share.
CONVERSATIONS_BEHIND = 30.0
# Its pace: deleting holds DuckDB's writer for a few ms per statement; it waits up to MAX_WAIT for the
# same pause as the conversation stage and takes at most a tenth of the time when none comes, or half
# once it is more than BEHIND seconds behind its horizon. A sweep is due as soon as a commit expires, and
# each waits anew: at 30 s, under a steady 5,000 spans/s (no pause of IDLE_GAP) retention fell up to
# 36 s behind, the spans stored swinging by a quarter (bench/retention.py, steady).
IDLE_GAP = 0.1
SHARE = 0.1
SHARE_BEHIND = 0.5
BEHIND = 5.0
MAX_WAIT = 5.0
POLL = 0.05

_TABLES = ("span_records", "log_records")
_SWEPT = "retention.swept"  # the last commit step 1 has swept
HELD_TABLE = "retention_held"
# Traces step 1 left behind (see the module docstring): the first commit of their rows, and when it arrived.
HELD_SCHEMA = f"""CREATE TABLE IF NOT EXISTS {HELD_TABLE} (
    trace_id VARCHAR NOT NULL,
    first_batch UBIGINT NOT NULL,
    since TIMESTAMPTZ NOT NULL
)"""
# The next commits after the last swept up to the batch mark, with their arrival and rows, for about
# ``rows`` rows (parameters: the last swept, the mark, rows): only row groups after the last swept are read.
_NEXT_COMMITS = (
    "SELECT batch_id, max(received_at), count(*) FROM (SELECT batch_id, received_at FROM ("
    "SELECT batch_id, received_at FROM span_records WHERE batch_id > $1 AND batch_id <= $2 UNION ALL "
    "SELECT batch_id, received_at FROM log_records WHERE batch_id > $1 AND batch_id <= $2) "
    "ORDER BY batch_id LIMIT $3) GROUP BY batch_id ORDER BY batch_id")
# When the oldest row not swept yet arrived (parameter: the last swept).
_UNSWEPT = ("SELECT min(received_at) FROM (SELECT received_at FROM span_records WHERE batch_id > $1 "
            "UNION ALL SELECT received_at FROM log_records WHERE batch_id > $1)")
# Those of ``swept_conversations`` whose span rows may go (parameters: the earliest arrival of their rows,
# which bounds the archive's row groups read; the horizon).
_EXPIRED = (
    "WITH c AS (SELECT conversation_id, state, last_arrival_at, revision FROM live_conversations "
    "JOIN swept_conversations USING (conversation_id) UNION ALL "
    "SELECT conversation_id, state, last_arrival_at, revision FROM archived_conversations "
    "JOIN swept_conversations USING (conversation_id) WHERE last_arrival_at >= ?) "
    "SELECT c.conversation_id FROM c JOIN sampling_decisions s ON s.conversation_id = c.conversation_id "
    "LEFT JOIN eval_progress p ON p.conversation_id = c.conversation_id "
    f"WHERE c.state = 'ended' AND c.last_arrival_at < ? AND NOT {JUDGEMENT_DUE} AND NOT {RETRY_DUE}")
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
        self.behind = Gauge("tracejudge_retention_behind_seconds",
                            "How long before the horizon of storage.retention.spans the oldest span or log record "
                            "retention has not swept yet arrived; 0 when none has expired (held rows not counted).")
        self.conversations_behind = Gauge(
            "tracejudge_retention_conversations_behind_seconds",
            "How long before the horizon of storage.retention.conversations the oldest ended conversation "
            "retention has not deleted or passed over yet arrived; 0 when none has expired (those kept on "
            "purpose not counted); absent without storage.retention.conversations.")
        for what in _OLDEST:
            self.deleted.declare(what=what)
        metrics.add_instruments(self.deleted, self.oldest, self.behind, self.conversations_behind)


class Retention(Stage):
    """Deletes what ``storage.retention`` lets go (see the module docstring)."""

    name = "retention"

    def __init__(self, store: Store, settings: Settings, metrics: Metrics, *,
                 clock: Callable[[], float] = time.time, interval: float = INTERVAL, chunk: int = CHUNK,
                 window: int = WINDOW, rows: int = ROWS, settle: float = SETTLE, max_wait: float = MAX_WAIT,
                 gather: float = GATHER, rescan: float = RESCAN) -> None:
        super().__init__(store, metrics)
        self.settings = settings
        self.clock = clock
        self.interval = interval
        self.chunk = chunk
        self.window = max(window, chunk)
        self.gather = gather
        self.rescan = rescan
        self.rows = rows
        self.settle = settle
        self.pacing = store.pacing(idle_gap=IDLE_GAP, share=SHARE, max_wait=max_wait, poll=POLL)
        self.m = RetentionMetrics(metrics)
        metrics.on_scrape(self._scraped)
        self.oldest: dict[str, dt.datetime | None] = {}
        self.sweeps = 0  # sweeps completed (tests wait on it through /api/status)
        self._next_arrival: dt.datetime | None = None  # when the oldest row not swept yet arrived
        self._held = 0  # traces held (step 1)
        self._waiting: tuple[int, float] | None = None  # the range (its last swept commit) waiting to settle, since
        # Step 3: the last conversation passed (last arrival, id), when its next pass is due (GATHER), when
        # its next pass from the oldest (RESCAN), and when the oldest ended one not passed yet arrived.
        self._after: tuple[dt.datetime, str] = (utc(0), "")
        self._conversations_due = 0.0
        self._rescan_at = 0.0
        self._next_conversation: dt.datetime | None = None
        self._indexes_warned = 0  # eighths of the memory limit the key indexes held at the last warning

    def _open(self) -> None:
        assert self.cur is not None
        self.cur.execute(HELD_SCHEMA)
        if self.settings.spans is not None:
            self._next_arrival = unswept(self.cur)

    # ------------------------------------------------------------ the loop

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.sweep()
                self.cycle_ok()
                delay = self.next_sweep()
            except _Stopping:
                return
            except Exception as exc:  # noqa: BLE001 - a conflict with another stage's write, a full disk: next sweep
                delay = self.sweep_failed(exc)
            self.stopping.wait(delay)

    def sweep_failed(self, exc: Exception) -> float:
        """In the handler of a sweep's failure: the seconds until the next sweep.

        A transaction that met the conversation stage writing some of the same rows (its trace map's moves
        to the archive, a conversation it reopened) was rolled back whole by DuckDB: the next sweep, a second
        later, deletes what is still due. Not an error, so it is logged in a line and not counted; any
        other failure is logged with its traceback, counted, and the next sweep waits the backoff.
        """
        if write_conflict(exc):
            log.info("a retention sweep met the conversation stage writing some of the rows it deletes; it was "
                     "rolled back, and the next sweep in %.0f s deletes what is still due", SOON)
            return SOON
        return self.cycle_failed("a retention sweep failed")

    def next_sweep(self) -> float:
        """Seconds until the next sweep is due: when the oldest row not swept yet expires, or the oldest
        ended conversation not passed yet (but GATHER seconds after the last pass at the soonest)."""
        keep, now = self.settings.spans, self.clock()
        delays = [self.interval]
        if keep is not None:
            if self._waiting is not None:  # a range waits for its conversations (``_settled``)
                return WAITING_AGAIN
            due = self.interval if self._next_arrival is None else self._next_arrival.timestamp() + keep - now
            # With nothing left to sweep, what arrives next expires no sooner than ``keep`` from now.
            delays += [keep, due, HELD_AGAIN if self._held else self.interval]
        keep = self.settings.conversations
        if keep is not None:
            nxt = self._next_conversation
            delays.append(max(keep if nxt is None else nxt.timestamp() + keep - now, self._conversations_due - now))
        return max(SOON, min(delays))

    def _scraped(self) -> None:
        self.m.behind.set(self.behind_seconds())
        conversations = self.conversations_behind_seconds()
        if conversations is not None:
            self.m.conversations_behind.set(conversations)

    def behind_seconds(self) -> float:
        """How long before the horizon of ``retention.spans`` the oldest row not swept yet arrived (0: none)."""
        return behind_seconds(self.settings, self.clock(), self._next_arrival) or 0.0

    def conversations_behind_seconds(self) -> float | None:
        """How long before the horizon of ``retention.conversations`` the oldest ended conversation step 3
        has not passed yet arrived (0: none; those passed over, kept on purpose, not counted); None without
        ``retention.conversations``. Up to GATHER seconds of it are by design."""
        keep = self.settings.conversations
        if keep is None:
            return None
        nxt = self._next_conversation
        return 0.0 if nxt is None else max(0.0, self.clock() - keep - nxt.timestamp())

    def sweep(self) -> dict[str, int]:
        """Delete everything due now, a transaction at a time; what was deleted, by kind."""
        try:
            return self._sweep()
        finally:
            # The last piece ends here: ended by the next sweep's first turn instead, it took in the
            # interval between sweeps, and under steady ingestion the share made that sweep wait nine.
            self.pacing.rest()

    def _sweep(self) -> dict[str, int]:
        cur = self.cur
        assert cur is not None
        deleted = {what: 0 for what in _OLDEST}
        # The conversation stage's stored batch mark: later commits are not taken in yet.
        mark = int(self._state("conversations.batch", "0"))
        spans, conversations = self.settings.spans, self.settings.conversations
        ranges = spans is not None
        chunks = conversations is not None and self.clock() >= self._conversations_due
        if chunks and self.clock() >= self._rescan_at:  # from the oldest: what was kept may go now
            self._after, self._rescan_at = (utc(0), ""), self.clock() + self.rescan
        # A range of step 1 and a chunk of step 3 in turn while either has more due: neither waits for the
        # other's backlog. Each horizon moves on with each piece: what expires while a sweep runs is swept by it.
        while ranges or chunks:
            if ranges:
                assert spans is not None
                ranges = self._turn() and self._expire_commits(utc(self.clock() - spans), mark, deleted)
            if chunks:
                assert conversations is not None
                chunks = self._turn() and self._expire_conversations(utc(self.clock() - conversations), mark,
                                                                     deleted)
                if not chunks:
                    self._conversations_passed()
        if spans is not None:
            self._next_arrival = unswept(cur)
            self._release_held(utc(self.clock() - spans), deleted)
        self._measure()
        self._check_indexes()
        self.sweeps += 1
        if any(deleted.values()):
            log.info("retention deleted %s", ", ".join(f"{n} {what.replace('_', ' ')}"
                                                       for what, n in deleted.items() if n))
        return deleted

    def _turn(self) -> bool:
        self.pacing.done()
        # Behind its horizon by more than BEHIND: under ingestion that never pauses, take more of the time.
        behind = self.behind_seconds() > BEHIND or (self.conversations_behind_seconds() or 0) > CONVERSATIONS_BEHIND
        self.pacing.share = SHARE_BEHIND if behind else SHARE
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

    # ------------------------------------------------------------ the deletes

    def _expire_commits(self, horizon: dt.datetime, mark: int, deleted: dict[str, int]) -> bool:
        """One range of step 1: the next commits wholly before the horizon, about ``rows`` rows; True when
        one was done (more may be due)."""
        cur = self.cur
        assert cur is not None
        done = int(self._state(_SWEPT, "0"))
        commits = cur.execute(_NEXT_COMMITS, [done, mark, self.rows]).fetchall()
        # Commits are numbered in arrival order, each with one arrival time: the range ends before the
        # first one not expired (a clock set back makes a later one look older; it waits for that one).
        taken = list(itertools.takewhile(lambda c: c[1] < horizon, commits))
        if not taken:
            return False
        lo, hi, since = done + 1, taken[-1][0], taken[0][1]
        in_range = [t for (t,) in cur.execute(COMMIT_TRACES, [lo, hi, lo, hi]).fetchall() if t is not None]
        held = {t: (first, at) for t, first, at in cur.execute("SELECT trace_id, first_batch, since FROM "
                                                                f"{HELD_TABLE}").fetchall()}
        go, keep, unready = self._classify(in_range, hi, horizon, since, lo)
        if not self._settled(done, unready, len(in_range)):
            return False
        again = [t for t in go if t in held]  # held before, free now: their rows before this range go too
        kept = registered_rows(cur, "kept_traces", ("trace_id",), [(t,) for t in keep]) if keep else None
        with Transaction(cur), kept or contextlib.nullcontext():
            n = [0, 0]
            for i, table in enumerate(_TABLES):
                # Whole commits: DuckDB drops their row groups at the next checkpoint, rewriting none.
                spare = " AND (trace_id IS NULL OR trace_id NOT IN (SELECT trace_id FROM kept_traces))" if keep else ""
                [(n[i],)] = cur.execute(f"DELETE FROM {table} WHERE batch_id BETWEEN ? AND ?{spare}",
                                        [lo, hi]).fetchall()
            if again:
                n = [a + b for a, b in zip(n, self._delete_traces(again, held, done))]
            self._hold([(t, lo, since) for t in keep if t not in held], again)
            self._set_state(_SWEPT, str(hi))
        self._count(deleted, (n[0], n[1]))
        # The next commit's arrival, or (beyond those read) a bound of it: how far behind the sweep still is.
        self._next_arrival = commits[len(taken)][1] if len(commits) > len(taken) else taken[-1][1]
        return True

    def _settled(self, done: int, held: int, traces: int) -> bool:
        """Whether to sweep a range that would hold ``held`` of its ``traces`` for their conversations. More
        than a quarter held are
        mostly conversations the stages upstream have not ended or sampled yet (after a burst they lag):
        held, they would go by trace id, the slow delete, a few seconds later. So the sweep waits for them,
        up to ``settle`` seconds, and then holds what is still needed (a conversation open for hours)."""
        if held * 4 <= traces:
            self._waiting = None
            return True
        if self._waiting is None or self._waiting[0] != done:
            self._waiting = (done, self.clock())
        if self.clock() - self._waiting[1] < self.settle:
            return False
        self._waiting = None
        return True

    def _release_held(self, horizon: dt.datetime, deleted: dict[str, int]) -> None:
        """Step 2: the rows of held traces whose conversations have expired since, a trace at a time."""
        cur = self.cur
        assert cur is not None
        done = int(self._state(_SWEPT, "0"))
        held = {t: (first, at) for t, first, at in cur.execute(f"SELECT trace_id, first_batch, since FROM "
                                                                f"{HELD_TABLE}").fetchall()}
        self._held = len(held)
        if not held:
            return
        since = min(at for _, at in held.values())
        go, _, _ = self._classify(list(held), done, horizon, since, min(first for first, _ in held.values()))
        for i in range(0, len(go), self.rows):
            part = go[i:i + self.rows]
            with Transaction(cur):
                n = self._delete_traces(part, held, done)
                self._hold([], part)
            self._count(deleted, n)
            self._held -= len(part)
            if i + self.rows < len(go) and not self._turn():
                return

    def _classify(self, traces: list[str], upto: int, horizon: dt.datetime, since: dt.datetime,
                  first: int) -> tuple[list[str], list[str], int]:
        """These traces split into those whose rows may go now and those held, and how many of those held
        wait for their conversation (the others for their later rows): a trace goes when it has no
        conversation, or its conversation has expired (ended, its last arrival before the horizon, sampled
        and nothing due for the evaluator) and every row of the trace is in commits up to ``upto``
        (a trace's rows go together: a rebuild finds a trace whole or gone). ``since``: no row of theirs
        arrived earlier; ``first``: none is in an earlier commit (both bound the row groups read)."""
        cur = self.cur
        assert cur is not None
        if not traces:
            return [], [], 0
        # Keyed traces by a join with the few asked for; the rest in the archive, within their commits.
        with registered_rows(cur, "swept_traces", ("trace_id",), [(t,) for t in traces]):
            places = cur.execute("SELECT trace_id, conversation_id, last_batch FROM trace_conversations "
                                 "JOIN swept_traces USING (trace_id)").fetchall()
        keyed = {t for t, _, _ in places}
        rest = [(t,) for t in traces if t not in keyed]
        if rest:
            with registered_rows(cur, "swept_traces", ("trace_id",), rest):
                places += cur.execute("SELECT trace_id, conversation_id, last_batch FROM trace_archive "
                                      "JOIN swept_traces USING (trace_id) WHERE last_batch >= ?", [first]).fetchall()
        conversations = sorted({c for _, c, _ in places})
        expired: set[str] = set()
        if conversations:
            with self.store.large_reads, registered_rows(cur, "swept_conversations", ("conversation_id",),
                                                         [(c,) for c in conversations]):
                expired = {c for (c,) in cur.execute(_EXPIRED, [since, horizon]).fetchall()}
        mapped = {t: (c, last) for t, c, last in places}
        go, keep, unready = [], [], 0
        for t in traces:
            c, last = mapped.get(t, (None, None))
            if c is None or (c in expired and last is not None and last <= upto):
                go.append(t)
            else:
                keep.append(t)
                unready += c not in expired
        return go, keep, unready

    def _delete_traces(self, traces: list[str], held: dict[str, tuple[int, dt.datetime]],
                       upto: int) -> tuple[int, int]:
        """The rows of these held traces in commits up to ``upto`` (spans, logs deleted)."""
        cur = self.cur
        assert cur is not None
        within, bounds = batch_filter([(held[t][0], upto) for t in traces])
        out = []
        with registered_rows(cur, "freed_traces", ("trace_id",), [(t,) for t in traces]):
            for table in _TABLES:
                [(n,)] = cur.execute(f"DELETE FROM {table} WHERE trace_id IN (SELECT trace_id FROM freed_traces)"
                                     f"{within}", bounds).fetchall()
                out.append(int(n))
        return out[0], out[1]

    def _hold(self, add: list[tuple[str, int, dt.datetime]], drop: list[str]) -> None:
        """Record traces held (trace, the first commit of their rows, when it arrived); forget ``drop``."""
        cur = self.cur
        assert cur is not None
        if drop:
            with registered_rows(cur, "dropped_traces", ("trace_id",), [(t,) for t in drop]):
                cur.execute(f"DELETE FROM {HELD_TABLE} WHERE trace_id IN (SELECT trace_id FROM dropped_traces)")
        insert_rows(cur, f"INSERT INTO {HELD_TABLE}", ("trace_id", "first_batch", "since"), add)
        self._held += len(add) - len(drop)

    def _expire_conversations(self, horizon: dt.datetime, mark: int, deleted: dict[str, int]) -> bool:
        """One chunk of step 3: the first ``chunk`` with nothing due among the next ``window`` ended
        conversations past the horizon after the last one passed (``_after``, moved on here); True when
        more may be due.

        Every table holding them is deleted from by one statement joining their ids, registered once, in
        one transaction: a kill -9 leaves each conversation whole or gone."""
        cur = self.cur
        assert cur is not None
        reviewed = ("AND NOT EXISTS (SELECT 1 FROM review_items r WHERE r.conversation_id = c.conversation_id) "
                    if self.settings.keep_reviewed else "")
        ended = _NEXT.format(columns="first_batch, revision", ended="AND state = 'ended' ")
        passed_at, passed_id = self._after
        with self.store.large_reads:
            window = cur.execute(
                f"WITH c AS ({ended}) "
                f"SELECT c.conversation_id, c.last_arrival_at, c.first_batch, NOT {JUDGEMENT_DUE} AND NOT {RETRY_DUE} "
                f"{reviewed}FROM c LEFT JOIN sampling_decisions s ON s.conversation_id = c.conversation_id "
                "LEFT JOIN eval_progress p ON p.conversation_id = c.conversation_id "
                "ORDER BY c.last_arrival_at, c.conversation_id",
                [horizon, passed_at, passed_at, passed_id, self.window]).fetchall()
        free = [(cid, at, first) for cid, at, first, deletable in window if deletable]
        rows = free[:self.chunk]
        # The next chunk starts after the last one deleted, or else after the window.
        last = rows[-1] if len(free) > self.chunk else window[-1] if window else None
        if last is None:
            return False
        more = len(window) == self.window or len(free) > self.chunk
        if not rows:
            self._passed((last[1], last[0]))
            return more
        ids = [cid for cid, _, _ in rows]
        gone = "conversation_id IN (SELECT conversation_id FROM expired_conversations)"
        with Transaction(cur), registered_rows(cur, "expired_conversations", ("conversation_id",), [(c,) for c in ids]):
            newest = max(at for _, at, _ in rows)
            spans = self._delete_rows(ids, newest, mark, [first for _, _, first in rows])
            delete_messages(cur, ids, ids, newest)  # within where their messages were written; most are archived
            for table in ("sampling_decisions", "verdicts", "not_run", "eval_progress"):
                cur.execute(f"DELETE FROM {table} WHERE {gone}")
            if not self.settings.keep_reviewed:
                cur.execute(f"DELETE FROM review_history WHERE item_id IN (SELECT id FROM review_items WHERE {gone})")
                cur.execute(f"DELETE FROM review_items WHERE {gone}")
            for table in ("trace_conversations", "trace_archive"):
                cur.execute(f"DELETE FROM {table} WHERE {gone}")
            # A conversation the conversation stage reopens meanwhile makes this commit conflict:
            # all of it rolls back, and the next pass from the oldest finds it open.
            [(live,)] = cur.execute(f"DELETE FROM live_conversations WHERE {gone}").fetchall()
            # The archive has no key: the last arrival bounds the row groups read (moves append the oldest first).
            [(archived,)] = cur.execute(f"DELETE FROM archived_conversations WHERE last_arrival_at <= ? AND {gone}",
                                        [newest]).fetchall()
        self._passed((last[1], last[0]))
        self._count(deleted, spans)
        deleted["conversations"] += live + archived
        self.m.deleted.inc(live + archived, what="conversations")
        return more

    def _passed(self, last: tuple[dt.datetime, str]) -> None:
        """Step 3 has passed every ended conversation up to ``last`` (arrival, id) this pass."""
        self._after = last
        # A bound of the next one's arrival, for how far behind step 3 is; a pass from the oldest reads again
        # those kept before it (on purpose, not behind), so it only moves on.
        if self._next_conversation is None or last[0] > self._next_conversation:
            self._next_conversation = last[0]

    def _conversations_passed(self) -> None:
        """Step 3's pass has passed every expired conversation: the next one is due GATHER seconds on at the
        soonest, or when the oldest ended one after them expires."""
        assert self.cur is not None
        self._conversations_due = self.clock() + self.gather
        at, cid = self._after
        [(self._next_conversation,)] = self.cur.execute(
            "SELECT min(last_arrival_at) FROM conversations WHERE state = 'ended' AND "
            "(last_arrival_at > ? OR (last_arrival_at = ? AND conversation_id > ?))", [at, at, cid]).fetchall()

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
            cur.execute(f"DELETE FROM {HELD_TABLE} WHERE trace_id IN (SELECT trace_id FROM expired_traces)")
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
                                          behind=self.behind_seconds(), held=self._held,
                                          conversations_behind=self.conversations_behind_seconds(),
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


def unswept(cur: duckdb.DuckDBPyConnection) -> dt.datetime | None:
    """When the oldest span or log record retention has not swept yet arrived (``None``: none)."""
    state = cur.execute("SELECT value FROM tracejudge_state WHERE key = ?", [_SWEPT]).fetchall()
    [(arrival,)] = cur.execute(_UNSWEPT, [int(state[0][0]) if state else 0]).fetchall()
    return arrival  # type: ignore[no-any-return]


def behind_seconds(settings: Settings, now: float, arrival: dt.datetime | None) -> float | None:
    """How long before the horizon of ``retention.spans`` a row not swept yet arrived: 0 when it has not
    expired or there is none, ``None`` without ``retention.spans``."""
    if settings.spans is None:
        return None
    return 0.0 if arrival is None else max(0.0, now - settings.spans - arrival.timestamp())


def storage_status(path: Path, settings: Settings, now: float, oldest: dict[str, dt.datetime | None], *,
                   behind: float | None, held: int | None = None, deleted: dict[str, int] | None = None,
                   sweeps: int | None = None, conversations_behind: float | None = None) -> dict[str, Any]:
    """The file's size and what retention keeps, for /api/status and ``tracejudge status``.

    ``behind``: ``behind_seconds``; ``held``: traces step 1 left behind; ``conversations_behind``:
    ``Retention.conversations_behind_seconds`` (the daemon's figures, absent from the file).
    """
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
                      "keep_reviewed": settings.keep_reviewed, "behind_seconds": behind},
    }
    if held is not None:
        out["retention"]["held_traces"] = held
    if conversations_behind is not None:
        out["retention"]["conversations"]["behind_seconds"] = conversations_behind
    if deleted is not None:
        out["retention"]["deleted"] = deleted
        out["retention"]["sweeps"] = sweeps
    return out
