"""Conversations kept current as data arrives: the stage that rebuilds each one as its traces come.

``Conversations(data, settings, metrics)`` is rebuild logic with no cursor: what is stored it reaches
through ``data`` (``data.StageData``: ``process.RemoteData`` in the stage process, ``duck.DuckData`` in
``tracejudge reindex`` and tests through ``duck.local_stage``, ``MemoryData`` in unit tests). Its
jobs are classes of their own modules over ``state.StageState``: ``resolve`` (traces to
conversations), ``rebuild`` (transcripts), ``endings`` (end rules, idle); this module is its loop.

A background ``Loop`` (``collector.background``): ``start()`` (loads the stored state, starts its thread,
which first catches up on commits it has not seen) -> ``on_commit`` (after each commit; it only
enqueues) -> ``stop()`` (writes what is rebuilt, records how far it got and leaves the rest, commits
queued or conversations not rebuilt yet, to the catch-up of the next start). ``open()`` then
``rebuild()`` rebuild conversations in the caller's thread, for a reindex (``reindex``); ``swap(now)``
swaps a finished reindex in between two cycles.

How far it got is the batch mark, written with the conversations in one transaction
(``StageData.write``). A conversation that cannot be rebuilt (a bug meeting odd data) keeps its stored
version (one never stored is stored without messages, with the reason) and is counted
(``conversations_failed``); it never stops the others. A cycle that fails is logged and counted, and
the stage starts again from what is stored.

Its own thread, so ingestion never waits for it; it works at its ``pacing``: in the daemon's process a
store's (while requests keep coming it waits for a pause in them, at most ``max_wait``, then works a
quarter of the time), in the stage process never busy (it gives way through its nice value). Each cycle
it takes the commits queued since the last one (``rows``), resolves every touched trace to a conversation,
rebuilds each touched conversation's transcript from all of its rows, applies the end rules to the
newest trace (the one that starts last) and ends conversations idle for ``idle_timeout``, and writes
``conversations`` and ``messages``. A changed transcript gets a new ``revision`` (to be judged again). A
backlog goes a group of commits at a time (``rows.groups``), a few to the row cache; the next group's
rows are asked for (``StageData.commit_rows``), and this one's conversations written, while it works.
"""

from __future__ import annotations

import concurrent.futures
import datetime as dt
import logging
import math
import queue
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping

from ..background import Loop
from ..config import Conversations as Settings
from ..metrics import Metrics
from ..store import Committed
from ..store.pacing import Pacing
from .archive import ARCHIVE_KEPT
from .data import StageData
from .endings import Ending
from .rebuild import Rebuild
from .resolve import Resolve
from .rows import GROUPS_CACHED, Batches, Light, commit_rows, groups
from .state import StageState, Stopping
from .stitch import answered, started
from .tables import TRACES_KEPT
from .data import Writes
if TYPE_CHECKING:
    from ..store import Store  # DuckDB only where a stage runs on it (local_stage)


log = logging.getLogger("tracejudge.conversations")

_STOP = object()
CATCH_UP_CHUNK = 500  # traces resolved, rebuilt and written together when catching up
# Seconds a touched conversation waits before its rebuild, taking in what comes with the first data:
# bench/soak.py's turns, a tenth of a second apart, were rebuilt and written twice. Rows wait in the
# row cache meanwhile (``cache_spans``): at 5,000 spans/s a wait of 1 s outgrew it, the rows of
# conversations not rebuilt yet were read back from DuckDB, and the stage fell 240 commits behind.
REBUILD_SETTLE = 0.5
CYCLE_GROUPS = 8  # groups of commits (``GROUPS_CACHED``) a cycle takes at most: a backlog goes in several
# Its pace (``collector.store.pacing``): a rebuild holds the interpreter lock, so it waits for a
# longer pause than the evaluator's, and gives way every 20 ms of work.
IDLE_GAP = 0.1  # seconds with nothing waiting to be stored that make a pause in ingestion
SHARE = 0.25  # after max_wait without a pause
PIECE = 0.02
POLL = 0.02


def never_busy() -> Pacing:
    """The pace of a stage with no ingestion beside it to give way to (its own process gives way through
    its nice value; a test's stage)."""
    return Pacing(lambda: math.inf, idle_gap=IDLE_GAP, share=SHARE, max_wait=30.0, poll=POLL, piece=PIECE)


class Conversations(Resolve, Rebuild, Ending, Loop):
    """The conversation stage: rebuild logic over ``StageData`` (in the stage process, in ``tracejudge
    reindex``, in tests); ``pacing`` says when it may work (``never_busy`` by default), ``fatal`` hears of
    an error met in a cycle (a local store stops on a fatal one)."""

    name = "conversations"
    takes_commits = True

    def __init__(self, data: StageData, settings: Settings, metrics: Metrics | None = None, *,
                 clock: Callable[[], float] = time.time, pacing: Pacing | None = None,
                 fatal: Callable[[BaseException], object] | None = None, cache_spans: int = 10_000,
                 rebuild_interval: float = 1.0, rebuild_settle: float = REBUILD_SETTLE, max_queued_commits: int = 2,
                 memo_rows: int = 5000, traces_kept: int = TRACES_KEPT, conversations_kept: int = ARCHIVE_KEPT) -> None:
        Loop.__init__(self, metrics or Metrics())
        StageState.__init__(self, data, settings, clock, pacing or never_busy(), cache_spans=cache_spans,
                            rebuild_interval=rebuild_interval, rebuild_settle=rebuild_settle, memo_rows=memo_rows,
                            traces_kept=traces_kept, conversations_kept=conversations_kept)
        self._on_fatal = fatal
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._processed_batch = 0
        self._resume_from = 0
        self._resume_to = 0
        self._opened_batch = 0  # the last commit of the runs before this one
        self.tick = min(1.0, settings.idle_timeout / 4)
        self.max_queued_commits = max_queued_commits
        self._waiting = False  # for ingestion to pause: commits are queued without their rows
        self._behind = False  # a cycle held commits back (``_cut``): new ones are queued without their rows
        self._idle_event = threading.Event()

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


    def _flush(self) -> None:
        """Write everything this cycle changed, with the batch mark (``StageData.write``); then the row
        cache drops what it parsed, so that it holds text (parsed trees are several times its size).

        In the stage process the daemon writes while this goes on (``StageData.write`` goes behind): its
        operations come after the writes, and the cycle ends with ``_sync``, which raises their error.
        """
        written = len(self._writes.conversations)
        try:
            try:
                self.data.write(self._writes, self._safe_batch())  # counted as pending until it is sent
            finally:
                self._writes = Writes(traces_kept=self.traces_kept)
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


def _without_rows(items: list[Any]) -> list[Any]:
    """The queued items with each whole commit as a ``Light`` one (its rows are read back when taken in)."""
    return [Light.of(it) if isinstance(it, Committed) else it for it in items]


def local_stage(store: Store, settings: Settings, metrics: Metrics | None = None, *, schema: str | None = None,
                idle_gap: float | None = None, max_wait: float = 30.0, **kw: Any) -> Conversations:
    """A conversation stage in this process, on a cursor of ``store`` of its own (on ``schema`` first), at
    the store's pace (``idle_gap``, ``max_wait``: ``collector.store.pacing``): ``tracejudge reindex``, tests."""
    from .duck import DuckData  # DuckDB only where a stage runs on it

    pacing = store.pacing(idle_gap=IDLE_GAP if idle_gap is None else idle_gap, share=SHARE, max_wait=max_wait,
                          poll=POLL, piece=PIECE)
    return Conversations(DuckData(store.cursor(schema), store), settings, metrics, pacing=pacing, fatal=store.fatal,
                         **kw)
