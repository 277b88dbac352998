"""The canonical shapes every dialect is read into, and small coercion helpers.

A dialect reader turns one span's attributes (or one span's events / log
records) into a ``Content``: the history the LLM call was sent, what it
answered, and the system instructions. Call facts that are not content
(models, tokens, ids) are read by ``_meta`` from one table for all dialects.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Literal, Mapping, NamedTuple

from ._indexed import INDEXED_PREFIXES
from ._salvage import salvage

Role = Literal["user", "assistant", "tool", "system"]
SpanKind = Literal["llm", "agent", "tool", "other"]


@dataclass(frozen=True)
class ToolCall:
    """A tool call the assistant made.

    ``arguments`` is the parsed JSON object when the raw value is one, else
    text, as conversation/v1 asks (``parse_json_or_raw``).
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
    # The response model of the latest LLM call before this span, named only here (LlamaIndex's
    # AgentOutput, see ``_meta``): the call's own spans carry the request model alone.
    reported_model: str | None = None


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


class _LastArrays(threading.local):
    """Per attribute name, the last JSON array text parsed on this thread and its items.

    Each LLM call resends the whole history, so a span's ``gen_ai.input.messages``
    text usually extends the previous call's text: only the new tail is parsed.
    The items are shared between the two results, which nothing mutates.
    """

    def __init__(self) -> None:
        self.by_key: dict[str, tuple[str, str, list[Any]]] = {}  # key -> (text, text without "]", items)


_last_arrays = _LastArrays()


def _loads_array_tail(key: str, s: str) -> Any:
    """``json.loads(s)`` for ``s`` stripped and starting with ``[``; same result, less work.

    When ``s`` is the last array seen under ``key`` followed by ``, more items]``,
    the items already parsed are reused and only ``[more items]`` is parsed: JSON
    array items are delimited, so each parses the same wherever it stands. An
    empty tail (``[a,]``) is not JSON and takes the full parse, as does any
    other shape.
    """
    last = _last_arrays.by_key.get(key)
    if last is not None:
        text, head, items = last
        if s == text:
            return list(items)
        if s.startswith(head):
            rest = s[len(head):].lstrip()
            if rest.startswith(","):
                try:
                    tail = json.loads("[" + rest[1:])
                except (ValueError, RecursionError):
                    tail = None
                if isinstance(tail, list) and tail:
                    value = items + tail
                    _last_arrays.by_key[key] = (s, s.rstrip()[:-1], value)
                    return value
    value = json.loads(s)
    if isinstance(value, list) and len(value) > 1:  # a one-message answer must not evict a history
        _last_arrays.by_key[key] = (s, s.rstrip()[:-1], value)
    return value


class Attrs:
    """A span's (or log's) attributes with each JSON-string value parsed at most once.

    Several readers look at the same JSON attribute (the model and the messages
    of ``request_data``, say); long conversations resend their history in every
    span, so parsing it twice would double the cost of a rebuild.
    """

    __slots__ = ("raw", "get", "_parsed", "_indexed", "salvaged")

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self.raw = raw
        self.get: Callable[[str], Any] = raw.get  # the readers' most frequent call: no extra frame
        self._parsed: dict[str, Any] = {}
        self._indexed: dict[str, list[tuple[str, Any]]] | None = None
        self.salvaged: list[str] = []  # keys whose JSON was cut and read up to the cut

    def __contains__(self, key: str) -> bool:
        return key in self.raw

    def indexed(self, prefix: str) -> list[tuple[str, Any]]:
        """The ``(key, value)`` pairs whose key starts with ``prefix``, one of ``INDEXED_PREFIXES``.

        One pass over the keys serves every prefix; attribute order is kept.
        """
        if self._indexed is None:
            self._indexed = {}
            for key, value in self.raw.items():
                if key.startswith(INDEXED_PREFIXES):
                    p = next(p for p in INDEXED_PREFIXES if key.startswith(p))
                    self._indexed.setdefault(p, []).append((key, value))
        return self._indexed.get(prefix, [])

    def json(self, key: str) -> Any:
        """The value, parsed if it is a JSON string.

        JSON cut short is read up to the cut (see ``_salvage``) and the key is
        listed in ``salvaged``; ``Truncated`` is raised only when even that fails.
        """
        if key in self._parsed:
            hit = self._parsed[key]
        else:
            value = self.raw.get(key)
            try:
                if isinstance(value, str) and value.lstrip().startswith("["):
                    try:
                        hit = _loads_array_tail(key, value.lstrip())
                    except ValueError:
                        raise Truncated(value[:80]) from None
                else:
                    hit = loads_maybe(value)
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
    """Tool arguments as conversation/v1 holds them: an object when the value is one or parses as one,
    else text (the raw string; the JSON text of a list or a scalar a dialect sent decoded)."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        return parsed if isinstance(parsed, dict) else value
    if isinstance(value, dict):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


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


# What ``json.dumps(ensure_ascii=False, separators=(",", ":"))`` builds on every call.
_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def dumps(value: Any) -> str:
    """Compact JSON with non-ASCII kept, for non-string tool results."""
    return _COMPACT.encode(value)


# A UTF-16 surrogate standing alone in a str: a JSON ``\\ud800`` escape without its
# pair (text cut between the two halves of an emoji). UTF-8 cannot hold one, so
# nothing could store or hash a text that keeps it.
_SURROGATE = re.compile("[\ud800-\udfff]")
REPLACEMENT = "\ufffd"


def repair_text(text: str) -> str:
    """``text`` with every lone surrogate replaced by U+FFFD (most texts are returned as they are)."""
    if text.isascii() or not _SURROGATE.search(text):
        return text
    return _SURROGATE.sub(REPLACEMENT, text)


def repaired(value: Any) -> Any:
    """A decoded JSON value with ``repair_text`` applied to every string in it, keys included."""
    if isinstance(value, str):
        return repair_text(value)
    if isinstance(value, list):
        return [repaired(v) for v in value]
    if isinstance(value, dict):
        return {repaired(k): repaired(v) for k, v in value.items()}
    return value
