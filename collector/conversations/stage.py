"""Conversations kept current as data arrives: the stage that rebuilds each one as its traces come.

A background ``Stage`` (``collector.background``): ``Conversations(store,
settings, metrics)`` -> ``start()`` (creates its tables, loads the open
conversations, starts its thread, which first catches up on commits it has not
seen) -> ``on_commit`` (the store calls it after each commit; it only enqueues)
-> ``stop()`` (writes what is rebuilt, records how far it got and leaves the
rest, commits queued or conversations not rebuilt yet, to the catch-up of the
next start). ``open(schema)`` then ``rebuild()`` rebuild conversations in the
caller's thread, for a reindex (``reindex``), which ``swap``s its result in.

How far it got is the batch mark (``writes``), written with the conversations
in one transaction. A conversation that cannot be rebuilt (a bug meeting odd
data) keeps its stored version (one never stored is stored without messages,
with the reason) and is counted (``conversations_failed``); it never stops the
others. A cycle that fails is logged and counted, and the stage starts again
from what is stored.

Its own thread, so ingestion never waits for it; it works at the store's pace
for it (``store.pacing``): while requests keep coming it waits for a pause in
them, at most ``max_wait``, then works a quarter of the time. Each cycle it
takes the commits queued since the last one (``rows``), resolves every touched
trace to a conversation (``tracemap``), rebuilds each touched conversation's
transcript from all of its rows (``assemble``), applies the end rules to the
newest trace (the one that starts last) and ends conversations idle for
``idle_timeout`` (``endings``), and writes ``conversations`` and ``messages``
(``writes``). A changed transcript gets a new ``revision`` (to be judged again). A backlog goes
a group of commits at a time (``rows.groups``), a few to the row cache; in the stage process the
next group's rows are read, and this one's conversations written, while it works (``process``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime as dt
import logging
import math
import queue
import sys
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Mapping

from ..background import Loop
from ..config import Conversations as Settings
from ..metrics import Metrics
from ..store import Committed
from ..store.pacing import Pacing
from .assemble import NO_CONTENT_REASON, ParseMemo, build_transcript
from .data import Ending, StageData
from .endings import ended_by_rule, idle
from .keys import conversation_key, has_messages
from .rows import GROUPS_CACHED, Batches, Light, RowCache, TraceRows, commit_rows, groups
from .archive import ARCHIVE_KEPT, ConversationArchive
from .stitch import Opening, Stitcher, answered, opening, started
from .tables import TRACES_KEPT
from .tracemap import TraceMap, Tracked, is_genai
from .transcript import Transcript
from .writes import ConversationRow, Writes, message_rows

log = logging.getLogger("tracejudge.conversations")

_STOP = object()
CATCH_UP_CHUNK = 500  # traces resolved, rebuilt and written together when catching up
END_CHUNK = 2000  # conversations ended as stored per transaction (a restart after downtime)
CYCLE_GROUPS = 8  # groups of commits (``GROUPS_CACHED``) a cycle takes at most: a backlog goes in several
# Its pace (``collector.store.pacing``): a rebuild holds the interpreter lock, so it waits for a
# longer pause than the evaluator's, and gives way every 20 ms of work.
IDLE_GAP = 0.1  # seconds with nothing waiting to be stored that make a pause in ingestion
SHARE = 0.25  # after max_wait without a pause
PIECE = 0.02
POLL = 0.02


class Stopping(Exception):
    """Raised inside a cycle (or a reindex's ``rebuild``) once ``stop`` is called: the rest is left to
    the next start."""


def never_busy() -> Pacing:
    """The pace of a stage with no ingestion beside it to give way to (its own process gives way through
    its nice value; a test's stage)."""
    return Pacing(lambda: math.inf, idle_gap=IDLE_GAP, share=SHARE, max_wait=30.0, poll=POLL, piece=PIECE)


class Conversations(Loop):
    """The conversation stage: rebuild logic over ``StageData`` (in the stage process, in ``tracejudge
    reindex``, in tests); ``pacing`` says when it may work (``never_busy`` by default), ``fatal`` hears of
    an error met in a cycle (a local store stops on a fatal one)."""

    name = "conversations"
    takes_commits = True

    def __init__(self, data: StageData, settings: Settings, metrics: Metrics | None = None, *,
                 clock: Callable[[], float] = time.time, pacing: Pacing | None = None,
                 fatal: Callable[[BaseException], object] | None = None, cache_spans: int = 10_000,
                 rebuild_interval: float = 1.0, max_queued_commits: int = 2, memo_rows: int = 5000,
                 traces_kept: int = TRACES_KEPT, conversations_kept: int = ARCHIVE_KEPT) -> None:
        super().__init__(metrics or Metrics())
        self.data = data
        self.settings = settings
        self.clock = clock
        self.pacing = pacing or never_busy()
        self._on_fatal = fatal
        self.rows = RowCache(cache_spans)
        self.map = TraceMap(ConversationArchive(conversations_kept))  # ended ones keyed (``archive``)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._warned_no_content: set[str] = set()
        self._warned_no_id: set[str | None] = set()  # services told how to set a conversation id
        self.stitcher = Stitcher(settings.stitch.window, settings.stitch.conversations)
        self._counted_no_content: set[str] = set()  # pending traces counted as LLM calls without content
        # Parsed rows of recently rebuilt conversations, so a rebuild parses only new rows.
        # Bounded in rows parsed, not conversations: a long conversation's memo holds all of them.
        self._memos: OrderedDict[str, tuple[ParseMemo, int]] = OrderedDict()  # conversation -> (memo, rows)
        self._memo_rows = 0
        self.memo_rows = memo_rows
        self._rows_written: dict[str, ConversationRow] = {}  # the row last written, per conversation in memory
        self._processed_batch = 0
        self._resume_from = 0
        self._resume_to = 0
        self._opened_batch = 0  # the last commit of the runs before this one
        self.tick = min(1.0, settings.idle_timeout / 4)
        self.rebuild_interval = rebuild_interval
        self.max_queued_commits = max_queued_commits
        self._waiting = False  # for ingestion to pause: commits are queued without their rows
        self._behind = False  # a cycle held commits back (``_cut``): new ones are queued without their rows
        self._hurry = False  # someone waits for this cycle (tests): no pauses
        self._dirty: dict[str, float] = {}  # conversation -> when its rebuild is due
        self._since: dict[str, int] = {}  # conversation -> the first commit its rebuild waits for
        self.traces_kept = traces_kept  # keyed in the trace map (``archive_traces``)
        self._writes = Writes(traces_kept=traces_kept)
        self._leaving: list[Tracked] = []  # ended with the writes not sent yet (``_write``)
        self._unranged: set[str] = set()  # traces read this cycle with no commits stored for them
        # The newest commit among the rows taken in: with the batch mark, where messages are written
        # (``ConversationRow.messages_batch``), increasing as they are (a reindex has no mark of its own).
        self._newest_batch = 0
        self._idle_event = threading.Event()
        self.failed = 0  # rebuilds that failed (the conversation keeps its stored version)

    # ------------------------------------------------------------ lifecycle

    def _open(self) -> None:
        """Load the stored state; ``start`` then queues the catch-up and runs the thread."""
        self._load_state()
        # Commits this stage never saw (a crash between commit and processing) come back from DuckDB.
        self._queue.put(("catch_up", None))

    def _wake(self) -> None:
        self._queue.put(_STOP)

    def _close(self) -> None:
        self.data.close()

    def _fatal(self) -> None:
        exc = sys.exc_info()[1]
        if exc is not None and self._on_fatal is not None:
            self._on_fatal(exc)

    def _load_state(self) -> None:
        """Where the stored conversations stand: the batch mark, the open conversations, the archive's
        filter, and the recent conversations without an id, to continue them (``stitch``; those with new
        data since are taken in again by the catch-up, which drops and puts them again)."""
        kept = self.stitcher.kept if self.stitcher.enabled else 0
        resume = self.data.resume(self.clock() - self.stitcher.window, kept)
        self._processed_batch = resume.mark
        self._resume_from = self._processed_batch
        self._resume_to = resume.committed  # the last commit made before now
        self._opened_batch = resume.opened
        self.map.archive.load(resume.filter_layers)
        self.map.load_open(resume.conversations)
        self.stitcher.clear()
        for recent in resume.recent:  # the most recent last: the last to go
            tr = recent.transcript
            digest = answered(tr.messages)
            if digest is not None:
                self.stitcher.put(recent.conversation_id, tr.service, digest, started(tr), recent.last_arrival)

    @property
    def processed_batch(self) -> int:
        """The last commit this stage has taken in (its conversations may await their rebuild)."""
        return self._processed_batch

    def status(self) -> dict[str, int]:
        """How far the stage has got, for /api/status."""
        return {"conversations_batch": self._processed_batch,
                "conversations_pending": len(self._dirty) + len(self._writes) + self.data.in_flight,
                "conversations_failed": self.failed}

    def held(self) -> dict[str, int]:
        return {**self.rows.held(), **self.map.held(), "memo_rows": self._memo_rows, "rebuilds_due": len(self._dirty),
                "queued": self._queue.qsize(), "stitch_conversations": len(self.stitcher)}

    def on_commit(self, committed: Committed | Light) -> None:
        """Called by the store's writer thread after each commit: hand off, return.

        While the stage is behind (ingestion busy, a cycle holding commits back, or several queued),
        a commit is queued without its rows (``Light``: they are read back from DuckDB by commit
        range), so a lagging stage cannot hold every span in memory; so is one the daemon sent light
        (the stage in its own process).
        """
        if isinstance(committed, Light) or self.takes_rows():
            self._queue.put(committed)
        else:
            self._queue.put(Light.of(committed))

    def takes_rows(self) -> bool:
        """Whether a commit handed over now would keep its rows (``on_commit``)."""
        return not self._waiting and not self._behind and self._queue.qsize() < self.max_queued_commits

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block until everything queued so far is processed (tests)."""
        self._idle_event.clear()
        self._queue.put(("idle", None))
        return self._idle_event.wait(timeout)

    # ------------------------------------------------------------ the loop

    def _run(self) -> None:
        items: list[Any] = []  # taken from the queue, not processed yet
        while True:
            if not items or self._waiting:  # else a cycle held commits back: they go on at once
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
            if self.stopping.is_set():
                break
            waiters = any(isinstance(it, tuple) and it[0] == "idle" for it in items)
            if not waiters and not self.pacing.ready():
                # Requests first: hold only which commits wait, not their rows.
                self._waiting = True
                items = _without_rows(items)
                continue
            self._waiting = False
            part, rest = self._cut(items)
            # What waits for the next cycle keeps which commits it was, not their rows: a backlog of
            # thousands of commits costs next to nothing (their rows are read back a group at a time).
            rest = _without_rows(rest)
            self._behind = bool(rest)
            try:
                self._cycle(part, upto=rest[0].received_at if rest else None, hurry=waiters)
                self.cycle_ok()
            except Stopping:
                break
            except Exception:  # noqa: BLE001 - one bad cycle must not stop the stage
                delay = self.cycle_failed("a conversation update failed; it is retried from the stored state")
                self._resync()  # its catch-up takes in the commits held back too
                if waiters:  # they wait for the retry
                    self._queue.put(("idle", None))
                self.stopping.wait(delay)  # a store that cannot write now may later
                rest = []
                self._behind = False
            finally:
                self.pacing.rest()
            items = rest
        self._finish()

    def _cut(self, items: list[Any]) -> tuple[list[Any], list[Any]]:
        """What this cycle takes (at most ``CYCLE_GROUPS`` groups of commits, with what was queued among
        them) and what waits for the next, in order: a conversation ends only between cycles, so one
        cycle over a whole backlog would hold every conversation of it in memory."""
        if any(isinstance(it, tuple) and it[0] == "swap" for it in items):
            return items, []  # a swap's cycle reads its commits back anyway
        limit = CYCLE_GROUPS * max(1, self.rows.max_rows // GROUPS_CACHED)
        rows = 0
        for i, it in enumerate(items):
            if isinstance(it, (Committed, Light)):
                n = commit_rows(it)
                if rows and rows + n > limit:
                    return items[:i], items[i:]
                rows += n
        return items, []

    def _finish(self) -> None:
        """At stop: write what is rebuilt with the batch mark, and say what the next start takes up."""
        try:
            self._flush()
            self._sync()
            mark = self._safe_batch()
            left = len(self.data.traces_since(mark, None))
        except Exception:  # noqa: BLE001
            self.error("writing conversations at stop failed; the next start catches up from the stored mark")
            return
        if left:
            log.info("stopped before catching up: %d traces left for the next start (committed after batch %d)",
                     left, mark)

    def _check_stop(self) -> None:
        if self.stopping.is_set():
            raise Stopping

    def _give_way(self) -> None:
        """Within a cycle: once a piece of work has run, let requests go first (``pacing``)."""
        if not self._hurry and not self.pacing.checkpoint(self.stopping):
            raise Stopping

    def _resync(self) -> None:
        """After a failed cycle memory may be ahead of what is stored: start again from the stored
        state (the batch mark and the open conversations) and catch up from there."""
        try:
            self._sync()
        except Exception:  # noqa: BLE001 - writes that failed were rolled back: the catch-up below redoes them
            pass
        self.map.clear()
        self.rows.clear()
        self._rows_written.clear()
        self._dirty.clear()
        self._since.clear()
        self._writes = Writes(traces_kept=self.traces_kept)
        self._leaving.clear()
        self._memos.clear()
        self._memo_rows = 0
        try:
            self._load_state()
        except Exception:  # noqa: BLE001
            self.error("reading the stored conversations failed; retrying on the next data")
        self._queue.put(("catch_up", None))

    def _safe_batch(self) -> int:
        """The batch mark to store now: every commit up to it has its conversations rebuilt
        and written (with this write), so the next start may catch up from there."""
        if self._since:
            return min(self._processed_batch, min(self._since.values()) - 1)
        return self._processed_batch

    def _cycle(self, items: list[Any], upto: float | None = None, hurry: bool = False) -> None:
        """Take in these commits and rebuild what they touched; ``upto``: when the first commit held back
        for the next cycle arrived (conversations idle by then end now); ``hurry``: someone waits."""
        committed = [it for it in items if isinstance(it, (Committed, Light))]
        idle_waiters = [it for it in items if isinstance(it, tuple) and it[0] == "idle"]
        swaps = [it[1] for it in items if isinstance(it, tuple) and it[0] == "swap"]
        if swaps:  # the commits with them are read back by the catch-up the swap queues
            self._swap(swaps)
            for waiter in idle_waiters:
                self._queue.put(waiter)
            return
        if any(isinstance(it, tuple) and it[0] == "catch_up" for it in items):
            self._catch_up()
        # Waiters (tests) want everything current: no debounce for them.
        self._hurry = hurry or bool(idle_waiters)
        previous: set[str] = set()
        todo = groups(committed, max(1, self.rows.max_rows // GROUPS_CACHED))
        ahead = None
        for n, group in enumerate(todo):
            self._check_stop()
            touched = self._ingest(group, ahead)
            # The rebuilds of the group before go now, after this group's reads: in the stage process
            # the daemon writes them, then reads the next group's rows, while this one's are rebuilt.
            if n:
                self._flush()
            ahead = self.rows.read_ahead(self.data, todo[n + 1]) if n + 1 < len(todo) else None
            # A backlog: rebuild what the previous group touched and this one did not (done
            # for now, as far as the backlog goes), while its rows are still cached.
            if previous:
                self._rebuild_due(only=previous - touched)
            previous = touched
        self._rebuild_due(force=self._hurry and upto is None)
        self._sweep_idle(upto)
        self._flush()
        self._sync()  # a cycle ends with its writes stored: waiters and /api/status see them
        if idle_waiters:
            self._idle_event.set()

    def _swap(self, swaps: list[tuple[dt.datetime, concurrent.futures.Future[int]]]) -> None:
        """Write what is rebuilt, swap the reindex in, then start again from the stored state (``_resync``)."""
        try:
            self._flush()
            self._sync()
        except Exception as exc:  # noqa: BLE001 - the swap's caller hears of it
            for _, done in swaps:
                done.set_exception(exc)
            raise
        for now, done in swaps:
            try:
                count = self.data.swap(now)
            except Exception as exc:  # noqa: BLE001 - the swap's caller hears of it
                done.set_exception(exc)
            else:
                done.set_result(count)
        self._resync()

    def _catch_up(self) -> None:
        """Rebuild what commits after the batch mark touched (a stop or a crash came between).

        Traces go in order of their last commit, a chunk at a time, each chunk
        written with the mark it reaches: every trace with a later commit is then
        still after the mark, so a stop here loses nothing and keeps what is done.
        """
        # Only commits made before this stage opened (or resynced): later ones reach it through
        # ``on_commit``, and reading them here too would rebuild a burst that arrived meanwhile twice.
        traces = self.data.traces_since(self._resume_from, self._resume_to)
        # Only those of an earlier run are news: commits made while this stage was starting (a first start
        # answering traffic at once, a restarted process) are taken in as on any cycle.
        before = sum(1 for _, _, first, _ in traces if first <= self._opened_batch)
        if before:
            log.info("catching up on %d traces committed before the last stop", before)
        for i in range(0, len(traces), CATCH_UP_CHUNK):
            part = traces[i:i + CATCH_UP_CHUNK]
            self._touch({t: at for t, at, _, _ in part}, since=self._processed_batch + 1,
                        taken={t: (first, last) for t, _, first, last in part}, complete=False)
            self._rebuild_due(force=True)
            nxt = traces[i + CATCH_UP_CHUNK][3] - 1 if i + CATCH_UP_CHUNK < len(traces) else self._resume_to
            self._processed_batch = max(self._processed_batch, nxt)
            self._flush()
        # Every commit made before this stage opened is now taken in, traceless logs included.
        self._processed_batch = max(self._processed_batch, self._resume_to)

    def rebuild(self, arrived: dict[str, float], batches: Mapping[str, Batches] | None = None) -> None:
        """A reindex's step, on a stage ``open``ed in the reindex's schema: take these traces in (their
        rows read back from DuckDB, within ``batches``, the first and last commits with rows of each),
        rebuild their conversations, end those idle by the stage's clock, and write it all (in the
        caller's transaction, if one is open).

        Raises:
            Stopping: ``stop`` came meanwhile (the caller's transaction must not commit).
        """
        self._touch(arrived, since=self._processed_batch + 1, taken=batches)
        self._rebuild_due(force=True)
        self._sweep_idle()
        self._flush()

    def swap(self, now: dt.datetime) -> concurrent.futures.Future[int]:
        """Swap a finished reindex in (``StageData.swap``) in the stage's thread, between two cycles, then
        start again from what is stored: nothing of the stage's is in flight meanwhile. The future resolves
        with the number of conversations, or what the swap raised; a stop first leaves it unresolved.
        """
        done: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._queue.put(("swap", (now, done)))
        return done

    # ------------------------------------------------------------ ingestion

    def _ingest(self, committed: list[Committed | Light], ahead: Any = None) -> set[str]:
        """Take these commits in (``ahead``: their rows as ``RowCache.read_ahead`` asked for them); returns
        the conversations they touched."""
        taken = self.rows.take(self.data, committed, ahead)
        current = self.map.of(self.data, list(taken.arrived), taken.mapped)
        # A trace seen for the first time has all its rows in these commits: the cache keeps
        # them, so that only traces with older rows are read back from DuckDB.
        self.rows.keep(taken, {t for t, cid in current.items() if cid is not None} | set(self.map.pending))
        # Commit by commit, and the traces of one commit (one request, as a rule) in the order of their
        # spans' times: an exporter batches them in any order, and a conversation's turns come in order.
        arrived = {t: taken.arrived[t]
                   for t in sorted(taken.arrived, key=lambda t: (taken.first[t], taken.rows[t].start(), t))}
        # A trace in no conversation and not pending is new (the cache's premise): its rows start in these commits.
        convs = self._touch(arrived, current, since=taken.first,
                            taken={t: (taken.first[t], taken.last[t]) for t in taken.arrived})
        self._processed_batch = max(self._processed_batch, *(c.batch_id for c in committed))
        return convs

    def _touch(self, arrived: dict[str, float], current: dict[str, str | None] | None = None,
               since: Mapping[str, int] | int = 0, taken: Mapping[str, Batches] | None = None,
               complete: bool = True) -> set[str]:
        """Resolve each touched trace to its conversation and mark those conversations for a rebuild.

        ``arrived``: when each trace's rows last arrived; ``current`` the trace map for these
        traces when the caller has read it already; ``since`` the first commit with a trace's
        new rows (for the batch mark), per trace or for all; ``taken`` the first and last commits
        with the rows of each trace the caller took in, where it knows them. ``complete``: a trace
        in no conversation and not pending has no other rows (its first rows are among these); else
        such a trace is read from the whole table.
        """
        if not arrived:
            return set()
        traces = list(arrived)
        if current is None:
            current = self.map.of(self.data, traces)
        # Their conversations' first commits bound the reads of these traces' older rows.
        self.map.load(self.data, [c for c in current.values() if c is not None])

        def unstored(tid: str) -> Batches:
            cid = current.get(tid)
            if cid is not None:
                return self.map.convs[cid].first_batch, None
            pending = self.map.pending.get(tid)
            if pending is not None:
                return pending[1], None
            return taken[tid] if complete and taken is not None and tid in taken else (None, None)

        keys: dict[str, str] = {}
        how: dict[str, str] = {}  # trace -> how it joined a conversation without an id, if not alone
        stitching: list[tuple[int, str, Opening | None]] = []  # traces to stitch by history, once all are read
        trace_batches: dict[str, Batches] = {}
        for i in range(0, len(traces), 500):  # bounded memory: rows of at most 500 traces at once
            chunk = traces[i:i + 500]
            rows = self.rows.get(self.data, chunk, where=self._batches(unstored, taken))
            for tid in chunk:
                self._check_stop()
                self._give_way()
                key = conversation_key(rows[tid].spans, self.settings.id_attributes)
                if key is None and current.get(tid) is None and not has_messages(rows[tid].spans, rows[tid].logs):
                    # Neither an id nor a message (yet: content may come in later rows): no conversation.
                    self._no_content(tid, rows[tid])
                    self.map.pending[tid] = (arrived[tid], rows[tid].first_batch)
                    continue
                trace_batches[tid] = rows[tid].batches()
                self._newest_batch = max(self._newest_batch, trace_batches[tid][1] or 0)
                self.map.pending.pop(tid, None)
                self._counted_no_content.discard(tid)
                if key is None:
                    key = self.map.chained(tid, rows[tid])
                    if key is not None:
                        how[tid] = "response"
                    else:
                        key = self._unkeyed(tid, rows[tid], current.get(tid), stitching)
                if key is not None:
                    keys[tid] = key
            del rows
        # In the order they started: a turn after the one it continues, whatever order they came in.
        for _, tid, op in sorted(stitching, key=lambda s: (s[0], s[1])):
            own = f"trace:{tid}"
            found = self.stitcher.find(op, arrived[tid], exclude=own) if op is not None else None
            keys[tid] = found or own
            if found is not None:
                how[tid] = "history"
                self.stitcher.drop(own)
            # The conversation's transcript is now the trace's own: alone, or the one it continues extended.
            if op is not None and op.digest is not None:
                self.stitcher.put(keys[tid], op.service, op.digest, op.started, arrived[tid])
            else:
                self.stitcher.drop(keys[tid])
        self.map.load(self.data, [*keys.values(), *(c for c in current.values() if c is not None)])
        now = self.clock()
        for tid, cid in keys.items():
            conv = self.map.convs[cid]
            old = current.get(tid)
            first = since if isinstance(since, int) else since[tid]
            if tid in how:
                conv.grouped(how[tid])
                if how[tid] == "response":  # its transcript is known again once rebuilt
                    self.stitcher.drop(cid)
            if old != cid:
                if old is not None:  # the span carrying the id arrived after its children
                    self.stitcher.drop(old)
                    prev = self.map.convs[old]
                    if tid in prev.traces:
                        prev.traces.remove(tid)
                    self._dirty.setdefault(old, now)
                    self._since.setdefault(old, first)
                self.map.move(tid, cid)
            if old is None and tid in conv.traces:
                # Back after the trace map forgot it (``archive_traces``): its older rows are in its
                # conversation's commits, and the cache holds only the new ones.
                self.rows.drop([tid])
                trace_batches[tid] = (conv.first_batch, trace_batches[tid][1])
            # Each touched trace's commits, as they are now (``_batches`` reads them back).
            self._writes.traces[tid] = (cid, *trace_batches[tid])
            if old is None:  # not keyed: neither memory nor the table knew it (``Writes.flush``)
                self._writes.new_traces.add(tid)
            b = trace_batches[tid][0]
            if b is not None and (conv.first_batch is not None or not conv.traces):  # None with traces: unknown
                conv.first_batch = b if conv.first_batch is None else min(conv.first_batch, b)
            # Also when the map has it already: a stop can come between writing the map and the
            # conversation (its rebuild waits for the next interval), and the catch-up mends it.
            if tid not in conv.traces:
                conv.traces.append(tid)
                if conv.state == "ended":  # a new trace reopens an ended conversation
                    conv.reopen()
                    self.metrics.conversations_reopened.inc()
            if not conv.first_arrival:
                conv.first_arrival = arrived[tid]
            conv.last_arrival = max(conv.last_arrival, arrived[tid])
            # At most one rebuild per conversation per interval while data streams in.
            self._dirty.setdefault(cid, max(now, conv.rebuilt_at + self.rebuild_interval))
            self._since.setdefault(cid, first)
        return set(keys.values())

    def _unkeyed(self, tid: str, rows: TraceRows, current: str | None,
                 stitching: list[tuple[int, str, Opening | None]]) -> str | None:
        """The conversation of a trace with no id nor previous response: the one it is in already, or None
        with the trace added to ``stitching`` (its conversation is decided once every trace is read)."""
        service = next((s for r in rows.spans if (s := r.get("service"))), None)
        if service not in self._warned_no_id:
            self._warned_no_id.add(service)
            log.warning("service %s sends traces with no conversation id: each is a conversation of its own, but "
                        "for one whose model call resends a recent conversation of the service whole, which "
                        "continues it (grouped_by: history). Set gen_ai.conversation.id on a span around each turn; "
                        "README.md, 'Point your bot at it', shows how with opentelemetry-instrumentation-openai-v2",
                        service or "(unnamed)")
        own = f"trace:{tid}"
        alone = current == own and self.map.convs[own].traces in ([], [tid])
        if current is not None and not alone:
            self.stitcher.drop(current)  # new rows: its transcript is known again once rebuilt
            return current
        # Still alone: with more of its rows it may turn out to continue another conversation.
        op = opening(build_transcript(rows.spans, rows.logs)) if self.stitcher.enabled else None
        stitching.append((op.started if op is not None else rows.start(), tid, op))
        return None

    def _no_content(self, tid: str, rows: TraceRows) -> None:
        """A trace with LLM calls but neither an id nor content makes no conversation: counted once, and
        the first of each service says why and how to turn capture on (as a conversation without content
        does)."""
        if tid in self._counted_no_content or not is_genai(rows, kinds=("llm",)):
            return
        self._counted_no_content.add(tid)
        self.metrics.genai_traces_without_content.inc()
        service = next((s for r in rows.spans if isinstance(s := r.get("service"), str) and s), "")
        if service not in self._warned_no_content:
            self._warned_no_content.add(service)
            log.warning("trace %s of service %s has LLM calls but neither a conversation id nor message content: "
                        "its spans are stored, it makes no conversation and cannot be judged: %s",
                        tid, service or "(unknown)", NO_CONTENT_REASON)

    def _batches(self, unstored: Callable[[str], Batches], taken: Mapping[str, Batches] | None = None
                 ) -> Callable[[list[str]], dict[str, Batches]]:
        """For ``RowCache.get``: the commits that can hold each trace's rows. Those this stage wrote for
        it (in this cycle's writes, else in ``trace_conversations``), with ``taken`` (commits just taken
        in for it); a trace with none stored from ``unstored(trace)`` (a trace in no conversation yet,
        or one an older version stored: its conversation's first commit on, learnt by its rebuild)."""

        def where(traces: list[str]) -> dict[str, Batches]:
            written = self._writes.traces
            stored = {t: (p.first_batch, p.last_batch)
                      for t, p in self.data.trace_map([t for t in traces if t not in written]).items()}
            out: dict[str, Batches] = {}
            for t in traces:
                first, last = written[t][1:] if t in written else stored.get(t, (None, None))
                if first is None or last is None:
                    self._unranged.add(t)
                    first, last = unstored(t)
                elif taken is not None and t in taken:
                    new_first, new_last = taken[t]
                    first = first if new_first is None else min(first, new_first)
                    last = last if new_last is None else max(last, new_last)
                out[t] = first, last
            return out

        return where

    # ------------------------------------------------------------ transcripts

    def _rebuild_due(self, force: bool = False, only: set[str] | None = None) -> None:
        now = self.clock()
        due = sorted(c for c, at in self._dirty.items() if (force or at <= now) and (only is None or c in only))
        convs = self.map.convs
        for i in range(0, len(due), 200):  # bounded memory: rows of at most 200 conversations at once
            part = [convs[c] for c in due[i:i + 200] if c in convs]
            firsts = {t: conv.first_batch for conv in part for t in conv.traces}
            rows = self.rows.get(self.data, firsts, where=self._batches(lambda t: (firsts[t], None)))
            for conv in part:
                self._check_stop()
                self._rebuild_one(conv, rows)
                self._give_way()
            del rows
            if i + 200 < len(due):
                self._flush()  # bounded memory: transcripts of at most 200 conversations wait to be written
        for cid in due:
            self._done(cid)

    def _done(self, cid: str) -> None:
        """The conversation's rebuild is no longer waited for (written with the next flush)."""
        self._dirty.pop(cid, None)
        self._since.pop(cid, None)

    def _rebuild_one(self, conv: Tracked, rows: dict[str, TraceRows] | None = None) -> None:
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

    def _rebuild(self, conv: Tracked, rows: dict[str, TraceRows] | None = None) -> None:
        conv.rebuilt_at = self.clock()
        if not conv.traces:  # every trace moved to a keyed conversation
            self.stitcher.drop(conv.id)
            self._writes.delete(conv.id)
            if conv.archived:
                self._writes.unarchive.add(conv.id)
            self.map.convs.pop(conv.id, None)
            self._rows_written.pop(conv.id, None)
            return
        if rows is None or any(t not in rows for t in conv.traces):
            rows = self.rows.get(self.data, conv.traces, where=self._batches(lambda _: (conv.first_batch, None)))
        # Now that every row of its traces is at hand, their first commit is known exactly.
        conv.first_batch = min((b for t in conv.traces if (b := rows[t].first_batch) is not None),
                               default=conv.first_batch)
        for t in self._unranged.intersection(conv.traces):  # stored by an older version: now they are known
            self._writes.traces[t] = (conv.id, *rows[t].batches())
        # Oldest first, as trace_ids promises: the same order live and in a reindex, whatever order
        # the traces' commits came in.
        conv.traces.sort(key=lambda t: (rows[t].start(), t))
        expired = conv.stored and any(not rows[t] for t in conv.traces)
        tr = self._stored(conv) if expired else None
        if tr is None:
            spans = [r for t in conv.traces for r in rows[t].spans]
            logs = [r for t in conv.traces for r in rows[t].logs]
            memo = self._drop_memo(conv.id) or ParseMemo()
            tr = build_transcript(spans, logs, memo)
            self._memos[conv.id] = (memo, len(spans) + len(logs))  # most recently rebuilt last
            self._memo_rows += len(spans) + len(logs)
            if self._memo_rows > self.memo_rows:
                self._trim_memos()
            digest = tr.content_hash(memo.digest)
            if digest != conv.hash:
                conv.revision += 1
                conv.hash = digest
        if conv.grouped_by != "id":  # what a trace with no id may continue now
            history = answered(tr.messages) if self.stitcher.enabled else None
            if history is None:
                self.stitcher.drop(conv.id)
            else:
                self.stitcher.put(conv.id, tr.service, history, started(tr), conv.last_arrival)
        conv.newest_trace = max(conv.traces, key=lambda t: (rows[t].start(), t))
        if conv.state == "open" and conv.newest_trace in rows:
            ended_by = ended_by_rule(self.settings.end_rules, rows[conv.newest_trace].spans)
            if ended_by is not None:
                self._end(conv, ended_by)
        self._write(conv, tr)

    def _stored(self, conv: Tracked) -> Transcript | None:
        """The stored transcript of a conversation whose older spans retention deleted: rebuilt from
        what is left it would lose their messages, so it stays as stored (with its new traces listed)."""
        stored = self.data.stored_transcript(conv.id)
        if stored is None:
            return None
        log.warning("conversation %s has new data, but the spans of its older traces were deleted "
                    "(storage.retention.spans): its stored transcript is kept as it was", conv.id)
        return dataclasses.replace(stored, trace_ids=tuple(conv.traces))

    def _trim_memos(self) -> None:
        """Down to three quarters of ``memo_rows`` (so that a trim, which walks the memos, comes once in
        many rebuilds): first the memos of conversations with no rebuild due, the least recently rebuilt
        first (a deferred rebuild keeps its memo), then the oldest; the newest stays, however long."""
        target = self.memo_rows * 3 // 4
        for cid in [c for c in self._memos if c not in self._dirty]:
            if self._memo_rows <= target:
                return
            self._drop_memo(cid)
        while self._memo_rows > target and len(self._memos) > 1:
            self._drop_memo(next(iter(self._memos)))

    def _drop_memo(self, cid: str) -> ParseMemo | None:
        memo, rows = self._memos.pop(cid, (None, 0))
        self._memo_rows -= rows
        return memo

    def _end(self, conv: Tracked, ended_by: str) -> None:
        conv.end(ended_by, self.clock())
        self.metrics.conversations_ended.inc(ended_by=ended_by)

    def _write(self, conv: Tracked, tr: Transcript) -> None:
        conv.last_span_end = tr.ended_at
        if not tr.content_captured and tr.llm_calls and (tr.service or "") not in self._warned_no_content:
            self._warned_no_content.add(tr.service or "")
            log.warning("conversation %s of service %s carries no message content, so it cannot be judged: %s",
                        conv.id, tr.service or "(unknown)", tr.no_content_reason)
        row = ConversationRow.of(conv, tr, self.clock(), max(self._processed_batch, self._newest_batch))
        self._rows_written[conv.id] = row
        self._writes.conversations[conv.id] = row
        self._writes.messages[conv.id] = message_rows(conv.id, tr, row.messages_batch)
        if conv.stored:
            self._writes.replace.add(conv.id)
        else:
            self._writes.new.add(conv.id)
        if conv.archived:  # back in live_conversations with this write, out of the archive with the same flush
            self._writes.unarchive.add(conv.id)
            conv.archived = False
        conv.stored = True
        if conv.state == "ended":
            # It leaves memory once this write is sent: until then the trace map and its row in DuckDB
            # may not say it ended, and reads of its traces must find it here (``_cycle`` sends a group's
            # writes after the next group's reads).
            self._leaving.append(conv)

    def _flush(self) -> None:
        """Write everything this cycle changed, with the batch mark (``Writes.flush``); then the row
        cache drops what it parsed, so that it holds text (parsed trees are several times its size).

        In the stage process the daemon writes while this goes on (``StageData.write`` goes behind): its
        operations come after the writes, and the cycle ends with ``_sync``, which raises their error.
        """
        written = len(self._writes.conversations)
        try:
            writes, self._writes = self._writes, Writes(traces_kept=self.traces_kept)
            self.data.write(writes, self._safe_batch())
        finally:
            self.rows.release()
            self._unranged.clear()
        for conv in self._leaving:
            if conv.state == "ended" and conv.id not in self._dirty:  # no new data meanwhile
                self._forget(conv)
        self._leaving.clear()
        archive = self.map.archive
        archive.written(written)
        # After the writes, on the same cursor (what it moves is stored), in a pause of ingestion.
        if archive.due() and (self._hurry or self.pacing.checkpoint(self.stopping)):
            archive.move(self.data, held=self.map.convs.keys())

    def _sync(self) -> None:
        """Everything written so far is stored (the stage process's writes behind are answered)."""
        self.data.sync()

    def _end_stored(self, convs: list[Tracked], now: float) -> None:
        """End conversations whose stored transcripts are current (open at the last stop, nothing new
        since) as they are stored, ``END_CHUNK`` per transaction: a restart after downtime ends them
        all without rebuilding each, and a stop in between leaves the rest open for the next start."""
        stamp = dt.datetime.fromtimestamp(now, dt.timezone.utc)
        convs = sorted(convs, key=lambda c: c.first_batch or 0)  # each part reads from its first commit on
        for i in range(0, len(convs), END_CHUNK):
            self._check_stop()
            self._give_way()
            part = convs[i:i + END_CHUNK]
            self.data.end_stored([Ending(c.id, c.ended_by, dt.datetime.fromtimestamp(c.closed_at or now, dt.timezone.utc))
                                  for c in part], part[0].first_batch or 0, stamp)
            for conv in part:
                self._done(conv.id)
                self._forget(conv)

    def _forget(self, conv: Tracked) -> None:
        """An ended conversation leaves memory; late data reads it back from DuckDB."""
        self.map.forget(conv)
        self._rows_written.pop(conv.id, None)
        self._drop_memo(conv.id)
        self.rows.drop(conv.traces)

    # ------------------------------------------------------------ idle

    def _sweep_idle(self, upto: float | None = None) -> None:
        """End the conversations idle for ``idle_timeout``: by now, or with commits held back for the next
        cycle by when the first of them arrived (time is the clock at commit, as if the stage had kept up)."""
        now = self.clock() if upto is None else min(self.clock(), upto)
        limit = self.settings.idle_timeout
        as_stored = []
        for conv in idle(list(self.map.convs.values()), now, limit):
            self._end(conv, "idle")
            row = self._rows_written.get(conv.id)
            if conv.id in self._dirty:  # new rows: rebuild
                self._rebuild_one(conv)
            elif row is None:  # loaded at start, and nothing new: what is stored is current
                as_stored.append(conv)
            else:
                self._done(conv.id)
                self._writes.conversations[conv.id] = row.ended(conv, now)
                self._forget(conv)
        self._end_stored(as_stored, now)
        for tid in [t for t, (at, _) in self.map.pending.items() if now - at >= limit]:
            del self.map.pending[tid]
            self._counted_no_content.discard(tid)


def _without_rows(items: list[Any]) -> list[Any]:
    """The queued items with each whole commit as a ``Light`` one (its rows are read back when taken in)."""
    return [Light.of(it) if isinstance(it, Committed) else it for it in items]
