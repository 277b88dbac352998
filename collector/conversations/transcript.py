"""The rebuilt conversation: ``Transcript`` and its conversation/v1 record.

Public: ``Transcript``, ``TranscriptMessage``, ``Usage``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Mapping

from ..normalize import ToolCall

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def from_unix_nano(ns: int | None) -> datetime | None:
    """OTLP nanoseconds -> an aware UTC datetime (None for 0: "not set", and for a time no datetime holds)."""
    if not ns:
        return None
    try:
        return _EPOCH + timedelta(microseconds=ns // 1000)
    except OverflowError:  # before year 1 or after 9999: garbage in a column, never a reason to fail a rebuild
        return None


def _rfc3339(dt: datetime | None) -> str | None:
    return dt.isoformat().replace("+00:00", "Z") if dt is not None else None


@dataclass(frozen=True)
class Usage:
    """Tokens summed over a conversation's LLM calls, each call once."""

    input_tokens: int = 0
    output_tokens: int = 0


@dataclass(frozen=True)
class TranscriptMessage:
    """One message of the transcript, with where it was first seen."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    at: datetime | None = None
    span_id: str | None = None
    source: str | None = None
    truncated: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The conversation/v1 message object (optional fields only when set)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [
                {**({"id": tc.id} if tc.id else {}), "name": tc.name, "arguments": tc.arguments}
                for tc in self.tool_calls
            ]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.name:
            out["name"] = self.name
        if self.at is not None:
            out["at"] = _rfc3339(self.at)
        if self.span_id:
            out["span_id"] = self.span_id
        if self.truncated:
            out["truncated"] = True
        return out


@dataclass(frozen=True)
class Transcript:
    """A conversation rebuilt from its traces.

    Attributes:
        messages: the transcript, each message once, in order.
        system: the system instructions of the first call that had any, if captured.
        models: response (else request) models of the LLM calls, first seen first.
        usage: tokens summed over the LLM calls, each call counted once; None
            when no call reported any.
        trace_ids: contributing traces, oldest first.
        service: ``service.name`` of the first span that has one.
        started_at / ended_at: first span start, last span end (UTC).
        llm_calls: number of distinct LLM calls.
        content_captured: False when no message content exists at all; such a
            conversation is stored and counted but never judged.
        no_content_reason: why, and how to turn capture on.
        unparsed_spans / unparsed_logs: rows skipped as malformed.
        truncated_spans: span ids whose content JSON did not parse (cut by an
            attribute length limit); their messages may be missing.
        sources: the dialect/location names the messages came from.
    """

    messages: tuple[TranscriptMessage, ...] = ()
    system: str | None = None
    models: tuple[str, ...] = ()
    usage: Usage | None = None
    trace_ids: tuple[str, ...] = ()
    service: str | None = None
    started_at: datetime | None = None
    ended_at: datetime | None = None
    llm_calls: int = 0
    content_captured: bool = False
    no_content_reason: str | None = None
    unparsed_spans: int = 0
    unparsed_logs: int = 0
    truncated_spans: tuple[str, ...] = ()
    sources: tuple[str, ...] = ()

    @property
    def user_turns(self) -> int:
        """Number of user messages."""
        return sum(1 for m in self.messages if m.role == "user")

    def content_hash(self) -> str:
        """A digest of what a judge sees (system + messages); re-judge when it changes."""
        doc = {"system": self.system, "messages": [
            {k: v for k, v in m.to_dict().items() if k not in ("at", "span_id")} for m in self.messages]}
        text = json.dumps(doc, ensure_ascii=False, sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def to_conversation_v1(self, conversation_id: str, ended_by: str = "open", *,
                           sampling: Mapping[str, Any] | None = None,
                           attributes: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The conversation/v1 record (docs/conversation-v1.md).

        Facts outside the format's table (call count, capture status, sources)
        go under ``attributes``, as the format requires.
        """
        attrs: dict[str, Any] = {
            "llm_calls": self.llm_calls,
            "content_captured": self.content_captured,
            "sources": list(self.sources),
        }
        if self.no_content_reason:
            attrs["no_content_reason"] = self.no_content_reason
        if self.unparsed_spans or self.unparsed_logs:
            attrs["unparsed_spans"] = self.unparsed_spans
            attrs["unparsed_logs"] = self.unparsed_logs
        if self.truncated_spans:
            attrs["truncated_spans"] = list(self.truncated_spans)
        attrs.update(attributes or {})
        record: dict[str, Any] = {
            "schema": "conversation/v1",
            "id": conversation_id,
            "source": "production",
            "service": self.service,
            "started_at": _rfc3339(self.started_at),
            "ended_at": _rfc3339(self.ended_at),
            "ended_by": ended_by,
            "system": self.system,
            "messages": [m.to_dict() for m in self.messages],
            "models": list(self.models),
            "trace_ids": list(self.trace_ids),
            "attributes": attrs,
        }
        if self.usage is not None:
            record["usage"] = {"input_tokens": self.usage.input_tokens, "output_tokens": self.usage.output_tokens}
        if sampling is not None:
            record["sampling"] = dict(sampling)
        return record
