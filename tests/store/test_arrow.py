"""Python rows as the Arrow tables DuckDB scans (``collector.store.arrow``)."""

from __future__ import annotations

import datetime as dt
import gc

import duckdb

from collector.store.arrow import rows_table

COLUMNS = ("text", "number", "real", "at", "raw", "flag", "nothing")
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def _rows(n: int) -> list[tuple[object, ...]]:
    return [(f"é{i}" if i % 4 else None, i, i / 2 if i % 3 else None, T0 + dt.timedelta(microseconds=i),
             bytes([i % 256]), i % 2 == 0, None) for i in range(n)]


def test_every_type_is_read_back_by_duckdb_as_it_was_given() -> None:
    rows = _rows(1000)
    con = duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")
    con.register("given", rows_table(COLUMNS, rows))
    assert con.execute("SELECT * FROM given").fetchall() == rows


def test_a_table_is_freed_without_the_garbage_collector() -> None:
    """nanoarrow's builder of an array from a list refers to itself: left so, every column of every
    insert waited for the daemon's garbage collector (17,000 cycles a second at 5,000 spans/s)."""
    rows = _rows(100)
    gc.collect()
    gc.disable()
    try:
        for _ in range(20):
            rows_table(COLUMNS, rows)
        assert gc.collect() == 0
    finally:
        gc.enable()
