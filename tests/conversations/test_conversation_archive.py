"""Ended conversations past the newest ``kept`` move to an unkeyed archive, with a Bloom filter of their ids
(``collector.conversations.archive``)."""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

import duckdb
import pytest

from collector.conversations import archive
from collector.conversations.archive import ArchiveFilter, ConversationArchive
from collector.conversations.data import ConversationRow, Writes
from collector.conversations.duck import CONFLICT_WAITS, DuckData
from collector.conversations.tables import _CONVERSATION_FIELDS, CONVERSATION_COLUMNS, SCHEMA, ensure_tables
from collector.store.schema import TRACE_MAP

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def _ids(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-{i:08d}-5f0e-4c1a-9d7b-3c2e1f0a9b8c" for i in range(n)]


def test_the_filter_never_misses_an_id_added_and_seldom_names_one_that_was_not(monkeypatch: pytest.MonkeyPatch
                                                                               ) -> None:
    monkeypatch.setattr(archive, "FIRST_CAPACITY", 1000)
    f = ArchiveFilter()
    added = _ids("in", 7000)
    f.add(added[:500], T0)
    f.add(added[500:], T0)  # past the first layer's capacity: the next ones go to new, larger layers
    assert [layer.capacity for layer in f.layers.values()] == [1000, 2000, 4000]
    assert len(f) == 7000 and f.nbytes() == 7000 * archive.BITS_PER_ID // 8
    assert f.maybe(added) == added
    others = _ids("out", 20_000)
    assert len(f.maybe(others)) < 20_000 * 3 / 2000  # 1 in 2,000 a full layer, three layers


def test_the_filter_is_read_back_from_the_file_as_it_was_written() -> None:
    con = duckdb.connect()
    con.execute(SCHEMA)
    f = ArchiveFilter()
    changed = f.add(_ids("a", 100), T0)
    DuckData(con).archive([], f.changed(changed))
    back = _read(con)
    assert {n: (x.capacity, x.ids, bytes(x.bits), x.newest) for n, x in back.layers.items()} == \
        {n: (x.capacity, x.ids, bytes(x.bits), x.newest) for n, x in f.layers.items()}
    assert back.maybe(["a-00000007-5f0e-4c1a-9d7b-3c2e1f0a9b8c", "nope"]) == ["a-00000007-5f0e-4c1a-9d7b-3c2e1f0a9b8c"]


def _read(con: duckdb.DuckDBPyConnection) -> ArchiveFilter:
    """The filter as the stage reads it back when it starts."""
    return ArchiveFilter(DuckData(con).filter_layers())


def _conversations(con: duckdb.DuckDBPyConnection, ids: list[str], state: str = "ended", start: int = 0) -> None:
    con.executemany("INSERT INTO live_conversations (conversation_id, state, last_arrival_at) VALUES (?, ?, ?)",
                    [(cid, state, T0 + dt.timedelta(minutes=start + i)) for i, cid in enumerate(ids)])


def _count(con: duckdb.DuckDBPyConnection, table: str) -> int:
    return con.execute(f"SELECT count(*) FROM {table}").fetchall()[0][0]


def test_the_oldest_ended_conversations_move_past_kept_and_a_quarter_and_the_view_shows_each_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(archive, "MOVED_AT_ONCE", 6)
    con = duckdb.connect()
    con.execute(SCHEMA)
    ended = _ids("e", 20)
    _conversations(con, ended)
    _conversations(con, _ids("o", 3), state="open")
    arc = ConversationArchive(kept=8)
    held = {ended[0]}  # the stage holds it in memory: it stays
    assert arc.move(DuckData(con), held) == 6  # at most MOVED_AT_ONCE at a time, the oldest first
    assert [r[0] for r in con.execute("SELECT conversation_id FROM archived_conversations ORDER BY 1").fetchall()] \
        == ended[1:7]
    assert arc.due()  # still over: the next flush moves on
    assert arc.move(DuckData(con), held) == 6
    assert not arc.due() and arc.move(DuckData(con), held) == 0  # 8 ended keyed, and the open ones
    assert (_count(con, "live_conversations"), _count(con, "archived_conversations")) == (11, 12)
    assert _count(con, "conversations") == 23
    assert arc.filter.maybe(ended) == ended[1:13]
    assert _read(con).maybe(ended) == ended[1:13]  # written with each move


def test_a_layer_goes_once_retention_deleted_its_conversations_and_its_survivors_move_to_the_newest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(archive, "FIRST_CAPACITY", 10)
    monkeypatch.setattr(archive, "RETIRE_SURVIVORS", 2)
    con = duckdb.connect()
    con.execute(SCHEMA)
    first = _ids("a", 10)
    _conversations(con, first)
    arc = ConversationArchive(kept=0)
    assert arc.move(DuckData(con), ()) == 10
    # retention deletes all but two of the first layer's conversations (say, kept for review)
    con.execute("DELETE FROM archived_conversations WHERE conversation_id NOT IN (?, ?)", first[:2])
    _conversations(con, _ids("b", 5), start=100)
    assert arc.move(DuckData(con), ()) == 5
    assert list(arc.filter.layers) == [1]  # the first layer went, and the survivors are in the second
    assert arc.filter.maybe(first) == first[:2]
    assert _read(con).maybe([*first[:2], *_ids("b", 5)]) == [*first[:2], *_ids("b", 5)]


def test_an_older_files_keyed_conversations_table_becomes_the_live_one_with_every_row() -> None:
    con = duckdb.connect()
    con.execute(f"CREATE TABLE conversations (conversation_id VARCHAR PRIMARY KEY, {_CONVERSATION_FIELDS})")
    con.executemany("INSERT INTO conversations (conversation_id, state) VALUES (?, 'ended')", [(c,) for c in "xyz"])
    ensure_tables(con)
    ensure_tables(con)  # once only
    assert con.execute("SELECT table_type FROM information_schema.tables WHERE table_name = 'conversations'"
                       ).fetchall() == [("VIEW",)]
    assert con.execute("SELECT conversation_id FROM live_conversations ORDER BY 1").fetchall() == [("x",), ("y",), ("z",)]
    assert ConversationArchive(kept=0).move(DuckData(con), ()) == 3
    assert con.execute("SELECT conversation_id FROM conversations ORDER BY 1").fetchall() == [("x",), ("y",), ("z",)]


def _retention_deleting(n: int, which: int) -> tuple[duckdb.DuckDBPyConnection, list[str], Any, DuckData]:
    """``n`` ended conversations, one of which (``which``) retention's transaction has deleted, uncommitted;
    the file, their ids, retention's cursor, and the stage's data on a cursor of its own."""
    con = duckdb.connect()
    con.execute(SCHEMA)
    ended = _ids("e", n)
    _conversations(con, ended)
    retention = con.cursor()
    retention.execute("BEGIN")
    retention.execute("DELETE FROM live_conversations WHERE conversation_id = ?", [ended[which]])
    return con, ended, retention, DuckData(con.cursor())


def test_a_move_that_meets_retention_deleting_the_same_conversations_goes_again_without_them() -> None:
    """Retention deletes the oldest ended conversations, the very ones the archive moves: a move whose
    delete meets one of retention's in flight is rolled back and tried again once that one has committed
    (here when the move pauses), and moves what is left; before, the stage's cycle failed on it."""
    con, ended, retention, data = _retention_deleting(5, 2)
    pauses: list[float] = []

    def pause(seconds: float) -> None:
        pauses.append(seconds)
        retention.execute("COMMIT")  # retention's chunk commits while the move waits

    data.pause = pause
    data.archive(ended, {})
    assert pauses == [CONFLICT_WAITS[0]]
    assert sorted(r[0] for r in con.execute("SELECT conversation_id FROM archived_conversations").fetchall()) \
        == [c for c in ended if c != ended[2]]
    assert _count(con, "live_conversations") == 0


def test_a_move_that_keeps_meeting_a_conflict_raises_after_its_last_try() -> None:
    con, ended, retention, data = _retention_deleting(3, 0)
    pauses: list[float] = []
    data.pause = pauses.append  # retention never commits
    with pytest.raises(duckdb.TransactionException, match="Conflict"):
        data.archive(ended, {})
    assert pauses == list(CONFLICT_WAITS)
    retention.execute("ROLLBACK")
    assert _count(con, "live_conversations") == 3 and _count(con, "archived_conversations") == 0


def test_a_write_that_meets_retention_deleting_a_conversation_it_replaces_goes_again() -> None:
    """The stage's write replaces a conversation (and moves the oldest traces to the trace archive) while
    retention deletes the oldest ended conversations with their traces: a write that meets one of
    retention's deletes in flight is rolled back and written again once that one has committed; before,
    the stage's cycle failed on it and started again from the stored state (once in a 10-minute soak)."""
    con, ended, retention, data = _retention_deleting(3, 1)
    con.execute(TRACE_MAP)
    [stored] = con.execute("SELECT * FROM live_conversations WHERE conversation_id = ?", [ended[1]]).fetchall()
    writes = Writes()
    writes.conversations[ended[1]] = dataclasses.replace(
        ConversationRow(**dict(zip(CONVERSATION_COLUMNS, stored))), state="open", ended_at=None)
    writes.replace.add(ended[1])
    pauses: list[float] = []

    def pause(seconds: float) -> None:
        pauses.append(seconds)
        retention.execute("COMMIT")

    data.pause = pause
    data.write(writes, 7)
    assert pauses == [CONFLICT_WAITS[0]]
    assert con.execute("SELECT conversation_id, state FROM live_conversations ORDER BY 1").fetchall() == \
        [(ended[0], "ended"), (ended[1], "open"), (ended[2], "ended")]
    assert con.execute("SELECT value FROM tracejudge_state WHERE key = 'conversations.batch'").fetchall() == [("7",)]
