"""A store filled without traffic: conversations, messages, sampling decisions and verdicts written as rows.

For tests that need thousands of stored conversations quickly (an export, a
comparison): the rows have the columns and the meaning the conversation stage
and the evaluator give them, the transcript hash included, but no spans.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb

from collector.conversations.tables import CONVERSATION_COLUMNS, MESSAGE_COLUMNS
from collector.conversations.tables import SCHEMA as CONVERSATIONS_SCHEMA
from collector.conversations.transcript import Transcript, TranscriptMessage, Usage
from collector.conversations.rebuild import message_rows
from collector.evals import judging
from collector.normalize import ToolCall
from collector.review import calibration
from collector.review import queue as review_queue
from collector.store import Store, insert_rows

T0 = dt.datetime(2026, 11, 30, 9, 0, tzinfo=dt.timezone.utc)


@dataclass
class StoredConversation:
    """One conversation as the conversation stage stores it."""

    conversation_id: str
    messages: list[TranscriptMessage]
    state: str = "ended"
    ended_by: str | None = "idle"
    service: str = "shopbot"
    arrived: dt.datetime = T0
    revision: int = 1
    models: tuple[str, ...] = ("gpt-4o-mini",)
    system: str | None = "You are ShopBot."
    trace_ids: tuple[str, ...] = field(default_factory=tuple)

    def transcript(self) -> Transcript:
        return Transcript(messages=tuple(self.messages), system=self.system, models=self.models,
                          usage=Usage(100 * len(self.messages), 20 * len(self.messages)),
                          trace_ids=self.trace_ids or (hashlib.sha256(self.conversation_id.encode()).hexdigest()[:32],),
                          service=self.service, started_at=self.arrived - dt.timedelta(minutes=5),
                          ended_at=self.arrived, llm_calls=len(self.messages), content_captured=True,
                          sources=("otel_genai",))

    def rows(self) -> tuple[tuple[Any, ...], list[tuple[Any, ...]]]:
        tr = self.transcript()
        ended = self.state == "ended"
        values = {
            "conversation_id": self.conversation_id, "service": tr.service, "started_at": tr.started_at,
            "ended_at": tr.ended_at if ended else None, "ended_by": self.ended_by if ended else None,
            "state": self.state, "user_turns": tr.user_turns, "input_tokens": tr.usage.input_tokens if tr.usage else None,
            "output_tokens": tr.usage.output_tokens if tr.usage else None, "llm_calls": tr.llm_calls,
            "message_count": len(tr.messages), "models": json.dumps(list(tr.models)), "system": tr.system,
            "content_captured": True, "no_content_reason": None, "transcript_hash": tr.content_hash(),
            "revision": self.revision, "trace_ids": json.dumps(list(tr.trace_ids)),
            "newest_trace_id": tr.trace_ids[-1], "first_arrival_at": tr.started_at, "last_arrival_at": self.arrived,
            "closed_at": self.arrived if ended else None, "updated_at": self.arrived, "unparsed_spans": 0,
            "unparsed_logs": 0, "sources": json.dumps(list(tr.sources)), "first_batch": None,
            "messages_batch": None, "grouped_by": "trace" if self.conversation_id.startswith("trace:") else "id",
        }
        return tuple(values[c] for c in CONVERSATION_COLUMNS), message_rows(self.conversation_id, tr, None)


def text_messages(turns: Sequence[tuple[str, str | None]], at: dt.datetime = T0) -> list[TranscriptMessage]:
    """(user, assistant) turns as messages; an assistant of None leaves the user's message unanswered."""
    out = []
    for i, (user, bot) in enumerate(turns):
        out.append(TranscriptMessage("user", user, at=at + dt.timedelta(seconds=20 * i), source="otel_genai"))
        if bot is not None:
            out.append(TranscriptMessage("assistant", bot, at=at + dt.timedelta(seconds=20 * i + 5),
                                         source="otel_genai"))
    return out


def tool_turn(user: str, call_id: str, result: str, answer: str) -> list[TranscriptMessage]:
    """A user message answered after a tool call (the call, its result, then the answer)."""
    return [TranscriptMessage("user", user, source="otel_genai"),
            TranscriptMessage("assistant", "", tool_calls=(ToolCall(call_id, "lookup_order", {"order_id": "B-1"}),),
                              span_id="00f067aa0ba902b7", source="otel_genai"),
            TranscriptMessage("tool", result, tool_call_id=call_id, name="lookup_order", source="otel_genai"),
            TranscriptMessage("assistant", answer, source="otel_genai")]


def create_store(path: Path) -> None:
    """A fresh store file with the tables of the conversation stage, the evaluator and the review queue."""
    store = Store(path)
    store.open()
    cur = store.cursor()
    try:
        cur.execute(CONVERSATIONS_SCHEMA)
        judging.ensure_schema(cur)
        review_queue.ensure_schema(cur)
    finally:
        cur.close()
        store.close()


def write(path: Path, conversations: Sequence[StoredConversation], *,
          decisions: Sequence[tuple[str, bool, float, str, str | None]] = (),
          verdicts: Sequence[dict[str, Any]] = ()) -> None:
    """Add conversations, sampling decisions ``(id, sampled, probability, rule, skipped_reason)`` and
    verdicts (``verdict_row`` fields) to a store ``create_store`` made."""
    con = duckdb.connect(str(path))
    try:
        convs, msgs = [], []
        for c in conversations:
            row, messages = c.rows()
            convs.append(row)
            msgs += messages
        insert_rows(con, "INSERT INTO live_conversations", CONVERSATION_COLUMNS, convs)
        insert_rows(con, "INSERT INTO messages", MESSAGE_COLUMNS, msgs)
        for cid, sampled, probability, rule, skipped in decisions:
            con.execute("INSERT INTO sampling_decisions VALUES (?, 1, NULL, ?, ?, ?, ?, ?)",
                        [cid, sampled, probability, rule, skipped, T0])
        add_verdicts(con, verdicts)
    finally:
        con.close()


def add_verdicts(cur: duckdb.DuckDBPyConnection, verdicts: Sequence[dict[str, Any]]) -> None:
    """Store verdicts (``verdict_row`` fields, and any column the table has), numbered after those stored."""
    if not verdicts:  # a store may have no verdicts table at all
        return
    [(last,)] = cur.execute("SELECT coalesce(max(seq), -1) FROM verdicts").fetchall()
    for n, v in enumerate(verdicts, start=last + 1):
        values = {**verdict_row(**v), "seq": n}
        cur.execute(f"INSERT INTO verdicts ({', '.join(values)}) VALUES ({', '.join('?' for _ in values)})",
                    list(values.values()))


def verdict_row(conversation_id: str, criterion_id: str, result: str, *, version: int = 1,
                superseded: bool = False, sha: str = "0" * 64, **columns: Any) -> dict[str, Any]:
    """A verdict's columns; ``columns`` set others (``judged_at``, ``inclusion_probability``...)."""
    key = f"{conversation_id}/{criterion_id}/{version}/{sha}/{superseded}"
    return {"id": key, "conversation_id": conversation_id, "criterion_id": criterion_id,
            "criterion_version": version, "judge_provider": "code", "judge_model": "code",
            "transcript_sha256": sha, "result": result, "error_reason": None, "reasoning": "r", "evidence": "[]",
            "evidence_verified": True, "flagged": False, "input_tokens": 0, "output_tokens": 0, "raw_reply": "",
            "inclusion_probability": 1.0, "sampling_rule": "default", "judged_at": T0, "superseded": superseded,
            "live": False,
            **columns}


def label(cur: duckdb.DuckDBPyConnection, conversation_id: str, criterion_id: str, value: str, at: dt.datetime,
          reviewer: str = "ana") -> None:
    """A blind label of ``reviewer`` given at ``at``, on the conversation's labelling task (made if need be)."""
    cur.execute("INSERT INTO calibration_items SELECT nextval('calibration_item_seq'), ?, ?, ? WHERE NOT EXISTS "
                "(SELECT 1 FROM calibration_items WHERE conversation_id = ? AND criterion_id = ?)",
                [conversation_id, criterion_id, at, conversation_id, criterion_id])
    [(item,)] = cur.execute("SELECT id FROM calibration_items WHERE conversation_id = ? AND criterion_id = ?",
                            [conversation_id, criterion_id]).fetchall()
    calibration.label(cur, item, value, reviewer, now=at)
