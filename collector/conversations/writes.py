"""What a cycle of the conversation stage writes, and the one transaction that writes it.

``conversations`` rows are ``ConversationRow``s (named fields, the table's
columns in order); a transcript's ``messages`` rows are replaced whole. The
batch mark (``tracejudge_state``: the last commit whose conversations are all
rebuilt and written) goes in the same transaction, so a crash or a stop at any
point leaves it true.

Lifecycle: ``Writes()`` collects a cycle's changes; ``flush(cur, mark)`` writes
them and is left empty, also when the write fails (the stage then starts again
from what is stored).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import duckdb
import orjson

from ..store import Transaction, insert_rows
from ..store.transactions import by_keys, one
from .tables import CONVERSATION_COLUMNS, MESSAGE_COLUMNS, TRACE_MAP_COLUMNS, TRACES_KEPT
from .tracemap import Tracked
from .transcript import Transcript

_UTC = dt.timezone.utc
log = logging.getLogger("tracejudge.conversations")


def _json_text(value: Any) -> str:
    """JSON text of a column (orjson; json where orjson refuses, e.g. integers past 64 bits)."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return json.dumps(value, ensure_ascii=False, default=str)


def _ts(seconds: float | None) -> dt.datetime | None:
    return dt.datetime.fromtimestamp(seconds, _UTC) if seconds is not None else None


@dataclass(frozen=True)
class ConversationRow:
    """One row of ``conversations``, its fields in the table's column order."""

    conversation_id: str
    service: str | None
    started_at: dt.datetime | None
    ended_at: dt.datetime | None
    ended_by: str | None
    state: str
    user_turns: int
    input_tokens: int | None
    output_tokens: int | None
    llm_calls: int
    message_count: int
    models: str
    system: str | None
    content_captured: bool
    no_content_reason: str | None
    transcript_hash: str | None
    revision: int
    trace_ids: str
    newest_trace_id: str | None
    first_arrival_at: dt.datetime | None
    last_arrival_at: dt.datetime | None
    closed_at: dt.datetime | None
    updated_at: dt.datetime | None
    unparsed_spans: int
    unparsed_logs: int
    sources: str
    first_batch: int | None
    messages_batch: int | None
    grouped_by: str

    @classmethod
    def of(cls, conv: Tracked, tr: Transcript, now: float, written: int) -> "ConversationRow":
        """``written``: the batch the stage has taken in, which its messages rows carry."""
        usage = tr.usage
        return cls(
            conversation_id=conv.id, service=tr.service, started_at=tr.started_at,
            ended_at=tr.ended_at if conv.state == "ended" else None, ended_by=conv.ended_by, state=conv.state,
            user_turns=tr.user_turns, input_tokens=usage.input_tokens if usage else None,
            output_tokens=usage.output_tokens if usage else None, llm_calls=tr.llm_calls,
            message_count=len(tr.messages), models=orjson.dumps(list(tr.models)).decode(), system=tr.system,
            content_captured=tr.content_captured, no_content_reason=tr.no_content_reason,
            transcript_hash=conv.hash, revision=conv.revision, trace_ids=orjson.dumps(conv.traces).decode(),
            newest_trace_id=conv.newest_trace, first_arrival_at=_ts(conv.first_arrival),
            last_arrival_at=_ts(conv.last_arrival), closed_at=_ts(conv.closed_at), updated_at=_ts(now),
            unparsed_spans=tr.unparsed_spans, unparsed_logs=tr.unparsed_logs,
            sources=orjson.dumps(list(tr.sources)).decode(), first_batch=conv.first_batch,
            messages_batch=written, grouped_by=conv.grouped_by)

    def ended(self, conv: Tracked, now: float) -> "ConversationRow":
        """This row once the conversation ended idle, its transcript unchanged."""
        return dataclasses.replace(self, ended_at=conv.last_span_end, ended_by=conv.ended_by, state=conv.state,
                                   closed_at=_ts(conv.closed_at), updated_at=_ts(now))

    def values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, c) for c in CONVERSATION_COLUMNS)  # astuple copies deep: slower


assert tuple(f.name for f in dataclasses.fields(ConversationRow)) == CONVERSATION_COLUMNS


def message_rows(cid: str, tr: Transcript, written: int | None) -> list[tuple[Any, ...]]:
    """The ``messages`` rows of a transcript, with the ``messages_batch`` its conversations row is written with."""
    return [(cid, i, m.role, m.content, _json_text(m.to_dict()["tool_calls"]) if m.tool_calls else None,
             m.tool_call_id, m.name, m.at, m.span_id, m.source, m.truncated, written)
            for i, m in enumerate(tr.messages)]


def delete_messages(cur: duckdb.DuckDBPyConnection, conversations: list[str], archived: Collection[str] = (),
                    arrived_by: dt.datetime | None = None) -> None:
    """Delete these conversations' stored messages, reading only the row groups that can hold them.

    ``messages`` has no index, and a transcript is replaced at every update, so a delete by id alone
    reads the whole table each time: the longer the history, the slower the stage. Each row carries
    in ``first_batch`` the ``messages_batch`` its conversations row was written with, in the same
    transaction; the smallest of the stored ones bounds the delete, and DuckDB skips the row groups
    written before it (rows are appended in the order they are written): the cost follows how long
    ago these transcripts were last written, not how long ago their conversations began. The largest
    bounds it above, so that retention's delete of the oldest conversations skips the newer ones. A row
    written before ``messages_batch`` carries its conversation's ``first_batch``, found from there
    (no upper bound then); one from before either is NULL, and still found.

    Their rows are read from ``live_conversations`` by key, and those of ``archived`` from the archive too,
    there only among the rows that arrived by ``arrived_by`` when given (moves append the oldest first,
    so DuckDB skips the newer row groups).
    """
    bounds = ("SELECT count(*), min(coalesce(messages_batch, first_batch)), max(messages_batch), "
              "count(*) FILTER (WHERE messages_batch IS NULL) FROM {table} WHERE conversation_id IN {keys}")
    found = by_keys(cur, bounds.format(table="live_conversations", keys="{keys}"), conversations)
    if archived:
        keys = "(SELECT unnest(?::VARCHAR[]))" + (" AND last_arrival_at <= ?" if arrived_by else "")
        found += cur.execute(bounds.format(table="archived_conversations", keys=keys),
                             [sorted(archived), *([arrived_by] if arrived_by else [])]).fetchall()
    low, high = 2**63 - 1, 0
    for stored, first, last, unknown in found:
        if not stored:
            continue
        low = min(low, first if first is not None else 0)
        high = max(high, 2**63 - 1 if unknown or last is None else last)
    if low > high:
        return  # none is stored
    cur.execute("DELETE FROM messages WHERE (first_batch BETWEEN ? AND ? OR first_batch IS NULL) "
                "AND conversation_id IN (SELECT unnest(?))", [low, high, conversations])


@dataclass
class Writes:
    """What one cycle changes, written together by ``flush``."""

    conversations: dict[str, ConversationRow] = field(default_factory=dict)
    messages: dict[str, list[tuple[Any, ...]]] = field(default_factory=dict)
    replace: set[str] = field(default_factory=set)  # conversations whose stored messages go
    new: set[str] = field(default_factory=set)  # of ``conversations``, those with no row stored
    deleted: set[str] = field(default_factory=set)
    unarchive: set[str] = field(default_factory=set)  # read back from the archive: their archived rows go
    # trace -> (its conversation, the first and last commits with its rows)
    traces: dict[str, tuple[str, int | None, int | None]] = field(default_factory=dict)
    new_traces: set[str] = field(default_factory=set)  # of ``traces``, those not keyed in ``trace_conversations``
    traces_kept: int = TRACES_KEPT  # keyed in ``trace_conversations``; older ones go to ``trace_archive``

    def __len__(self) -> int:
        """Conversations waiting to be written or deleted."""
        return len(self.conversations) + len(self.deleted)

    def delete(self, cid: str) -> None:
        self.deleted.add(cid)
        self.conversations.pop(cid, None)
        self.messages.pop(cid, None)

    def flush(self, cur: duckdb.DuckDBPyConnection, mark: int) -> None:
        """Write everything in one transaction, column-wise, with the batch mark; then start empty.

        Keyed rows known to be new are inserted; the others replace their stored rows (``_write`` says
        why not ``INSERT OR REPLACE``). Should one taken as new be stored after all, the transaction is
        rolled back and written again with every row replacing, so what is written never depends on it.
        """
        try:
            try:
                self._write(cur, mark, trust_new=True)
            except duckdb.ConstraintException as exc:
                if Transaction.is_open(cur):
                    raise  # part of a caller's transaction, which the failure ended: it cannot be redone here
                log.warning("a conversation or trace taken as new was stored already (%s); written again "
                            "replacing every row", exc)
                self._write(cur, mark, trust_new=False)
        finally:
            self.conversations, self.messages = {}, {}
            self.replace, self.new, self.deleted, self.unarchive = set(), set(), set(), set()
            self.traces, self.new_traces = {}, set()

    def _write(self, cur: duckdb.DuckDBPyConnection, mark: int, trust_new: bool) -> None:
        """One transaction. A keyed row is replaced by deleting the stored one by key (``by_keys``, in the
        key's index), then inserting: DuckDB's ``INSERT OR REPLACE`` checked every row against the key
        at about five times the cost of an insert (trace map at 200,000 keys), and most rows the stage
        writes are new."""
        conversations = [(cid, row) for cid, row in self.conversations.items() if cid not in self.deleted]
        with Transaction(cur):
            # Untrusted, a transcript written in full replaces any stored one as well.
            gone = sorted(self.deleted | self.replace | (set() if trust_new else self.messages.keys()))
            if gone:
                delete_messages(cur, gone, self.unarchive)
            stored = [cid for cid, _ in conversations if not trust_new or cid not in self.new]
            by_keys(cur, "DELETE FROM live_conversations WHERE conversation_id IN {keys}", sorted(self.deleted) + stored)
            if self.unarchive:
                cur.execute("DELETE FROM archived_conversations WHERE conversation_id IN (SELECT unnest(?))",
                            [sorted(self.unarchive)])
            by_keys(cur, "DELETE FROM trace_conversations WHERE trace_id IN {keys}",
                    [t for t in self.traces if not trust_new or t not in self.new_traces])
            insert_rows(cur, "INSERT INTO trace_conversations", TRACE_MAP_COLUMNS,
                        [(t, *where) for t, where in self.traces.items()])
            archive_traces(cur, self.traces_kept)
            insert_rows(cur, "INSERT INTO messages", MESSAGE_COLUMNS,
                        [m for cid, msgs in self.messages.items() if cid not in self.deleted for m in msgs])
            insert_rows(cur, "INSERT INTO live_conversations", CONVERSATION_COLUMNS, [row.values() for _, row in conversations])
            cur.execute("INSERT OR REPLACE INTO tracejudge_state VALUES ('conversations.batch', ?)", [str(mark)])


MOVED_AT_ONCE = 50_000


def archive_traces(cur: duckdb.DuckDBPyConnection, kept: int) -> None:
    """Keep at most ``kept`` traces keyed in ``trace_conversations`` (and a quarter more between moves):
    past that, those with the oldest last commits move to ``trace_archive`` (``TRACE_MAP`` says why).

    A trace back after the map forgot it has a keyed row and an archived one (views take the keyed
    one); its archived row goes when the new one moves. Finding it reads the archive's trace ids, so
    moves come a quarter of ``kept`` at a time: a quarter of a second per move at 10 million archived.
    """
    count = one(cur.execute("SELECT count(*) FROM trace_conversations"))
    if not count or count[0] <= kept + kept // 4:
        return
    # At most MOVED_AT_ONCE a flush: a file of an older version, with every trace keyed, moves its
    # excess over several (800,000 of a million at once took 9 s, 50,000 0.6 s).
    step = min(count[0] - kept, MOVED_AT_ONCE)
    cutoff = one(cur.execute("SELECT coalesce(last_batch, 0) FROM trace_conversations "
                             "ORDER BY last_batch NULLS FIRST LIMIT 1 OFFSET ?", [step - 1]))
    assert cutoff is not None, "the count says the row at this offset exists"
    moved = "last_batch IS NULL OR last_batch <= ?"
    columns = ", ".join(TRACE_MAP_COLUMNS)
    cur.execute(f"DELETE FROM trace_archive WHERE trace_id IN (SELECT trace_id FROM trace_conversations WHERE {moved})",
                [cutoff[0]])
    cur.execute(f"INSERT INTO trace_archive ({columns}) SELECT {columns} FROM trace_conversations WHERE {moved}",
                [cutoff[0]])
    cur.execute(f"DELETE FROM trace_conversations WHERE {moved}", [cutoff[0]])
