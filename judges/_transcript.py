"""The transcript model (conversation/v1), its rendering for a judge, and the hash of that rendering.

A judge reads the transcript as one message per line (``USER: ...``,
``BOT: ...``, ``TOOL name: ...``). Production messages are hostile input: a user
may type ``</transcript>`` or a fake ``BOT:`` line to steer the judge. The
rendering keeps the frame's structure unforgeable: frame tags inside content
are defused and every continuation line of a message is indented, so only the
renderer writes a line that starts with a speaker label.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError, field_validator

from ._errors import ConversationError
from ._jsonl import escape_line_breaks, split_json_lines

SCHEMA = "conversation/v1"

EndedBy = Literal[
    "handover", "bot_closed", "idle", "open", "unknown",
    "goal_reached", "user_done", "user_left", "turn_limit", "unanswered", "error",
]


class _Record(BaseModel):
    # conversation/v1 says readers ignore unknown fields, so these models do too.
    model_config = ConfigDict(extra="ignore", frozen=True)


class ToolCall(_Record):
    """A tool call the assistant made."""

    id: str | None = None
    """The call id that the tool message answers."""
    name: str
    """The tool's name."""
    arguments: dict[str, Any] | str = Field(default_factory=dict)
    """An object when the arguments parse as JSON, else the raw string."""


class Message(_Record):
    """One message of a transcript."""

    role: Literal["user", "assistant", "tool"]
    """Who spoke."""
    content: str
    """The text; ``""`` for an assistant turn that only calls tools."""
    tool_calls: list[ToolCall] = []
    """Tool calls the assistant made."""
    tool_call_id: str | None = None
    """On a tool message: the call it answers."""
    name: str | None = None
    """On a tool message: the tool's name."""
    at: AwareDatetime | None = None
    """When the message was sent or received."""
    span_id: str | None = None
    """The span it was first seen in."""
    truncated: bool = False
    """The instrumentation cut this content."""

    @field_validator("content", mode="before")
    @classmethod
    def _null_content(cls, v: Any) -> Any:
        # Some writers send null for a tool-only assistant turn; the format says "".
        return "" if v is None else v


class Sampling(_Record):
    """How a production conversation was picked for judging."""

    probability: float = Field(gt=0, le=1)
    """Its inclusion probability; a conversation sampled at 10% stands for ten."""
    rule: str = ""
    """The sampling rule that decided it."""


class Usage(BaseModel):
    """Tokens spent."""

    model_config = ConfigDict(extra="forbid")

    input_tokens: int = 0
    output_tokens: int = 0


class Conversation(_Record):
    """A conversation/v1 record: a production conversation or a simulated one."""

    schema_: Literal["conversation/v1"] = Field("conversation/v1", alias="schema")
    """Format tag."""
    id: str
    """Conversation key."""
    source: Literal["production", "simulation"]
    """Where it came from."""
    service: str | None = None
    started_at: AwareDatetime | None = None
    ended_at: AwareDatetime | None = None
    ended_by: EndedBy
    """How it ended."""
    system: str | None = None
    """The system instructions, if captured."""
    messages: list[Message]
    """The transcript, each message once, in order."""
    models: list[str] = []
    usage: Usage | None = None
    trace_ids: list[str] = []
    grouped_by: str | None = None
    """Production: how its traces were grouped (``id``, ``response``, ``history``, ``trace``)."""
    persona_id: str | None = None
    """Simulation: the scenario id; records with the same persona_id are replicates."""
    expected: dict[str, Any] | None = None
    """Simulation: the scenario's ``expected:`` block."""
    sampling: Sampling | None = None
    """Production: the inclusion probability and the rule that decided it."""
    attributes: dict[str, Any] = {}

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)

    @property
    def user_turns(self) -> int:
        """How many messages the user sent."""
        return sum(1 for m in self.messages if m.role == "user")

    def to_json(self) -> str:
        """One conversation/v1 JSON line (no trailing newline; U+2028, U+2029 and U+0085 escaped)."""
        return escape_line_breaks(self.model_dump_json(by_alias=True, exclude_none=True))


# Tags the judge frame uses; in content they are defused (``<`` -> ``‹``) so the
# transcript cannot close its own block or open a new criterion.
FRAME_TAGS = ("transcript", "criterion", "instructions", "verdict")
_TAG = re.compile(r"<(\s*/?\s*(?:" + "|".join(FRAME_TAGS) + r")\b[^<>]*)>", re.IGNORECASE)
_CONTINUATION = "  "  # indents every line of a message after its first


Piece = tuple[str, "int | None", int]
"""A piece of a rendered line: its text, where it comes from and its offset there.

Where: ``-1`` is the message's ``content``, ``k >= 0`` the text of its k-th tool
call as ``tool_call_text`` gives it, ``None`` the frame's own text (labels,
separators). Offsets count characters of that source.
"""


def _neutral_pieces(text: str, source: int | None) -> list[Piece]:
    if "<" in text:
        text = _TAG.sub(lambda m: "‹" + m.group(1) + "›", text)  # as long as the tag: offsets hold
    out: list[Piece] = []
    at = 0
    # splitlines knows every line boundary (\r, \v, \x1e, \u2028, ...), not only \n.
    for line in text.splitlines(keepends=True):
        if out:
            out.append(("\n" + _CONTINUATION, None, 0))
        out.append((line.splitlines()[0], source, at))
        at += len(line)
    return out


def neutralize(text: str) -> str:
    """Defuse text that imitates the judge frame.

    Frame tags (``<transcript>``, ``</criterion>``, ...) become ``‹transcript›``;
    line breaks (any Unicode line boundary) become ``\n`` and every following line is indented, so no content can
    start a line with a speaker label of its own.

    Args:
        text: message content (or a quote of it).

    Returns:
        The text as the judge sees it.
    """
    return "".join(p[0] for p in _neutral_pieces(text, None))


def _label(name: str) -> str:
    # A tool name is a label in the frame: nothing in it may end the label early.
    return re.sub(r"[^\w.\-]", "_", name) or "tool"


def tool_call_text(call: ToolCall) -> str:
    """How a tool call appears on its BOT line: ``[calls name {json arguments}]``."""
    args = call.arguments if isinstance(call.arguments, str) else json.dumps(
        call.arguments, ensure_ascii=False, sort_keys=True
    )
    return f"[calls {_label(call.name)} {args}]"


def render_pieces(messages: Iterable[Message]) -> Iterator[list[Piece]]:
    """Each message's rendered line as pieces that say where their text comes from (see ``render_lines``)."""
    names: dict[str, str] = {}
    for m in messages:
        if m.role == "user":
            yield [("USER: ", None, 0), *_neutral_pieces(m.content, -1)]
        elif m.role == "assistant":
            parts = [_neutral_pieces(m.content, -1)] if m.content else []
            for k, call in enumerate(m.tool_calls):
                if call.id:
                    names[call.id] = call.name
                parts.append(_neutral_pieces(tool_call_text(call), k))
            line: list[Piece] = [("BOT: ", None, 0)]
            for i, part in enumerate(parts):
                line += [(" ", None, 0), *part] if i else part
            yield line
        else:
            name = m.name or names.get(m.tool_call_id or "", "")
            yield [(f"TOOL {_label(name)}: ", None, 0), *_neutral_pieces(m.content, -1)]


def render_lines(messages: Iterable[Message]) -> Iterator[str]:
    """Yield the transcript one rendered message at a time (see ``render_transcript``)."""
    for pieces in render_pieces(messages):
        yield "".join(p[0] for p in pieces)


def render_transcript(messages: Iterable[Message]) -> str:
    """Render a transcript for a judge, inside ``<transcript>`` tags.

    One message per line: ``USER: ...``, ``BOT: ...`` (tool calls appended as
    ``[calls name {json arguments}]``), ``TOOL name: ...``. Content is passed
    through ``neutralize``.

    Args:
        messages: the transcript.

    Returns:
        The ``<transcript>`` block.
    """
    return transcript_block(render_lines(messages))


def transcript_block(lines: Iterable[str]) -> str:
    """Wrap rendered lines in the ``<transcript>`` tags."""
    return "<transcript>\n" + "\n".join(lines) + "\n</transcript>"


def transcript_sha256(messages: Iterable[Message]) -> str:
    """SHA-256 of the transcript exactly as a judge reads it.

    The hash is over the ``render_transcript`` block (UTF-8): whatever changes
    what a judge is shown (a message, a tool call, a tool's name) changes it,
    and nothing else does (times, span ids, ``truncated``).

    Args:
        messages: the transcript.

    Returns:
        The lowercase hex digest.
    """
    digest = TranscriptDigest()
    for line in render_lines(messages):
        digest.add(line)
    return digest.hexdigest()


class TranscriptDigest:
    """``transcript_sha256`` taken one ``render_lines`` line at a time: the SHA-256 of the block
    ``transcript_block`` makes of them. A caller whose transcript grows keeps a ``copy()`` after each
    line and goes on from the last one still the same, hashing only the new lines."""

    __slots__ = ("_sha", "_lines")

    def __init__(self) -> None:
        self._sha = hashlib.sha256(b"<transcript>\n")
        self._lines = 0

    def add(self, line: str) -> None:
        """The next rendered line."""
        text = "\n" + line if self._lines else line
        self._sha.update(text.encode("utf-8", "surrogatepass"))  # as block_sha256 encodes the block
        self._lines += 1

    def copy(self) -> "TranscriptDigest":
        out = TranscriptDigest.__new__(TranscriptDigest)
        out._sha, out._lines = self._sha.copy(), self._lines
        return out

    def hexdigest(self) -> str:
        """The digest of the lines added so far (more may be added after)."""
        sha = self._sha.copy()
        sha.update(b"\n</transcript>")
        return sha.hexdigest()


def block_sha256(block: str) -> str:
    """``transcript_sha256`` of a block ``render_transcript`` gave (for a caller that has rendered it already)."""
    # surrogatepass: a lone surrogate in stored text must give a digest, never an error.
    return hashlib.sha256(block.encode("utf-8", "surrogatepass")).hexdigest()


def read_conversations(path: str | Path) -> list[Conversation]:
    """Read a conversation/v1 JSONL file.

    Args:
        path: the file; lines end in ``\n`` (or ``\r\n``), blank lines are skipped.

    Returns:
        The conversations in file order.

    Raises:
        ConversationError: unreadable file, bad JSON, wrong ``schema`` or an
            invalid record, naming the file and line.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConversationError(f"{path}: cannot read: {exc.strerror}") from None
    return list(parse_conversations(split_json_lines(text), source=str(path)))


def parse_conversations(lines: Iterable[str], source: str = "<input>") -> Iterator[Conversation]:
    """Parse conversation/v1 JSON lines (see ``read_conversations``), split on ``\n`` only (``split_json_lines``)."""
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConversationError(f"{source}:{n}: not JSON ({exc.msg})") from None
        if not isinstance(raw, dict):
            raise ConversationError(f"{source}:{n}: expected a JSON object")
        if raw.get("schema") != SCHEMA:
            raise ConversationError(f"{source}:{n}: schema is {raw.get('schema')!r}, expected {SCHEMA!r}")
        try:
            yield Conversation.model_validate(raw)
        except ValidationError as exc:
            problems = "; ".join(
                ".".join(str(p) for p in e["loc"]) + ": " + e["msg"] for e in exc.errors()
            )
            raise ConversationError(f"{source}:{n}: {problems}") from None
