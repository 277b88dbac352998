"""Writing to DuckDB from any stage: one way to open a transaction, one way to insert many rows.

``Transaction`` is BEGIN ... COMMIT (ROLLBACK when the block raises); opened inside
another on the same cursor it is part of that one, so a caller that stores several
things at once wraps them all in one commit. ``registered`` hands DuckDB an Arrow
table for one bulk statement: row-by-row inserts cost DuckDB about 1.5 ms a row,
an Arrow insert microseconds.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Iterator, Sequence
from typing import Any

import duckdb
import pyarrow as pa


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


@contextlib.contextmanager
def registered(cur: duckdb.DuckDBPyConnection, name: str, table: pa.Table) -> Iterator[str]:
    """``table`` readable as ``name`` on ``cur`` for the statements of the block."""
    cur.register(name, table)
    try:
        yield name
    finally:
        cur.unregister(name)


def rows_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> pa.Table:
    """Rows (tuples in ``columns`` order) as an Arrow table, column by column."""
    return pa.table({name: pa.array([r[i] for r in rows]) for i, name in enumerate(columns)})


def insert_rows(cur: duckdb.DuckDBPyConnection, statement: str, columns: Sequence[str],
                rows: Sequence[Sequence[Any]]) -> None:
    """``statement`` (``INSERT [OR REPLACE] INTO t``) with ``rows``, in one bulk insert; nothing when empty."""
    if rows:
        with registered(cur, "incoming_rows", rows_table(columns, rows)):
            cur.execute(f"{statement} SELECT * FROM incoming_rows")


def utc_now(now: dt.datetime | None = None) -> dt.datetime:
    """``now``, or the wall clock in UTC."""
    return now if now is not None else dt.datetime.now(dt.timezone.utc)
