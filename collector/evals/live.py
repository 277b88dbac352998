"""Live criteria: judged on open conversations, turn by turn, as well as at the end like any other.

A criterion written ``live: true`` (docs/criteria.md) is judged on the
conversations still open, so that a failure is seen while the user is still
there: a code check at every new assistant message, an LLM criterion once per
turn, once the conversation has had no new data for ``alerts.live_settle`` (a
turn's spans arrive over a moment). Live verdicts are stored with ``live =
true``, apart from the verdict made at the end, which is still made and is the
one counted. Each live fail is handed to ``on_fail`` in the transaction that
stores it: the daemon opens the conversation's live review item and fires its
alert there.

Lifecycle: the ``Evaluator`` makes a ``Live`` when a criterion is live and runs
a pass (``Live.pass_``) every ``POLL`` seconds on its loop once
``Evaluator.go_live`` gives it ``on_fail``; it stops with the evaluator (judge
calls in flight are abandoned, and made again at the next start). Its DuckDB
work goes through the evaluator's (one piece at a time, when ingestion pauses).
A pass:

1. **store** what was judged since the last pass, in one transaction: the live
   verdicts, the ``live_progress`` rows (per conversation and criterion, the
   newest assistant message judged) and, for the fails, ``on_fail``.
2. **look** at the open conversations written since the last look
   (``updated_at``; rows written in the last ``SLACK`` seconds are read again,
   as the evaluator's scan does, and passed over when unchanged), and at those
   whose LLM criteria wait for their turn to settle. Work goes only to
   conversations a live criterion applies to, and only to new turns:

   - sampling: the rules that can be read on an open conversation (``service``,
     ``model``, ``attribute``, ``status``, user turns) give the rate, and the
     conversation's draw (the same as at its end) decides. A rule on
     ``ended_by`` matches no open conversation: the next rule, or the default
     rate, decides it while it is open; at its end it is decided again on all
     of them, for the verdict that counts.
   - the newest assistant message's ``seq`` against ``live_progress``: code
     checks are due at once; LLM criteria once the conversation's last arrival
     is ``settle`` seconds old on the daemon's clock, and while the day's judge
     tokens last (``sampling.budget.judge_tokens_per_day``, which what they
     spend counts against).
3. **judge** the conversations with criteria due, on their transcript as it is
   then, in a task of their own: a slow judge call holds up no later pass.

What was judged is in DuckDB (``live_progress``, written with the verdicts), so
a restart neither judges a turn again nor skips one (a turn judged and not
stored is judged again). A conversation's progress rows go once it is no longer
open (every ``CLEAN_EVERY`` seconds): reopened by a new trace, it is judged
again from its newest answer on.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import duckdb

from judges import Conversation, Criterion, JudgeRun, LLMCriterion, Verdict

from ..conversations.record import conversation_records
from ..metrics import Counter, Histogram, Metrics
from ..store.transactions import Transaction, by_keys, insert_rows
from . import verdicts
from .judging import STORING, Judging, utc
from .sampling import SKIPPED_TOKENS, ConversationFacts, Sampler, unit_hash

T = TypeVar("T")

POLL = 0.5
"""Seconds between two passes: a code check's fail is stored within about this of its turn being written."""
SLACK = 60.0  # rows written this recently are read again: their commit may land after a look
LOOK_AT_ONCE = 500  # conversations read in one look; the rest wait for the next pass
CLEAN_EVERY = 60.0

PROGRESS_SCHEMA = """CREATE TABLE IF NOT EXISTS live_progress (
    conversation_id VARCHAR NOT NULL,
    criterion_id VARCHAR NOT NULL,
    seq INTEGER NOT NULL,
    judged_at TIMESTAMPTZ NOT NULL
)"""
# No key: it holds rows of open conversations only, replaced by deleting them first, in the storing transaction.
PROGRESS_COLUMNS = ("conversation_id", "criterion_id", "seq", "judged_at")

# What a look reads of a conversation: what the sampling rules look at, where its messages are, its last arrival.
_LOOKED = ("conversation_id", "service", "models", "user_turns", "trace_ids", "first_batch", "messages_batch",
           "arrived")
_LOOKED_SQL = ", ".join(_LOOKED[:-1]) + ", epoch(last_arrival_at) AS arrived"

Facts = Callable[[duckdb.DuckDBPyConnection, dict[str, Any]], ConversationFacts]
"""What the sampling rules can look at of a conversation, from its ``conversations`` row."""


class Db(Protocol):
    """Runs a piece of DuckDB work on the evaluator's cursor, in its DuckDB thread, when its turn comes."""

    def __call__(self, work: Callable[[duckdb.DuckDBPyConnection], T]) -> Awaitable[T]: ...


@dataclass(frozen=True)
class LiveFailure:
    """A live fail, handed to ``on_fail`` in the transaction that stores it."""

    verdict_id: str
    verdict: Verdict
    severity: str
    service: str | None
    turn: int
    """User messages in the transcript judged."""


OnLiveFail = Callable[[duckdb.DuckDBPyConnection, list[LiveFailure], dt.datetime], object]


@dataclass
class _Job:
    """An open conversation with live criteria due, read for its judges."""

    conversation: Conversation
    criteria: list[Criterion]
    passed: list[Criterion]
    """Due, and passed over on this turn (the day's judge tokens are spent)."""
    seq: int
    """The newest assistant message in ``conversation``."""
    probability: float
    rule: str
    arrived: float
    """The conversation's last arrival (epoch seconds)."""
    service: str | None


@dataclass
class _Outcome:
    job: _Job
    run: JudgeRun


class LiveMetrics:
    def __init__(self, metrics: Metrics) -> None:
        self.verdicts = Counter("tracejudge_live_verdicts_total", "Live verdicts stored (on open conversations), "
                                "by result.", ("result",))
        self.seconds = Histogram("tracejudge_live_seconds", "Seconds from a turn's last arrival to its live "
                                 "verdicts stored.")
        self.not_run = Counter("tracejudge_live_not_run_total", "Live LLM criteria due on a turn and passed over, "
                               "by reason.", ("reason",))
        for result in ("pass", "fail", "not_applicable", "error"):
            self.verdicts.declare(result=result)
        self.not_run.declare(reason=SKIPPED_TOKENS)
        metrics.add_instruments(self.verdicts, self.seconds, self.not_run)


class Live:
    """Live criteria on open conversations (see the module docstring)."""

    def __init__(self, criteria: Sequence[Criterion], judging: Judging, sampler: Sampler, metrics: Metrics, *,
                 settle: float, tokens: Counter, facts: Facts, spans: bool,
                 clock: Callable[[], float] = time.time) -> None:
        """
        Args:
            criteria: the live ones (LLM ones only when ``judging`` has a provider).
            settle: ``alerts.live_settle``.
            tokens: the evaluator's count of judge tokens spent, by kind.
            facts: what the sampling rules look at; ``spans``: it reads span rows (then only for turns due).
        """
        self.criteria = list(criteria)
        self.judging = judging
        self.sampler = sampler
        self.settle = settle
        self.tokens = tokens
        self.facts = facts
        self.spans = spans
        self.clock = clock
        self.m = LiveMetrics(metrics)
        self.on_fail: OnLiveFail | None = None
        self._mark = 0.0  # epoch seconds: rows written after it are looked at
        self._seen: dict[str, float] = {}  # conversation -> its updated_at last looked at, for rows since the mark
        self._todo: dict[str, None] = {}  # changed conversations not looked at yet, the oldest first
        self._waiting: dict[str, float] = {}  # conversation -> when its LLM criteria are due
        self._in_flight: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._finished: list[_Outcome] = []
        self._cleaned = 0.0
        self._woken = asyncio.Event()

    def held(self) -> dict[str, int]:
        return {"live_seen": len(self._seen), "live_todo": len(self._todo), "live_waiting": len(self._waiting),
                "live_in_flight": len(self._in_flight)}

    async def sleep(self, seconds: float) -> None:
        """Until ``seconds`` have passed or judged conversations wait to be stored."""
        if not self._finished:
            try:
                await asyncio.wait_for(self._woken.wait(), timeout=seconds)
            except asyncio.TimeoutError:
                pass
        self._woken.clear()

    def cancel(self) -> list[asyncio.Task[None]]:
        """Abandon the judge calls in flight (their turns are judged again at the next start); the tasks."""
        for task in self._tasks:
            task.cancel()
        return list(self._tasks)

    async def pass_(self, db: Db) -> None:
        """Store what was judged, look for turns due, and start judging them."""
        if self._finished:
            outcomes, self._finished = self._finished, []
            await db(lambda cur: self.store(cur, outcomes))
        jobs = await db(self.look)
        if jobs:
            self._in_flight.update(j.conversation.id for j in jobs)
            task = asyncio.ensure_future(self._judge_all(jobs))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------ look

    def look(self, cur: duckdb.DuckDBPyConnection) -> list[_Job]:
        """In the DuckDB thread: the open conversations with live criteria due now, read for their judges."""
        now = self.clock()
        if now - self._cleaned >= CLEAN_EVERY:
            self._clean(cur)
            self._cleaned = now
        self._changed(cur, now)
        due = [cid for cid, at in self._waiting.items() if at <= now]
        ids = [cid for cid in dict.fromkeys([*due, *self._todo]) if cid not in self._in_flight][:LOOK_AT_ONCE]
        for cid in ids:
            self._todo.pop(cid, None)
            self._waiting.pop(cid, None)
        rows = [dict(zip(_LOOKED, r)) for r in by_keys(
            cur, f"SELECT {_LOOKED_SQL} FROM live_conversations WHERE state = 'open' AND content_captured "
            "AND conversation_id IN {keys}", ids)]
        # Sampling before reading messages, unless the rules read span rows: then only for the turns due.
        sampling = {r["conversation_id"]: self._sampling(cur, r) for r in rows if not self.spans}
        rows = [r for r in rows if self.spans or sampling[r["conversation_id"]] is not None]
        newest = self._newest_answers(cur, rows)
        judged = self._progress(cur, list(newest))
        due_now: dict[str, tuple[dict[str, Any], list[Criterion]]] = {}
        for r in rows:
            cid = r["conversation_id"]
            if cid not in newest:
                continue
            new = [c for c in self.criteria if judged.get((cid, c.id), -1) < newest[cid]]
            settled = float(r["arrived"] or 0) + self.settle
            if now < settled and any(isinstance(c, LLMCriterion) for c in new):
                self._waiting[cid] = settled  # looked at again then, whatever comes meanwhile
                new = [c for c in new if not isinstance(c, LLMCriterion)]
            if new and self.spans:
                sampling[cid] = self._sampling(cur, r)
            if new and sampling[cid] is not None:
                due_now[cid] = (r, new)
        records = conversation_records(cur, list(due_now))
        jobs = []
        for cid, (r, new) in due_now.items():
            if cid not in records:
                continue
            conversation = Conversation.model_validate(records[cid])
            answers = [i for i, m in enumerate(conversation.messages) if m.role == "assistant"]
            if not answers:  # rewritten since its messages were read
                continue
            kept = self._within_budget(new)
            probability, rule = sampling[cid] or (1.0, "default")
            jobs.append(_Job(conversation, kept, [c for c in new if c not in kept], answers[-1], probability, rule,
                             float(r["arrived"] or now), r["service"]))
        return jobs

    def _changed(self, cur: duckdb.DuckDBPyConnection, now: float) -> None:
        """Queue the open conversations written since the mark that were not looked at as they are now."""
        rows = cur.execute("SELECT conversation_id, epoch(updated_at) FROM live_conversations WHERE state = 'open' "
                           "AND updated_at > ?", [utc(self._mark)]).fetchall()
        for cid, at in rows:
            if self._seen.get(cid) != at:
                self._seen[cid] = at
                self._todo[cid] = None
        newest = max((at for _, at in rows), default=self._mark)
        # The mark trails by SLACK, and never passes what was read (the writer's clock may be another).
        self._mark = max(self._mark, min(now - SLACK, newest))
        self._seen = {cid: at for cid, at in self._seen.items() if at > self._mark}

    def _sampling(self, cur: duckdb.DuckDBPyConnection, row: dict[str, Any]) -> tuple[float, str] | None:
        """(probability, rule) when live criteria apply to the open conversation, else None."""
        facts = self.facts(cur, {**row, "ended_by": None})
        rule, rate = self.sampler.rule_for(facts)
        return (rate, rule) if unit_hash(facts.conversation_id, self.sampler.settings.seed) < rate else None

    def _newest_answers(self, cur: duckdb.DuckDBPyConnection, rows: list[dict[str, Any]]) -> dict[str, int]:
        """The ``seq`` of each conversation's newest assistant message (none: no answer yet)."""
        if not rows:
            return {}
        # A transcript's rows are written whole, with its messages_batch: DuckDB skips the row groups before.
        batches = [r["messages_batch"] for r in rows]
        low = 0 if None in batches else min(batches)
        return dict(cur.execute(
            "SELECT conversation_id, max(seq) FROM messages WHERE (first_batch >= ? OR first_batch IS NULL) "
            "AND role = 'assistant' AND conversation_id IN (SELECT unnest(?::VARCHAR[])) GROUP BY ALL",
            [low, [r["conversation_id"] for r in rows]]).fetchall())

    def _progress(self, cur: duckdb.DuckDBPyConnection, ids: list[str]) -> dict[tuple[str, str], int]:
        """The newest assistant message judged, per (conversation, criterion)."""
        if not ids:
            return {}
        return {(cid, crit): seq for cid, crit, seq in cur.execute(
            "SELECT conversation_id, criterion_id, seq FROM live_progress WHERE conversation_id IN "
            "(SELECT unnest(?::VARCHAR[]))", [ids]).fetchall()}

    def _within_budget(self, criteria: list[Criterion]) -> list[Criterion]:
        """``criteria`` without the LLM ones once the day's judge tokens are spent (counted as passed over)."""
        limit = self.sampler.settings.budget.judge_tokens_per_day
        if limit is None or self.sampler.usage().judge_tokens_today < limit:
            return criteria
        kept: list[Criterion] = [c for c in criteria if not isinstance(c, LLMCriterion)]
        if len(kept) < len(criteria):
            self.m.not_run.inc(len(criteria) - len(kept), reason=SKIPPED_TOKENS)
        return kept

    def _clean(self, cur: duckdb.DuckDBPyConnection) -> None:
        """Progress rows of conversations no longer open go."""
        cur.execute("DELETE FROM live_progress WHERE conversation_id NOT IN "
                    "(SELECT conversation_id FROM live_conversations WHERE state = 'open')")

    # ------------------------------------------------------------ judge and store

    async def _judge_all(self, jobs: list[_Job]) -> None:
        try:
            runs = await asyncio.gather(*(self.judging.judge(j.conversation, j.criteria) for j in jobs))
        finally:
            self._in_flight.difference_update(j.conversation.id for j in jobs)
        self._finished += [_Outcome(j, run) for j, run in zip(jobs, runs)]
        self._woken.set()

    def store(self, cur: duckdb.DuckDBPyConnection, outcomes: list[_Outcome]) -> None:
        """In the DuckDB thread: the live verdicts, progress rows and fails of ``outcomes``, in one transaction."""
        assert self.on_fail is not None, "Evaluator.go_live gives it on_fail"
        now = utc(self.clock())
        failures: list[LiveFailure] = []
        severity = {c.id: c.severity for c in self.criteria}
        with STORING, Transaction(cur):
            for o in outcomes:
                job = o.job
                stored = set(verdicts.store_verdicts(
                    cur, o.run.verdicts, probability=job.probability, rule=job.rule, now=now,
                    current={v.conversation_id: v.transcript_sha256 for v in o.run.verdicts}, live=True))
                failures += [LiveFailure(vid, v, severity[v.criterion_id], job.service, job.conversation.user_turns)
                             for v in o.run.verdicts if (vid := verdicts.verdict_id(v, live=True)) in stored
                             and v.result == "fail"]
            progress = [(o.job.conversation.id, c.id, o.job.seq, now) for o in outcomes
                        for c in (*o.job.criteria, *o.job.passed)]
            cur.execute("DELETE FROM live_progress WHERE list_contains(?, conversation_id || chr(31) || criterion_id)",
                        [[f"{cid}\x1f{crit}" for cid, crit, _, _ in progress]])
            insert_rows(cur, "INSERT INTO live_progress", PROGRESS_COLUMNS, progress)
            if failures:
                self.on_fail(cur, failures, now)
        for o in outcomes:  # the verdicts counted last: whoever waits for them finds the rest done
            usage = o.run.usage
            self.tokens.inc(usage.input_tokens, kind="input")
            self.tokens.inc(usage.output_tokens, kind="output")
            if usage.input_tokens + usage.output_tokens:
                self.sampler.record_tokens(usage.input_tokens + usage.output_tokens)
            if o.run.verdicts:
                self.m.seconds.observe(max(0.0, self.clock() - o.job.arrived))
            for v in o.run.verdicts:
                self.m.verdicts.inc(result=v.result)


def ensure_schema(cur: duckdb.DuckDBPyConnection) -> None:
    """The ``live_progress`` table."""
    cur.execute(PROGRESS_SCHEMA)
