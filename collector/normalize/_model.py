"""The canonical shapes every dialect is read into, and small coercion helpers.

A dialect reader turns one span's attributes (or one span's events / log
records) into a ``Content``: the history the LLM call was sent, what it
answered, and the system instructions. Call facts that are not content
(models, tokens, ids) are read by ``_meta`` from one table for all dialects.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal, Mapping, NamedTuple

from ._salvage import salvage

Role = Literal["user", "assistant", "tool", "system"]
SpanKind = Literal["llm", "agent", "tool", "other"]


@dataclass(frozen=True)
class ToolCall:
    """A tool call the assistant made.

    ``arguments`` is the parsed JSON object (or list) when the raw value parses,
    else the raw string, as conversation/v1 asks.
    """

    id: str | None
    name: str
    arguments: Any


@dataclass(frozen=True)
class Message:
    """One message of a call's history or answer, in canonical form."""

    role: Role
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    truncated: bool = False

    @cached_property
    def key(self) -> tuple[str, str, tuple[str, ...], str]:
        """What two copies of the same message share across calls and dialects.

        Role, text and tool-call ids: arguments are left out because dialects
        re-serialize them differently (object vs JSON string, key order).
        Cached: a long history is compared once per call that resends it.
        """
        ids = tuple(tc.id or tc.name for tc in self.tool_calls)
        return (self.role, self.content.strip(), ids, self.tool_call_id or "")


@dataclass
class Content:
    """Message content one source holds for one LLM call (or agent turn).

    ``input`` / ``output`` are None when the source did not carry that side at
    all (as opposed to an empty list). System messages are moved out of
    ``input`` into ``system``.
    """

    source: str
    input: list[Message] | None = None
    output: list[Message] | None = None
    system: str | None = None
    truncated: bool = False

    def has_messages(self) -> bool:
        return bool(self.input) or bool(self.output)


@dataclass
class Meta:
    """Facts about a span that are not message content, read from one table."""

    kind: SpanKind = "other"
    request_model: str | None = None
    response_model: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    response_id: str | None = None
    previous_response_id: str | None = None
    tool_call_id: str | None = None
    tool_name: str | None = None


class Event(NamedTuple):
    """A span event or a log record, reduced to what the readers look at."""

    name: str
    attributes: Mapping[str, Any]
    body: Any


# ---------------------------------------------------------------- coercion helpers


class Truncated(ValueError):
    """A JSON string that does not parse: usually cut by an attribute length limit."""


def loads_maybe(value: Any) -> Any:
    """Structured values pass through; JSON strings are parsed.

    Raises ``Truncated`` when a string looks like JSON (starts with ``[`` or
    ``{``) but does not parse, so the caller can flag the row. Any other string
    is returned unchanged.
    """
    if not isinstance(value, str):
        return value
    s = value.lstrip()
    if not s or s[0] not in "[{":
        return value
    try:
        return json.loads(s)
    except ValueError:
        raise Truncated(value[:80]) from None


class Attrs:
    """A span's (or log's) attributes with each JSON-string value parsed at most once.

    Several readers look at the same JSON attribute (the model and the messages
    of ``request_data``, say); long conversations resend their history in every
    span, so parsing it twice would double the cost of a rebuild.
    """

    __slots__ = ("raw", "_parsed", "salvaged")

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self.raw = raw
        self._parsed: dict[str, Any] = {}
        self.salvaged: list[str] = []  # keys whose JSON was cut and read up to the cut

    def get(self, key: str) -> Any:
        return self.raw.get(key)

    def __contains__(self, key: str) -> bool:
        return key in self.raw

    def json(self, key: str) -> Any:
        """The value, parsed if it is a JSON string.

        JSON cut short is read up to the cut (see ``_salvage``) and the key is
        listed in ``salvaged``; ``Truncated`` is raised only when even that fails.
        """
        if key in self._parsed:
            hit = self._parsed[key]
        else:
            try:
                hit = loads_maybe(self.raw.get(key))
            except Truncated as exc:
                hit = salvage(self.raw[key])
                if hit is None:
                    hit = exc
                else:
                    self.salvaged.append(key)
            self._parsed[key] = hit
        if isinstance(hit, Truncated):
            raise hit
        return hit


def parse_json_or_raw(value: Any) -> Any:
    """Tool arguments: an object/list when the string parses as one, else the raw value."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        return parsed if isinstance(parsed, (dict, list)) else value
    return value


def as_int(value: Any) -> int | None:
    """Token counts arrive as ints, floats or (proto3 JSON) strings."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return None
    return None


def as_str(value: Any) -> str | None:
    """A non-empty string, else None (ids and models; numbers are stringified)."""
    if isinstance(value, str):
        return value or None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return None


def dumps(value: Any) -> str:
    """Compact JSON with non-ASCII kept, for non-string tool results."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
