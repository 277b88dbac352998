"""The trace map keeps the newest traces keyed and moves the others to ``trace_archive`` (``archive_traces``)."""

from __future__ import annotations

import duckdb
import pytest

from collector.conversations import duck
from collector.store.schema import SCHEMA
from collector.store.transactions import conversation_traces, mapped_traces, trace_place


def _map(con: duckdb.DuckDBPyConnection, table: str) -> list[tuple[str, str, int]]:
    return con.execute(f"SELECT trace_id, conversation_id, last_batch FROM {table} ORDER BY ALL").fetchall()


def test_the_oldest_traces_move_a_bounded_number_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    con = duckdb.connect()
    con.execute(SCHEMA)
    con.executemany("INSERT INTO trace_conversations VALUES (?, ?, ?, ?)",
                    [(f"t{i:02d}", f"c{i // 2}", i, i) for i in range(1, 21)] + [("t00", "c0", None, None)])
    monkeypatch.setattr(duck, "TRACES_MOVED_AT_ONCE", 6)
    duck.archive_traces(con, 8)
    # NULL commits (an older version's rows) count as the oldest
    assert [t for t, _, _ in _map(con, "trace_archive")] == ["t00", "t01", "t02", "t03", "t04", "t05"]
    moves = 1
    while con.execute("SELECT count(*) FROM trace_conversations").fetchall()[0][0] > 10:  # 8 and a quarter
        duck.archive_traces(con, 8)
        moves += 1
    assert moves == 2  # 21 keyed, then 15, then 9: each move goes toward 8, at most 6 at a time
    assert [t for t, _, _ in _map(con, "trace_conversations")] == [f"t{i:02d}" for i in range(12, 21)]
    con.execute("INSERT INTO trace_conversations VALUES ('t21', 'c10', 21, 21)")
    duck.archive_traces(con, 8)  # 10: within a quarter more, nothing moves
    assert len(_map(con, "trace_conversations")) == 10
    assert len(_map(con, "trace_map")) == 22


def test_a_trace_keyed_again_shows_once_and_is_archived_once() -> None:
    """A trace that came back after its move (taken as new by the stage) is in both tables for a while: the
    map shows its keyed row, and its next move replaces the archived one."""
    con = duckdb.connect()
    con.execute(SCHEMA)
    con.executemany("INSERT INTO trace_conversations VALUES (?, ?, ?, ?)", [("a", "c1", 1, 1), ("b", "c2", 2, 2)])
    duck.archive_traces(con, 0)
    con.execute("INSERT INTO trace_conversations VALUES ('a', 'trace:a', 7, 7)")
    assert _map(con, "trace_map") == [("a", "trace:a", 7), ("b", "c2", 2)]
    duck.archive_traces(con, 0)
    assert _map(con, "trace_archive") == [("a", "trace:a", 7), ("b", "c2", 2)]
    assert _map(con, "trace_conversations") == []


def test_a_trace_is_placed_from_the_keyed_map_else_the_archive() -> None:
    con = duckdb.connect()
    con.execute(SCHEMA)
    con.executemany("INSERT INTO trace_conversations VALUES (?, ?, ?, ?)", [("a", "c1", 3, 5), ("b", "c2", 4, 4)])
    duck.archive_traces(con, 0)
    con.execute("INSERT INTO trace_conversations VALUES ('b', 'trace:b', 9, 9)")
    assert trace_place(con, "a") == ("c1", 3)
    assert trace_place(con, "b") == ("trace:b", 9)  # keyed again: the keyed row wins
    assert trace_place(con, "z") == (None, None)


def test_reads_of_the_map_by_conversation_and_by_trace_agree_with_its_view() -> None:
    """``conversation_traces`` and ``mapped_traces`` read the two tables without the view's anti-join (which
    hashes every keyed trace id): they answer what the view answers, a trace keyed again included."""
    con = duckdb.connect()
    con.execute(SCHEMA)
    con.executemany("INSERT INTO trace_conversations VALUES (?, ?, ?, ?)",
                    [("a", "c1", 1, 2), ("b", "c1", 3, 3), ("c", "c2", 4, 4), ("d", "c3", 5, 5)])
    duck.archive_traces(con, 0)
    con.executemany("INSERT INTO trace_conversations VALUES (?, ?, ?, ?)",
                    [("b", "trace:b", 8, 8), ("c", "c2", 9, 9), ("e", "c1", 10, 11)])
    for convs in (["c1"], ["c2", "trace:b"], ["c1", "c2", "c3", "trace:b", "nobody"], []):
        view = con.execute("SELECT trace_id, conversation_id, first_batch, last_batch FROM trace_map "
                           "WHERE conversation_id IN (SELECT unnest(?::VARCHAR[])) ORDER BY ALL", [convs]).fetchall()
        assert sorted(conversation_traces(con, convs)) == view
    assert sorted(conversation_traces(con, ["c1"])) == [("a", "c1", 1, 2), ("e", "c1", 10, 11)]  # b is trace:b's now
    assert mapped_traces(con, ["a", "b", "e", "z"]) == {"a", "b", "e"}  # archived, in both, keyed; z in neither
    assert mapped_traces(con, []) == set()
