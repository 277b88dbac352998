"""Writing to DuckDB from any stage: one way to open a transaction, one way to insert many rows.

``Transaction`` is BEGIN ... COMMIT (ROLLBACK when the block raises); opened inside
another on the same cursor it is part of that one, so a caller that stores several
things at once wraps them all in one commit. ``registered`` hands DuckDB an Arrow
table (``collector.store.arrow``) for one bulk statement: row-by-row inserts cost
DuckDB about 1.5 ms a row, an Arrow insert microseconds.

The Arrow builder is imported where a table is built, not with this module: the
conversation stage's process writes through a cursor whose statements the daemon
runs, hands its rows over with ``registered_rows``, and so never loads it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import duckdb

from ..ingest.batches import LogBatch, SpanBatch

if TYPE_CHECKING:
    from .arrow import Table


@dataclass
class Committed:
    """What one transaction of the writer stored; handed to commit listeners."""

    batch_id: int
    received_at: float
    spans: SpanBatch
    logs: LogBatch
    spans_stored: int
    logs_stored: int


class Transaction:
    """BEGIN ... COMMIT, or ROLLBACK when the block raises; inside another on the same cursor, part of it."""

    _open: set[int] = set()  # ids of cursors with a transaction open

    def __init__(self, cur: duckdb.DuckDBPyConnection) -> None:
        self.cur = cur
        self.outer = False

    def __enter__(self) -> duckdb.DuckDBPyConnection:
        if id(self.cur) not in Transaction._open:
            self.cur.execute("BEGIN TRANSACTION")
            Transaction._open.add(id(self.cur))
            self.outer = True
        return self.cur

    @staticmethod
    def is_open(cur: duckdb.DuckDBPyConnection) -> bool:
        """Whether a ``Transaction`` is open on this cursor."""
        return id(cur) in Transaction._open

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if not self.outer:
            return
        Transaction._open.discard(id(self.cur))
        if kind is None:
            self.cur.execute("COMMIT")
            return
        try:
            self.cur.execute("ROLLBACK")
        except duckdb.Error:
            pass  # a database DuckDB invalidated cannot roll back: the error that got us here is the news


KEYS_PER_LOOKUP = 2048
"""Keys in one IN list of ``by_keys``: DuckDB answers a list up to its ``index_scan_max_count`` (2048)
from the primary key's index."""


def by_keys(cur: Any, sql: str, keys: Sequence[Any]) -> list[tuple[Any, ...]]:
    """The rows of ``sql`` for these primary keys: its ``{keys}`` becomes an IN list of them, a chunk at a time.

    A list of parameters is looked up in the key's index, at the same cost at any table size.
    ``IN (SELECT unnest(?))`` is a join instead, which reads the whole column: on the trace map that
    grew from 4 to 12 ms a read in five minutes of a soak, and without retention it grows for ever.
    """
    out: list[tuple[Any, ...]] = []
    for i in range(0, len(keys), KEYS_PER_LOOKUP):
        chunk = list(keys[i:i + KEYS_PER_LOOKUP])
        out += cur.execute(sql.format(keys=f"({', '.join('?' * len(chunk))})"), chunk).fetchall()
    return out


def write_conflict(exc: BaseException) -> bool:
    """Whether ``exc`` is DuckDB's "Conflict on tuple deletion/update": another transaction changed some
    of the same rows first. DuckDB rolled this one back whole, so it may go again."""
    return isinstance(exc, duckdb.TransactionException) and "Conflict" in str(exc)


def one(cur: Any) -> tuple[Any, ...] | None:
    """The first row of ``cur``'s last result, read to its end (``fetchone`` leaves it open).

    A result not read to its end keeps its transaction open, and after any change to
    the catalog (a schema made or dropped) DuckDB refuses every checkpoint while one
    is open: on an idle long-lived cursor the WAL and DuckDB's memory then grow for good.
    """
    rows = cur.fetchall()
    return rows[0] if rows else None


def register(cur: duckdb.DuckDBPyConnection, name: str, table: Table) -> None:
    """``cur.register``, after running the cursor's last result to its end.

    DuckDB 2 refuses to register while a result is not read to its end, as one is
    after an INSERT whose count nobody reads; nobody reads it once a table is registered.
    """
    complete = getattr(cur, "complete", None)  # DuckDB 2; before it, register never waited
    if complete is not None:
        complete()
    cur.register(name, table)


@contextlib.contextmanager
def registered(cur: duckdb.DuckDBPyConnection, name: str, table: Table) -> Iterator[str]:
    """``table`` readable as ``name`` on ``cur`` for the statements of the block."""
    register(cur, name, table)
    try:
        yield name
    finally:
        cur.unregister(name)


@contextlib.contextmanager
def registered_rows(cur: Any, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Iterator[str]:
    """``rows`` (tuples in ``columns`` order) readable as ``name`` on ``cur`` for the statements of the block.

    A cursor with ``register_rows`` (the stage process's) has its table built where it runs.
    """
    remote = getattr(cur, "register_rows", None)
    if remote is None:
        register(cur, name, rows_table(columns, rows))
    else:
        remote(name, columns, rows)
    try:
        yield name
    except BaseException:
        with contextlib.suppress(duckdb.Error):  # in a transaction the error aborted: its error is the news
            cur.unregister(name)
        raise
    cur.unregister(name)


def rows_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
    """Rows (tuples in ``columns`` order) as an Arrow table, column by column."""
    from .arrow import rows_table  # see the module's docstring

    return rows_table(columns, rows)


def insert_rows(cur: duckdb.DuckDBPyConnection, statement: str, columns: Sequence[str],
                rows: Sequence[Sequence[Any]]) -> None:
    """``statement`` (``INSERT [OR REPLACE] INTO t``) with ``rows``, in one bulk insert; nothing when empty."""
    if rows:
        with registered_rows(cur, "incoming_rows", columns, rows):
            cur.execute(f"{statement} SELECT * FROM incoming_rows")


# Ranges of commits one ``batch_filter`` names at most: DuckDB tests each row against every range
# (500 ranges cost more than a read of the whole last hour), so the nearest are merged.
MAX_RANGES = 8

Batches = tuple["int | None", "int | None"]
"""The commits that can hold a trace's rows, first and last; None for either end when unknown
(from the table's first commit, to its last)."""


def batch_filter(batches: Sequence[Batches]) -> tuple[str, list[int]]:
    """`` AND (batch_id BETWEEN ? AND ? OR ...)`` covering these ranges of commits (a trace's, each),
    and its parameters; nothing when one range's first commit is unknown (the whole table is read).

    Rows are stored in commit order, so DuckDB skips every row group outside the ranges. Overlapping
    ranges are merged, then the nearest, down to ``MAX_RANGES``: they split at the widest gaps, so a
    trace of a conversation open for days costs a range of its own, not a read of those days.
    """
    if not batches or any(first is None for first, _ in batches):
        return "", []
    inf = 2**64
    merged: list[list[int]] = []
    for first, last in sorted((f, inf if last is None else last) for f, last in batches if f is not None):
        if merged and first <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], last)
        else:
            merged.append([first, last])
    if len(merged) > MAX_RANGES:
        gaps = sorted(range(1, len(merged)), key=lambda i: merged[i][0] - merged[i - 1][1])[-(MAX_RANGES - 1):]
        starts = [0, *sorted(gaps), len(merged)]
        merged = [[merged[a][0], max(r[1] for r in merged[a:b])] for a, b in zip(starts, starts[1:])]
    terms, params = [], []
    for first, last in merged:
        if last >= inf:
            terms.append("batch_id >= ?")
            params.append(first)
        else:
            terms.append("batch_id BETWEEN ? AND ?")
            params += [first, last]
    return f" AND ({' OR '.join(terms)})", params


def trace_batches(cur: Any, traces: Sequence[str]) -> dict[str, Batches]:
    """The first and last commits ``trace_conversations`` holds for each of these traces (by key); a
    trace it does not hold is left out, one stored by an older version has (None, None)."""
    return {t: (first, last) for t, first, last in by_keys(
        cur, "SELECT trace_id, first_batch, last_batch FROM trace_conversations WHERE trace_id IN {keys}", traces)}


def trace_place(cur: Any, trace_id: str) -> tuple[str | None, int | None]:
    """A trace's conversation and the first commit with its rows: from the keyed map (its index), else
    from the archive (a read of its trace ids, a quarter the size of the span table's); (None, None)
    for a trace in neither, or an older version's first commit."""
    for table in ("trace_conversations", "trace_archive"):
        row = one(cur.execute(f"SELECT conversation_id, first_batch FROM {table} WHERE trace_id = ? LIMIT 1",
                              [trace_id]))
        if row is not None:
            return row[0], row[1]
    return None, None


# The distinct traces with rows in a range of commits (parameters: first, last, first, last).
COMMIT_TRACES = ("SELECT trace_id FROM span_records WHERE batch_id BETWEEN ? AND ? "
                 "UNION SELECT trace_id FROM log_records WHERE batch_id BETWEEN ? AND ?")


def mapped_traces(cur: Any, traces: Sequence[str]) -> set[str]:
    """Those of these traces the trace map holds: keyed ones by key, archived ones by a join that hashes
    only the traces asked for (a semi-join with ``trace_map`` would hash every trace id it holds)."""
    found = {t for (t,) in by_keys(cur, "SELECT trace_id FROM trace_conversations WHERE trace_id IN {keys}", traces)}
    rest = [(t,) for t in traces if t not in found]
    if rest:
        with registered_rows(cur, "asked_traces", ("trace_id",), rest):
            found.update(t for (t,) in cur.execute(
                "SELECT DISTINCT trace_id FROM trace_archive JOIN asked_traces USING (trace_id)").fetchall())
    return found


def conversation_traces(cur: Any, conversations: Sequence[str]) -> list[tuple[str, str, int | None, int | None]]:
    """Every trace of these conversations (``trace_map``'s rows): trace, conversation, first and last commits.

    Read from the two tables, not the view: the view's anti-join hashes every keyed trace id, 30 MB
    of DuckDB's memory at 250,000 traces (half its limit with the key's index, and retention ran out of
    it), where these joins hash only the conversations asked for, and the archived traces found are
    looked up by key.
    """
    if not conversations:
        return []
    read = ("SELECT trace_id, conversation_id, first_batch, last_batch FROM {} "
            "JOIN wanted_conversations USING (conversation_id)")
    with registered_rows(cur, "wanted_conversations", ("conversation_id",), [(c,) for c in conversations]):
        keyed = cur.execute(read.format("trace_conversations")).fetchall()
        archived = {row[0]: row for row in cur.execute(read.format("trace_archive")).fetchall()}
    # A trace back after the map forgot it is keyed again, maybe to another conversation: the keyed row wins.
    for (t,) in by_keys(cur, "SELECT trace_id FROM trace_conversations WHERE trace_id IN {keys}", list(archived)):
        del archived[t]
    return [*keyed, *archived.values()]


def utc_now(now: dt.datetime | None = None) -> dt.datetime:
    """``now``, or the wall clock in UTC."""
    return now if now is not None else dt.datetime.now(dt.timezone.utc)
