"""The conversation/v1 record (``docs/conversation-v1.md``): the one builder, for live and stored conversations.

``conversation_v1`` turns a ``Transcript`` into the record; ``conversation_record``
reads a stored conversation back into a ``Transcript`` (``stored_transcript``)
and hands it to the same builder. The API, the CLI, the evaluator, the review page and exports all read
conversations through it, so what a judge is shown is what a reviewer and an
export see.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Mapping

import duckdb
import orjson

from ..listing import iso_utc
from ..normalize import ToolCall
from .transcript import Transcript, TranscriptMessage, Usage


def conversation_v1(transcript: Transcript, conversation_id: str, ended_by: str = "open", *,
                    sampling: Mapping[str, Any] | None = None,
                    attributes: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The conversation/v1 record of a transcript.

    Facts outside the format's table (call count, capture status, sources, and
    the caller's ``attributes``) go under ``attributes``, as the format requires.
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
    if t.usage is not None:  # absent when no LLM call reported token counts
        record["usage"] = {"input_tokens": t.usage.input_tokens, "output_tokens": t.usage.output_tokens}
    if sampling is not None:
        record["sampling"] = dict(sampling)
    return record


def conversation_record(cur: duckdb.DuckDBPyConnection, conversation_id: str) -> dict[str, Any] | None:
    """The conversation/v1 record of a stored conversation, or None.

    Its ``attributes`` also carry the stored ``revision``, ``transcript_hash`` and ``user_turns``.
    """
    stored = stored_transcript(cur, conversation_id)
    if stored is None:
        return None
    transcript, (state, ended_by, revision, digest, user_turns) = stored
    return conversation_v1(transcript, conversation_id, ended_by if state == "ended" and ended_by else "open",
                           attributes={"revision": revision, "transcript_hash": digest, "user_turns": user_turns})


def stored_transcript(cur: duckdb.DuckDBPyConnection, conversation_id: str
                      ) -> tuple[Transcript, tuple[str, str | None, int, str, int]] | None:
    """A stored conversation read back into a ``Transcript``, with its (state, ended_by, revision,
    transcript_hash, user_turns); None when it is not stored."""
    row = cur.execute(
        "SELECT service, started_at, ended_at, state, ended_by, system, models, input_tokens, output_tokens, "
        "trace_ids, llm_calls, content_captured, no_content_reason, revision, transcript_hash, user_turns, "
        "unparsed_spans, unparsed_logs, sources FROM conversations WHERE conversation_id = ?",
        [conversation_id]).fetchone()
    if row is None:
        return None
    (service, started, ended, state, ended_by, system, models, inp, out, trace_ids, llm_calls, captured,
     reason, revision, digest, user_turns, unparsed_spans, unparsed_logs, sources) = row
    messages = tuple(
        TranscriptMessage(role=role, content=content or "", tool_calls=tuple(
            ToolCall(tc.get("id"), tc["name"], tc.get("arguments")) for tc in orjson.loads(tool_calls or "[]")),
            tool_call_id=tool_call_id or None, name=name or None, at=_utc(at), span_id=span_id or None,
            source=source, truncated=bool(truncated))
        for role, content, tool_calls, tool_call_id, name, at, span_id, source, truncated in cur.execute(
            "SELECT role, content, tool_calls, tool_call_id, name, \"at\", span_id, source, truncated FROM messages "
            "WHERE conversation_id = ? ORDER BY seq", [conversation_id]).fetchall())
    transcript = Transcript(
        messages=messages, system=system, models=tuple(orjson.loads(models or "[]")),
        usage=None if inp is None and out is None else Usage(inp or 0, out or 0),
        trace_ids=tuple(orjson.loads(trace_ids or "[]")), service=service, started_at=_utc(started),
        ended_at=_utc(ended), llm_calls=llm_calls, content_captured=bool(captured), no_content_reason=reason,
        unparsed_spans=unparsed_spans or 0, unparsed_logs=unparsed_logs or 0,
        sources=tuple(orjson.loads(sources or "[]")))
    return transcript, (state, ended_by, revision, digest, user_turns)


def _utc(value: dt.datetime | None) -> dt.datetime | None:
    # DuckDB hands TIMESTAMPTZ back in the session's zone (naive ones are UTC); the record speaks UTC.
    if value is None:
        return None
    return (value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)).astimezone(dt.timezone.utc)
