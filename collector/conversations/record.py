"""A stored conversation as a conversation/v1 record (``docs/conversation-v1.md``): the one builder.

The API, the CLI, the evaluator and the review page all read conversations
through it, so what a judge is shown is what a reviewer and an export see.
"""

from __future__ import annotations

from typing import Any

import duckdb
import orjson

from ..listing import iso_utc


def conversation_record(cur: duckdb.DuckDBPyConnection, conversation_id: str) -> dict[str, Any] | None:
    """The conversation/v1 record of a stored conversation, or None."""
    row = cur.execute(
        "SELECT service, started_at, ended_at, state, ended_by, system, models, input_tokens, output_tokens, "
        "trace_ids, llm_calls, content_captured, no_content_reason, revision, transcript_hash, user_turns, "
        "unparsed_spans, unparsed_logs, sources FROM conversations WHERE conversation_id = ?",
        [conversation_id]).fetchone()
    if row is None:
        return None
    (service, started, ended, state, ended_by, system, models, inp, out, trace_ids, llm_calls, captured,
     reason, revision, digest, user_turns, unparsed_spans, unparsed_logs, sources) = row
    messages = []
    for role, content, tool_calls, tool_call_id, name, at, span_id, truncated in cur.execute(
            "SELECT role, content, tool_calls, tool_call_id, name, \"at\", span_id, truncated FROM messages "
            "WHERE conversation_id = ? ORDER BY seq", [conversation_id]).fetchall():
        msg: dict[str, Any] = {"role": role, "content": content or ""}
        if tool_calls:
            msg["tool_calls"] = orjson.loads(tool_calls)
        if tool_call_id:
            msg["tool_call_id"] = tool_call_id
        if name:
            msg["name"] = name
        if at is not None:
            msg["at"] = iso_utc(at)
        if span_id:
            msg["span_id"] = span_id
        if truncated:
            msg["truncated"] = True
        messages.append(msg)
    attributes: dict[str, Any] = {"llm_calls": llm_calls, "content_captured": bool(captured),
                                  "revision": revision, "transcript_hash": digest, "user_turns": user_turns,
                                  "sources": orjson.loads(sources or "[]")}
    if reason:
        attributes["no_content_reason"] = reason
    if unparsed_spans or unparsed_logs:
        attributes.update(unparsed_spans=unparsed_spans, unparsed_logs=unparsed_logs)
    record: dict[str, Any] = {
        "schema": "conversation/v1",
        "id": conversation_id,
        "source": "production",
        "service": service,
        "started_at": iso_utc(started),
        "ended_at": iso_utc(ended),
        "ended_by": ended_by if state == "ended" and ended_by else "open",
        "system": system,
        "messages": messages,
        "models": orjson.loads(models or "[]"),
        "trace_ids": orjson.loads(trace_ids or "[]"),
        "attributes": attributes,
    }
    if inp is not None or out is not None:  # absent when no LLM call reported token counts
        record["usage"] = {"input_tokens": inp or 0, "output_tokens": out or 0}
    return record
