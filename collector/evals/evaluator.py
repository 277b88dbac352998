"""Online evals in the daemon: sample conversations as they end, judge them, store verdicts.

A background ``Stage`` (its lifecycle is in ``collector.background``):
``Evaluator(store, config, metrics, criteria=..., provider=...)`` -> ``start()``
(creates its tables, records the criteria texts, refills the budgets from what
is stored, starts its thread) -> ``stop()`` (stores what was judged; calls in
flight are abandoned and made again at the next start). A cycle that fails is
logged and counted, and the next one comes after a delay.

It runs in a thread of its own with its own event loop. Ingestion comes first:
each piece of DuckDB work (reading a conversation, storing, scanning) runs
alone, at the store's pace for it (``store.pacing``, ``_db``), in a thread of
its own, so that judge calls in flight are never held up: run on the loop, the
pieces held it for three quarters of the time at concurrency 64. Each cycle, about once a second or as soon as a
conversation is judged:

1. **scan**: conversations written since the last scan (``updated_at``) that
   have ended. One with no sampling decision gets one now (``Sampler.decide``);
   one picked for judging whose current revision has no progress row goes to
   the pending queue (bounded: while it is full the scan waits).
2. **judge**: pending conversations start, oldest first, up to twice
   ``judges.concurrency`` at once; their judge calls share one limit of
   ``judges.concurrency``.
3. **store**: the verdicts, not-run records and progress rows of every
   conversation judged and not stored yet, in one transaction, once
   ``STORE_AT_ONCE`` wait, the first has waited ``STORE_WAIT``, or no other is
   being judged or waits to be.

With a provider, the first cycles also queue, page by page, the sampled
conversations whose LLM criteria were not run for want of one (no key at an
earlier start): their verdicts replace those not-run records.

Criteria written ``live: true`` are also judged on open conversations, turn by
turn, in passes of their own on the same loop (``evals.live``), once ``go_live``
says what to do with a live fail.

Everything that says what is done lives in DuckDB (``sampling_decisions``,
``verdicts``, ``eval_progress``), so a restart neither loses nor repeats work:
a conversation in flight at a crash has no progress row and is judged again,
and criteria that already have a verdict on its current transcript are skipped
(``store_verdicts`` would store a repeat once anyway). A transcript that
changes (late data, or reopened and ended again) gets a new revision and is
judged again. Conversations whose verdicts include errors are retried three
times (after 1, 10 and 60 minutes) on the criteria that errored.

``tracejudge eval`` runs the same ``Judging`` over stored conversations.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime as dt
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import duckdb
import orjson

from judges import Criterion, LLMCriterion, Provider

from ..background import Stage
from ..config import Config
from ..errors import UserError
from ..metrics import Counter, Gauge, Histogram, Metrics
from ..store import Store
from ..store.transactions import batch_filter, by_keys, trace_batches
from . import verdicts
from .backfill import Backfill, backfill_jobs, run_backfill
from . import live
from .judging import JUDGEMENT_DUE, Job, Judging, OnStored, Outcome, Prepared, ensure_schema, utc
from .sampling import ConversationFacts, Sampler
from .setup import NO_PROVIDER

log = logging.getLogger("tracejudge.evaluator")
T = TypeVar("T")

SCAN_SLACK = 60.0  # rows written this recently are read again: their commit may land after a scan
SCAN_PAGE = 2000
MAX_PENDING = 5000
PREPARE_AT_ONCE = 16  # conversations read for their judges in one piece of DuckDB work
# A store is a transaction of about ten statements whatever it holds, each a few ms of DuckDB's time
# under load: storing each cycle's few outcomes (8 on average at 10,000 spans/s) took the DuckDB thread
# a third of a core. Outcomes wait for others up to STORE_WAIT seconds, and do not hold judging slots.
STORE_AT_ONCE = 64
STORE_WAIT = 0.5
# The evaluator's pace (``collector.store.pacing``). Its pieces are single DuckDB statements, a few ms
# each and mostly outside the interpreter lock, and judge calls wait behind them: a short pause
# between requests is enough, at any load below saturation.
IDLE_GAP = 0.01
SHARE = 1 / 8  # after max_wait without a pause
POLL = 0.005


# --------------------------------------------------------------- sampling facts


def _attribute_keys(sampler: Sampler) -> tuple[set[str], bool]:
    """The attribute keys the rules look at, and whether any rule looks at span status."""
    keys = {r.when.attribute.key for r in sampler.settings.rules if r.when.attribute is not None}
    return keys, any(r.when.status == "error" for r in sampler.settings.rules)


def conversation_facts(cur: duckdb.DuckDBPyConnection, row: dict[str, Any], keys: set[str],
                       status: bool) -> ConversationFacts:
    """What the sampling rules can look at; span rows are read only when a rule needs them."""
    attributes: dict[str, set[Any]] = {}
    has_error = False
    trace_ids = orjson.loads(row["trace_ids"] or "[]")
    if (keys or status) and trace_ids:
        # Within the commits that hold the traces' rows (the trace map's ranges, looked up by key; for a
        # trace no longer keyed, the conversation's commits): the read then costs what the conversation
        # holds, not what the table holds.
        stored = trace_batches(cur, trace_ids)
        within, bounds = batch_filter([stored.get(t, (row.get("first_batch"), None)) for t in trace_ids])
        for attrs, resource, code in cur.execute(
                "SELECT attributes, resource, status_code FROM span_records WHERE trace_id IN (SELECT unnest(?))"
                + within, [trace_ids, *bounds]).fetchall():
            has_error = has_error or code == 2  # STATUS_CODE_ERROR
            for text in (attrs, resource):
                if not keys or not text:
                    continue
                values = orjson.loads(text)
                for key in keys & values.keys():
                    value = values[key]
                    attributes.setdefault(key, set()).add(
                        orjson.dumps(value).decode() if isinstance(value, (dict, list)) else value)
    return ConversationFacts(
        conversation_id=row["conversation_id"], ended_by=row["ended_by"], service=row["service"],
        models=tuple(orjson.loads(row["models"] or "[]")), user_turns=row["user_turns"] or 0,
        attributes=attributes, has_error=has_error)


# --------------------------------------------------------------- the daemon stage


class EvalMetrics:
    """The evaluator's own instruments, added to the daemon's /metrics."""

    def __init__(self, metrics: Metrics) -> None:
        self.decisions = Counter("tracejudge_eval_sampling_decisions_total",
                                 "Ended conversations decided for judging, by outcome.", ("outcome",))
        self.verdicts = Counter("tracejudge_eval_verdicts_total", "Verdicts stored, by result.", ("result",))
        self.not_run = Counter("tracejudge_eval_not_run_total", "Criteria that could not run, by reason.",
                               ("reason",))
        self.judged = Counter("tracejudge_eval_conversations_judged_total", "Conversations judged (one revision).")
        self.tokens = Counter("tracejudge_eval_judge_tokens_total", "Judge tokens spent, by kind.", ("kind",))
        self.pending = Gauge("tracejudge_eval_pending", "Sampled conversations waiting for their judges.")
        self.in_flight = Gauge("tracejudge_eval_in_flight", "Conversations being judged now.")
        self.seconds = Histogram("tracejudge_eval_conversation_seconds",
                                 "Time to judge one conversation on every criterion.")
        for outcome in ("sampled", "not_sampled", "skipped_budget"):
            self.decisions.declare(outcome=outcome)
        for result in ("pass", "fail", "not_applicable", "error"):
            self.verdicts.declare(result=result)
        self.tokens.declare(kind="input")
        self.tokens.declare(kind="output")
        metrics.add_instruments(self.decisions, self.verdicts, self.not_run, self.judged, self.tokens, self.pending,
                                self.in_flight, self.seconds)


class Evaluator(Stage):
    """The online eval stage of the daemon (see the module docstring)."""

    name = "evaluator"

    def __init__(self, store: Store, cfg: Config, metrics: Metrics, *, criteria: Sequence[Criterion],
                 provider: Provider | None, no_provider: str | None = None, on_stored: OnStored | None = None,
                 clock: Callable[[], float] = time.time, poll: float = 1.0, settle: float = 2.0,
                 max_wait: float = 30.0) -> None:
        super().__init__(store, metrics)
        self.pacing = store.pacing(idle_gap=IDLE_GAP, share=SHARE, max_wait=max_wait, poll=POLL)
        """When DuckDB work may run: ``max_wait`` is how long it waits for a pause in ingestion."""
        self.clock = clock
        self.poll = poll
        self.settle = settle
        """Seconds a conversation stays unjudged after it was last written (late rows of its last trace)."""
        self.sampler = Sampler(cfg.sampling, clock=clock)
        self.judging = Judging(criteria, provider, concurrency=cfg.judges.concurrency,
                               timeout=cfg.judges.timeout, on_stored=on_stored,
                               no_provider=no_provider, clock=clock)
        self.max_in_flight = 2 * cfg.judges.concurrency
        self.m = EvalMetrics(metrics)
        self._keys, self._status = _attribute_keys(self.sampler)
        # Live LLM criteria need a provider: without one they are reported as not run at the end, as the others.
        live_criteria = [c for c in criteria if c.live and (provider is not None or not isinstance(c, LLMCriterion))]
        self.live = live.Live(
            live_criteria, self.judging, self.sampler, metrics, settle=cfg.alerts.live_settle, tokens=self.m.tokens,
            facts=lambda cur, row: conversation_facts(cur, row, self._keys, self._status),
            spans=bool(self._keys or self._status), clock=clock) if live_criteria else None
        """Judges live criteria on open conversations, from ``go_live`` on; None when no criterion is live."""
        self._live_task: asyncio.Task[None] | None = None
        self._pending: OrderedDict[str, Job] = OrderedDict()
        self._attempts: dict[str, int] = {}
        self._backfills: list[Backfill] = []
        self._in_flight: dict[str, asyncio.Task[None]] = {}
        self._finished: dict[str, Outcome] = {}  # judged, not stored yet
        self._finished_since = 0.0  # monotonic time the oldest of them was judged
        self.store_wait = STORE_WAIT
        self._db_lock: asyncio.Lock | None = None
        self._db_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tracejudge-evaluator-db")
        self._mark: tuple[dt.datetime, str] = (utc(0), "")
        self._not_run_mark: str | None = "" if provider is not None else None
        """Conversations with not-run records queued up to this id; None once all are (or without a provider)."""
        self.scans = 0
        """Scans completed since the start (each also looks for retries that are due)."""
        self._next_scan = 0.0  # monotonic time before which no scan starts (unless the last had more)
        self._scan_more = False
        self._skipped_scan = False  # the last cycle left a scan for later: it was not due
        self._loop: asyncio.AbstractEventLoop | None = None
        self._woken: asyncio.Event | None = None
        self._started = threading.Event()  # its loop runs (or its thread ended)

    # ------------------------------------------------------------ lifecycle

    def _open(self) -> None:
        cur = self.cur
        assert cur is not None
        ensure_schema(cur)
        live.ensure_schema(cur)
        verdicts.store_criteria(cur, self.judging.criteria, now=utc(self.clock()))
        now = self.clock()
        admitted = cur.execute("SELECT epoch(decided_at) FROM sampling_decisions WHERE sampled "
                               "AND decided_at >= ?", [utc(now - 3600)]).fetchall()
        spent = cur.execute("SELECT epoch(judged_at), input_tokens + output_tokens FROM verdicts "
                            "WHERE judged_at >= ?", [utc(now - 86400)]).fetchall()
        self.sampler.restore(admitted_at=[float(t) for (t,) in admitted], tokens=[(float(t), int(n)) for t, n in spent])

    def start(self) -> None:
        super().start()
        self._started.wait()  # from now on ``wake``, ``start_backfill`` and ``stop`` reach its loop

    def _wake(self) -> None:
        self.wake()

    def go_live(self, on_fail: live.OnLiveFail) -> None:
        """Start judging live criteria on open conversations (none: nothing to do); ``on_fail`` is told of each
        live fail in the transaction that stores it. The daemon calls it once its API listens: its alerts link
        to review items there."""
        if self.live is None or self._loop is None:
            return
        self.live.on_fail = on_fail
        self._loop.call_soon_threadsafe(self._start_live)

    def _start_live(self) -> None:
        self._live_task = asyncio.ensure_future(self._live_passes())

    async def _live_passes(self) -> None:
        """A live pass every ``live.POLL`` seconds, and as soon as judged turns wait to be stored."""
        assert self.live is not None and self.cur is not None
        cur = self.cur

        def db(work: Callable[[duckdb.DuckDBPyConnection], T]) -> Awaitable[T]:
            return self._db(lambda: work(cur))

        while not self.stopping.is_set():
            try:
                await self.live.pass_(db)
            except Exception:  # noqa: BLE001 - one failed pass must not end live judging
                await self.live.sleep(self.cycle_failed("a live pass failed; its work is tried again"))
                continue
            await self.live.sleep(live.POLL)

    @property
    def judged(self) -> int:
        """Conversations judged (one revision each) since the start."""
        return int(self.m.judged.value())

    def wake(self) -> None:
        """Look for ended conversations now instead of at the next poll."""
        if self._loop is not None and self._woken is not None:
            with contextlib.suppress(RuntimeError):  # its loop has ended already
                self._loop.call_soon_threadsafe(self._woken.set)

    def start_backfill(self, since: dt.datetime | None, criterion_ids: Sequence[str], *,
                       simulated: bool = False) -> Backfill:
        """Start a ``tracejudge eval`` pass on this stage's loop; poll the returned progress.

        Raises:
            UserError: an unknown criterion id, or no criteria configured.
        """
        if not self.judging.criteria:
            raise UserError("no criteria to judge with: judges.criteria is empty")
        judging = self.judging.subset(criterion_ids) if criterion_ids else self.judging
        assert self._loop is not None
        self._backfills.append(Backfill(id=len(self._backfills) + 1))
        progress = self._backfills[-1]

        async def run() -> None:
            cur = self.store.cursor()  # its own: the stage's runs in the DuckDB thread meanwhile
            try:
                jobs = backfill_jobs(cur, since, simulated=simulated)
                await run_backfill(cur, judging, jobs, progress, parallel=self.max_in_flight)
            except Exception:  # noqa: BLE001
                log.exception("tracejudge eval pass %d failed", progress.id)
            finally:
                cur.close()

        asyncio.run_coroutine_threadsafe(run(), self._loop)
        return progress

    def backfill(self, backfill_id: int) -> Backfill | None:
        """The progress of an eval pass started by ``start_backfill``."""
        return self._backfills[backfill_id - 1] if 0 < backfill_id <= len(self._backfills) else None

    def status(self) -> dict[str, int]:
        """For /api/status: sampled conversations waiting and being judged, and judged so far."""
        return {"evals_pending": len(self._pending), "evals_in_flight": len(self._in_flight) + len(self._finished),
                "evals_judged": self.judged}

    def held(self) -> dict[str, int]:
        return {"pending": len(self._pending), "attempts": len(self._attempts), "in_flight": len(self._in_flight),
                "judged_unstored": len(self._finished), "backfills": len(self._backfills),
                **(self.live.held() if self.live is not None else {})}

    # ------------------------------------------------------------ the loop

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        finally:
            self._started.set()  # a start waiting for a loop that never ran returns all the same

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._woken = asyncio.Event()
        self._db_lock = asyncio.Lock()
        self.judging.bind()
        self._started.set()
        try:
            while not self.stopping.is_set():
                try:
                    more = await self._cycle()
                except Exception:  # noqa: BLE001 - one failed cycle must not end the stage
                    await self._sleep(self.cycle_failed("a cycle failed; its work is tried again"))
                    continue
                self.cycle_ok()
                if not more:
                    # A wake whose scan was not due yet is answered once it is.
                    scan_in = max(0.0, self._next_scan - time.monotonic()) if self._skipped_scan else self.poll
                    await self._sleep(min(self._store_in(), scan_in) if self._finished else scan_in)
        finally:
            for task in self._in_flight.values():
                task.cancel()
            stopped = [*self._in_flight.values(), *(self.live.cancel() if self.live is not None else [])]
            if self._live_task is not None:
                self._live_task.cancel()
                stopped.append(self._live_task)
            await asyncio.gather(*stopped, return_exceptions=True)
            try:  # what was judged before the stop is kept; after any piece still running
                await self._loop.run_in_executor(self._db_thread, self._store_outcomes, self._take_finished())
            except Exception:  # noqa: BLE001
                self.error("storing the last verdicts failed; those conversations are judged again")
            self._db_thread.shutdown(wait=True)
            await self.judging.aclose()

    async def _sleep(self, seconds: float) -> None:
        """Until ``seconds`` have passed, ``wake`` is called or the stage is stopping."""
        assert self._woken is not None
        if not self.stopping.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._woken.wait(), timeout=seconds)
        self._woken.clear()

    async def _db(self, work: Callable[[], T]) -> T:
        """``work`` as one piece of DuckDB work, one at a time, when ``pacing`` lets it run (requests go
        first), in the DuckDB thread: the loop goes on with the judge calls in flight meanwhile. Once the
        stage is stopping, work no longer waits."""
        assert self._db_lock is not None and self._loop is not None
        async with self._db_lock:
            await self.pacing.turn(self.stopping)
            try:
                return await self._loop.run_in_executor(self._db_thread, work)
            finally:
                self.pacing.done()

    async def _cycle(self) -> bool:
        """Store what was judged, scan, start what there is room for; True when the scan has more to read now."""
        if self._store_due():
            await self._store_finished()
        more = False
        # A scan joins every ended conversation kept with its decisions, and ran at every cycle (one per
        # judged or stored batch, and per wake). Scans now come a quarter of ``poll`` apart at most, unless
        # the last had more to read (the daemon's CPU a span: 0.94x under load, bench/soak.py); with work
        # queued, ``poll`` apart (they would take the DuckDB thread from the reads that start the next).
        self._skipped_scan = not (self._scan_more or time.monotonic() >= self._next_scan)
        if len(self._pending) < MAX_PENDING and not self._skipped_scan:
            busy = self._busy_ids()  # read here: the loop changes these while the scan runs
            more = self._scan_more = await self._db(lambda: self._scan_all(busy))
            self.scans += 1
            queued = len(self._pending) >= self.max_in_flight
            self._next_scan = time.monotonic() + (self.poll if queued else self.poll / 4)
        self._start_pending()
        self.m.pending.set(len(self._pending))
        self.m.in_flight.set(len(self._in_flight))
        return more

    def _scan_all(self, busy: list[str]) -> bool:
        """In the DuckDB thread: the scan, the retries due, and a page of criteria not run for want of a
        provider; True when the scan has more to read now."""
        more = self._scan(busy)
        self._retries(busy)
        if self._not_run_mark is not None:
            self._not_run_mark = self._provider_now(busy)
        return more

    def _scan(self, busy: list[str]) -> bool:
        """Decide and queue ended conversations that need it (``busy``: those queued, in flight or judged
        and not stored); True when a full page came back."""
        assert self.cur is not None
        cur = self.cur
        now = self.clock()
        since, after = self._mark
        cols = ("conversation_id", "updated_at", "revision", "transcript_hash", "ended_by", "service", "models",
                "user_turns", "trace_ids", "decided", "probability", "rule", "first_batch")
        # Only rows that need something: no decision yet, or sampled and not judged at this revision.
        # Those queued or being judged are left out, so they cannot fill every page.
        with self.store.large_reads:
            rows = cur.execute(
                "SELECT c.conversation_id, c.updated_at, c.revision, c.transcript_hash, c.ended_by, c.service, "
                "c.models, c.user_turns, c.trace_ids, s.conversation_id IS NOT NULL, s.probability, s.rule, "
                "c.first_batch FROM conversations c "
                "LEFT JOIN sampling_decisions s ON s.conversation_id = c.conversation_id "
                "LEFT JOIN eval_progress p ON p.conversation_id = c.conversation_id "
                "WHERE c.state = 'ended' AND (c.updated_at > ? OR (c.updated_at = ? AND c.conversation_id > ?)) "
                f"AND {JUDGEMENT_DUE} "
                "AND c.conversation_id NOT IN (SELECT unnest(?::VARCHAR[])) "  # a hash anti-join, not a list walk per row
                "ORDER BY c.updated_at, c.conversation_id LIMIT ?",
                [since, since, after, busy, SCAN_PAGE]).fetchall()
        settled = utc(now - self.settle)
        decisions = []
        last: tuple[dt.datetime, str] | None = None
        for values in rows:
            row = dict(zip(cols, values))
            if row["updated_at"] > settled:
                break  # too fresh: late rows of its last trace may still come; the next scans see it
            last = (row["updated_at"], row["conversation_id"])
            if row["decided"]:
                self._queue(Job(row["conversation_id"], row["revision"], row["probability"], row["rule"]))
                continue
            d = self.sampler.decide(conversation_facts(cur, row, self._keys, self._status))
            decisions.append(verdicts.SamplingRecord(row["conversation_id"], d.sampled, d.probability, d.rule,
                                                  row["revision"], row["transcript_hash"], d.skipped))
            self.m.decisions.inc(outcome="sampled" if d.sampled else
                                 ("skipped_budget" if d.skipped else "not_sampled"))
            if d.sampled:
                self._queue(Job(row["conversation_id"], row["revision"], d.probability, d.rule))
        verdicts.record_samplings(cur, decisions, now=utc(now))
        if last is not None:
            # The mark trails by SCAN_SLACK: a row written just before it may commit after this scan.
            self._mark = max(self._mark, min(last, (utc(now - SCAN_SLACK), "")))
        return len(rows) == SCAN_PAGE and last is not None

    def _retries(self, busy: list[str]) -> None:
        """Conversations whose verdicts had errors, once their retry time has come."""
        assert self.cur is not None
        rows = self.cur.execute(
            "SELECT p.conversation_id, p.revision, p.attempts, s.probability, s.rule FROM eval_progress p "
            "JOIN sampling_decisions s USING (conversation_id) JOIN conversations c USING (conversation_id) "
            "WHERE p.retry_at <= ? AND c.revision = p.revision "
            "AND p.conversation_id NOT IN (SELECT unnest(?::VARCHAR[])) LIMIT ?",
            [utc(self.clock()), busy, MAX_PENDING]).fetchall()
        for cid, revision, attempts, probability, rule in rows:
            self._attempts[cid] = attempts + 1
            self._pending[cid] = Job(cid, revision, probability, rule, only_errors=True)

    def _provider_now(self, busy: list[str]) -> str | None:
        """Queue a page of sampled conversations whose LLM criteria were not run for want of a provider.

        Returns the mark to go on from, or None when there are no more.
        """
        assert self.cur is not None and self._not_run_mark is not None
        llm = [f"{c.id}\x1f{c.version}" for c in self.judging.criteria if isinstance(c, LLMCriterion)]
        room = MAX_PENDING - len(self._pending)
        if not llm or room <= 0:
            return self._not_run_mark if llm else None
        reasons = " OR ".join(["starts_with(n.reason, ?)"] * len(NO_PROVIDER))
        rows = self.cur.execute(
            "SELECT DISTINCT n.conversation_id, c.revision, s.probability, s.rule FROM not_run n "
            "JOIN sampling_decisions s USING (conversation_id) JOIN conversations c USING (conversation_id) "
            "WHERE c.state = 'ended' AND s.sampled AND s.skipped_reason IS NULL AND n.conversation_id > ? "
            f"AND list_contains(?, n.criterion_id || chr(31) || n.criterion_version) AND ({reasons}) "
            "AND NOT EXISTS (SELECT 1 FROM verdicts v WHERE v.conversation_id = n.conversation_id "
            "AND v.criterion_id = n.criterion_id AND NOT v.superseded AND NOT v.live) "
            "AND n.conversation_id NOT IN (SELECT unnest(?::VARCHAR[])) ORDER BY n.conversation_id LIMIT ?",
            [self._not_run_mark, llm, *NO_PROVIDER, busy, room]).fetchall()
        if not rows:
            return None
        log.info("judging %d conversations whose LLM criteria were not run for want of a provider", len(rows))
        for cid, revision, probability, rule in rows:
            # In its place if queued already: a retry of errors alone would leave the LLM criteria out.
            self._pending[cid] = Job(cid, revision, probability, rule)
        return str(rows[-1][0])

    def _busy_ids(self) -> list[str]:
        """Conversations queued, being judged or judged and not stored yet: the scans leave them out."""
        return [*self._pending, *self._in_flight, *self._finished]

    def _queue(self, job: Job) -> None:
        self._pending[job.conversation_id] = job  # a key already there keeps its place

    def _start_pending(self) -> None:
        # A read for a few conversations costs about what one for many does: once judged conversations
        # no longer held their slots until stored, slots came back one at a time, and each was read alone.
        if self.max_in_flight - len(self._in_flight) < min(len(self._pending), PREPARE_AT_ONCE,
                                                            self.max_in_flight // 2):
            return
        jobs: list[Job] = []
        while self._pending and len(self._in_flight) + len(jobs) < self.max_in_flight:
            jobs.append(self._pending.popitem(last=False)[1])
        for i in range(0, len(jobs), PREPARE_AT_ONCE):
            part = jobs[i:i + PREPARE_AT_ONCE]
            task = asyncio.ensure_future(self._judge_all(part))
            for job in part:
                self._in_flight[job.conversation_id] = task

    async def _judge_all(self, jobs: list[Job]) -> None:
        """Read these conversations in one piece of DuckDB work, then judge each; each outcome waits in
        ``_finished`` for the next cycle to store it with others."""
        started = time.monotonic()
        cur = self.cur
        assert cur is not None
        try:
            prepared = await self._db(lambda: self._prepare(cur, jobs))
            await asyncio.gather(*(self._judge(job, p, started) for job, p in zip(jobs, prepared)))
        finally:
            for job in jobs:
                self._in_flight.pop(job.conversation_id, None)

    def _prepare(self, cur: duckdb.DuckDBPyConnection, jobs: list[Job]) -> list[Prepared | None | duckdb.Error]:
        """In the DuckDB thread: ``Judging.prepare_many``, or for each job the error that reading them raised."""
        try:
            return list(self.judging.prepare_many(cur, jobs))
        except duckdb.Error as exc:
            return [exc] * len(jobs)

    async def _judge(self, job: Job, prepared: Prepared | None | duckdb.Error, started: float) -> None:
        attempts = self._attempts.pop(job.conversation_id, 1)
        try:
            if isinstance(prepared, duckdb.Error):
                raise prepared
            if prepared is not None:
                run = await self.judging.judge(prepared.conversation, prepared.todo)
                if not self._finished:
                    self._finished_since = time.monotonic()
                self._finished[job.conversation_id] = Outcome(job, run, prepared.sha256, prepared.skipped, attempts)
        except duckdb.Error:
            self.error(f"reading {job.conversation_id} for its judges failed; it is judged again")
            self._pending.setdefault(job.conversation_id, job)
        except Exception:  # noqa: BLE001 - a bug in one conversation must not stop the stage
            self.error(f"judging {job.conversation_id} failed")
        finally:
            self._in_flight.pop(job.conversation_id, None)
        self.m.seconds.observe(time.monotonic() - started)
        if self._woken is not None:
            self._woken.set()  # the next cycle fills the free slot, and stores it once due

    def _store_due(self) -> bool:
        """Whether the outcomes waiting are stored now (``STORE_AT_ONCE``)."""
        return bool(self._finished) and (len(self._finished) >= STORE_AT_ONCE or self._store_in() == 0
                                         or not (self._in_flight or self._pending))

    def _store_in(self) -> float:
        """Seconds until the outcomes waiting have waited ``store_wait`` (at most ``poll``)."""
        return max(0.0, min(self.poll, self._finished_since + self.store_wait - time.monotonic()))

    def _take_finished(self) -> list[Outcome]:
        outcomes = list(self._finished.values())
        self._finished.clear()
        return outcomes

    async def _store_finished(self) -> None:
        """Store every outcome waiting, in one transaction, then count it and look for changed transcripts."""
        outcomes = self._take_finished()
        if outcomes:
            await self._db(lambda: self._store_outcomes(outcomes))

    def _store_outcomes(self, outcomes: list[Outcome]) -> None:
        """In the DuckDB thread: store ``outcomes``; what failed to store goes back to the queue."""
        if not outcomes:
            return
        assert self.cur is not None
        try:
            self.judging.store(self.cur, outcomes)
        except duckdb.Error:
            self.error(f"storing the verdicts of {len(outcomes)} conversations failed; they are judged again")
            for o in outcomes:
                self._pending.setdefault(o.job.conversation_id, o.job)
            return
        for o in outcomes:
            self._account(o)
        # A transcript that changed while it was judged is judged again once it has ended again:
        # its row was left out of the scans meanwhile, and the scan's mark may have passed it.
        jobs = {o.job.conversation_id: o.job for o in outcomes}
        for cid, revision in by_keys(  # by key: a join would read every conversation kept
                self.cur, "SELECT conversation_id, revision FROM conversations WHERE state = 'ended' AND "
                "conversation_id IN {keys}", list(jobs)):
            job = jobs[cid]
            if revision > job.revision:
                self._pending[cid] = Job(cid, revision, job.probability, job.rule)

    def _account(self, outcome: Outcome) -> None:
        run = outcome.run
        self.m.judged.inc()
        stored = set(outcome.stored)
        for v in run.verdicts:
            if verdicts.verdict_id(v) in stored:
                self.m.verdicts.inc(result=v.result)
        for n in run.not_run:
            self.m.not_run.inc(reason=n.reason)
        spent = run.usage.input_tokens + run.usage.output_tokens
        self.m.tokens.inc(run.usage.input_tokens, kind="input")
        self.m.tokens.inc(run.usage.output_tokens, kind="output")
        if spent:
            self.sampler.record_tokens(spent)
