"""Reindex: every conversation rebuilt from the stored rows beside the live ones, then swapped in.

``Reindex(store, settings)`` -> ``prepare()`` (starts, or resumes one that a crash
or a stop cut off) -> ``run(stop)`` (rebuilds, a chunk of traces at a time) ->
``swap(cur)`` (one transaction). In a running daemon ``Runner`` does the same in
a thread of its own, and the live stage runs the swap (``Conversations.swap``).

It builds in a schema of its own (``reindex``: its own ``conversations``,
``messages`` and trace map), with a conversation stage opened there:
the same code as the live stage, reading the rows of the main schema. Traces go
in the order of their last commit, each chunk committed with how far it got,
so memory stays bounded (conversations idle by the data's own arrival times end
as they would have live, and leave memory) and a reindex cut off goes on from
its last chunk, as long as the conversation settings did not change. The live
conversations stay as they are until the swap, which replaces them in one
transaction: a reindex that fails or stops half way changes nothing.

It covers the commits made before it started (``upto``); the swap sets the
conversation stage's batch mark there, so the stage rebuilds what came since.
A transcript that changes gets the next revision (to be judged again); one that
does not keeps its revision. Conversations with a trace whose rows retention
deleted cannot be rebuilt whole: they are copied over as stored (``kept``).
"""

from __future__ import annotations

import concurrent.futures
import datetime as dt
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

import duckdb

from ..config import Conversations as Settings
from ..metrics import Metrics
from ..store import Transaction
from ..store.schema import TRACE_MAP
from ..store.transactions import one
from .archive import ARCHIVE_KEPT
from .duck import REINDEX_SCHEMA as SCHEMA, DuckData, swap_reindexed
from .stage import local_stage
from .tables import ensure_tables

if TYPE_CHECKING:
    from ..store import Store  # imported when first asked for (collector.store)

log = logging.getLogger("tracejudge.reindex")

LAYOUT = "traces-v3"  # reindex_traces with each trace's first and last commits
CHUNK = 500  # traces rebuilt and committed together
# Those kept as stored, copied from the main schema before the rebuild: every one into the live table (keyed,
# so that the rebuild finds it; the reindex's moves archive it with its filter).
_KEPT_FROM = {"live_conversations": "conversations", "messages": "messages",
              "trace_conversations": "trace_conversations", "trace_archive": "trace_archive"}


@dataclass
class Progress:
    """How far a reindex has got (``GET /api/reindex``, the CLI's progress bar)."""

    state: str = "preparing"
    """``preparing``, ``rebuilding``, ``swapping``, ``finished``, ``stopped`` or ``failed``."""
    total: int = 0
    """Traces to rebuild from."""
    done: int = 0
    resumed: bool = False
    """It goes on from a reindex a crash or a stop cut off."""
    resumed_from: int = 0
    """Traces that one had done already."""
    conversations: int = 0
    kept: int = 0
    """Conversations copied over as stored: retention deleted spans of theirs."""
    failed: int = 0
    """Conversations that could not be rebuilt (stored without messages, with the reason)."""
    failure: str | None = None
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Reindex:
    """One reindex of the conversations of ``store`` (see the module docstring)."""

    def __init__(self, store: Store, settings: Settings, *, chunk: int = CHUNK,
                 clock: Callable[[], float] = time.time, max_wait: float = 30.0,
                 conversations_kept: int = ARCHIVE_KEPT) -> None:
        self.store = store
        self.conversations_kept = conversations_kept  # ended ones keyed, the rest archived (``archive``)
        self.settings = settings
        self.chunk = chunk
        self.clock = clock
        self.max_wait = max_wait
        self.progress = Progress()
        self._now = 0.0  # the rebuilding stage's clock: the arrival time the rebuild has reached

    # ------------------------------------------------------------ steps

    def prepare(self) -> None:
        """Start a reindex, or resume the one a crash or a stop cut off (same settings)."""
        cur = self.store.cursor()
        try:
            # With the layout of its tables: one an older version left cannot be resumed.
            fingerprint = f"{LAYOUT} {self.settings.model_dump_json()}"
            if self._resumable(cur, fingerprint):
                done = int(self._state(cur, "reindex.done"))
                self.progress.resumed, self.progress.resumed_from = True, done
                log.info("resuming the reindex a stop cut off, after %d traces", done)
            else:
                self._start(cur, fingerprint)
            self.progress.done = int(self._state(cur, "reindex.done"))
            row = one(cur.execute(f"SELECT count(*) FROM {SCHEMA}.reindex_traces"))
            self.progress.total = int(row[0]) if row else 0
            self.progress.kept = int(self._state(cur, "reindex.kept"))
        finally:
            cur.close()

    def run(self, stop: threading.Event | None = None, on_progress: Callable[[Progress], None] | None = None
            ) -> bool:
        """Rebuild the traces left, a chunk at a time; False if ``stop`` came first (what is done is kept)."""
        stage = local_stage(self.store, self.settings, Metrics(), schema=SCHEMA, clock=lambda: self._now,
                            max_wait=self.max_wait, conversations_kept=self.conversations_kept)
        if stop is not None:
            stage.stopping = stop  # its rebuild raises Stopping once it is set
        self.progress.state = "rebuilding"
        try:
            stage.open()
            assert isinstance(stage.data, DuckData)
            cur = stage.data.cur  # the stage's own: a chunk's writes commit with how far it got
            while True:
                rows = cur.execute(f"SELECT n, trace_id, arrived, first, last FROM {SCHEMA}.reindex_traces WHERE n > ? "
                                   "ORDER BY n LIMIT ?", [self.progress.done, self.chunk]).fetchall()
                self._now = max((at for _, _, at, _, _ in rows), default=self.clock())
                with Transaction(cur):
                    # The last, empty one ends the idle ones now.
                    stage.rebuild({t: at for _, t, at, _, _ in rows},
                                  batches={t: (first, last) for _, t, _, first, last in rows})
                    last = rows[-1][0] if rows else self.progress.done
                    cur.execute("INSERT OR REPLACE INTO tracejudge_state VALUES ('reindex.done', ?)", [str(last)])
                self.progress.done = last
                if on_progress is not None:
                    on_progress(self.progress)
                if not rows:
                    self.progress.failed = stage.failed
                    return True
        except Exception as exc:
            if stage.stopping.is_set():
                self.progress.state = "stopped"
                return False
            self._failed(exc)
            raise
        finally:
            stage.stop()

    def swap(self, cur: duckdb.DuckDBPyConnection) -> int:
        """Replace the live conversations with the rebuilt ones, in one transaction (``swap_reindexed``); the
        number of conversations. Nothing else may write conversations meanwhile: a running daemon's stage
        swaps instead (``Runner``)."""
        self.swapping()
        try:
            count = swap_reindexed(cur, dt.datetime.fromtimestamp(self.clock(), dt.timezone.utc))
        except Exception as exc:
            self._failed(exc)
            raise
        return self.swapped(count)

    def swapping(self) -> None:
        self.progress.state = "swapping"

    def swapped(self, conversations: int) -> int:
        """The swap is done: ``conversations`` are stored."""
        self.progress.conversations = conversations
        self.progress.state = "finished"
        self.progress.finished_at = time.time()
        log.info("reindex finished: %d conversations (%d kept as stored)", self.progress.conversations,
                 self.progress.kept)
        return conversations

    # ------------------------------------------------------------ its schema

    def _resumable(self, cur: duckdb.DuckDBPyConnection, fingerprint: str) -> bool:
        row = one(cur.execute("SELECT count(*) FROM duckdb_tables() WHERE database_name = current_database() "
                          "AND schema_name = ? AND table_name = 'tracejudge_state'", [SCHEMA]))
        if not row or not row[0]:
            return False
        if self._state(cur, "reindex.settings") == fingerprint and self._state(cur, "reindex.done") is not None:
            return True
        log.info("an earlier reindex was cut off with other conversation settings (or by an older version): "
                 "starting again")
        return False

    def _start(self, cur: duckdb.DuckDBPyConnection, fingerprint: str) -> None:
        """The reindex's schema, its tables, the order of the traces, and the conversations kept as stored."""
        with Transaction(cur):
            ensure_tables(cur)  # a file no daemon has opened since conversations came has none yet
            cur.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
            cur.execute(f"CREATE SCHEMA {SCHEMA}")
        shadow = self.store.cursor(SCHEMA)
        try:
            with Transaction(shadow):
                ensure_tables(shadow)
                shadow.execute(TRACE_MAP)
                upto = self.store.batch_id
                # One pass over the rows, so that each chunk reads its traces by number, each within its commits.
                shadow.execute(
                    # Within a commit, traces in the order they started: a chunk's are stitched in that order (as
                    # the live stage takes them), so a turn must not come in a chunk before the one it continues.
                    "CREATE TABLE reindex_traces AS SELECT row_number() OVER (ORDER BY batch, arrived, start, trace_id) "
                    "AS n, trace_id, arrived, first, batch AS last FROM (SELECT trace_id, epoch(max(received_at)) AS arrived, "
                    "max(batch_id) AS batch, min(batch_id) AS first, min(t) AS start FROM (SELECT trace_id, received_at, "
                    "batch_id, start_time_unix_nano AS t FROM main.span_records WHERE batch_id <= ? UNION ALL "
                    "SELECT trace_id, received_at, batch_id, time_unix_nano FROM main.log_records "
                    "WHERE batch_id <= ? AND trace_id IS NOT NULL) GROUP BY trace_id)", [upto, upto])
                # A conversation with a trace whose rows are gone cannot be rebuilt whole.
                shadow.execute(
                    "CREATE TEMP TABLE reindex_kept AS SELECT DISTINCT conversation_id FROM main.trace_map t "
                    "WHERE NOT EXISTS (SELECT 1 FROM main.span_records s WHERE s.trace_id = t.trace_id) "
                    "AND NOT EXISTS (SELECT 1 FROM main.log_records l WHERE l.trace_id = t.trace_id)")
                for table, source in _KEPT_FROM.items():
                    shadow.execute(f"INSERT INTO {table} SELECT * FROM main.{source} WHERE conversation_id IN "
                                   "(SELECT conversation_id FROM reindex_kept)")
                row = one(shadow.execute("SELECT count(*) FROM reindex_kept"))
                shadow.execute("DROP TABLE reindex_kept")
                for key, value in (("reindex.settings", fingerprint), ("reindex.upto", str(upto)),
                                   ("reindex.done", "0"), ("reindex.kept", str(row[0] if row else 0))):
                    shadow.execute("INSERT OR REPLACE INTO tracejudge_state VALUES (?, ?)", [key, value])
        finally:
            shadow.close()

    @staticmethod
    def _state(cur: duckdb.DuckDBPyConnection, key: str) -> Any:
        row = one(cur.execute(f"SELECT value FROM {SCHEMA}.tracejudge_state WHERE key = ?", [key]))
        return row[0] if row else None

    def _failed(self, exc: BaseException) -> None:
        self.progress.state = "failed"
        text = str(exc).strip().splitlines()
        self.progress.failure = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
        self.progress.finished_at = time.time()


class AlreadyRunning(Exception):
    """A reindex runs already in this daemon."""


class Swaps(Protocol):
    """The live stage, in this process or its own: it swaps a reindex in between two of its cycles
    (``StageData.swap``), resolving with the number of conversations."""

    def swap(self, now: dt.datetime) -> concurrent.futures.Future[int]: ...


class Runner:
    """A reindex in a running daemon, at most one at a time, in a thread of its own beside the live stage.

    It gives way to ingestion as the live stage does, and its result is swapped in by the live stage
    (``Conversations.swap``); a stop leaves what it did for the next one to go on from.
    """

    def __init__(self, store: Store, settings: Settings, live: Swaps) -> None:
        self.store = store
        self.settings = settings
        self.live = live
        self.job: Reindex | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> Progress:
        """Start a reindex (or resume one cut off); its progress.

        Raises:
            AlreadyRunning: one runs already.
        """
        if self._thread is not None and self._thread.is_alive():
            raise AlreadyRunning("a reindex is running already: follow it with GET /api/reindex")
        self.job = job = Reindex(self.store, self.settings)
        self._thread = threading.Thread(target=self._run, args=(job,), name="tracejudge-reindex", daemon=True)
        self._thread.start()
        return job.progress

    def _run(self, job: Reindex) -> None:
        try:
            job.prepare()
            if not job.run(self._stop):
                return
            job.swapping()
            swapped = self.live.swap(dt.datetime.fromtimestamp(job.clock(), dt.timezone.utc))
            while not self._stop.is_set():
                try:
                    job.swapped(swapped.result(timeout=0.1))
                    return
                except concurrent.futures.TimeoutError:
                    continue
            job.progress.state = "stopped"
        except Exception as exc:  # noqa: BLE001 - reported through GET /api/reindex and the log
            if job.progress.state != "failed":
                job._failed(exc)
            log.exception("reindex failed; the live conversations are unchanged")

    def stop(self) -> None:
        """Stop a running reindex (what it did is kept for the next one) and wait for its thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
