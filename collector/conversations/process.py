"""The conversation stage in a process of its own: rebuilding transcripts never holds the receivers'
interpreter lock.

On two cores the lock, not the cores, limited the stage: it shared one interpreter with the
receivers and the writer, and gave way to them, so under a steady load it got a quarter of the
time and fell behind without bound. ``StageProcess`` runs ``Conversations`` in a child process
(a new interpreter, niced, so that on a busy machine the kernel runs ingestion first). It is started
as a plain ``python -c`` with its two pipes, not by multiprocessing's ``spawn``, which would also
start multiprocessing's resource tracker, a process of 7 MB that nothing here needs.

A file has one DuckDB process, so the child has no database of its own: its stage works on a
``RemoteCursor``, whose statements this process runs, one at a time and in order, on a cursor of
the store (``_serve``). DuckDB runs them without the interpreter lock. Two kinds of request do not
wait for their answer, so that the two processes work at once: a group's writes go in one request
(``write_behind``, raised by the next call if they fail), then the rows of the next group are read
(``query_ahead``), both while the child rebuilds this group's conversations. At 10,000 spans/s that
made conversations current after the last ack 1.4x sooner (``bench/soak.py``); a large request goes
once every answer is read, see ``RemoteCursor.post``. The child gets:

- each commit with its rows, as the stage in the daemon's process had them; while several wait
  to be sent, or while the child's stage is behind (it would drop them), only which commit each was
  (``Light``), whose rows it reads back by commit range;
- ``stop``, ``wait_idle``, and ``swap``: a reindex's result is swapped in by a function that runs
  here, on the served cursor, between two of the child's cycles.

It sends back its status, what it holds and its counters (for /api/status and /metrics), and the
answers to waits and swaps. From its status this side knows how far conversations are behind
ingestion (``lag``: commits not taken in yet, and how long ago the oldest arrived), and warns once
they are ``conversations.lag_warning`` behind: until the stage catches up, conversations end and are
judged late.

A child that dies (killed, out of memory) has the transaction it had open rolled back; it is
started again after a backoff and catches up from the stored batch mark, as a new start does, so
nothing committed is lost. A child whose mark does not move for ``conversations.stall_timeout``
while commits wait (frozen, deadlocked: ``Stall``) is killed, so it goes the same way; until the
new one has taken in what was stored at the stall, the stage is ``stalled`` and /readyz fails. It
exits with this process: it ignores SIGINT and SIGTERM (the parent stops it), and its pipes close
when the parent goes, even after ``kill -9``.

Lifecycle: ``StageProcess(store, settings, metrics)`` -> ``start()`` (creates the stage's tables,
then starts the child, which opens its stage and catches up) -> ``on_commit`` ... -> ``stop()``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import gc
import itertools
import json
import logging
import math
import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Callable

import duckdb

from ..background import BACKOFF, Stage
from ..config import Conversations as Settings
from ..system.memory import limit_arenas, peak_resident_bytes, resident_bytes, trimmer
from ..metrics import Metrics
from ..store import Committed, Pacing, register, rows_table
from ..words import duration_text, plural
from .rows import Light
from .tables import ensure_tables

if TYPE_CHECKING:
    from ..store import Store  # imported when first asked for (collector.store)

log = logging.getLogger("tracejudge.conversations")

WHOLE_COMMITS = 4  # commits sent with their rows at most at once (the rest as the traces they touched)
PREFETCH = 4096  # rows sent with a statement's answer; the rest on each fetch
STATUS_EVERY = 0.2  # seconds between two reports of the child's status
COLLECT_EVERY = 25  # reports between two garbage collections and trims of the child's heap (5 s)
STOP_TIMEOUT = 4.0  # seconds a stopping child has to write what it rebuilt before it is killed
NICE = 10
_COUNTERS = ("conversations_ended", "conversations_reopened", "genai_traces_without_content", "stage_errors")
ARRIVALS = 4096  # arrivals kept for the lag in seconds (one a second at first; see Arrivals)
LAG_CHECK = 1.0  # seconds without a report from the child after which the lag is checked anyway
CAUGHT_UP = 0.25  # of lag_warning: the lag back under it, the log says conversations caught up


class ChildDied(Exception):
    """The child process ended while something waited on it."""


# ---------------------------------------------------------------- the child's side


class RemoteCursor:
    """The DuckDB cursor calls the stage makes, run by the parent on a cursor of its store."""

    def __init__(self, conn: Connection, lock: threading.Lock) -> None:
        self._conn = conn
        self._lock = lock
        self._rows: list[tuple[Any, ...]] = []
        self._more = False
        # Requests sent whose answers are not read yet (``post``), oldest first; the parent answers in order.
        self._posted: collections.deque[Posted] = collections.deque()

    def call(self, *request: Any) -> Any:
        with self._lock:
            self._settle()
            try:
                self._conn.send(request)
                answer = self._conn.recv()
            except (EOFError, OSError):
                os._exit(0)  # the parent is gone (killed) mid-statement: nothing can be written now
        return _result(answer)

    def post(self, *request: Any, behind: bool = False, small: bool = False) -> "Posted":
        """Send ``request`` and go on: the parent runs it while this process works. Its answer is read
        before the next call's (``Posted.result``); a write ``behind`` has no result, and its error
        is raised by the next call instead. A ``small`` request may go while answers wait unread."""
        posted = Posted(self, behind)
        with self._lock:
            # Else one request in flight at most: while the parent sends a long answer no one reads, a
            # long request would wait for it to read, and each for the other. A small one fits in the
            # pipe's buffer and never waits.
            if not small:
                self._settle()
            try:
                self._conn.send(request)
            except (EOFError, OSError):
                os._exit(0)
            self._posted.append(posted)
        return posted

    def sync(self) -> None:
        """Wait until the parent has answered every request posted so far (raising a write's error)."""
        with self._lock:
            self._settle()

    @property
    def in_flight(self) -> int:
        """Requests posted and not answered yet, as far as this process has read."""
        return len(self._posted)

    def _settle(self) -> None:
        failed = None
        while self._posted:
            try:
                answer = self._conn.recv()
            except (EOFError, OSError):
                os._exit(0)
            posted = self._posted.popleft()
            posted.answer = answer
            if posted.behind and answer[0] != "ok" and failed is None:
                failed = answer
        if failed is not None:
            _result(failed)

    def write_behind(self, writes: Any, mark: int) -> None:
        """``Writes.flush(cursor, mark)``, run by the parent in one request while this process goes on."""
        self.post("writes", writes, mark, behind=True)

    def query_ahead(self, queries: Sequence[tuple[str, Any]]) -> "Posted":
        """Every row of each query (SQL, parameters), read by the parent while this process works:
        ``result()`` is a list of rows per query."""
        return self.post("queries", queries, small=True)

    def execute(self, sql: str, params: Any = None) -> "RemoteCursor":
        self._rows, self._more = self.call("execute", sql, params)
        return self

    def fetchone(self) -> tuple[Any, ...] | None:
        got = self.fetchmany(1)
        return got[0] if got else None

    def fetchmany(self, n: int = 1) -> list[tuple[Any, ...]]:
        if len(self._rows) < n and self._more:
            rows, self._more = self.call("fetch", max(n - len(self._rows), PREFETCH))
            self._rows.extend(rows)
        out, self._rows = self._rows[:n], self._rows[n:]
        return out

    def fetchall(self) -> list[tuple[Any, ...]]:
        out = self._rows
        while self._more:
            rows, self._more = self.call("fetch", 0)
            out.extend(rows)
        self._rows = []
        return out

    def register_rows(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """The parent builds the Arrow table: this process never loads the Arrow builder (see collector.store)."""
        self.call("register_rows", name, columns, rows)

    def unregister(self, name: str) -> None:
        self.call("unregister", name)

    def close(self) -> None:
        """The parent owns the cursor."""


class Posted:
    """A request ``RemoteCursor.post`` sent; its answer once read."""

    def __init__(self, cursor: RemoteCursor, behind: bool) -> None:
        self.cursor = cursor
        self.behind = behind
        self.answer: tuple[Any, ...] | None = None

    def result(self) -> Any:
        if self.answer is None:
            self.cursor.sync()  # its own error, if any, is raised below, not by sync
        assert self.answer is not None
        return _result(self.answer)


def _result(answer: tuple[Any, ...]) -> Any:
    """The value of an answer from the parent, or its error raised here as the parent's type."""
    if answer[0] == "ok":
        return answer[1]
    _, module, name, message = answer
    kind = getattr(duckdb, name, None) if module.lstrip("_").startswith("duckdb") else None  # or _duckdb
    if isinstance(kind, type) and issubclass(kind, Exception):
        raise kind(message)
    raise RuntimeError(f"{name}: {message}")


class RemoteStore:
    """What ``Conversations`` asks of its store, in the child."""

    def __init__(self, cursor: RemoteCursor) -> None:
        self._cursor = cursor

    def cursor(self, schema: str | None = None) -> Any:
        assert schema is None, "a reindex runs in the daemon's own process"
        return self._cursor

    @property
    def batch_id(self) -> int:
        return int(self._cursor.call("batch_id"))

    @property
    def opened_batch(self) -> int:
        return int(self._cursor.call("opened_batch"))

    def fatal(self, exc: BaseException) -> bool:
        """``Store.fatal``: the daemon's side told its store when the statement failed (``_serve``)."""
        return isinstance(exc, duckdb.FatalException)

    def pacing(self, *, idle_gap: float, share: float, max_wait: float, poll: float,
               piece: float = math.inf) -> Pacing:
        # Never busy: the child gives way through its nice value, not by waiting for pauses.
        return Pacing(lambda: math.inf, idle_gap=idle_gap, share=share, max_wait=max_wait, poll=poll, piece=piece)


_BOOT = ("import json, sys; sys.path[:] = json.loads(sys.argv[2]); "
         "from collector.conversations.process import boot; boot(sys.argv[1])")


def boot(fds: str) -> None:
    """The child's entry (``_BOOT``): its two pipes by descriptor, then ``_child``'s arguments on the
    second one."""
    queries, control = (Connection(int(fd)) for fd in fds.split(","))
    _child(queries, control, *control.recv())


def _child(queries: Connection, control: Connection, settings: Settings, log_format: str,
           log_level: int) -> None:
    """The child process: a ``Conversations`` stage over the parent's cursor, fed through ``control``."""
    from .stage import Conversations

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the whole group: the parent stops us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    limit_arenas()  # as the daemon does, before this process starts its threads
    os.nice(NICE)
    logging.basicConfig(level=log_level, format=log_format)
    # A rebuild makes many short-lived containers and no cycles: the collector's passes over them
    # cost a fifth of its time at Python's thresholds, and still a seventh at 10,000 allocations
    # between passes, while in a 400k-span soak no pass found a cycle. So it only runs with the
    # status reports (``COLLECT_EVERY``), which bounds what a cycle could hold.
    gc.freeze()
    gc.disable()
    send_lock = threading.Lock()

    def send(*message: Any) -> None:
        with send_lock:
            control.send(message)

    cursor = RemoteCursor(queries, threading.Lock())
    metrics = Metrics()
    stage = Conversations(RemoteStore(cursor), settings, metrics,  # type: ignore[arg-type]
                          max_queued_commits=WHOLE_COMMITS)
    try:
        stage.start()
    except Exception as exc:  # noqa: BLE001 - the parent logs it and starts a child again
        send("failed", type(exc).__module__, type(exc).__name__, str(exc))
        return
    done = threading.Event()

    trim = trimmer()

    def report() -> None:
        for n in itertools.count(1):
            if n % COLLECT_EVERY == 0:
                gc.collect()
                if trim is not None:
                    trim(0)  # what the last rebuilds freed goes back to the system, not kept by malloc
            counters = {c: dict(getattr(metrics, c)._values) for c in _COUNTERS}
            try:
                send("status", stage.status(), stage.held(), stage.stopped, counters, resident_bytes(),
                     peak_resident_bytes(), stage.takes_rows())
            except (OSError, EOFError):
                return
            if done.wait(STATUS_EVERY):
                return

    def answer_idle(token: int, timeout: float) -> None:
        send("idle", token, stage.wait_idle(timeout))

    def swap_in(token: int) -> None:
        def run(_: Any) -> None:  # on the parent's cursor, which the swap function was given
            cursor.call("swap", token)

        def answered(future: concurrent.futures.Future[None]) -> None:
            send("swapped", token, _error_text(future.exception()))

        stage.swap(run).add_done_callback(answered)

    threading.Thread(target=report, name="tracejudge-status", daemon=True).start()
    try:
        while True:
            try:
                msg = control.recv()
            except (EOFError, OSError):
                os._exit(0)  # the parent is gone (killed): there is nothing to write to
            if msg[0] == "commits":
                for light in msg[1]:
                    stage.on_commit(light)
            elif msg[0] == "idle":
                threading.Thread(target=answer_idle, args=(msg[1], msg[2]), daemon=True).start()
            elif msg[0] == "swap":
                swap_in(msg[1])
            elif msg[0] == "stop":
                break
    finally:
        stage.stop()
        done.set()
        try:
            send("status", stage.status(), stage.held(), stage.stopped,
                 {c: dict(getattr(metrics, c)._values) for c in _COUNTERS}, resident_bytes(), 0, False)
            send("stopped")
        except (OSError, EOFError):
            pass


def _error_text(exc: BaseException | None) -> str | None:
    return None if exc is None else f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------- the daemon's side


class Arrivals:
    """When the commits the stage has not taken in yet arrived, for how long conversations are behind.

    One commit is kept per ``width`` seconds of arrivals, and those after it stand for it: the
    arrival read for a commit is at most ``width`` early. Past ``most`` kept, every other one goes and
    the width doubles, so a backlog of days costs a few hundred KB (the arrival read is then at most
    the gap between two kept commits early). Caught up, it starts again at the first width.
    """

    def __init__(self, most: int = ARRIVALS, width: float = 1.0) -> None:
        self._most = most
        self._first_width = self._width = width
        self._kept: collections.deque[tuple[int, float]] = collections.deque()  # (batch, arrival), oldest first
        self._lock = threading.Lock()  # added to by the writer's thread, read by the API's

    def add(self, batch: int, at: float) -> None:
        with self._lock:
            if self._kept and at - self._kept[-1][1] < self._width:
                return
            self._kept.append((batch, at))
            if len(self._kept) > self._most:
                self._kept = collections.deque(itertools.islice(self._kept, 0, None, 2))
                self._width *= 2

    def arrival(self, batch: int) -> float | None:
        """When commit ``batch`` arrived, or a little before (see above); None if it came before any kept.
        Commits before it are let go."""
        with self._lock:
            while len(self._kept) > 1 and self._kept[1][0] <= batch:
                self._kept.popleft()
            if len(self._kept) == 1:
                self._width = self._first_width
            return self._kept[0][1] if self._kept and self._kept[0][0] <= batch else None

    def __len__(self) -> int:
        return len(self._kept)


class Stall:
    """The stall rule: a stage process that takes in no commit for ``timeout`` seconds while commits wait
    is stalled (frozen, deadlocked: its reports, if any, show the same mark).

    Its clock starts again when a process starts and whenever its mark moves; work that starts
    waiting after a quiet spell counts from when it arrived, so an idle process is never stalled.
    Times come from the caller (the store's clock), so a test gives its own.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._mark: int | None = None
        self._since = 0.0  # when the process started or its mark last moved

    def restart(self, now: float) -> None:
        """A new process, or one that cannot progress by no fault of its own: it has ``timeout`` from now."""
        self._mark, self._since = None, now

    def reported(self, mark: int, now: float) -> None:
        """A report of the process's mark (the last commit it took in): progress if it moved."""
        if mark != self._mark:
            self._mark, self._since = mark, now

    def check(self, waiting: int, behind: float, now: float) -> float | None:
        """Seconds the process has taken in nothing while work waited, once that is ``timeout`` or more;
        else None. ``waiting``: commits it has not taken in; ``behind``: how long ago the oldest arrived."""
        if not waiting:
            return None
        quiet = min(behind, now - self._since)
        return quiet if quiet >= self.timeout else None


class StageProcess(Stage):
    """The daemon's conversation stage, run in a child process (see the module docstring)."""

    name = "conversations"
    takes_commits = True

    def __init__(self, store: Store, settings: Settings, metrics: Metrics) -> None:
        super().__init__(store, metrics)
        self.settings = settings
        self.restarts = 0
        self._status: dict[str, Any] = {"conversations_batch": 0, "conversations_pending": 0,
                                        "conversations_failed": 0}
        self._held: dict[str, int] = {}
        self._child_stopped: str | None = None
        self._rss = 0
        self._peak_rss = 0
        self._counted: dict[str, dict[tuple[str, ...], float]] = {}  # the current child's counters, as added
        self._outgoing: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._room = threading.BoundedSemaphore(WHOLE_COMMITS)  # commits queued with their rows
        # Whether the child's stage took commits with their rows at its last report: one that is behind
        # drops them (``Conversations.takes_rows``), so sending them would only cost both processes.
        self._takes_rows = True
        self._tokens = itertools.count(1)
        self._waits: dict[int, tuple[threading.Event, list[bool]]] = {}
        self._swaps: dict[int, tuple[Callable[[duckdb.DuckDBPyConnection], object],
                                     concurrent.futures.Future[None]]] = {}
        self._registered: dict[str, Any] = {}
        self._answering = False  # a request of the child's runs here (a swap may take long): it waits on us
        self._arrivals = Arrivals()
        self._started_at = 0.0
        self._lag_warned = False
        self._stall = Stall(settings.stall_timeout)
        self._stalled: str | None = None  # why, from the stall until the commits then stored are taken in
        self._stalled_until = 0
        self._killed: Any = None  # the process killed for a stall
        self._proc: Any = None
        self._control: Connection | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------ lifecycle

    def open(self, schema: str | None = None) -> None:
        raise NotImplementedError("a reindex opens a Conversations stage of its own")

    def start(self) -> None:
        """Create the stage's tables here (an error in them stops the start-up), then start the child;
        it opens its stage and catches up while the daemon starts."""
        self.cur = self.store.cursor()
        self._started_at = self.store.clock()
        ensure_tables(self.cur)
        # The lag counts from the stored mark until a child reports its own: a backlog stored before this
        # start shows at once, and a child stuck before its first report stalls.
        mark = self.cur.execute("SELECT value FROM tracejudge_state WHERE key = 'conversations.batch'").fetchall()
        self._status["conversations_batch"] = int(mark[0][0]) if mark else 0
        self._thread = threading.Thread(target=self._supervise, name="tracejudge-conversations", daemon=True)
        self._thread.start()

    def _wake(self) -> None:
        self._outgoing.put(("stop",))

    def _join(self, thread: threading.Thread) -> None:
        """The child has ``STOP_TIMEOUT`` to write what it rebuilt and end; then it is killed."""
        thread.join(STOP_TIMEOUT)
        if thread.is_alive():
            log.warning("the conversation stage's process did not stop within %.0f s: killed; the next start "
                        "catches up from the stored batch mark", STOP_TIMEOUT)
            if self._proc is not None:
                self._proc.kill()
            thread.join()

    @property
    def state(self) -> str:
        if self._child_stopped is not None:
            return f"stopped: {self._child_stopped}"
        if self._stalled is not None:
            return f"stalled: {self._stalled}"
        return super().state

    @property
    def stopped(self) -> str | None:
        return self._child_stopped or self._stopped

    @property
    def stalled(self) -> str | None:
        return self._stalled if self.stopped is None else None

    def status(self) -> dict[str, Any]:
        commits, seconds = self.lag()
        return {**self._status, "conversations_lag_commits": commits, "conversations_lag_seconds": round(seconds, 1),
                "conversations_process": self.process()}

    def held(self) -> dict[str, int]:
        return dict(self._held)

    def lag(self) -> tuple[int, float]:
        """How far conversations are behind ingestion: commits stored that the child had not taken in at
        its last report (before one, the stored mark), and seconds since the oldest of them arrived (for
        commits stored before this daemon started, since it started: at least that). Both grow while
        the child takes nothing in, frozen or not, as they come from this side's marks."""
        done = int(self._status.get("conversations_batch", 0))
        commits = max(0, self.store.batch_id - done)
        if not commits:
            return 0, 0.0
        oldest = self._arrivals.arrival(done + 1)
        return commits, max(0.0, self.store.clock() - (self._started_at if oldest is None else oldest))

    def _check_lag(self) -> None:
        """Warn once conversations are ``lag_warning`` behind; say when they are back under a quarter of it."""
        commits, seconds = self.lag()
        warn_at = self.settings.lag_warning
        if not self._lag_warned and seconds >= warn_at:
            self._lag_warned = True
            log.warning("conversations are %s behind ingestion (%s not taken in yet): they end and are judged "
                        "late until the conversation stage catches up; if this lasts, data arrives faster than "
                        "it rebuilds (tracejudge_conversations_lag_seconds on /metrics follows it)",
                        duration_text(round(seconds)), plural(commits, "commit"))
        elif self._lag_warned and seconds < warn_at * CAUGHT_UP:
            self._lag_warned = False
            log.warning("conversations caught up with ingestion (%s behind now)", duration_text(round(seconds)))
        self._check_stall(commits, seconds)

    def _check_stall(self, commits: int, seconds: float) -> None:
        """Kill a stalled child (SIGKILL: a stopped process ignores the rest); the supervisor starts
        another after its backoff, which catches up from the stored mark. Until the commits stored at the
        stall are taken in, /readyz names the stage."""
        if self._stalled is not None and int(self._status.get("conversations_batch", 0)) >= self._stalled_until:
            log.warning("the conversation stage caught up after its stall (%s behind ingestion now)",
                        duration_text(round(seconds)))
            self._stalled = None
        proc = self._proc
        if proc is None or proc is self._killed or self.stopped is not None or self.stopping.is_set():
            return
        # Not the child's fault: it waits on this side's answer (a reindex's swap), or on a store that
        # cannot write (/readyz names the store then).
        if self._answering or self.store.failure is not None:
            self._stall.restart(self.store.clock())
            return
        quiet = self._stall.check(commits, seconds, self.store.clock())
        if quiet is None:
            return
        self._stalled = (f"no progress for {round(quiet)} s with {plural(commits, 'commit')} waiting; its process "
                         "was killed and starts again")
        self._stalled_until = self.store.batch_id
        self._killed = proc
        log.error("the conversation stage's process is stalled: it took in nothing for %s while %s waited "
                  "(conversations.stall_timeout; conversations are %s behind ingestion); it is killed and starts "
                  "again, catching up from the stored batch mark", duration_text(round(quiet)),
                  plural(commits, "commit"), duration_text(round(seconds)))
        proc.kill()

    def process(self) -> dict[str, int]:
        """The child: its pid, resident memory now and at most, and how often it was started again."""
        pid = self._proc.pid if self._proc is not None else 0
        return {"pid": pid or 0, "rss_bytes": self._rss, "peak_rss_bytes": self._peak_rss,
                "restarts": self.restarts}

    # ------------------------------------------------------------ what the daemon asks

    def on_commit(self, committed: Committed) -> None:
        """From the writer's thread: queue the commit for the child, never blocking on it. Its rows go
        along while few commits wait to be sent; beyond that only which commit it was (the child reads
        its rows back), so a slow child never makes the daemon hold every span."""
        self._arrivals.add(committed.batch_id, committed.received_at)
        if self._takes_rows and self._room.acquire(blocking=False):
            self._outgoing.put(("commit", committed))
        else:
            self._outgoing.put(("commit", Light.of(committed)))

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block until everything queued so far is processed (tests)."""
        token = next(self._tokens)
        event, result = threading.Event(), [False]
        self._waits[token] = (event, result)
        self._outgoing.put(("idle", token, timeout))
        event.wait(timeout + 1)
        self._waits.pop(token, None)
        return result[0]

    def swap(self, fn: Callable[[duckdb.DuckDBPyConnection], object]) -> concurrent.futures.Future[None]:
        """``Conversations.swap``: ``fn`` runs here, on the served cursor, between two of the child's cycles."""
        token = next(self._tokens)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._swaps[token] = (fn, done)
        self._outgoing.put(("swap", token))
        return done

    # ------------------------------------------------------------ the supervisor thread

    def _supervise(self) -> None:
        failures = 0
        while not self.stopping.is_set():
            began = time.monotonic()
            why = self._run_child()
            if self.stopping.is_set():
                return
            if time.monotonic() - began > BACKOFF.most:
                failures = 0
            failures += 1
            delay = BACKOFF.delay(failures)
            self.restarts += 1
            self.metrics.stage_errors.inc(stage=self.name)
            log.error("the conversation stage's process ended (%s); it starts again in %.0f s and catches up "
                      "from the stored batch mark", why, delay)
            for token, (_, done) in list(self._swaps.items()):
                self._swaps.pop(token, None)
                done.set_exception(ChildDied(f"the conversation stage's process ended ({why}) before the swap"))
            if self.stopping.wait(delay):
                return

    def _run_child(self) -> str:
        """Start a child, serve its statements until it ends; why it ended."""
        queries, child_queries = multiprocessing.Pipe()
        control, child_control = multiprocessing.Pipe()
        root = logging.getLogger()
        fmt = next((h.formatter._fmt for h in root.handlers if h.formatter is not None and h.formatter._fmt),
                   "%(asctime)s %(levelname)s %(name)s: %(message)s")
        fds = (child_queries.fileno(), child_control.fileno())
        try:
            proc = subprocess.Popen([sys.executable, "-c", _BOOT, ",".join(map(str, fds)), json.dumps(sys.path)],
                                    pass_fds=fds, stdin=subprocess.DEVNULL)
        finally:
            child_queries.close()
            child_control.close()
        try:
            control.send((self.settings, fmt, logging.getLogger("tracejudge").getEffectiveLevel()))
        except OSError:
            pass  # it ended already: serving finds its pipe closed, and its exit code says how
        self._proc, self._control, self._counted = proc, control, {}
        self._stall.restart(self.store.clock())
        ended = threading.Event()
        reader = threading.Thread(target=self._read_control, args=(control, ended), name="tracejudge-conv-status",
                                  daemon=True)
        reader.start()
        sender = threading.Thread(target=self._send, args=(control, ended), name="tracejudge-conv-send",
                                  daemon=True)
        sender.start()
        try:
            self._serve(queries)
        finally:
            ended.set()
            self._outgoing.put(("wake",))
            try:
                proc.wait(STOP_TIMEOUT)  # its pipe closed: it is exiting
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            queries.close()
            control.close()
            reader.join()
            sender.join()
            self._drop_registered()
            self._rollback()
        return f"exit code {proc.returncode}"

    def _serve(self, conn: Connection) -> None:
        """Run the child's statements on the stage's cursor until its pipe closes."""
        cur = self.cur
        assert cur is not None
        while True:
            try:
                request = conn.recv()
            except (EOFError, OSError):
                return
            answer: tuple[Any, ...]
            self._answering = True
            try:
                answer = ("ok", self._answer(cur, request))
            except Exception as exc:  # noqa: BLE001 - the child raises it where it made the call
                answer = ("err", type(exc).__module__, type(exc).__name__, str(exc))
                self.store.fatal(exc)
            finally:
                self._answering = False
            try:
                conn.send(answer)
            except (OSError, EOFError):
                return

    def _answer(self, cur: duckdb.DuckDBPyConnection, request: tuple[Any, ...]) -> Any:
        op = request[0]
        if op == "execute":
            _, sql, params = request
            cur.execute(sql, params) if params is not None else cur.execute(sql)
            if cur.description is None:
                return [], False
            rows = cur.fetchmany(PREFETCH)
            return rows, len(rows) == PREFETCH
        if op == "fetch":
            rows = cur.fetchmany(request[1]) if request[1] else cur.fetchall()
            return rows, bool(request[1]) and len(rows) == request[1]
        if op == "register_rows":
            table = rows_table(request[2], request[3])
            register(cur, request[1], table)
            self._registered[request[1]] = table
            return None
        if op == "unregister":
            cur.unregister(request[1])
            self._registered.pop(request[1], None)
            return None
        if op == "writes":  # the stage's writes of a cycle (``RemoteCursor.write_behind``)
            request[1].flush(cur, request[2])
            return None
        if op == "queries":
            return [cur.execute(sql, params).fetchall() for sql, params in request[1]]
        if op == "batch_id":
            return self.store.batch_id
        if op == "opened_batch":
            return self.store.opened_batch
        if op == "swap":
            fn, _ = self._swaps[request[1]]
            fn(cur)
            return None
        raise ValueError(f"unknown request {op!r}")

    def _send(self, control: Connection, ended: threading.Event) -> None:
        """Hand the child what the daemon queued: commits in batches, waits, swaps, the stop."""
        while not ended.is_set():
            first = self._outgoing.get()
            items = [first]
            while True:
                try:
                    items.append(self._outgoing.get_nowait())
                except queue.Empty:
                    break
            commits = [it[1] for it in items if it[0] == "commit"]
            others = [it for it in items if it[0] not in ("commit", "wake")]
            try:
                if commits:
                    try:
                        control.send(("commits", commits))
                    finally:
                        for c in commits:
                            if isinstance(c, Committed):
                                self._room.release()
                for it in others:
                    control.send(it)
            except (OSError, EOFError):
                if any(it[0] == "stop" for it in others):
                    return
                continue  # the child is gone: the next one catches up from the stored mark
            if any(it[0] == "stop" for it in others):
                return

    def _read_control(self, control: Connection, ended: threading.Event) -> None:
        while True:
            try:
                if not control.poll(LAG_CHECK):  # a child that stopped reporting is behind all the same
                    self._check_lag()
                    continue
                msg = control.recv()
            except (EOFError, OSError):
                return
            kind = msg[0]
            if kind == "failed":
                log.error("the conversation stage could not start in its process (%s: %s)", msg[2], msg[3])
            elif kind == "status":
                self._status, self._held, self._child_stopped = msg[1], msg[2], msg[3]
                self._stall.reported(int(self._status.get("conversations_batch", 0)), self.store.clock())
                self._add_counters(msg[4])
                self._rss = msg[5]
                self._peak_rss = max(self._peak_rss, msg[6])
                self._takes_rows = msg[7]
                self._check_lag()
            elif kind == "idle":
                event, result = self._waits.get(msg[1], (None, None))
                if event is not None and result is not None:
                    result[0] = msg[2]
                    event.set()
            elif kind == "swapped":
                _, done = self._swaps.pop(msg[1], (None, None))
                if done is not None:
                    if msg[2] is None:
                        done.set_result(None)
                    else:
                        done.set_exception(RuntimeError(msg[2]))

    def _add_counters(self, counters: dict[str, dict[tuple[str, ...], float]]) -> None:
        """Add what the child's counters gained since its last report to the daemon's."""
        for name, values in counters.items():
            ours = getattr(self.metrics, name)
            seen = self._counted.setdefault(name, {})
            for key, value in values.items():
                gained = value - seen.get(key, 0.0)
                if gained:
                    ours.inc(gained, **dict(zip(ours.labelnames, key)))
                seen[key] = value

    def _drop_registered(self) -> None:
        if self.cur is None:
            return
        for name in list(self._registered):
            try:
                self.cur.unregister(name)
            except duckdb.Error:
                pass
        self._registered.clear()

    def _rollback(self) -> None:
        """A child that died inside a transaction leaves it open on the served cursor."""
        if self.cur is None:
            return
        try:
            self.cur.execute("ROLLBACK")
        except duckdb.Error:
            pass  # none was open


