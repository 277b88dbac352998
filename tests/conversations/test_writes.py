"""Replacing a stored transcript: its old messages go, wherever and by whichever version they were written.

Each ``messages`` row carries where it was written (``first_batch``: the batch the stage had taken in,
its conversations row's ``messages_batch``), so that the delete reads only the row groups written since.
Rows an older version wrote carry their conversation's first commit instead, or nothing.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from pathlib import Path

import duckdb
import pytest

from collector.conversations.tables import CONVERSATION_COLUMNS
from collector.conversations.duck import DuckData
from collector.conversations.data import ConversationRow, Writes

from ..support.stored import StoredConversation, create_store, text_messages


def flush(db: Path, conv: StoredConversation, written: int | None, mark: int, first_batch: int | None = 0) -> None:
    """Write ``conv`` as the stage writes a rebuilt conversation, its messages ``written`` at that batch."""
    row, _ = conv.rows()
    row_values = ConversationRow(**dict(zip(CONVERSATION_COLUMNS, row)))
    written_row = dataclasses.replace(row_values, first_batch=first_batch, messages_batch=written)
    writes = Writes()
    writes.conversations[conv.conversation_id] = written_row
    writes.messages[conv.conversation_id] = [(*m[:-1], written) for m in conv.rows()[1]]
    con = duckdb.connect(str(db))
    try:
        stored = con.execute("SELECT count(*) FROM conversations WHERE conversation_id = ?",
                             [conv.conversation_id]).fetchall()[0][0]
        if stored:
            writes.replace.add(conv.conversation_id)
        DuckData(con).write(writes, mark)
    finally:
        con.close()


def stored(db: Path, cid: str) -> list[tuple[str, int | None]]:
    con = duckdb.connect(str(db))
    try:
        return con.execute("SELECT content, first_batch FROM messages WHERE conversation_id = ? ORDER BY seq",
                           [cid]).fetchall()
    finally:
        con.close()


@pytest.mark.slow
def test_a_transcript_begun_long_ago_is_replaced_where_it_was_last_written(tmp_path: Path) -> None:
    db = tmp_path / "t.duckdb"
    create_store(db)
    conv = StoredConversation("c-1", text_messages([("hello", "hi")]))
    flush(db, conv, 5, mark=5, first_batch=1)
    for i in range(1, 30):  # others written later, so that c-1's rows sit in the oldest row group
        flush(db, StoredConversation(f"other-{i}", text_messages([("x", "y")])), 5 + i, mark=5 + i)
    conv.messages = text_messages([("hello", "hi"), ("and then?", "done")])
    flush(db, conv, 40, mark=40, first_batch=1)  # a new turn, long after the conversation began
    assert stored(db, "c-1") == [("hello", 40), ("hi", 40), ("and then?", 40), ("done", 40)]
    conv.messages = text_messages([("hello", "hi"), ("and then?", "done"), ("bye", "bye")])
    flush(db, conv, 41, mark=41, first_batch=1)
    assert [content for content, _ in stored(db, "c-1")] == ["hello", "hi", "and then?", "done", "bye", "bye"]
    assert {batch for _, batch in stored(db, "c-1")} == {41}
    assert all(len(stored(db, f"other-{i}")) == 2 for i in range(1, 30)), "the others' messages are kept"


def test_messages_an_older_version_wrote_are_replaced(tmp_path: Path) -> None:
    db = tmp_path / "t.duckdb"
    create_store(db)
    # Written before messages_batch: the rows carry the conversation's first commit, the row has none.
    by_first = StoredConversation("by-first", text_messages([("hello", "hi")]))
    flush(db, by_first, 3, mark=3, first_batch=3)
    # Written before either: nothing on the rows.
    bare = StoredConversation("bare", text_messages([("hello", "hi")]))
    flush(db, bare, None, mark=4, first_batch=None)
    con = duckdb.connect(str(db))
    con.execute("UPDATE live_conversations SET messages_batch = NULL")
    con.execute("UPDATE live_conversations SET first_batch = 4 WHERE conversation_id = 'bare'")  # learnt since
    con.close()
    for conv in (by_first, bare):
        conv.messages = text_messages([("hello", "hi"), ("more", "ok")])
        flush(db, conv, 9, mark=9, first_batch=3)
        assert stored(db, conv.conversation_id) == [("hello", 9), ("hi", 9), ("more", 9), ("ok", 9)]


def test_the_oldest_transcripts_are_deleted_between_where_they_were_written_and_the_others_kept(tmp_path: Path) -> None:
    """As retention deletes the messages of the oldest conversations: bounded on both sides where it can be."""
    from collector.conversations.duck import delete_messages

    db = tmp_path / "t.duckdb"
    create_store(db)
    for i in range(1, 8):
        flush(db, StoredConversation(f"c-{i}", text_messages([("x", "y")])), i, mark=i)
    legacy = StoredConversation("legacy", text_messages([("hello", "hi")]))
    flush(db, legacy, None, mark=8, first_batch=None)  # as a version before first_batch wrote it
    con = duckdb.connect(str(db))
    try:
        con.execute("UPDATE live_conversations SET messages_batch = NULL WHERE conversation_id = 'legacy'")
        delete_messages(con, ["c-1", "c-3"])
        delete_messages(con, ["legacy", "c-6"])
        delete_messages(con, ["never-stored"])
        left = con.execute("SELECT DISTINCT conversation_id FROM messages ORDER BY 1").fetchall()
        # Archived ones, as retention deletes them: found in the archive among those arrived by its bound.
        con.execute("UPDATE live_conversations SET last_arrival_at = TIMESTAMPTZ '2026-01-01 00:00:00+00' "
                    "+ to_seconds(messages_batch::BIGINT)")
        moved = "conversation_id IN ('c-2', 'c-4')"
        con.execute(f"INSERT INTO archived_conversations SELECT * FROM live_conversations WHERE {moved}")
        con.execute(f"DELETE FROM live_conversations WHERE {moved}")
        at = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
        delete_messages(con, ["c-2", "c-4"], {"c-2", "c-4"}, at + dt.timedelta(seconds=3))  # c-4 arrived after
        after_early = con.execute("SELECT DISTINCT conversation_id FROM messages ORDER BY 1").fetchall()
        delete_messages(con, ["c-2", "c-4"], {"c-2", "c-4"}, at + dt.timedelta(seconds=4))
        after_both = con.execute("SELECT DISTINCT conversation_id FROM messages ORDER BY 1").fetchall()
    finally:
        con.close()
    assert [c for (c,) in left] == ["c-2", "c-4", "c-5", "c-7"]
    assert [c for (c,) in after_early] == ["c-4", "c-5", "c-7"]
    assert [c for (c,) in after_both] == ["c-5", "c-7"]


def test_rows_taken_as_new_that_are_stored_already_are_replaced_all_the_same(tmp_path: Path, caplog) -> None:
    """New rows are inserted, not replaced (``Writes.flush``): one that is stored after all (a bug in
    what the stage knows) rolls the transaction back and writes it again, every row replacing."""
    db = tmp_path / "t.duckdb"
    create_store(db)
    conv = StoredConversation("c-1", text_messages([("hello", "hi")]))
    row, messages = conv.rows()
    first = ConversationRow(**dict(zip(CONVERSATION_COLUMNS, row)))

    def write(row: ConversationRow, mark: int) -> None:
        writes = Writes()
        writes.conversations["c-1"] = row
        writes.messages["c-1"] = [(*m[:-1], mark) for m in messages]
        writes.new.add("c-1")  # wrong the second time
        writes.traces["t-1"] = ("c-1", 1, mark)
        writes.new_traces.add("t-1")
        con = duckdb.connect(str(db))
        try:
            DuckData(con).write(writes, mark)
        finally:
            con.close()

    write(first, 5)
    assert "written again" not in caplog.text
    write(dataclasses.replace(first, revision=2, messages_batch=7), 7)
    assert "taken as new was stored already" in caplog.text
    con = duckdb.connect(str(db))
    try:
        assert con.execute("SELECT revision FROM live_conversations").fetchall() == [(2,)]
        assert con.execute("SELECT count(*), min(first_batch) FROM messages").fetchall() == [(len(messages), 7)]
        assert con.execute("SELECT trace_id, last_batch FROM trace_conversations").fetchall() == [("t-1", 7)]
        assert con.execute("SELECT value FROM tracejudge_state WHERE key = 'conversations.batch'").fetchall() == [("7",)]
    finally:
        con.close()
