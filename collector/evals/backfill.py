"""``tracejudge eval``: judge stored conversations (a new criterion, a provider that came late).

A pass judges sampled, ended conversations (or, with ``--source simulation``,
the stored simulated ones) on the criteria that have no verdict on their
current transcript yet, with the daemon's ``Judging``,
updating a ``Backfill`` as each conversation ends, inside the daemon when one
runs (``Evaluator.start_backfill``) or on the file.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import duckdb

from .judging import Job, Judging
from .simulations import simulation_ids


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


def backfill_jobs(cur: duckdb.DuckDBPyConnection, since: dt.datetime | None, *,
                  simulated: bool = False) -> list[Job]:
    """Sampled, ended conversations (closed at or after ``since``), oldest first; or with ``simulated``
    the stored simulated conversations (imported at or after ``since``)."""
    if simulated:
        return [Job.simulation(cid) for cid in simulation_ids(cur, since)]
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
