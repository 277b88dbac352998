"""The conversation/v1 record (``docs/conversation-v1.md``): the one builder, for live and stored conversations.

``conversation_v1`` turns a ``Transcript`` into the record; ``conversation_record``
reads a stored conversation back into a ``Transcript`` (``stored_transcript``)
and hands it to the same builder (``stored_record``); ``conversation_records`` reads many at once. ``stored_transcripts`` is
the same read for many conversations at once (a page of an export), their
messages in one query. The API, the CLI, the evaluator, the review page and exports all read
conversations through it, so what a judge is shown is what a reviewer and an
export see.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Mapping, NamedTuple, Sequence

import duckdb
import orjson

from ..words import iso_utc
from ..normalize import ToolCall
from ..store.transactions import by_keys
from .transcript import Transcript, TranscriptMessage, Usage


def conversation_v1(transcript: Transcript, conversation_id: str, ended_by: str = "open", *,
                    sampling: Mapping[str, Any] | None = None,
                    attributes: Mapping[str, Any] | None = None,
                    grouped_by: str | None = None) -> dict[str, Any]:
    """The conversation/v1 record of a transcript.

    Facts outside the format's table (call count, capture status, sources, and
    the caller's ``attributes``) go under ``attributes``, as the format requires.
    ``grouped_by``: how its traces were grouped (``stitch.GROUPED_BY``), when known.
    """
    t = transcript
    attrs: dict[str, Any] = {"llm_calls": t.llm_calls, "content_captured": t.content_captured,
                             "sources": list(t.sources)}
    if t.no_content_reason:
        attrs["no_content_reason"] = t.no_content_reason
    if t.unparsed_spans or t.unparsed_logs:
        attrs.update(unparsed_spans=t.unparsed_spans, unparsed_logs=t.unparsed_logs)
    if t.truncated_spans:
        attrs["truncated_spans"] = list(t.truncated_spans)
    attrs.update(attributes or {})
    record: dict[str, Any] = {
        "schema": "conversation/v1",
        "id": conversation_id,
        "source": "production",
        "service": t.service,
        "started_at": iso_utc(t.started_at),
        "ended_at": iso_utc(t.ended_at),
        "ended_by": ended_by,
        "system": t.system,
        "messages": [m.to_dict() for m in t.messages],
        "models": list(t.models),
        "trace_ids": list(t.trace_ids),
        "attributes": attrs,
    }
    if grouped_by is not None:
        record["grouped_by"] = grouped_by
    if t.usage is not None:  # absent when no LLM call reported token counts
        record["usage"] = {"input_tokens": t.usage.input_tokens, "output_tokens": t.usage.output_tokens}
    if sampling is not None:
        record["sampling"] = dict(sampling)
    return record


STORED_COLUMNS = (
    "conversation_id", "service", "started_at", "ended_at", "state", "ended_by", "system", "models", "input_tokens",
    "output_tokens", "trace_ids", "llm_calls", "content_captured", "no_content_reason", "revision", "transcript_hash",
    "user_turns", "unparsed_spans", "unparsed_logs", "sources", "grouped_by",
)
"""The ``conversations`` columns ``stored_transcripts`` reads a transcript from, in the order it takes them."""


class StoredFacts(NamedTuple):
    """What a stored conversation says beside its transcript."""

    state: str
    ended_by: str | None
    revision: int
    transcript_hash: str
    user_turns: int
    grouped_by: str | None = None


def stored_select(alias: str = "", text_times: bool = False) -> str:
    """The select list of ``STORED_COLUMNS``, each prefixed with ``alias`` (``"c."``); with ``text_times``
    the times as the record's RFC 3339 text (see ``stored_transcripts``)."""
    time = _utc_text if text_times else (lambda c: f"timezone('UTC', {c})")
    return ", ".join(f"{time(alias + c)} AS {c}" if c in _TIMES else alias + c for c in STORED_COLUMNS)


# Times are read as UTC wall-clock TIMESTAMPs: DuckDB hands a TIMESTAMPTZ to Python in the session's zone,
# a conversion that costs more than the rest of a message's read.
_TIMES = frozenset({"started_at", "ended_at"})


def conversation_record(cur: duckdb.DuckDBPyConnection, conversation_id: str) -> dict[str, Any] | None:
    """The conversation/v1 record of a stored conversation, or None.

    Its ``attributes`` also carry the stored ``revision``, ``transcript_hash`` and ``user_turns``.
    """
    stored = stored_transcript(cur, conversation_id)
    if stored is None:
        return None
    return stored_record(conversation_id, *stored)


def conversation_records(cur: duckdb.DuckDBPyConnection, conversation_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``conversation_record`` of many conversations in two reads (their rows, then their messages);
    those not stored are left out."""
    if not conversation_ids:
        return {}
    return {cid: stored_record(cid, transcript, facts)
            for cid, transcript, facts in stored_transcripts(cur, _stored_rows(cur, conversation_ids))}


def _stored_rows(cur: duckdb.DuckDBPyConnection, conversation_ids: Sequence[str]) -> list[tuple[Any, ...]]:
    """The ``stored_select`` rows of these conversations, by id: the live table by its key first (the
    evaluator reads the conversations it judges, just ended), the archive for the rest."""
    rows = by_keys(cur, f"SELECT {stored_select()} FROM live_conversations WHERE conversation_id IN {{keys}}",
                   sorted(set(conversation_ids)))
    rest = sorted(set(conversation_ids) - {r[0] for r in rows})
    if rest:
        rows += cur.execute(f"SELECT {stored_select()} FROM archived_conversations WHERE conversation_id IN "
                            "(SELECT unnest(?::VARCHAR[]))", [rest]).fetchall()
    return sorted(rows, key=lambda r: r[0])


def stored_record(conversation_id: str, transcript: Transcript, facts: StoredFacts, *,
                  sampling: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The conversation/v1 record of a transcript read back by ``stored_transcripts`` (``conversation_v1``
    with the stored ``ended_by`` and the stored facts under ``attributes``)."""
    ended_by = facts.ended_by if facts.state == "ended" and facts.ended_by else "open"
    return conversation_v1(transcript, conversation_id, ended_by, sampling=sampling,
                           attributes={"revision": facts.revision, "transcript_hash": facts.transcript_hash,
                                       "user_turns": facts.user_turns}, grouped_by=facts.grouped_by)


def stored_transcript(cur: duckdb.DuckDBPyConnection, conversation_id: str
                      ) -> tuple[Transcript, StoredFacts] | None:
    """A stored conversation read back into a ``Transcript``, with its (state, ended_by, revision,
    transcript_hash, user_turns); None when it is not stored."""
    found = stored_transcripts(cur, _stored_rows(cur, [conversation_id]))
    return (found[0][1], found[0][2]) if found else None


def stored_transcripts(cur: duckdb.DuckDBPyConnection, rows: Sequence[Sequence[Any]], *,
                       text_times: bool = False) -> list[tuple[str, Transcript, StoredFacts]]:
    """Stored conversations read back into ``Transcript``s, their messages in one query.

    Args:
        rows: ``conversations`` rows selected as ``stored_select`` lists the columns (more columns
            after those are ignored), in the order wanted.
        text_times: each message's ``at`` as the record's RFC 3339 text, formatted by DuckDB, for
            transcripts only turned into records (an export): a third of the time of a page goes into
            making and formatting those datetimes in Python otherwise.

    Returns:
        ``(conversation_id, transcript, facts)`` in the order of ``rows``.
    """
    if not rows:
        return []
    ids = [r[0] for r in rows]
    select = message_select(text_times)
    if len(ids) == 1:
        found = cur.execute(f"SELECT {select} FROM messages WHERE conversation_id = ? ORDER BY seq",
                            ids).fetchall()
    else:
        # The range lets the scan skip row groups outside it (a keyset page's ids are neighbours); the list
        # keeps only these conversations (a filtered page leaves others between them).
        found = cur.execute(
            f"SELECT {select} FROM messages WHERE conversation_id BETWEEN ? AND ? "
            "AND conversation_id IN (SELECT unnest(?::VARCHAR[])) ORDER BY conversation_id, seq",
            [min(ids), max(ids), ids]).fetchall()
    messages: dict[str, list[TranscriptMessage]] = {}
    for m in found:
        messages.setdefault(m[0], []).append(stored_message(m, text_times))
    return [(row[0], *stored_conversation(row, messages.get(row[0], ()))) for row in rows]


def stored_message(row: Sequence[Any], text_times: bool = False) -> TranscriptMessage:
    """One message of a transcript from a ``messages`` row selected as ``message_select`` lists the columns."""
    _, role, content, tool_calls, tool_call_id, name, at, span_id, source, truncated = row
    return TranscriptMessage(
        role=role, content=content or "", tool_calls=_tool_calls(tool_calls), tool_call_id=tool_call_id or None,
        name=name or None, at=at if text_times else _utc(at), span_id=span_id or None, source=source,
        truncated=bool(truncated))


def stored_conversation(row: Sequence[Any], messages: Sequence[TranscriptMessage]
                        ) -> tuple[Transcript, StoredFacts]:
    """A stored conversation's transcript and facts, from its ``conversations`` row (selected as
    ``stored_select`` lists the columns; more after those are ignored) and its messages in order."""
    (_, service, started, ended, state, ended_by, system, models, inp, out_tokens, trace_ids, llm_calls,
     captured, reason, revision, digest, user_turns, unparsed_spans, unparsed_logs, sources, grouped_by) = row[:_STORED]
    transcript = Transcript(
        messages=tuple(messages), system=system, models=tuple(orjson.loads(models or "[]")),
        usage=None if inp is None and out_tokens is None else Usage(inp or 0, out_tokens or 0),
        trace_ids=tuple(orjson.loads(trace_ids or "[]")), service=service, started_at=_utc(started),
        ended_at=_utc(ended), llm_calls=llm_calls, content_captured=bool(captured), no_content_reason=reason,
        unparsed_spans=unparsed_spans or 0, unparsed_logs=unparsed_logs or 0,
        sources=tuple(orjson.loads(sources or "[]")))
    return transcript, StoredFacts(state, ended_by, revision, digest, user_turns, grouped_by)


_STORED = len(STORED_COLUMNS)


def message_select(text_times: bool = False) -> str:
    """The select list of the ``messages`` columns a transcript is read from (see ``stored_transcripts``)."""
    at = _utc_text('"at"') if text_times else "timezone('UTC', \"at\")"
    return f"conversation_id, role, content, tool_calls, tool_call_id, name, {at} AS \"at\", span_id, source, truncated"


def _utc_text(column: str) -> str:
    # As ``listing.iso_utc`` writes it: seconds, then the microseconds only when there are some, then Z.
    utc = f"timezone('UTC', {column})"
    return (f"CASE WHEN microsecond({column}) % 1000000 = 0 THEN strftime({utc}, '%Y-%m-%dT%H:%M:%SZ') "
            f"ELSE strftime({utc}, '%Y-%m-%dT%H:%M:%S.%fZ') END")


def _tool_calls(text: str | None) -> tuple[ToolCall, ...]:
    if not text or text == "[]":
        return ()
    return tuple(ToolCall(tc.get("id"), tc["name"], tc.get("arguments")) for tc in orjson.loads(text))


def _utc(value: Any) -> Any:
    # DuckDB hands TIMESTAMPTZ back in the session's zone (naive ones are UTC); the record speaks UTC.
    # Text (``text_times``) is the record's already.
    if not isinstance(value, dt.datetime):
        return value
    if value.tzinfo is None:
        return value.replace(tzinfo=dt.timezone.utc)
    return value if value.tzinfo is dt.timezone.utc else value.astimezone(dt.timezone.utc)
