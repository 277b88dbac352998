"""Read queries shared by the JSON API (in the daemon) and the CLI (when no daemon runs).

Each takes a DuckDB cursor of its own and returns plain JSON-ready values.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import duckdb
import orjson

MAX_LIMIT = 100_000
"""The most rows a listing returns at once (``limit``), in the API and the CLI."""

CONVERSATION_LIST_COLUMNS = (
    "conversation_id", "service", "state", "ended_by", "started_at", "ended_at", "user_turns",
    "message_count", "llm_calls", "input_tokens", "output_tokens", "content_captured", "revision",
    "last_arrival_at",
)


def iso_utc(value: Any) -> Any:
    """A datetime (naive ones are UTC, as DuckDB returns them) as RFC 3339 UTC text; anything else as is."""
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.timezone.utc)
        return value.astimezone(dt.timezone.utc).isoformat().replace("+00:00", "Z")
    return value


def parse_since(text: str, now: dt.datetime | None = None) -> dt.datetime:
    """``15m`` / ``2h`` / ``7d`` ago, or an ISO 8601 time (UTC when it has no zone)."""
    from .config import parse_duration

    now = now or dt.datetime.now(dt.timezone.utc)
    try:
        seconds = parse_duration(text)
    except ValueError:
        seconds = None
    try:
        if seconds is not None:
            return now - dt.timedelta(seconds=seconds)
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
        return (when if when.tzinfo else when.replace(tzinfo=dt.timezone.utc)).astimezone(dt.timezone.utc)
    except OverflowError:
        raise ValueError(f"since: {text!r} is before the year 1") from None
    except ValueError:
        raise ValueError(f"since: {text!r} is neither a duration (15m, 2h, 7d) nor an ISO 8601 time") from None


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


def conversation_counts(cur: duckdb.DuckDBPyConnection) -> dict[str, int]:
    """Conversations by state, plus how many carry no content (never judged)."""
    counts = {"open": 0, "ended": 0}
    for state, n in cur.execute("SELECT state, count(*) FROM conversations GROUP BY state").fetchall():
        counts[state] = n
    row = cur.execute("SELECT count(*) FROM conversations WHERE NOT content_captured").fetchone()
    counts["without_content"] = int(row[0]) if row else 0
    return counts
