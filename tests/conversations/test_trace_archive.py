"""The trace map keeps the newest traces keyed and moves the others to ``trace_archive`` (``archive_traces``)."""

from __future__ import annotations

import duckdb
import pytest

from collector.conversations import writes
from collector.store.schema import SCHEMA
from collector.store.transactions import trace_place


def _map(con: duckdb.DuckDBPyConnection, table: str) -> list[tuple[str, str, int]]:
    return con.execute(f"SELECT trace_id, conversation_id, last_batch FROM {table} ORDER BY ALL").fetchall()


def test_the_oldest_traces_move_a_bounded_number_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    con = duckdb.connect()
    con.execute(SCHEMA)
    con.executemany("INSERT INTO trace_conversations VALUES (?, ?, ?, ?)",
                    [(f"t{i:02d}", f"c{i // 2}", i, i) for i in range(1, 21)] + [("t00", "c0", None, None)])
    monkeypatch.setattr(writes, "MOVED_AT_ONCE", 6)
    writes.archive_traces(con, 8)
    # NULL commits (an older version's rows) count as the oldest
    assert [t for t, _, _ in _map(con, "trace_archive")] == ["t00", "t01", "t02", "t03", "t04", "t05"]
    moves = 1
    while con.execute("SELECT count(*) FROM trace_conversations").fetchall()[0][0] > 10:  # 8 and a quarter
        writes.archive_traces(con, 8)
        moves += 1
    assert moves == 2  # 21 keyed, then 15, then 9: each move goes toward 8, at most 6 at a time
    assert [t for t, _, _ in _map(con, "trace_conversations")] == [f"t{i:02d}" for i in range(12, 21)]
    con.execute("INSERT INTO trace_conversations VALUES ('t21', 'c10', 21, 21)")
    writes.archive_traces(con, 8)  # 10: within a quarter more, nothing moves
    assert len(_map(con, "trace_conversations")) == 10
    assert len(_map(con, "trace_map")) == 22


def test_a_trace_keyed_again_shows_once_and_is_archived_once() -> None:
    """A trace that came back after its move (taken as new by the stage) is in both tables for a while: the
    map shows its keyed row, and its next move replaces the archived one."""
    con = duckdb.connect()
    con.execute(SCHEMA)
    con.executemany("INSERT INTO trace_conversations VALUES (?, ?, ?, ?)", [("a", "c1", 1, 1), ("b", "c2", 2, 2)])
    writes.archive_traces(con, 0)
    con.execute("INSERT INTO trace_conversations VALUES ('a', 'trace:a', 7, 7)")
    assert _map(con, "trace_map") == [("a", "trace:a", 7), ("b", "c2", 2)]
    writes.archive_traces(con, 0)
    assert _map(con, "trace_archive") == [("a", "trace:a", 7), ("b", "c2", 2)]
    assert _map(con, "trace_conversations") == []


def test_a_trace_is_placed_from_the_keyed_map_else_the_archive() -> None:
    con = duckdb.connect()
    con.execute(SCHEMA)
    con.executemany("INSERT INTO trace_conversations VALUES (?, ?, ?, ?)", [("a", "c1", 3, 5), ("b", "c2", 4, 4)])
    writes.archive_traces(con, 0)
    con.execute("INSERT INTO trace_conversations VALUES ('b', 'trace:b', 9, 9)")
    assert trace_place(con, "a") == ("c1", 3)
    assert trace_place(con, "b") == ("trace:b", 9)  # keyed again: the keyed row wins
    assert trace_place(con, "z") == (None, None)
