"""Judging one conversation on the configured criteria, and storing what that produced.

``Judging`` reads a conversation as the judges see it (its conversation/v1
record), leaves out criteria that already have a verdict on that transcript,
runs the rest (``judges.arun_judges``; judge calls share one concurrency limit)
and stores verdicts, not-run records and progress rows in one transaction. Who
is told of the verdicts stored (the review queue, in the daemon) is given as
``on_stored``. The daemon's evaluator and ``tracejudge eval`` share it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import duckdb

from judges import (
    Backoff,
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

from ..conversations.record import conversation_records
from ..errors import UserError
from ..store.schema import drop_primary_key
from ..store.transactions import Transaction, insert_rows
from . import simulations, verdicts

# One row per judged conversation, replaced at each judgement. No key, for the reason and on the terms
# of the evals tables (``verdicts.UNKEYED``): only ``store`` writes it, deleting the rows it replaces.
PROGRESS_SCHEMA = """CREATE TABLE IF NOT EXISTS {name} (
    conversation_id VARCHAR NOT NULL,
    revision INTEGER NOT NULL,
    judged_at TIMESTAMPTZ NOT NULL,
    errors INTEGER NOT NULL,
    attempts INTEGER NOT NULL,
    retry_at TIMESTAMPTZ
)"""
PROGRESS_COLUMNS = ("conversation_id", "revision", "judged_at", "errors", "attempts", "retry_at")

# An ended conversation the evaluator has still to decide, judge at its current revision, or retry
# (aliases: c conversations, s sampling_decisions, p eval_progress). The scan queues the first two;
# retention keeps all three.
JUDGEMENT_DUE = ("(s.conversation_id IS NULL OR (s.sampled AND s.skipped_reason IS NULL "
                 "AND (p.revision IS NULL OR p.revision < c.revision)))")
RETRY_DUE = "(p.retry_at IS NOT NULL AND p.revision = c.revision)"

# The evals tables have no key (``verdicts.UNKEYED``): a store writes each row once by reading first, in
# its transaction. The evaluator and a ``tracejudge eval`` pass store on two cursors of one daemon, so
# their stores take turns: each begins after the other has committed, and sees what it wrote.
STORING = threading.Lock()

RETRIES = 3
"""How many times a conversation's judge errors are judged again."""
RETRY = Backoff(60.0, 3600.0, factor=10.0)
"""The wait before each: a minute, 10 minutes, an hour. No jitter: the evaluator's concurrency already paces them."""
_UTC = dt.timezone.utc

OnStored = Callable[[duckdb.DuckDBPyConnection, list[str], dt.datetime], object]
"""Told, in the storing transaction, the ids of the verdicts just stored and the time."""


def utc(seconds: float) -> dt.datetime:
    """Epoch seconds as an aware UTC datetime."""
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
    simulated: bool = False
    """A simulated conversation (``simulations``): read from there, its verdicts kept there, and its fails open
    no review item."""

    @classmethod
    def simulation(cls, conversation_id: str) -> "Job":
        return cls(conversation_id, 0, 1.0, simulations.RULE, simulated=True)


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
                 timeout: float, on_stored: OnStored | None = None, no_provider: str | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.criteria = list(criteria)
        self.no_provider = no_provider
        self.concurrency = concurrency
        self._raw_provider = provider
        self.provider: Provider | None = None
        self.timeout = timeout
        self.on_stored = on_stored
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
                        timeout=self.timeout, on_stored=self.on_stored, no_provider=self.no_provider,
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
        return self.prepare_many(cur, [job])[0]

    def prepare_many(self, cur: duckdb.DuckDBPyConnection, jobs: Sequence[Job]) -> list[Prepared | None]:
        """``prepare`` of several jobs in three reads, whatever their number (the evaluator's reads of its
        conversations are what its DuckDB thread spends its time on under load); None for one not stored."""
        # Keyed by (simulated, id): a simulated id is not production's (``simulations``).
        production = conversation_records(cur, [j.conversation_id for j in jobs if not j.simulated])
        records: dict[tuple[bool, str], dict[str, Any]] = {}
        for job in jobs:
            record = (simulations.simulated_record(cur, job.conversation_id) if job.simulated
                      else production.get(job.conversation_id))
            if record is None:
                continue
            if not job.simulated:
                record["sampling"] = {"probability": job.probability, "rule": job.rule}
            records[job.simulated, job.conversation_id] = record
        conversations = {key: Conversation.model_validate(r) for key, r in records.items()}
        shas = {key: transcript_sha256(c.messages) for key, c in conversations.items()}
        found: dict[tuple[bool, str], list[tuple[str, int, str | None, str]]] = {}
        for simulated in (False, True):
            mine = {cid: sha for (sim, cid), sha in shas.items() if sim == simulated}
            if not mine:
                continue
            for cid, criterion, version, model, result in cur.execute(
                    "SELECT v.conversation_id, criterion_id, criterion_version, judge_model, result "
                    f"FROM {verdicts.verdicts_table(simulated)} v JOIN (SELECT unnest(?::VARCHAR[]) AS "
                    "conversation_id, unnest(?::VARCHAR[]) AS transcript_sha256) USING (conversation_id, "
                    "transcript_sha256) WHERE NOT v.live",  # a live verdict stands in for no end verdict
                    [list(mine), list(mine.values())]).fetchall():
                found.setdefault((simulated, cid), []).append((criterion, version, model, result))
        out: list[Prepared | None] = []
        for job in jobs:
            which = (job.simulated, job.conversation_id)
            conversation = conversations.get(which)
            if conversation is None:
                out.append(None)
                continue
            rows = found.get(which, [])
            done = {(c, v, m) for c, v, m, result in rows if result != "error"}
            errored = {(c, v, m) for c, v, m, result in rows if result == "error"}
            todo = []
            for c in self.criteria:
                key = (c.id, c.version, self._judge_model(c))
                if key in done or (job.only_errors and key not in errored):
                    continue
                todo.append(c)
            out.append(Prepared(conversation, todo, shas[which], len(self.criteria) - len(todo)))
        return out

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
        """Store verdicts, not-run records and progress rows of several conversations in one transaction.

        A few statements for all of them, not a few for each: under load the evaluator stores what
        twenty or more conversations produced at once, and the DuckDB thread was busy storing them
        one by one (three quarters of its time in bench/online.py) while judge calls waited to start.
        """
        now = utc(self.clock())
        with STORING, Transaction(cur):
            groups: dict[tuple[bool, float, str | None], list[Outcome]] = defaultdict(list)
            for o in outcomes:
                groups[(o.job.simulated, o.job.probability, o.job.rule)].append(o)
            for (simulated, probability, rule), group in groups.items():
                owner = {verdicts.verdict_id(v): o for o in group for v in o.run.verdicts}
                stored = verdicts.store_verdicts(cur, [v for o in group for v in o.run.verdicts],
                                                 probability=probability, rule=rule, now=now,
                                                 current={o.job.conversation_id: o.sha256 for o in group},
                                                 simulated=simulated)
                for o in group:
                    o.stored = [vid for vid in stored if owner[vid] is o]
            real = [o for o in outcomes if not o.job.simulated]  # reviewers and the schedule are production's
            if self.on_stored is not None:
                self.on_stored(cur, [vid for o in real for vid in o.stored], now)
            for simulated in (False, True):
                verdicts.store_not_run(cur, [n for o in outcomes if o.job.simulated == simulated
                                             for n in o.run.not_run], now=now, simulated=simulated)
            if progress:
                rows = {o.job.conversation_id: self._progress(o, now) for o in real}  # the last one stands
                cur.execute("DELETE FROM eval_progress WHERE conversation_id IN (SELECT unnest(?::VARCHAR[]))",
                            [list(rows)])
                insert_rows(cur, "INSERT INTO eval_progress", PROGRESS_COLUMNS, list(rows.values()))

    def _progress(self, o: Outcome, now: dt.datetime) -> tuple[Any, ...]:
        errors = sum(1 for v in o.run.verdicts if v.result == "error")
        retry = utc(self.clock() + RETRY.delay(o.attempts)) if errors and o.attempts <= RETRIES else None
        return (o.job.conversation_id, o.job.revision, now, errors, o.attempts, retry)

    async def run_job(self, cur: duckdb.DuckDBPyConnection, job: Job, *, progress: bool = True) -> Outcome | None:
        """Judge one conversation and store the outcome; None when the conversation is gone."""
        p = self.prepare(cur, job)
        if p is None:
            return None
        outcome = Outcome(job, await self.judge(p.conversation, p.todo), p.sha256, p.skipped)
        self.store(cur, [outcome], progress=progress)
        return outcome


def ensure_schema(cur: duckdb.DuckDBPyConnection) -> None:
    """The tables of the evals stage: verdicts and the rest (``verdicts``), and the progress rows."""
    verdicts.ensure_schema(cur)
    simulations.ensure_schema(cur)
    cur.execute(PROGRESS_SCHEMA.format(name="eval_progress"))
    drop_primary_key(cur, "eval_progress", PROGRESS_SCHEMA.format(name="eval_progress_unkeyed"),
                     "its index grew with what is kept")
