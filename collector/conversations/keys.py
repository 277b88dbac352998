"""Which conversation a trace belongs to, from its span and resource attributes.

Ids often sit only on the root span (or only on the app's agent span), so the
key is resolved per trace: an id on any span applies to the whole trace.

Public: ``conversation_key``, ``group_keyed``, ``has_messages``, ``response_links``, ``load_json_column``, and
``StoredRow`` with ``json_column`` (a row whose JSON columns every reader shares, parsed once; the
default attributes to look in are ``config.DEFAULT_ID_ATTRIBUTES``).
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Iterator, Mapping, Sequence

import orjson

from ..config import DEFAULT_ID_ATTRIBUTES
from ..normalize import Attrs, Content, Event, as_str, read_events, read_meta, read_span, repair_text, repaired

def _inexact(value: Any) -> bool:
    """Whether a value orjson decoded holds a float that may have been an integer past 64 bits
    (orjson reads those as floats, json keeps them exact)."""
    stack = [value]
    while stack:
        v = stack.pop()
        t = type(v)
        if t is dict:
            stack.extend(v.values())
        elif t is list:
            stack.extend(v)
        elif t is float and (v >= 9.2e18 or v <= -9.2e18):
            return True
    return False


def load_json_column(text: Any) -> Any:
    """A JSON column as stored (text), or already decoded by the caller.

    Raises ``ValueError`` for text that is not JSON and for any other type.
    A lone surrogate escape in the text is decoded as U+FFFD.
    """
    if text is None or isinstance(text, (dict, list)):
        return text
    if not isinstance(text, (str, bytes)):
        raise ValueError(f"JSON column holds a {type(text).__name__}")
    # orjson first (several times faster); json where orjson is strict (NaN, Infinity, lone
    # surrogates, ...: json's answer, or its error) or inexact (integers past 64 bits).
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return repaired(json.loads(text))
    return json.loads(text) if _inexact(value) else value


class StoredRow(dict[str, Any]):
    """A stored span or log row (column -> value) whose JSON columns are parsed at most once until ``release``.

    The conversation stage reads a span's attributes for its conversation key,
    its end rules and its transcript; with this row they share one parse. The
    parsed values are shared: readers must not change them. The stage releases
    them after each write, so that its row cache holds text, not parsed trees.
    """

    __slots__ = ("_parsed",)
    _parsed: dict[str, tuple[Any, BaseException | None]]  # column -> (value, error), once parsed

    def json(self, column: str) -> Any:
        """``load_json_column`` of the column, parsed on the first call (its ``ValueError`` raised again after)."""
        try:
            parsed = self._parsed
        except AttributeError:
            parsed = self._parsed = {}
        if column not in parsed:
            try:
                parsed[column] = (load_json_column(self.get(column)), None)
            except (ValueError, RecursionError) as exc:  # not JSON, or nested past the parser's limit
                parsed[column] = (None, exc)
        value, error = parsed[column]
        if error is not None:
            raise error.with_traceback(None)
        return value

    def release(self) -> None:
        """Drop what was parsed (the next ``json`` parses again)."""
        try:
            del self._parsed
        except AttributeError:
            pass


def json_column(row: Mapping[str, Any], column: str) -> Any:
    """A row's JSON column decoded (``load_json_column``); once per ``StoredRow``, whoever asks."""
    if type(row) is StoredRow:
        return row.json(column)
    return load_json_column(row.get(column))


# An unset id written as text (Logfire writes RunConfig's group_id=None as "null"): no id at all, else every
# conversation of such a bot would be one.
_UNSET = frozenset({"null", "None", "undefined"})


def _lookup(attrs: Mapping[str, Any], name: str) -> str | None:
    if name.endswith("*"):
        prefix = name[:-1]
        for key in sorted(k for k in attrs if k.startswith(prefix)):
            v = as_str(attrs[key])
            if v and v not in _UNSET:
                return repair_text(v)
        return None
    v = as_str(attrs.get(name))
    return repair_text(v) if v and v not in _UNSET else None


def conversation_key(spans: Sequence[dict[str, Any]],
                     id_attributes: Sequence[str] = DEFAULT_ID_ATTRIBUTES) -> str | None:
    """The conversation id of one trace, from any of its span rows.

    For each attribute in ``id_attributes`` order: the span attributes of any
    span (earliest span first), then their resource attributes. Malformed rows
    are skipped. Returns None when no span carries one; the caller then keys the
    trace as ``trace:<trace_id>`` (or chains it, see ``group_keyed``).
    """
    ordered = iter(sorted(spans, key=_span_order))
    parsed: list[tuple[dict[str, Any], dict[str, Any]]] = []

    def each() -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
        """The rows' (attributes, resource), parsed as far as a reader goes: an id on the first span
        (the root, as a rule) leaves the others' attributes, model calls' long histories, unparsed."""
        yield from parsed
        for row in ordered:
            try:
                attrs = json_column(row, "attributes") or {}
                resource = json_column(row, "resource") or {}
            except (ValueError, RecursionError):  # not JSON, or nested past the parser's limit
                continue
            if isinstance(attrs, dict) and isinstance(resource, dict):
                parsed.append((attrs, resource))
                yield attrs, resource

    for name in id_attributes:
        for attrs, _ in each():
            v = _lookup(attrs, name)
            if v:
                return v
        for _, resource in parsed:  # every row is parsed by now
            v = _lookup(resource, name)
            if v:
                return v
    return None


def _span_order(row: Mapping[str, Any]) -> tuple[int, str]:
    start = row.get("start_time_unix_nano")
    return (start if isinstance(start, int) else 0, str(row.get("span_id") or ""))


def response_links(spans: Iterable[dict[str, Any]]) -> tuple[set[str], set[str]]:
    """(response ids, previous-response ids) named by a trace's span rows.

    For chaining traces that carry no conversation id: a trace whose previous
    response id is another trace's response id continues that conversation.
    """
    ids: set[str] = set()
    previous: set[str] = set()
    for row in spans:
        try:
            attrs = json_column(row, "attributes")
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's limit
            continue
        if isinstance(attrs, dict):
            meta = read_meta(Attrs(attrs), str(row.get("name") or ""))
            if meta.response_id:
                ids.add(meta.response_id)
            if meta.previous_response_id:
                previous.add(meta.previous_response_id)
    return ids, previous


def _found(content: Content | None) -> bool:
    return content is not None and content.has_messages()


def has_messages(spans: Iterable[Mapping[str, Any]], logs: Iterable[Mapping[str, Any]] = ()) -> bool:
    """Whether any row of a trace carries message content (the history or answer of a call or agent
    turn, in its attributes, span events or log records): a trace with no conversation id and none
    makes no conversation (the construction of an agent, a call with content capture off).

    Stops at the first span that has some; rows that do not parse are skipped.
    """
    for row in spans:
        try:
            attrs = json_column(row, "attributes")
            events = json_column(row, "events") or []
        except (ValueError, RecursionError):
            continue
        if not isinstance(attrs, dict):
            continue
        if _found(read_span(attrs, str(row.get("name") or ""))[1]):
            return True
        if isinstance(events, list) and _found(read_events(
                [Event(e.get("name") or "", e.get("attributes") or {}, None) for e in events if isinstance(e, dict)])):
            return True
    by_span: dict[Any, list[Event]] = {}
    for row in logs:
        try:
            attrs = json_column(row, "attributes") or {}
            body = json_column(row, "body")
        except (ValueError, RecursionError):
            continue
        if isinstance(attrs, dict):
            name = row.get("event_name") or attrs.get("event.name") or ""
            by_span.setdefault(row.get("span_id"), []).append(Event(str(name), attrs, body))
    return any(_found(read_events(events, "log")) for events in by_span.values())


def group_keyed(traces: Mapping[str, list[dict[str, Any]]],
                id_attributes: Sequence[str] = DEFAULT_ID_ATTRIBUTES) -> dict[str, list[str]]:
    """Group whole traces into conversations by their ids: ``{conversation id: [trace ids]}``.

    A trace with no id attribute joins the conversation of the trace whose
    response it continues (``gen_ai.request.previous_response.id``), else stands
    alone as ``trace:<trace_id>`` (``assemble.group_traces`` then stitches those
    by their history).
    """
    keys: dict[str, str | None] = {t: conversation_key(rows, id_attributes) for t, rows in traces.items()}
    links = {t: response_links(rows) for t, rows in traces.items()}
    owner: dict[str, str] = {}  # response id -> trace id
    for t in sorted(traces):
        for rid in sorted(links[t][0]):
            owner.setdefault(rid, t)
    resolved: dict[str, str] = {}

    def resolve(t: str, seen: frozenset[str]) -> str:
        if t in resolved:
            return resolved[t]
        key = keys[t]
        if key is None:
            for prev in sorted(links[t][1]):
                parent = owner.get(prev)
                if parent is not None and parent != t and parent not in seen:
                    key = resolve(parent, seen | {t})
                    break
        resolved[t] = key or f"trace:{t}"
        return resolved[t]

    groups: dict[str, list[str]] = {}
    for t in sorted(traces):
        groups.setdefault(resolve(t, frozenset()), []).append(t)
    return groups
