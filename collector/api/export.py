"""Stored conversations as conversation/v1 JSON lines, a page at a time: what ``tracejudge replay export`` reads.

The daemon's ``GET /api/export/conversations`` and the file client (no daemon)
both read through a ``Walk``, so the two give the same lines. A walk reads one
snapshot (a read transaction held for the walk: DuckDB still checkpoints
meanwhile), so every conversation the filter selected when it began is
written exactly once, however the store changes while it goes. Nothing holds
more than a page, however many conversations are exported.

Two ways through, chosen by how many conversations the filter selects:

- **By storage position** (a large export). The ``messages`` rows of a
  conversation are written together, in order, whenever it is rebuilt
  (``conversations.duck.DuckData.write``), so a window of rows by ``rowid`` holds whole
  conversations, the last one perhaps cut (it waits for the next window).
  The window's conversations rows are read in one query. Conversations are
  written in the order they were last stored, then those without messages.
  Each window is a range read: the cost of the export grows with what it
  writes, not with pages times the table, as reading a page's messages by id
  would (``messages`` is not in id order: one scan of it per page).
- **By id** (a filter that selects few): keyset pages of ``PAGE``
  conversations in id order, each page's messages found by id.

A conversation whose messages are not together after all (no writer does
that today) is still written once: from the window that holds its first
message, with its messages read by id.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import duckdb
import orjson

from judges import escape_line_breaks

from ..conversations.record import (STORED_COLUMNS, message_select, stored_conversation, stored_message,
                                    stored_record, stored_select, stored_transcripts)
from ..store.transactions import one

PAGE = 2000
"""Conversations per page of a walk by id. Finding a page's messages by id scans the ``messages`` table,
about 85 ms for 8 million messages, so a page must not be small; its records take about 16 MB of memory a
thousand, so it must not be large either."""

BY_ID_MAX = 10 * PAGE
"""A filter that selects at most this many conversations is walked by id (at most ten scans of
``messages``); more, by storage position."""

WINDOW = 65536
"""``messages`` rows per page of a walk by storage position (about 8,000 conversations of 8 messages). Each
page reads its conversations rows in one query that scans the ``conversations`` table's ids, so a page must
not be small; its messages are read as a stream, and its lines take about 2 KB a conversation."""

FILE_MEMORY_LIMIT = "64MB"
"""DuckDB's ``memory_limit`` for an export read from the file (no daemon): a walk reads each block once, so
nothing gains from keeping it, and the export's memory stays flat however large the file (with a page, and
the process's own 90 MB, under 300 MB)."""

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
_FAILED = ("SELECT conversation_id FROM verdicts WHERE criterion_id = ? AND NOT superseded AND NOT live "
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
    row = one(cur.execute(f"SELECT count(*) FROM conversations c {where}", params))
    return int(row[0]) if row else 0


class Walk:
    """One export's read of the store, a page at a time (see the module docstring).

    It opens a read transaction on ``cur`` and holds it until ``close``; ``cur`` must be a cursor of its
    own, used for nothing else meanwhile.
    """

    def __init__(self, cur: duckdb.DuckDBPyConnection, f: ExportFilter, *, evals: bool = True,
                 size: int = PAGE, window: int | None = None, by_id_max: int | None = None) -> None:
        """
        Args:
            f: which conversations.
            evals: the file has the evals tables (``sampling_decisions``, ``verdicts``); without them
                nothing was sampled or judged.
            size, window, by_id_max: ``PAGE``, ``WINDOW``, ``BY_ID_MAX`` by default.
        """
        self.cur, self.f, self.evals, self.size = cur, f, evals, size
        self.window = WINDOW if window is None else window
        by_id_max = BY_ID_MAX if by_id_max is None else by_id_max
        cur.execute("BEGIN TRANSACTION")
        self.total = count(cur, f, evals=evals)
        """The conversations the filter selects: exactly what the walk writes."""
        self.written = 0
        row = one(cur.execute("SELECT max(rowid) FROM messages"))
        self._end = 0 if row is None or row[0] is None else int(row[0]) + 1
        self._pos = 0  # the next window's first rowid
        self._after: str | None = None  # the last id of the page before, by id
        self._by_id = self.total <= by_id_max or (_needs_evals(f) and not evals)
        self._empty_only = False  # by storage position, past the last window: conversations without messages
        self._done = self.total == 0

    def page(self) -> list[bytes] | None:
        """The next page's lines (perhaps none, when a window held no selected conversation), or None once
        every conversation selected is written.

        Raises:
            RuntimeError: the walk wrote fewer conversations than it selected (a store that breaks the
                rules above), rather than end as if whole.
        """
        if self._done:
            return None
        if self._by_id or self._empty_only:
            lines, self._after = self._by_id_page()
            self._done = self._after is None
        else:
            lines = self._window()
            self._empty_only = self._pos >= self._end
        self.written += len(lines)
        if self._done and self.written != self.total:
            raise RuntimeError(f"the export selected {self.total} conversations but found {self.written}")
        return lines

    def close(self) -> None:
        """Ends the read transaction (the cursor stays open)."""
        try:
            self.cur.execute("ROLLBACK")
        except duckdb.Error:
            pass  # no transaction left to end: the cursor failed or was closed

    def __iter__(self) -> Iterator[bytes]:
        """Every line, then ``close``."""
        try:
            while (lines := self.page()) is not None:
                yield from lines
        finally:
            self.close()

    def _select(self, where: str, tail: str = "") -> str:
        # The conversations rows of a page (times as text) and, for those picked, their sampling decision.
        sql = f"SELECT {stored_select('c.', text_times=True)}, c.message_count FROM conversations c {where} {tail}"
        if self.evals:
            sql = (f"SELECT p.*, s.probability, s.rule FROM ({sql}) p LEFT JOIN sampling_decisions s "
                   f"ON s.conversation_id = p.conversation_id AND {_PICKED.format(a='s.')}")
        return sql + (" ORDER BY p.conversation_id" if tail and self.evals else "")

    def _line(self, row: tuple[Any, ...], messages: list[Any]) -> bytes:
        sampling = None
        if self.evals and row[_N + 1] is not None:
            sampling = {"probability": row[_N + 1], "rule": row[_N + 2] or ""}
        transcript, facts = stored_conversation(row, messages)
        return escape_line_breaks(orjson.dumps(stored_record(row[0], transcript, facts, sampling=sampling))) + b"\n"

    def _by_id_page(self) -> tuple[list[bytes], str | None]:
        where, params = _where(self.f, self._after)
        if self._empty_only:
            where = (where + " AND " if where else "WHERE ") + "coalesce(c.message_count, 0) = 0"
        sql = self._select(where, "ORDER BY c.conversation_id LIMIT ?")
        rows = self.cur.execute(sql, [*params, self.size]).fetchall()
        found = stored_transcripts(self.cur, rows, text_times=True) if not self._empty_only else []
        messages = {cid: transcript.messages for cid, transcript, _ in found}
        lines = [self._line(row, list(messages.get(row[0], ()))) for row in rows]
        return lines, (rows[-1][0] if len(rows) == self.size else None)

    def _window(self) -> list[bytes]:
        lo = self._pos
        hi = self._pos = min(lo + self.window, self._end)
        where, params = _where(self.f, None)
        within = "c.conversation_id IN (SELECT conversation_id FROM messages WHERE rowid >= ? AND rowid < ?)"
        sql = self._select((where + " AND " if where else "WHERE ") + within)
        convs = {row[0]: row for row in self.cur.execute(sql, [*params, lo, hi]).fetchall()}
        if not convs:
            return []
        lines: list[bytes] = []
        apart: list[tuple[Any, ...]] = []  # conversations whose messages are not together: read by id after
        run: list[tuple[Any, ...]] = []  # the messages of one conversation, as they come

        def done(run: list[tuple[Any, ...]]) -> None:
            row = convs.get(run[0][2])
            if row is None:
                return  # not selected
            n = row[_N] or 0
            if len(run) == n and run[0][1] == 0 and run[-1][1] == n - 1:
                lines.append(self._line(row, [stored_message(m[2:], True) for m in run]))
            elif any(m[1] == 0 for m in run):  # each conversation has one first message: written once
                apart.append(row)

        # The messages are read as a stream, a vector at a time: the window's rows are never all in memory.
        self.cur.execute(f"SELECT rowid, seq, {message_select(text_times=True)} FROM messages "
                         "WHERE rowid >= ? AND rowid < ? ORDER BY rowid", [lo, hi])
        while chunk := self.cur.fetchmany(2048):
            for m in chunk:
                if run and m[2] != run[0][2]:
                    done(run)
                    run = []
                run.append(m)
        if run:
            row = convs.get(run[0][2])
            missing = (row[_N] or 0) - len(run) if row is not None else 0
            if missing > 0 and run[0][1] == 0 and hi < self._end:
                # Cut by the window's end: the rest of its messages come next; they belong to this window.
                more = self.cur.execute(
                    f"SELECT rowid, seq, {message_select(text_times=True)} FROM messages "
                    "WHERE rowid >= ? AND rowid < ? AND conversation_id = ? ORDER BY rowid",
                    [hi, hi + missing, run[0][2]]).fetchall()
                if len(more) == missing and more[-1][0] == hi + missing - 1:
                    run += more
                    self._pos = hi + missing
            done(run)
        for row in apart:
            found = stored_transcripts(self.cur, [row], text_times=True)
            lines.append(self._line(row, list(found[0][1].messages)))
        return lines


def lines(cur: duckdb.DuckDBPyConnection, f: ExportFilter, **walk: Any) -> Iterator[bytes]:
    """Every conversation ``f`` selects as a JSON line, a page at a time (a ``Walk`` on ``cur``)."""
    yield from Walk(cur, f, **walk)


_N = len(STORED_COLUMNS)
