"""The conversation stage's tables, and the reads of them that the API and the CLI share.

``conversations`` has one row per conversation, ``messages`` its rebuilt
transcript, ``tracejudge_state`` how far the stage has got (its batch mark).
Reads take a DuckDB cursor of the caller's and return JSON-ready values.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import duckdb

from ..words import iso_utc
from ..store.transactions import Transaction, one

_CONVERSATION_FIELDS = """
    service VARCHAR,
    started_at TIMESTAMPTZ,
    ended_at TIMESTAMPTZ,
    ended_by VARCHAR,
    state VARCHAR NOT NULL,
    user_turns INTEGER,
    input_tokens BIGINT,
    output_tokens BIGINT,
    llm_calls INTEGER,
    message_count INTEGER,
    models VARCHAR,
    system VARCHAR,
    content_captured BOOLEAN,
    no_content_reason VARCHAR,
    transcript_hash VARCHAR,
    revision INTEGER,
    trace_ids VARCHAR,
    newest_trace_id VARCHAR,
    first_arrival_at TIMESTAMPTZ,
    last_arrival_at TIMESTAMPTZ,
    closed_at TIMESTAMPTZ,
    updated_at TIMESTAMPTZ,
    unparsed_spans INTEGER,
    unparsed_logs INTEGER,
    sources VARCHAR,
    first_batch UBIGINT,
    messages_batch UBIGINT,
    grouped_by VARCHAR
"""

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS live_conversations (
    conversation_id VARCHAR PRIMARY KEY,
{_CONVERSATION_FIELDS});
-- The first commit holding rows of the conversation's traces (reads of them skip older ones).
-- Added to older files; NULL there until the conversation is rebuilt.
ALTER TABLE live_conversations ADD COLUMN IF NOT EXISTS first_batch UBIGINT;
-- Where its messages were last written: the batch the stage had taken in then, as their rows carry it
-- (messages.first_batch). Added to older files; NULL there until the transcript is written again.
ALTER TABLE live_conversations ADD COLUMN IF NOT EXISTS messages_batch UBIGINT;
-- Ended conversations past the newest ARCHIVE_KEPT, without a key (``archive`` says why).
CREATE TABLE IF NOT EXISTS archived_conversations (
    conversation_id VARCHAR NOT NULL,
{_CONVERSATION_FIELDS});
-- How its traces were grouped (``stitch.GROUPED_BY``). Added to older files, in both tables at once (the
-- ``conversations`` view is one over the other); NULL there until the conversation is rebuilt.
ALTER TABLE live_conversations ADD COLUMN IF NOT EXISTS grouped_by VARCHAR;
ALTER TABLE archived_conversations ADD COLUMN IF NOT EXISTS grouped_by VARCHAR;
-- A Bloom filter of every id ever archived, in layers of growing capacity (``archive.ArchiveFilter``).
CREATE TABLE IF NOT EXISTS conversation_filter (
    layer INTEGER PRIMARY KEY, capacity BIGINT NOT NULL, ids BIGINT NOT NULL, bits BLOB NOT NULL,
    newest TIMESTAMPTZ);
CREATE VIEW IF NOT EXISTS conversations AS
    SELECT * FROM live_conversations UNION ALL SELECT * FROM archived_conversations;
CREATE TABLE IF NOT EXISTS messages (
    conversation_id VARCHAR NOT NULL,
    seq INTEGER NOT NULL,
    role VARCHAR NOT NULL,
    content VARCHAR,
    tool_calls VARCHAR,
    tool_call_id VARCHAR,
    name VARCHAR,
    "at" TIMESTAMPTZ,
    span_id VARCHAR,
    source VARCHAR,
    truncated BOOLEAN,
    first_batch UBIGINT
);
-- The batch the stage had taken in when it wrote these rows (the conversations row's messages_batch
-- has the same value; before that column, its conversation's first_batch): rows are appended in the
-- order they are written, so replacing a transcript deletes from there on and DuckDB skips the row
-- groups written before, however long ago the conversation began. NULL in rows older than the column.
ALTER TABLE messages ADD COLUMN IF NOT EXISTS first_batch UBIGINT;
CREATE TABLE IF NOT EXISTS tracejudge_state (key VARCHAR PRIMARY KEY, value VARCHAR);
"""

CONVERSATION_COLUMNS = (
    "conversation_id", "service", "started_at", "ended_at", "ended_by", "state", "user_turns", "input_tokens",
    "output_tokens", "llm_calls", "message_count", "models", "system", "content_captured", "no_content_reason",
    "transcript_hash", "revision", "trace_ids", "newest_trace_id", "first_arrival_at", "last_arrival_at",
    "closed_at", "updated_at", "unparsed_spans", "unparsed_logs", "sources", "first_batch", "messages_batch",
    "grouped_by",
)
MESSAGE_COLUMNS = ("conversation_id", "seq", "role", "content", "tool_calls", "tool_call_id", "name", "at",
                   "span_id", "source", "truncated", "first_batch")
# ``trace_conversations`` (created with the store's tables: its views join it)
TRACE_MAP_COLUMNS = ("trace_id", "conversation_id", "first_batch", "last_batch")
# Traces keyed in ``trace_conversations`` (``TRACE_MAP`` in the store's schema says why), about 14-17 MB of
# index (``archive_traces`` moves a quarter more at a time): at 1,000 traces/s (10,000 spans/s) the last
# 3 minutes of traces, at 10 a second the last 5 hours. An open conversation's traces are known however
# old: the stage holds them.
TRACES_KEPT = 200_000

def ensure_tables(cur: duckdb.DuckDBPyConnection) -> None:
    """``SCHEMA`` in the cursor's schema, on a file of any version: the keyed ``conversations`` table of an
    older one becomes ``live_conversations`` (its conversations move to the archive a flush at a time)."""
    with Transaction(cur):
        row = one(cur.execute(
            "SELECT table_type FROM information_schema.tables WHERE table_catalog = current_database() "
            "AND table_schema = current_schema() AND table_name = 'conversations'"))
        if row and row[0] == "BASE TABLE":
            cur.execute("ALTER TABLE conversations RENAME TO live_conversations")
        cur.execute(SCHEMA)


CONVERSATION_LIST_COLUMNS = (
    "conversation_id", "service", "state", "ended_by", "started_at", "ended_at", "user_turns",
    "message_count", "llm_calls", "input_tokens", "output_tokens", "content_captured", "revision",
    "last_arrival_at", "grouped_by",
)


def list_conversations(cur: duckdb.DuckDBPyConnection, *, since: dt.datetime | None = None,
                       state: str | None = None, service: str | None = None,
                       limit: int = 50) -> list[dict[str, Any]]:
    """Conversations, the most recently active first."""
    where: list[str] = []
    params: list[Any] = []
    if since is not None:
        where.append("last_arrival_at >= ?")
        params.append(since)
    if state:
        where.append("state = ?")
        params.append(state)
    if service:
        where.append("service = ?")
        params.append(service)
    sql = (f"SELECT {', '.join(CONVERSATION_LIST_COLUMNS)} FROM conversations "
           f"{'WHERE ' + ' AND '.join(where) if where else ''} "
           "ORDER BY last_arrival_at DESC, conversation_id LIMIT ?")
    rows = cur.execute(sql, [*params, limit]).fetchall()
    return [{k: iso_utc(v) for k, v in zip(CONVERSATION_LIST_COLUMNS, r)} for r in rows]


def conversation_counts(cur: duckdb.DuckDBPyConnection) -> dict[str, int]:
    """Conversations by state, plus how many carry no content (never judged)."""
    counts = {"open": 0, "ended": 0}
    for state, n in cur.execute("SELECT state, count(*) FROM conversations GROUP BY state").fetchall():
        counts[state] = n
    row = one(cur.execute("SELECT count(*) FROM conversations WHERE NOT content_captured"))
    counts["without_content"] = int(row[0]) if row else 0
    return counts
