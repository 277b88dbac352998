"""The rebuilt conversation: ``Transcript``, its messages and its digest.

Public: ``Transcript``, ``TranscriptMessage``, ``Usage``. Its conversation/v1
record is built by ``record.conversation_v1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from judges import Message as JudgeMessage
from judges import ToolCall as JudgeToolCall
from judges import TranscriptDigest, render_lines, transcript_sha256

from ..words import iso_utc
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
    at: datetime | str | None = None
    """When it was sent; RFC 3339 text when read back only to be exported (``stored_transcripts``)."""
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
            out["at"] = iso_utc(self.at)
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
        started_at / ended_at: first span start, last span end (UTC); RFC 3339 text when read back only to
            be exported (``stored_transcripts``), as a message's ``at``.
        llm_calls: number of distinct LLM calls.
        content_captured: False when no message content exists at all; such a
            conversation is stored and counted but never judged.
        no_content_reason: why, and how to turn capture on.
        unparsed_spans / unparsed_logs: rows skipped as malformed.
        truncated_spans: span ids whose content JSON did not parse (cut by an
            attribute length limit); their messages may be missing.
        sources: the dialect/location names the messages came from.
        opening: how many of ``messages`` the first call with content was sent (its input, the history
            it resends): a trace with no conversation id continues a conversation whose whole
            transcript these begin with (``stitch``). 0 when not rebuilt from rows.
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
    opening: int = 0

    @property
    def user_turns(self) -> int:
        """Number of user messages."""
        return sum(1 for m in self.messages if m.role == "user")

    def content_hash(self, memo: "DigestMemo | None" = None) -> str:
        """The digest of what a judge reads (``judges.transcript_sha256``): stored as ``transcript_hash``.

        A new digest is a new revision, to be judged again; the evaluator checks
        its verdicts against the same function over the stored record, which
        gives the same messages.

        ``memo`` carries the digest's state between calls for a transcript that
        grows (the conversation stage's rebuilds reuse unchanged message
        objects): only the messages after the last one still the same are
        rendered and hashed. A message's line depends on no other but for a
        tool result without a name (the judge names it from the call before);
        a transcript holding one is rendered whole.
        """
        if memo is None or any(m.role == "tool" and not m.name for m in self.messages):
            return transcript_sha256(_judge_message(m) for m in self.messages)
        same, before = 0, memo.messages
        for old, new in zip(before, self.messages):
            if old is not new:
                break
            same += 1
        states = memo.states[:same + 1]
        for m in self.messages[same:]:
            state = states[-1].copy()
            state.add(next(render_lines([_judge_message(m)])))
            states.append(state)
        memo.messages, memo.states = self.messages, states
        return states[-1].hexdigest()


class DigestMemo:
    """What ``Transcript.content_hash`` keeps between calls: the messages it hashed, and the digest's
    state after each of them (``states[i]``: after the first ``i``)."""

    __slots__ = ("messages", "states")

    def __init__(self) -> None:
        self.messages: tuple[TranscriptMessage, ...] = ()
        self.states: list[TranscriptDigest] = [TranscriptDigest()]


def _judge_message(m: TranscriptMessage) -> JudgeMessage:
    """The message as a judge reads it; no validation: a message the record's reader would refuse still hashes."""
    return JudgeMessage.model_construct(
        role=m.role, content=m.content,  # type: ignore[arg-type]  # the stored role, not validated here
        tool_call_id=m.tool_call_id, name=m.name,
        tool_calls=[JudgeToolCall.model_construct(id=tc.id, name=tc.name, arguments=tc.arguments)
                    for tc in m.tool_calls])
