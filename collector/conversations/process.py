"""The conversation stage in a process of its own: rebuilding transcripts never holds the receivers'
interpreter lock.

On two cores the lock, not the cores, limited the stage: it shared one interpreter with the
receivers and the writer, and gave way to them, so under a steady load it got a quarter of the
time and fell behind without bound. ``StageProcess`` runs ``Conversations`` in a child process
(a new interpreter, niced, so that on a busy machine the kernel runs ingestion first). It is started
as a plain ``python -c`` with its two pipes, not by multiprocessing's ``spawn``, which would also
start multiprocessing's resource tracker, a process of 7 MB that nothing here needs.

A file has one DuckDB process, so the child has no database of its own: its stage asks for the
operations of ``data.StageData`` through ``RemoteData``, by name and with plain arguments, never SQL
text nor objects whose code would run here; this process checks each against ``data.OPERATIONS`` and
unpickles nothing but plain data (``plain_request``), then runs it on its ``DuckData`` (``_serve``), one
at a time and in order. DuckDB runs them without the interpreter lock. Two operations do not wait for
their answer, so that the two processes work at once: a group's ``write`` (raised by the next call if it
fails), then the next group's ``commit_rows`` (read ahead), both while the child rebuilds this group's
conversations. At 10,000 spans/s that made conversations current after the last ack 1.4x sooner
(``bench/soak.py``); a large request goes once every answer is read, see ``RemoteData._post``. The
child gets:

- each commit with its rows, as the stage in the daemon's process had them (no read back); while several
  wait to be sent, or while the child's stage is behind (it would drop them), only which commit each was
  (``Light``), whose rows it reads back by commit range;
- ``stop``, ``wait_idle``, and ``swap``: a reindex's result is swapped in by the child's stage between
  two of its cycles, which asks for the operation ``swap(now)``.

It sends back its status, what it holds and its counters (for /api/status and /metrics), and the
answers to waits and swaps. From its status this side knows how far conversations are behind
ingestion (``lag``: commits not taken in yet, and how long ago the oldest arrived), and warns once
they are ``conversations.lag_warning`` behind: until the stage catches up, conversations end and are
judged late.

A child that dies (killed, out of memory) leaves no transaction open: each operation is whole here. It is
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
import datetime as dt
import io
import gc
import itertools
import json
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Mapping

import duckdb

from ..background import BACKOFF, Stage
from ..config import Conversations as Settings
from ..system.memory import limit_arenas, peak_resident_bytes, resident_bytes, trimmer
from ..metrics import Metrics
from ..store import Committed
from ..store.transactions import Batches
from ..words import duration_text, plural
from .rows import Light
from .data import (Layer, Writes, OPERATIONS, CommitRows, EndedToArchive, Ending, Later, Resume, StoredConversation, StoredRows,
                   TracePlace, TraceSince)
from .duck import DuckData
from .transcript import Transcript

if TYPE_CHECKING:
    from ..store import Store  # imported when first asked for (collector.store)

log = logging.getLogger("tracejudge.conversations")

WHOLE_COMMITS = 4  # commits sent with their rows at most at once (the rest as the traces they touched)
STATUS_EVERY = 0.2  # seconds between two reports of the child's status
TRIM_EVERY = 25  # reports between two trims of the child's heap (5 s)
# Reports between two garbage collections (30 s): a full pass walks the whole heap of rows and memos,
# about 0.1 s at 5,000 spans/s, and every 5 s took 4.5% of the process's CPU (py-spy); with nothing
# cyclic left (``Posted``), passes in a soak find nothing. Their interval bounds what a cycle could hold.
COLLECT_EVERY = 150
STOP_TIMEOUT = 4.0  # seconds a stopping child has to write what it rebuilt before it is killed
NICE = 10
_COUNTERS = ("conversations_ended", "conversations_reopened", "genai_traces_without_content", "stage_errors")
ARRIVALS = 4096  # arrivals kept for the lag in seconds (one a second at first; see Arrivals)
LAG_CHECK = 1.0  # seconds without a report from the child after which the lag is checked anyway
CAUGHT_UP = 0.25  # of lag_warning: the lag back under it, the log says conversations caught up


class ChildDied(Exception):
    """The child process ended while something waited on it."""


# ---------------------------------------------------------------- the child's side


class RemoteData:
    """``StageData`` in the child: each operation goes to the parent by name, with plain arguments
    (``_request``), and the parent runs it on its ``DuckData`` (``StageProcess._serve``), one at a time and
    in order. A write does not wait for its answer (its error is raised by the next call), nor does
    ``commit_rows`` (the rows are read while this process works; ``result()`` waits for them)."""

    def __init__(self, conn: Connection, lock: threading.Lock | None = None) -> None:
        self._conn = conn
        self._lock = lock or threading.Lock()
        # Operations sent whose answers are not read yet (``_post``), oldest first; the parent answers in order.
        self._posted: collections.deque[Posted] = collections.deque()

    # ------------------------------------------------------------ the operations

    def resume(self, stitch_since: float, stitch_kept: int) -> Resume:
        return self._call("resume", stitch_since, stitch_kept)  # type: ignore[no-any-return]

    def trace_map(self, trace_ids: Sequence[str]) -> dict[str, TracePlace]:
        return self._call("trace_map", list(trace_ids))  # type: ignore[no-any-return]

    def conversations(self, ids: Sequence[str], maybe_archived: Sequence[str]) -> list[StoredConversation]:
        return self._call("conversations", list(ids), list(maybe_archived))  # type: ignore[no-any-return]

    def trace_rows(self, trace_ids: Sequence[str], batches: Sequence[Batches]) -> StoredRows:
        return self._call("trace_rows", list(trace_ids), list(batches))  # type: ignore[no-any-return]

    def commit_rows(self, first: int, last: int) -> Later[CommitRows]:
        # Small: it may go while answers wait unread (see ``_post``).
        return self._post(("commit_rows", first, last), small=True)

    def traces_since(self, after: int, upto: int | None) -> list[TraceSince]:
        return self._call("traces_since", after, upto)  # type: ignore[no-any-return]

    def stored_transcript(self, conversation_id: str) -> Transcript | None:
        return self._call("stored_transcript", conversation_id)  # type: ignore[no-any-return]

    def write(self, writes: Writes, mark: int) -> None:
        self._post(("write", writes, mark), behind=True)

    def end_stored(self, endings: Sequence[Ending], first_batch: int, updated_at: dt.datetime) -> None:
        self._call("end_stored", list(endings), first_batch, updated_at)

    def ended_to_archive(self, over: int, keep: int, most: int, held: Sequence[str]) -> EndedToArchive:
        return self._call("ended_to_archive", over, keep, most, list(held))  # type: ignore[no-any-return]

    def archived_by(self, last_arrival: dt.datetime | None, limit: int) -> list[str]:
        return self._call("archived_by", last_arrival, limit)  # type: ignore[no-any-return]

    def archive(self, ids: Sequence[str], layers: Mapping[int, Layer | None]) -> None:
        self._call("archive", list(ids), dict(layers))

    def swap(self, now: dt.datetime) -> int:
        return int(self._call("swap", now))

    def sync(self) -> None:
        with self._lock:
            self._settle()

    @property
    def in_flight(self) -> int:
        return len(self._posted)

    def close(self) -> None:
        """The parent owns the data."""

    # ------------------------------------------------------------ the pipe

    def _call(self, *request: Any) -> Any:
        with self._lock:
            self._settle()
            try:
                self._conn.send_bytes(_dumps(request))
                answer = self._conn.recv()
            except (EOFError, OSError):
                os._exit(0)  # the parent is gone (killed) mid-operation: nothing can be written now
        return _result(answer)

    def _post(self, request: tuple[Any, ...], behind: bool = False, small: bool = False) -> "Posted":
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
            self._posted.append(posted)  # before it goes: pending until answered (/api/status)
            try:
                self._conn.send_bytes(_dumps(request))
            except (EOFError, OSError):
                os._exit(0)
        return posted

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


class Posted(Later[Any]):
    """An operation ``RemoteData`` sent without waiting; its answer once read.

    It answers ``result`` itself: given its own bound method to read, as ``Later`` takes one, it referred
    to itself, and only the garbage collector freed it, with its answer (a commit's rows), seconds later.
    """

    def __init__(self, data: RemoteData, behind: bool) -> None:
        self.data = data
        self.behind = behind
        self.answer: tuple[Any, ...] | None = None

    def result(self) -> Any:
        if self.answer is None:
            self.data.sync()  # its own error, if any, is raised below, not by sync
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


def _dumps(request: tuple[Any, ...]) -> bytes:
    return pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)


# What an operation's arguments may be made of, beside the builtin containers, numbers, text and bytes
# (which pickle writes without naming a class): the parent refuses any other class by name, so nothing
# it unpickles can run code of the child's choosing.
PLAIN_CLASSES = frozenset({
    ("datetime", "datetime"), ("datetime", "timezone"), ("datetime", "timedelta"),
    ("collector.conversations.data", "Ending"),
    ("collector.conversations.data", "Writes"), ("collector.conversations.data", "ConversationRow"),
    ("collector.conversations.data", "Layer"),
})


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in PLAIN_CLASSES:
            raise pickle.UnpicklingError(f"{module}.{name} is not plain data")
        return super().find_class(module, name)


def plain_request(raw: bytes) -> tuple[str, tuple[Any, ...]]:
    """An operation from the child: its name, one of ``data.OPERATIONS``, and its arguments, plain data.

    Raises:
        ValueError: anything else.
    """
    try:
        request = _PlainUnpickler(io.BytesIO(raw)).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError, TypeError) as exc:
        raise ValueError(f"not an operation of plain data: {exc}") from None
    if not isinstance(request, tuple) or not request or request[0] not in OPERATIONS:
        raise ValueError(f"unknown operation {request[0] if isinstance(request, tuple) and request else request!r}")
    return request[0], request[1:]


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
    # status reports (``COLLECT_EVERY``), which bounds how long a cycle could hold memory.
    gc.freeze()
    gc.disable()
    send_lock = threading.Lock()

    def send(*message: Any) -> None:
        with send_lock:
            control.send(message)

    metrics = Metrics()
    stage = Conversations(RemoteData(queries), settings, metrics, max_queued_commits=WHOLE_COMMITS)
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
            if n % TRIM_EVERY == 0 and trim is not None:
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

    def swap_in(token: int, now: dt.datetime) -> None:
        def answered(future: concurrent.futures.Future[int]) -> None:
            error = future.exception()
            send("swapped", token, _error_text(error), None if error is not None else future.result())

        stage.swap(now).add_done_callback(answered)

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
                swap_in(msg[1], msg[2])
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
        self._swaps: dict[int, concurrent.futures.Future[int]] = {}
        self.data: DuckData | None = None  # what the child's operations run on
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
        self.data = DuckData(self.cur, self.store)  # creates the tables
        # The lag counts from the stored mark until a child reports its own: a backlog stored before this
        # start shows at once, and a child stuck before its first report stalls.
        self._status["conversations_batch"] = self.data.mark()
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

    def swap(self, now: dt.datetime) -> concurrent.futures.Future[int]:
        """``Conversations.swap``: the child's stage swaps a reindex in between two of its cycles (it asks for
        ``StageData.swap``, which runs here); the number of conversations."""
        token = next(self._tokens)
        done: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._swaps[token] = done
        self._outgoing.put(("swap", token, now))
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
            for token, done in list(self._swaps.items()):
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
        return f"exit code {proc.returncode}"

    def _serve(self, conn: Connection) -> None:
        """Run the child's operations on this side's ``DuckData`` until its pipe closes: an operation is a
        name from ``data.OPERATIONS`` and plain arguments (``plain_request``), nothing else."""
        data = self.data
        assert data is not None
        while True:
            try:
                raw = conn.recv_bytes()
            except (EOFError, OSError):
                return
            answer: tuple[Any, ...]
            self._answering = True
            name = "(unread)"
            try:
                name, args = plain_request(raw)
                answer = ("ok", self._answer(data, name, args))
            except Exception as exc:  # noqa: BLE001 - the child raises it where it made the call
                # Named: an operation posted behind fails at a later call, whose traceback is not its own.
                answer = ("err", type(exc).__module__, type(exc).__name__, f"{exc} (in {name})")
                self.store.fatal(exc)
            finally:
                self._answering = False
            try:
                conn.send(answer)
            except (OSError, EOFError):
                return

    def _answer(self, data: DuckData, name: str, args: tuple[Any, ...]) -> Any:
        """One operation, run now: ``commit_rows`` is read here while the child works on."""
        if name == "commit_rows":
            return data.read_commits(*args)
        return getattr(data, name)(*args)

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
                done = self._swaps.pop(msg[1], None)
                if done is not None:
                    if msg[2] is None:
                        done.set_result(msg[3])
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
