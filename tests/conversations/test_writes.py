"""Replacing a stored transcript: its old messages go, however the conversation's first commit moved,
and rows written before ``messages.first_batch`` existed are found too."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import duckdb

from collector.conversations.tables import CONVERSATION_COLUMNS
from collector.conversations.writes import ConversationRow, Writes

from ..support.stored import StoredConversation, create_store, text_messages


def flush(db: Path, conv: StoredConversation, first_batch: int | None, mark: int) -> None:
    """Write ``conv`` as the stage writes a rebuilt conversation, its rows carrying ``first_batch``."""
    row, _ = conv.rows()
    written = dataclasses.replace(ConversationRow(**dict(zip(CONVERSATION_COLUMNS, row))), first_batch=first_batch)
    writes = Writes()
    writes.conversations[conv.conversation_id] = written
    writes.messages[conv.conversation_id] = [(*m[:-1], first_batch) for m in conv.rows()[1]]
    con = duckdb.connect(str(db))
    try:
        stored = con.execute("SELECT count(*) FROM conversations WHERE conversation_id = ?",
                             [conv.conversation_id]).fetchall()[0][0]
        if stored:
            writes.replace.add(conv.conversation_id)
        writes.flush(con, mark)
    finally:
        con.close()


def stored(db: Path, cid: str) -> list[tuple[str, int | None]]:
    con = duckdb.connect(str(db))
    try:
        return con.execute("SELECT content, first_batch FROM messages WHERE conversation_id = ? ORDER BY seq",
                           [cid]).fetchall()
    finally:
        con.close()


def test_a_rebuilt_transcript_replaces_the_stored_one_when_its_first_commit_moves(tmp_path: Path) -> None:
    db = tmp_path / "t.duckdb"
    create_store(db)
    conv = StoredConversation("c-1", text_messages([("hello", "hi")]))
    flush(db, conv, 5, mark=5)
    for i in range(1, 30):  # others written later, so that c-1's rows sit in the oldest row group
        flush(db, StoredConversation(f"other-{i}", text_messages([("x", "y")])), 5 + i, mark=5 + i)
    conv.messages = text_messages([("hello", "hi"), ("and then?", "done")])
    flush(db, conv, 9, mark=40)  # one of its traces moved away: its first commit is later now
    assert stored(db, "c-1") == [("hello", 9), ("hi", 9), ("and then?", 9), ("done", 9)]
    conv.messages = text_messages([("hello", "hi"), ("and then?", "done"), ("bye", "bye")])
    flush(db, conv, 2, mark=41)  # a trace with older spans joined: earlier
    assert [content for content, _ in stored(db, "c-1")] == ["hello", "hi", "and then?", "done", "bye", "bye"]
    assert {batch for _, batch in stored(db, "c-1")} == {2}


def test_messages_stored_before_the_first_batch_column_are_replaced(tmp_path: Path) -> None:
    db = tmp_path / "t.duckdb"
    create_store(db)
    conv = StoredConversation("old", text_messages([("hello", "hi")]))
    flush(db, conv, None, mark=3)  # as an older tracejudge wrote it: no first_batch on its messages
    con = duckdb.connect(str(db))
    con.execute("UPDATE conversations SET first_batch = 3 WHERE conversation_id = 'old'")  # but on its row
    con.close()
    conv.messages = text_messages([("hello", "hi"), ("more", "ok")])
    flush(db, conv, 7, mark=8)
    assert stored(db, "old") == [("hello", 7), ("hi", 7), ("more", 7), ("ok", 7)]
