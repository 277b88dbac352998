"""What a cycle of the conversation stage writes: ``Writes``, plain data for ``StageData.write``.

``conversations`` rows are ``ConversationRow``s (named fields, the table's
columns in order); a transcript's ``messages`` rows are replaced whole. The
batch mark (``tracejudge_state``: the last commit whose conversations are all
rebuilt and written) goes in the same transaction (``duck.DuckData.write``), so
a crash or a stop at any point leaves it true.

Lifecycle: ``Writes()`` collects a cycle's changes; the stage hands it to
``StageData.write`` with the mark and starts a new one.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import orjson

from .duck import archive_traces, delete_messages  # noqa: F401 - retention imports them from here
from .tables import CONVERSATION_COLUMNS, TRACES_KEPT
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


@dataclass
class Writes:
    """What one cycle changes, written together by ``StageData.write``."""

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
