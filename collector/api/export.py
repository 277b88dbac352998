"""Stored conversations as conversation/v1 JSON lines, a page at a time: what ``tracejudge replay export`` reads.

The daemon's ``GET /api/export/conversations`` and the file client (no daemon)
both read through ``page``, so the two give the same lines. A page is a keyset
page: the next ``size`` conversations after the last id, ordered by
``conversation_id``, read with one query for their ``conversations`` rows (and
sampling decisions) and one for their messages (``stored_transcripts``), and
each record is built by the one builder (``stored_record``). Nothing holds more
than a page, however many conversations are exported, and each page is a short
read of its own, never a transaction held open for the whole export.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import duckdb
import orjson

from ..conversations.record import STORED_COLUMNS, stored_record, stored_select, stored_transcripts

PAGE = 2000
"""Conversations per page. Finding a page's messages scans the ``messages`` table (its rows are in the
order they were written, not by conversation), about 85 ms for 8 million messages, so a page must not be
small; its records take about 16 MB of memory a thousand, so it must not be large either."""

FILE_MEMORY_LIMIT = "128MB"
"""DuckDB's ``memory_limit`` for an export read from the file (no daemon): the blocks each page reads are
let go past it, so the export's memory stays flat however large the file (with a page, and the process's
own 130 MB, under 300 MB)."""

TOTAL_HEADER = "X-Tracejudge-Total"
"""The header of ``GET /api/export/conversations`` saying how many conversations the filter selected."""


@dataclass(frozen=True)
class ExportFilter:
    """Which stored conversations an export writes; every one given must hold."""

    since: dt.datetime | None = None
    """Only conversations with data arrived at or after this time (``last_arrival_at``, the daemon's clock)."""
    state: str | None = None
    """``open`` or ``ended``."""
    sampled_only: bool = False
    """Only conversations the sampler picked for judging (not those a budget stopped)."""
    criterion_failed: str | None = None
    """Only conversations whose current verdict on this criterion is ``fail``: the verdict ``stats`` counts
    (on the current transcript, the newest criterion version)."""


@dataclass
class Export:
    """An export under way: how many conversations it should write, and their lines as they come."""

    total: int
    """The conversations the filter selected when the export started (more may arrive meanwhile)."""
    lines: Iterable[bytes]
    """The conversation/v1 records, one JSON line each, ending in a newline."""
    close: Callable[[], None] = lambda: None
    """Lets go of what the export holds (the daemon's answer), whether its lines were read or not."""


# The picked conversations: the sampler chose them and no budget stopped them (as ``stats`` counts them).
_PICKED = "{a}sampled AND {a}skipped_reason IS NULL"
# The current verdict per conversation on one criterion, as ``review.stats`` counts it: on the current
# transcript, the newest criterion version, the newest verdict (an aggregate, which spills to disk when it
# must, where a window would not).
_FAILED = ("SELECT conversation_id FROM verdicts WHERE criterion_id = ? AND NOT superseded "
           "GROUP BY conversation_id HAVING arg_max(result, (criterion_version, seq)) = 'fail'")


def _where(f: ExportFilter, after: str | None) -> tuple[str, list[Any]]:
    where: list[str] = []
    params: list[Any] = []
    if after is not None:
        where.append("c.conversation_id > ?")
        params.append(after)
    if f.since is not None:
        where.append("c.last_arrival_at >= ?")
        params.append(f.since)
    if f.state:
        where.append("c.state = ?")
        params.append(f.state)
    if f.sampled_only:
        where.append(f"c.conversation_id IN (SELECT conversation_id FROM sampling_decisions "
                     f"WHERE {_PICKED.format(a='')})")
    if f.criterion_failed:
        where.append(f"c.conversation_id IN ({_FAILED})")
        params.append(f.criterion_failed)
    return ("WHERE " + " AND ".join(where)) if where else "", params


def _needs_evals(f: ExportFilter) -> bool:
    return f.sampled_only or f.criterion_failed is not None


def count(cur: duckdb.DuckDBPyConnection, f: ExportFilter, *, evals: bool = True) -> int:
    """How many conversations ``f`` selects now (for a progress bar: more may arrive meanwhile).

    Args:
        evals: the file has the evals tables (``sampling_decisions``, ``verdicts``); without them
            nothing was sampled or judged.
    """
    if _needs_evals(f) and not evals:
        return 0
    where, params = _where(f, None)
    row = cur.execute(f"SELECT count(*) FROM conversations c {where}", params).fetchone()
    return int(row[0]) if row else 0


def page(cur: duckdb.DuckDBPyConnection, f: ExportFilter, after: str | None, *, size: int = PAGE,
         evals: bool = True) -> tuple[list[bytes], str | None]:
    """The next page of an export.

    Args:
        f: which conversations.
        after: the last conversation id of the page before; None for the first page.
        size: conversations per page.
        evals: as for ``count``.

    Returns:
        The page's conversation/v1 records, each a JSON line ending in a newline, in
        ``conversation_id`` order, and the id to pass as ``after`` for the next page
        (None when this was the last).
    """
    if _needs_evals(f) and not evals:
        return [], None
    where, params = _where(f, after)
    sql = f"SELECT {stored_select('c.')} FROM conversations c {where} ORDER BY c.conversation_id LIMIT ?"
    if evals:  # the sampling decision of each conversation picked, for the record's ``sampling``
        sql = (f"SELECT p.*, s.probability, s.rule FROM ({sql}) p LEFT JOIN sampling_decisions s "
               f"ON s.conversation_id = p.conversation_id AND {_PICKED.format(a='s.')} "
               "ORDER BY p.conversation_id")
    rows = cur.execute(sql, [*params, size]).fetchall()
    lines = []
    for (cid, transcript, facts), row in zip(stored_transcripts(cur, rows, text_times=True), rows):
        sampling = None
        if evals and row[_N] is not None:
            sampling = {"probability": row[_N], "rule": row[_N + 1] or ""}
        lines.append(orjson.dumps(stored_record(cid, transcript, facts, sampling=sampling)) + b"\n")
    return lines, (rows[-1][0] if len(rows) == size else None)


def lines(cur: duckdb.DuckDBPyConnection, f: ExportFilter, *, size: int = PAGE,
          evals: bool = True) -> Iterator[bytes]:
    """Every conversation ``f`` selects as a JSON line, a page at a time (see ``page``)."""
    after: str | None = None
    while True:
        chunk, after = page(cur, f, after, size=size, evals=evals)
        yield from chunk
        if after is None:
            return


_N = len(STORED_COLUMNS)
