"""Background stages: the daemon's work beside ingestion, each in a thread of its own.

The conversation stage and the evaluator are ``Stage``s. ``Stage`` owns their
thread and lifecycle; a stage writes ``_open`` (what it sets up before its
thread starts), ``_run`` (its loop of cycles) and ``_wake`` (how a stop reaches
a loop that sleeps).

Lifecycle: ``Stage(store, metrics)`` -> ``start()`` -> running -> ``stop()``.

- ``start()`` opens the stage's cursor (``cur``) and runs ``_open`` in the
  caller's thread, so an error there (its tables, its stored state) stops the
  daemon's start-up; then it starts ``_run`` in a thread named
  ``tracejudge-<name>``. ``open()`` alone does the first part, for a stage
  worked from the caller's thread (``tracejudge reindex``).
- While running, ``_run`` loops until ``stopping`` is set. A cycle that raises
  hands the error to ``cycle_failed``: the traceback is logged,
  ``tracejudge_stage_errors_total{stage}`` counts it, and the stage goes on with
  its next cycle after a delay (1 s, doubling up to a minute while cycles keep
  failing; ``cycle_ok`` starts it again at 1 s).
- If ``_run`` ends before ``stop()`` (something beyond one cycle raised, or a
  bug left the loop), the stage has stopped for good: the log says why at
  CRITICAL, ``state`` says ``stopped: <reason>``, ``/readyz`` answers 503 naming
  it and ``/api/status`` shows it under ``stages``. The daemon goes on taking
  data (nothing acknowledged is lost; the next start catches up).
- A stage may say it is ``stalled`` (the conversation stage's process taking in
  nothing while commits wait): ``/readyz`` answers 503 naming it until it
  catches up; it still runs.
- ``tracejudge_stage_running{stage}`` on /metrics is 1 from ``start()`` until the
  stage stops, for good or at ``stop()``, for an alert rule to see a stopped stage.
- ``held()`` says what the stage keeps in memory (``tracejudge_stage_held{stage,what}``
  on /metrics), so that growth shows where it is.
- ``stop()`` sets ``stopping``, wakes the loop, joins the thread, then closes the
  cursor. It may be called at any point, also after a start that failed half
  way, and more than once.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import duckdb

from judges import Backoff

from .metrics import Metrics

if TYPE_CHECKING:
    from .store import Store  # imported when first asked for (collector.store)

log = logging.getLogger("tracejudge.stages")

BACKOFF = Backoff(1.0, 60.0)
"""The wait before a stage's next cycle while cycles keep failing. No jitter: the failure is this daemon's own, with
no other client to fall in step with."""


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class Loop:
    """A background loop of the daemon with a stage's lifecycle, and no store of its own (the conversation
    stage's rebuild logic, which reaches its data through ``StageData``); ``Stage`` adds the store."""

    name: ClassVar[str]
    """Names its thread, its ``stage`` label on /metrics and its key under ``stages`` in /api/status."""
    takes_commits: ClassVar[bool] = False
    """Whether the store hands it each commit (``on_commit``): it stops only after the store's drain."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped: str | None = None
        self._failures = 0  # cycles failed in a row
        metrics.stage_errors.declare(stage=self.name)
        metrics.on_scrape(self._report_held)

    # ------------------------------------------------------------ lifecycle

    def open(self) -> None:
        """Set the stage up (``_open``), without its thread."""
        self._open()

    def start(self) -> None:
        """``open``, then run the stage's loop in its thread."""
        self.open()
        self._thread = threading.Thread(target=self._thread_body, name=f"tracejudge-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop and wait for it, then close the cursor."""
        if self._thread is not None:
            self.stopping.set()
            self._wake()
            self._join(self._thread)
            self._thread = None
        self._close()

    def _close(self) -> None:
        """After the thread ended at ``stop``: let go of what ``open`` took."""

    def _join(self, thread: threading.Thread) -> None:
        """Wait for the stage's thread at ``stop``."""
        thread.join()

    @property
    def stopped(self) -> str | None:
        """Why the stage's thread ended before ``stop``, if it did."""
        return self._stopped

    @property
    def state(self) -> str:
        """For /api/status: ``running``, ``stopped: <reason>``, or ``not running`` (not started, or stopped)."""
        if self._stopped is not None:
            return f"stopped: {self._stopped}"
        return "running" if self._thread is not None else "not running"

    @property
    def stalled(self) -> str | None:
        """Why the stage is stalled (it runs but takes in nothing while work waits), if it is: /readyz fails."""
        return None

    def status(self) -> dict[str, Any]:
        """How far the stage has got, for /api/status (its keys are the stage's own)."""
        return {}

    def held(self) -> dict[str, int]:
        """What the stage holds in memory, by structure, in rows or entries: ``tracejudge_stage_held``."""
        return {}

    def _report_held(self) -> None:
        # A stalled stage still runs (it is restarted); only one stopped for good is 0.
        running = self._thread is not None and self.stopped is None
        self.metrics.stage_running.set(1 if running else 0, stage=self.name)
        for what, n in self.held().items():
            self.metrics.stage_held.set(n, stage=self.name, what=what)

    # ------------------------------------------------------------ for the stages

    def cycle_failed(self, what: str) -> float:
        """Log the exception being handled with ``what`` and count it; the seconds to wait before the next cycle."""
        self._failures += 1
        delay = BACKOFF.delay(self._failures)
        self.metrics.stage_errors.inc(stage=self.name)
        log.exception("%s stage: %s; it goes on in %.0f s", self.name, what, delay)
        self._fatal()
        return delay

    def cycle_ok(self) -> None:
        """A cycle succeeded: the next failure waits ``BACKOFF.first`` again."""
        self._failures = 0

    def run_cycles(self, cycle: Callable[[], bool], what: str, interval: float) -> None:
        """Call ``cycle`` until ``stopping``: again at once when it returns True (more to do), after
        ``interval`` when False; after a failure (logged as ``what``), after the backoff."""
        while not self.stopping.is_set():
            try:
                busy = cycle()
                self.cycle_ok()
                delay = 0.0 if busy else interval
            except Exception:  # noqa: BLE001 - a cycle's failure is logged, counted and tried again
                delay = self.cycle_failed(what)
            self.stopping.wait(delay)

    def error(self, what: str) -> None:
        """Log the exception being handled with ``what`` and count it, for a failure within a cycle."""
        self.metrics.stage_errors.inc(stage=self.name)
        log.exception("%s stage: %s", self.name, what)
        self._fatal()

    def _fatal(self) -> None:
        """A fatal error met here (the exception being handled) stops what can no longer work."""

    # ------------------------------------------------------------ written by each stage

    def _open(self) -> None:
        """Set up before the thread starts (tables, stored state); ``self.cur`` is open."""

    def _run(self) -> None:
        """The loop: cycles until ``stopping`` is set."""
        raise NotImplementedError

    def _wake(self) -> None:
        """Make a sleeping loop see ``stopping`` now."""

    # ------------------------------------------------------------ the thread

    def _thread_body(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # beyond one cycle: the stage cannot go on
            self._stopped = _reason(exc)
            log.critical("the %s stage stopped (%s); the daemon goes on taking data, and the next start catches "
                         "up: restart it", self.name, self._stopped, exc_info=exc)
            return
        if not self.stopping.is_set():
            self._stopped = "its loop ended before the stop"
            log.critical("the %s stage stopped (%s): restart the daemon", self.name, self._stopped)


class Stage(Loop):
    """A background stage over the store, with a cursor of its own (see the module docstring)."""

    def __init__(self, store: Store, metrics: Metrics) -> None:
        self.store = store
        self.cur: duckdb.DuckDBPyConnection | None = None
        super().__init__(metrics)

    def open(self, schema: str | None = None) -> None:
        """Open the stage's cursor (on ``schema`` first: ``Store.cursor``) and set it up, without its thread."""
        self.cur = self.store.cursor(schema)
        self._open()

    def _close(self) -> None:
        if self.cur is not None:
            self.cur.close()
            self.cur = None

    def _fatal(self) -> None:
        """A fatal DuckDB error met here stops the store (``Store.fatal``): no retry can succeed."""
        exc = sys.exc_info()[1]
        if exc is not None:
            self.store.fatal(exc)
