"""Online evals in the daemon: sample conversations as they end, judge them, store verdicts.

Lifecycle: ``Evaluator(store, config, metrics, criteria=..., provider=...)``
-> ``start()`` (creates its tables, records the criteria texts, refills the
budgets from what is stored, starts its thread) -> ``stop()`` (stores what was
judged; calls in flight are abandoned and made again at the next start).

It runs in a thread of its own with its own event loop. Ingestion comes first:
each piece of DuckDB work (reading a conversation, storing, scanning) runs
alone, between requests (``_db_work``); judge calls in flight are never held
up. Each cycle, about once a second or as soon as a conversation is judged:

1. **scan**: conversations written since the last scan (``updated_at``) that
   have ended. One with no sampling decision gets one now (``Sampler.decide``);
   one picked for judging whose current revision has no progress row goes to
   the pending queue (bounded: while it is full the scan waits).
2. **judge**: pending conversations start, oldest first, up to twice
   ``judges.concurrency`` at once; their judge calls share one limit of
   ``judges.concurrency``.
3. **store**: the verdicts, not-run records and progress rows of every
   conversation judged since the last cycle, in one transaction.

With a provider, the first cycles also queue, page by page, the sampled
conversations whose LLM criteria were not run for want of one (no key at an
earlier start): their verdicts replace those not-run records.

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
import contextlib
import datetime as dt
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import duckdb
import orjson

from judges import (
    Conversation,
    Criterion,
    JudgeRequest,
    JudgeRun,
    LLMCriterion,
    NotRun,
    Provider,
    ProviderReply,
    arun_judges,
    transcript_sha256,
)

from . import evals
from .config import Config
from .errors import UserError
from .judge_setup import NO_PROVIDER
from .metrics import Counter, Gauge, Histogram, Metrics
from .queries import conversation_record
from .sampling import ConversationFacts, Sampler
from .store import Store

log = logging.getLogger("tracejudge.evaluator")

PROGRESS_SCHEMA = """
CREATE TABLE IF NOT EXISTS eval_progress (
    conversation_id VARCHAR PRIMARY KEY,
    revision INTEGER NOT NULL,
    judged_at TIMESTAMPTZ NOT NULL,
    errors INTEGER NOT NULL,
    attempts INTEGER NOT NULL,
    retry_at TIMESTAMPTZ
);
"""

RETRY_AFTER = (60.0, 600.0, 3600.0)  # seconds before the 2nd, 3rd and 4th attempt on errors
SCAN_SLACK = 60.0  # rows written this recently are read again: their commit may land after a scan
SCAN_PAGE = 2000
MAX_PENDING = 5000
IDLE_GAP = 0.01  # ingestion counts as paused once nothing has waited to be stored for this long
BUSY_SHARE = 8  # after max_wait, while ingestion stays busy, DuckDB work takes at most 1/8 of the time
_UTC = dt.timezone.utc


def _utc(seconds: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(seconds, _UTC)


class _Limited:
    """A provider whose calls share one semaphore: the concurrency limit across conversations."""

    def __init__(self, inner: Provider, limit: asyncio.Semaphore) -> None:
        self.inner = inner
        self.name = inner.name
        self.model = inner.model
        self.limit = limit

    async def send(self, request: JudgeRequest) -> ProviderReply:
        async with self.limit:
            return await self.inner.send(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


# --------------------------------------------------------------- one conversation


@dataclass(frozen=True)
class Job:
    """A sampled conversation to judge at one revision, with its inclusion probability."""

    conversation_id: str
    revision: int
    probability: float
    rule: str
    """The sampling rule that picked it: ``rules[0]``, ... or ``default``."""
    only_errors: bool = False
    """A retry: only the criteria whose current verdict is an error."""


@dataclass
class Outcome:
    """What judging one conversation produced; ``stored`` is filled in when it is stored."""

    job: Job
    run: JudgeRun
    sha256: str
    """The transcript judged."""
    skipped: int
    """Criteria not called again: they already have a verdict on this transcript."""
    attempts: int = 1
    stored: list[str] = field(default_factory=list)
    """Ids of verdicts newly stored (a repeat after a crash stores none)."""


@dataclass
class Prepared:
    """A conversation read for judging, and the criteria it still needs."""

    conversation: Conversation
    todo: list[Criterion]
    sha256: str
    skipped: int


class Judging:
    """Judges one conversation at a time on the configured criteria and stores the outcome.

    The daemon's evaluator and ``tracejudge eval`` share it. DuckDB calls run
    on the caller's cursor, in the caller's thread; ``judge`` awaits the judge calls.
    """

    def __init__(self, criteria: Sequence[Criterion], provider: Provider | None, *, concurrency: int,
                 timeout: float, queue_results: Sequence[str], no_provider: str | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.criteria = list(criteria)
        self.no_provider = no_provider
        self.concurrency = concurrency
        self._raw_provider = provider
        self.provider: Provider | None = None
        self.timeout = timeout
        self.queue_results = list(queue_results)
        self.clock = clock

    def bind(self) -> None:
        """Create the shared call limit on the running loop (call from inside it)."""
        limit = asyncio.Semaphore(self.concurrency)
        self.provider = _Limited(self._raw_provider, limit) if self._raw_provider is not None else None

    async def aclose(self) -> None:
        if self.provider is not None:
            await self.provider.aclose()

    def subset(self, criterion_ids: Sequence[str]) -> Judging:
        """The same judging on some criteria only, sharing the provider and its call limit.

        Raises:
            UserError: an id that is not among the configured criteria.
        """
        known = {c.id for c in self.criteria}
        unknown = sorted(set(criterion_ids) - known)
        if unknown:
            raise UserError(f"no criterion {', '.join(unknown)} in judges.criteria "
                            f"(configured: {', '.join(sorted(known)) or 'none'})")
        other = Judging([c for c in self.criteria if c.id in criterion_ids], None, concurrency=self.concurrency,
                        timeout=self.timeout, queue_results=self.queue_results, no_provider=self.no_provider,
                        clock=self.clock)
        other._raw_provider, other.provider = self._raw_provider, self.provider
        return other

    def _judge_model(self, c: Criterion) -> str | None:
        # As the runner records it: the provider's model, or the code check's name.
        if isinstance(c, LLMCriterion):
            return self.provider.model if self.provider is not None else None
        return c.check

    def prepare(self, cur: duckdb.DuckDBPyConnection, job: Job) -> Prepared | None:
        """The conversation record, and the criteria that still need a verdict on its current transcript."""
        record = conversation_record(cur, job.conversation_id)
        if record is None:
            return None
        record["sampling"] = {"probability": job.probability, "rule": job.rule}
        conversation = Conversation.model_validate(record)
        sha = transcript_sha256(conversation.messages)
        rows = cur.execute(
            "SELECT criterion_id, criterion_version, judge_model, result FROM verdicts "
            "WHERE conversation_id = ? AND transcript_sha256 = ?", [job.conversation_id, sha]).fetchall()
        done = {(cid, version, model) for cid, version, model, result in rows if result != "error"}
        errored = {(cid, version, model) for cid, version, model, result in rows if result == "error"}
        todo = []
        for c in self.criteria:
            key = (c.id, c.version, self._judge_model(c))
            if key in done or (job.only_errors and key not in errored):
                continue
            todo.append(c)
        return Prepared(conversation, todo, sha, len(self.criteria) - len(todo))

    async def judge(self, conversation: Conversation, criteria: Sequence[Criterion]) -> JudgeRun:
        """Run the criteria on one conversation; a conversation without content runs none of them."""
        if not (conversation.attributes or {}).get("content_captured", True):
            return JudgeRun(verdicts=[], not_run=[
                NotRun(conversation_id=conversation.id, criterion_id=c.id, criterion_version=c.version,
                       reason="no content captured") for c in criteria], usage={"input_tokens": 0,
                                                                                 "output_tokens": 0})
        if not criteria:
            return JudgeRun(verdicts=[], not_run=[], usage={"input_tokens": 0, "output_tokens": 0})
        run = await arun_judges(criteria, [conversation], self.provider, concurrency=len(criteria),
                                timeout=self.timeout)
        if self.provider is None and self.no_provider:
            run.not_run = [n.model_copy(update={"reason": self.no_provider}) if n.reason == "no provider configured"
                           else n for n in run.not_run]
        return run

    def store(self, cur: duckdb.DuckDBPyConnection, outcomes: Sequence[Outcome], *, progress: bool = True) -> None:
        """Store verdicts, not-run records and progress rows of several conversations in one transaction."""
        now = _utc(self.clock())
        with evals.Transaction(cur):
            for o in outcomes:
                job, run = o.job, o.run
                o.stored = evals.store_verdicts(cur, run.verdicts, probability=job.probability, rule=job.rule,
                                                queue_results=self.queue_results, now=now,
                                                current={job.conversation_id: o.sha256})
                if run.not_run:
                    evals.store_not_run(cur, run.not_run, now=now)
                if progress:
                    errors = sum(1 for v in run.verdicts if v.result == "error")
                    retry = (_utc(self.clock() + RETRY_AFTER[o.attempts - 1])
                             if errors and o.attempts <= len(RETRY_AFTER) else None)
                    cur.execute("INSERT OR REPLACE INTO eval_progress VALUES (?, ?, ?, ?, ?, ?)",
                                [job.conversation_id, job.revision, now, errors, o.attempts, retry])

    async def run_job(self, cur: duckdb.DuckDBPyConnection, job: Job, *, progress: bool = True) -> Outcome | None:
        """Judge one conversation and store the outcome; None when the conversation is gone."""
        p = self.prepare(cur, job)
        if p is None:
            return None
        outcome = Outcome(job, await self.judge(p.conversation, p.todo), p.sha256, p.skipped)
        self.store(cur, [outcome], progress=progress)
        return outcome


def ensure_schema(cur: duckdb.DuckDBPyConnection) -> None:
    """The tables of evals and the progress table of this stage."""
    evals.ensure_schema(cur)
    cur.execute(PROGRESS_SCHEMA)


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
        for attrs, resource, code in cur.execute(
                "SELECT attributes, resource, status_code FROM span_records WHERE trace_id IN (SELECT unnest(?))",
                [trace_ids]).fetchall():
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
        self.failures = Counter("tracejudge_eval_stage_errors_total",
                                "Cycles of the evaluator that failed (logged; the work is retried).")
        for outcome in ("sampled", "not_sampled", "skipped_budget"):
            self.decisions.declare(outcome=outcome)
        for result in ("pass", "fail", "not_applicable", "error"):
            self.verdicts.declare(result=result)
        self.tokens.declare(kind="input")
        self.tokens.declare(kind="output")
        instruments = (self.decisions, self.verdicts, self.not_run, self.judged, self.tokens, self.pending,
                       self.in_flight, self.seconds, self.failures)
        metrics.add_collector(lambda: [line for i in instruments for line in i.render()])


class Evaluator:
    """The online eval stage of the daemon (see the module docstring)."""

    def __init__(self, store: Store, cfg: Config, metrics: Metrics, *, criteria: Sequence[Criterion],
                 provider: Provider | None, no_provider: str | None = None, clock: Callable[[], float] = time.time,
                 poll: float = 1.0, settle: float = 2.0, max_wait: float = 30.0) -> None:
        self.store = store
        self.max_wait = max_wait
        """Seconds DuckDB work waits for a pause in ingestion before it takes its 1/BUSY_SHARE anyway."""
        self.clock = clock
        self.poll = poll
        self.settle = settle
        """Seconds a conversation stays unjudged after it was last written (late rows of its last trace)."""
        self.sampler = Sampler(cfg.sampling, clock=clock)
        self.judging = Judging(criteria, provider, concurrency=cfg.judges.concurrency,
                               timeout=cfg.judges.timeout, queue_results=cfg.review.queue_results,
                               no_provider=no_provider, clock=clock)
        self.max_in_flight = 2 * cfg.judges.concurrency
        self.m = EvalMetrics(metrics)
        self._keys, self._status = _attribute_keys(self.sampler)
        self._cur: duckdb.DuckDBPyConnection | None = None
        self._pending: OrderedDict[str, Job] = OrderedDict()
        self._attempts: dict[str, int] = {}
        self._backfills: list[Backfill] = []
        self._in_flight: dict[str, asyncio.Task[None]] = {}
        self._finished: dict[str, Outcome] = {}  # judged, not stored yet
        self._waiting_since: float | None = None
        self._next_turn = 0.0
        self._db_lock: asyncio.Lock | None = None
        self._mark: tuple[dt.datetime, str] = (_utc(0), "")
        self._not_run_mark: str | None = "" if provider is not None else None
        """Conversations with not-run records queued up to this id; None once all are (or without a provider)."""
        self.scans = 0
        """Scans completed since the start (each also looks for retries that are due)."""
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._wake: asyncio.Event | None = None
        self._started = threading.Event()

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        cur = self.store.cursor()
        self._cur = cur
        ensure_schema(cur)
        evals.store_criteria(cur, self.judging.criteria, now=_utc(self.clock()))
        now = self.clock()
        admitted = cur.execute("SELECT epoch(decided_at) FROM sampling_decisions WHERE sampled "
                               "AND decided_at >= ?", [_utc(now - 3600)]).fetchall()
        spent = cur.execute("SELECT epoch(judged_at), input_tokens + output_tokens FROM verdicts "
                            "WHERE judged_at >= ?", [_utc(now - 86400)]).fetchall()
        self.sampler.restore(admitted_at=[float(t) for (t,) in admitted], tokens=[(float(t), int(n)) for t, n in spent])
        self._thread = threading.Thread(target=self._run, name="tracejudge-evaluator", daemon=True)
        self._thread.start()
        self._started.wait()

    def stop(self) -> None:
        if self._thread is not None and self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join()
            self._thread = None
        if self._cur is not None:
            self._cur.close()
            self._cur = None

    @property
    def judged(self) -> int:
        """Conversations judged (one revision each) since the start."""
        return int(self.m.judged.value())

    def wake(self) -> None:
        """Look for ended conversations now instead of at the next poll."""
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def start_backfill(self, since: dt.datetime | None, criterion_ids: Sequence[str]) -> Backfill:
        """Start a ``tracejudge eval`` pass on this stage's loop; poll the returned progress.

        Raises:
            UserError: an unknown criterion id, or no criteria configured.
        """
        if not self.judging.criteria:
            raise UserError("no criteria to judge with: judges.criteria is empty")
        judging = self.judging.subset(criterion_ids) if criterion_ids else self.judging
        assert self._loop is not None and self._cur is not None
        self._backfills.append(Backfill(id=len(self._backfills) + 1))
        progress = self._backfills[-1]
        cur = self._cur

        async def run() -> None:
            jobs = backfill_jobs(cur, since)
            try:
                await run_backfill(cur, judging, jobs, progress, parallel=self.max_in_flight)
            except Exception:  # noqa: BLE001
                log.exception("tracejudge eval pass %d failed", progress.id)

        asyncio.run_coroutine_threadsafe(run(), self._loop)
        return progress

    def backfill(self, backfill_id: int) -> Backfill | None:
        """The progress of an eval pass started by ``start_backfill``."""
        return self._backfills[backfill_id - 1] if 0 < backfill_id <= len(self._backfills) else None

    def status(self) -> dict[str, int]:
        """For /api/status: sampled conversations waiting and being judged, and judged so far."""
        return {"evals_pending": len(self._pending), "evals_in_flight": len(self._in_flight) + len(self._finished),
                "evals_judged": self.judged}

    # ------------------------------------------------------------ the loop

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._db_lock = asyncio.Lock()
        self.judging.bind()
        self._started.set()
        try:
            while not self._stop.is_set():
                more = False
                try:
                    more = await self._cycle()
                except duckdb.Error:
                    self.m.failures.inc()
                    log.exception("evaluator cycle failed; it is tried again")
                if not more:
                    await self._sleep(self.poll)
        finally:
            for task in self._in_flight.values():
                task.cancel()
            await asyncio.gather(*self._in_flight.values(), return_exceptions=True)
            try:
                self._store_finished()  # what was judged before the stop is kept
            except duckdb.Error:
                log.exception("storing the last verdicts failed; those conversations are judged again")
            await self.judging.aclose()

    async def _sleep(self, seconds: float) -> None:
        assert self._stop is not None and self._wake is not None
        waits = [asyncio.ensure_future(self._stop.wait()), asyncio.ensure_future(self._wake.wait())]
        await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        self._wake.clear()

    @contextlib.asynccontextmanager
    async def _db_work(self) -> AsyncIterator[None]:
        """One piece of DuckDB work, when it may run: requests go first.

        Ingestion and this stage share one interpreter lock and DuckDB. Work
        runs one piece at a time, each when no request has waited to be stored
        for ``IDLE_GAP`` (between requests, at any load below saturation);
        while requests queue without a pause for ``max_wait``, it runs at most
        1/``BUSY_SHARE`` of the time. Judge calls in flight are not held up:
        only reading, storing and scanning.
        """
        assert self._stop is not None and self._db_lock is not None
        async with self._db_lock:
            while self.store.idle_seconds < IDLE_GAP and not self._stop.is_set():
                now = time.monotonic()
                if self._waiting_since is None:
                    self._waiting_since = now
                if now - self._waiting_since >= self.max_wait and now >= self._next_turn:
                    break
                await asyncio.sleep(0.005)
            else:
                self._waiting_since = None
            began = time.perf_counter()
            try:
                yield
            finally:
                self._next_turn = time.monotonic() + (BUSY_SHARE - 1) * (time.perf_counter() - began)

    async def _cycle(self) -> bool:
        """Store what was judged, scan, start what there is room for; True when the scan has more to read now."""
        async with self._db_work():
            self._store_finished()
        more = False
        if len(self._pending) < MAX_PENDING:
            async with self._db_work():
                more = self._scan()
                self._retries()
                if self._not_run_mark is not None:
                    self._not_run_mark = self._provider_now()
            self.scans += 1
        self._start_pending()
        self.m.pending.set(len(self._pending))
        self.m.in_flight.set(len(self._in_flight))
        return more

    def _scan(self) -> bool:
        """Decide and queue ended conversations that need it; True when a full page came back."""
        assert self._cur is not None
        cur = self._cur
        now = self.clock()
        since, after = self._mark
        cols = ("conversation_id", "updated_at", "revision", "transcript_hash", "ended_by", "service", "models",
                "user_turns", "trace_ids", "decided", "probability", "rule")
        # Only rows that need something: no decision yet, or sampled and not judged at this revision.
        # Those queued or being judged are left out, so they cannot fill every page.
        rows = cur.execute(
            "SELECT c.conversation_id, c.updated_at, c.revision, c.transcript_hash, c.ended_by, c.service, "
            "c.models, c.user_turns, c.trace_ids, s.conversation_id IS NOT NULL, s.probability, s.rule "
            "FROM conversations c "
            "LEFT JOIN sampling_decisions s ON s.conversation_id = c.conversation_id "
            "LEFT JOIN eval_progress p ON p.conversation_id = c.conversation_id "
            "WHERE c.state = 'ended' AND (c.updated_at > ? OR (c.updated_at = ? AND c.conversation_id > ?)) "
            "AND (s.conversation_id IS NULL OR (s.sampled AND s.skipped_reason IS NULL "
            "AND (p.revision IS NULL OR p.revision < c.revision))) "
            "AND c.conversation_id NOT IN (SELECT unnest(?::VARCHAR[])) "  # a hash anti-join, not a list walk per row
            "ORDER BY c.updated_at, c.conversation_id LIMIT ?",
            [since, since, after, self._busy_ids(), SCAN_PAGE]).fetchall()
        settled = _utc(now - self.settle)
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
            decisions.append(evals.SamplingRecord(row["conversation_id"], d.sampled, d.probability, d.rule,
                                                  row["revision"], row["transcript_hash"], d.skipped))
            self.m.decisions.inc(outcome="sampled" if d.sampled else
                                 ("skipped_budget" if d.skipped else "not_sampled"))
            if d.sampled:
                self._queue(Job(row["conversation_id"], row["revision"], d.probability, d.rule))
        evals.record_samplings(cur, decisions, now=_utc(now))
        if last is not None:
            # The mark trails by SCAN_SLACK: a row written just before it may commit after this scan.
            self._mark = max(self._mark, min(last, (_utc(now - SCAN_SLACK), "")))
        return len(rows) == SCAN_PAGE and last is not None

    def _retries(self) -> None:
        """Conversations whose verdicts had errors, once their retry time has come."""
        assert self._cur is not None
        rows = self._cur.execute(
            "SELECT p.conversation_id, p.revision, p.attempts, s.probability, s.rule FROM eval_progress p "
            "JOIN sampling_decisions s USING (conversation_id) JOIN conversations c USING (conversation_id) "
            "WHERE p.retry_at <= ? AND c.revision = p.revision "
            "AND p.conversation_id NOT IN (SELECT unnest(?::VARCHAR[])) LIMIT ?",
            [_utc(self.clock()), self._busy_ids(), MAX_PENDING]).fetchall()
        for cid, revision, attempts, probability, rule in rows:
            self._attempts[cid] = attempts + 1
            self._pending[cid] = Job(cid, revision, probability, rule, only_errors=True)

    def _provider_now(self) -> str | None:
        """Queue a page of sampled conversations whose LLM criteria were not run for want of a provider.

        Returns the mark to go on from, or None when there are no more.
        """
        assert self._cur is not None and self._not_run_mark is not None
        llm = [f"{c.id}\x1f{c.version}" for c in self.judging.criteria if isinstance(c, LLMCriterion)]
        room = MAX_PENDING - len(self._pending)
        if not llm or room <= 0:
            return self._not_run_mark if llm else None
        reasons = " OR ".join(["starts_with(n.reason, ?)"] * len(NO_PROVIDER))
        rows = self._cur.execute(
            "SELECT DISTINCT n.conversation_id, c.revision, s.probability, s.rule FROM not_run n "
            "JOIN sampling_decisions s USING (conversation_id) JOIN conversations c USING (conversation_id) "
            "WHERE c.state = 'ended' AND s.sampled AND s.skipped_reason IS NULL AND n.conversation_id > ? "
            f"AND list_contains(?, n.criterion_id || chr(31) || n.criterion_version) AND ({reasons}) "
            "AND NOT EXISTS (SELECT 1 FROM verdicts v WHERE v.conversation_id = n.conversation_id "
            "AND v.criterion_id = n.criterion_id AND NOT v.superseded) "
            "AND n.conversation_id NOT IN (SELECT unnest(?::VARCHAR[])) ORDER BY n.conversation_id LIMIT ?",
            [self._not_run_mark, llm, *NO_PROVIDER, [*self._in_flight, *self._finished], room]).fetchall()
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
        while self._pending and len(self._in_flight) + len(self._finished) < self.max_in_flight:
            cid, job = self._pending.popitem(last=False)
            self._in_flight[cid] = asyncio.ensure_future(self._judge(job))

    async def _judge(self, job: Job) -> None:
        """Read, judge; the outcome waits in ``_finished`` for the next cycle to store it with others."""
        assert self._cur is not None
        started = time.monotonic()
        attempts = self._attempts.pop(job.conversation_id, 1)
        try:
            async with self._db_work():
                prepared = self.judging.prepare(self._cur, job)
            if prepared is not None:
                run = await self.judging.judge(prepared.conversation, prepared.todo)
                self._finished[job.conversation_id] = Outcome(job, run, prepared.sha256, prepared.skipped, attempts)
        except duckdb.Error:
            self.m.failures.inc()
            log.exception("reading %s for its judges failed; it is judged again", job.conversation_id)
            self._pending.setdefault(job.conversation_id, job)
        except Exception:  # noqa: BLE001 - a bug in one conversation must not stop the stage
            self.m.failures.inc()
            log.exception("judging %s failed", job.conversation_id)
        finally:
            self._in_flight.pop(job.conversation_id, None)
        self.m.seconds.observe(time.monotonic() - started)
        if self._wake is not None:
            self._wake.set()  # the next cycle stores it and fills the free slot

    def _store_finished(self) -> None:
        """Store every outcome waiting, in one transaction, then count it and look for changed transcripts."""
        if not self._finished:
            return
        assert self._cur is not None
        outcomes = list(self._finished.values())
        try:
            self.judging.store(self._cur, outcomes)
        except duckdb.Error:
            self.m.failures.inc()
            log.exception("storing the verdicts of %d conversations failed; they are judged again", len(outcomes))
            for o in outcomes:
                self._pending.setdefault(o.job.conversation_id, o.job)
            self._finished.clear()
            return
        self._finished.clear()
        for o in outcomes:
            self._account(o)
        # A transcript that changed while it was judged is judged again once it has ended again:
        # its row was left out of the scans meanwhile, and the scan's mark may have passed it.
        jobs = {o.job.conversation_id: o.job for o in outcomes}
        for cid, revision in self._cur.execute(
                "SELECT conversation_id, revision FROM conversations WHERE state = 'ended' AND "
                "conversation_id IN (SELECT unnest(?::VARCHAR[]))", [list(jobs)]).fetchall():
            job = jobs[cid]
            if revision > job.revision:
                self._pending[cid] = Job(cid, revision, job.probability, job.rule)

    def _account(self, outcome: Outcome) -> None:
        run = outcome.run
        self.m.judged.inc()
        stored = set(outcome.stored)
        for v in run.verdicts:
            if evals.verdict_id(v) in stored:
                self.m.verdicts.inc(result=v.result)
        for n in run.not_run:
            self.m.not_run.inc(reason=n.reason)
        spent = run.usage.input_tokens + run.usage.output_tokens
        self.m.tokens.inc(run.usage.input_tokens, kind="input")
        self.m.tokens.inc(run.usage.output_tokens, kind="output")
        if spent:
            self.sampler.record_tokens(spent)


# --------------------------------------------------------------- backfill (tracejudge eval)


@dataclass
class Backfill:
    """Progress of one ``tracejudge eval`` pass."""

    id: int
    total: int = 0
    done: int = 0
    verdicts: int = 0
    """Verdicts newly stored (criteria already judged on a transcript are not called again)."""
    skipped: int = 0
    """Criterion runs skipped: a verdict on the same transcript was there already."""
    not_run: int = 0
    errors: int = 0
    finished: bool = False
    failure: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def backfill_jobs(cur: duckdb.DuckDBPyConnection, since: dt.datetime | None) -> list[Job]:
    """Sampled, ended conversations (closed at or after ``since``), oldest first."""
    params: list[Any] = []
    where = "c.state = 'ended' AND s.sampled AND s.skipped_reason IS NULL"
    if since is not None:
        where += " AND c.closed_at >= ?"
        params.append(since)
    return [Job(cid, revision, probability, rule) for cid, revision, probability, rule in cur.execute(
        "SELECT c.conversation_id, c.revision, s.probability, s.rule FROM conversations c "
        f"JOIN sampling_decisions s USING (conversation_id) WHERE {where} ORDER BY c.closed_at, "
        "c.conversation_id", params).fetchall()]


async def run_backfill(cur: duckdb.DuckDBPyConnection, judging: Judging, jobs: Sequence[Job], progress: Backfill,
                       *, parallel: int) -> Backfill:
    """Judge ``jobs`` with ``judging``, ``parallel`` conversations at once, updating ``progress`` as each ends.

    The daemon's path without its progress rows: the daemon's own schedule is
    left as it was, and what is stored is stored once all the same.
    """
    progress.total = len(jobs)
    gate = asyncio.Semaphore(parallel)

    async def one(job: Job) -> None:
        async with gate:
            outcome = await judging.run_job(cur, job, progress=False)
        progress.done += 1
        if outcome is not None:
            progress.verdicts += len(outcome.stored)
            progress.skipped += outcome.skipped
            progress.not_run += len(outcome.run.not_run)
            progress.errors += sum(1 for v in outcome.run.verdicts if v.result == "error")

    try:
        await asyncio.gather(*(one(job) for job in jobs))
    except Exception as exc:  # noqa: BLE001 - reported to whoever started the pass
        progress.failure = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        progress.finished = True
    return progress
