"""What an exporter changes in a request before it leaves, and nothing more.

- LangSmith builds threads from ``langsmith.metadata.thread_id``, not from
  ``gen_ai.conversation.id``: each span that carries a conversation id (one
  of ``conversations.id_attributes``) gets that attribute too, unless it has it.
- ``redact: content`` passes message content (the attributes below, and log
  bodies) through ``collector.redact``, one ``Redactor`` per request, so a
  value gets the same placeholder throughout it.

Ids, timestamps and every other attribute stay as they were. A request that
needs neither is sent as the bytes that came in.

The thread attribute alone is added on the wire (``add_thread``): the bytes of
each span that gets it are the span's bytes with one more attribute field after
them (protobuf appends a repeated field's elements in the order they come), and
only the lengths of the messages around it change. Decoding and encoding the
whole request cost 3.6 ms of a 600 KB one, all of it holding the GIL that
ingestion needs.
"""

from __future__ import annotations

import functools
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from ..redact import Redactor

THREAD_ATTRIBUTE = "langsmith.metadata.thread_id"

CONTENT_PREFIXES = (
    "gen_ai.input.", "gen_ai.output.", "gen_ai.prompt", "gen_ai.completion", "gen_ai.system_instructions",
    "gen_ai.tool.call.arguments", "gen_ai.tool.call.result", "input.value", "output.value", "llm.input_messages",
    "llm.output_messages", "traceloop.entity.input", "traceloop.entity.output", "langwatch.input",
    "langwatch.output", "content", "message", "body",
)
"""Attribute keys (and their prefixes) that hold message content: the semantic conventions' and those of the
instrumentation libraries the fixtures come from; ``content`` / ``message`` / ``body`` as events carry it."""


def _content_key(key: str) -> bool:
    return key.startswith(CONTENT_PREFIXES)


def _strings(value: AnyValue) -> Iterator[str]:
    kind = value.WhichOneof("value")
    if kind == "string_value":
        yield value.string_value
    elif kind == "array_value":
        for v in value.array_value.values:
            yield from _strings(v)
    elif kind == "kvlist_value":
        for kv in value.kvlist_value.values:
            yield from _strings(kv.value)


def _redact(value: AnyValue, redactor: Redactor) -> None:
    kind = value.WhichOneof("value")
    if kind == "string_value":
        value.string_value = redactor.text(value.string_value)
    elif kind == "array_value":
        for v in value.array_value.values:
            _redact(v, redactor)
    elif kind == "kvlist_value":
        for kv in value.kvlist_value.values:
            _redact(kv.value, redactor)


def _content(attributes: Iterable[KeyValue]) -> Iterator[AnyValue]:
    return (kv.value for kv in attributes if _content_key(kv.key))


def rewrite(signal: str, body: bytes, *, thread_from: Sequence[str] = (), redact: bool = False) -> bytes:
    """``body`` (an OTLP protobuf export request of ``signal``) as this exporter sends it.

    Args:
        thread_from: add ``THREAD_ATTRIBUTE`` from the first of these attributes a span carries
            (LangSmith); empty: add nothing.
        redact: redact message content.
    """
    if not thread_from and not redact:
        return body
    rank = {key: n for n, key in enumerate(thread_from) if "*" not in key}
    if not redact:
        return add_thread(body, rank) if signal == "traces" else body
    values: list[AnyValue] = []
    if signal == "traces":
        traces = ExportTraceServiceRequest.FromString(body)
        added = 0
        for rs in traces.resource_spans:
            for ss in rs.scope_spans:
                for span in ss.spans:
                    if thread_from:
                        added += _add_thread(span.attributes, rank)
                    if redact:
                        values += _content(span.attributes)
                        for event in span.events:
                            values += _content(event.attributes)
        if not added and not values:
            return body
        out = traces
    else:
        logs = ExportLogsServiceRequest.FromString(body)
        for rl in logs.resource_logs:
            for sl in rl.scope_logs:
                for record in sl.log_records:
                    if redact:
                        values.append(record.body)
                        values += _content(record.attributes)
        if not values:
            return body
        out = logs  # type: ignore[assignment]
    if values:
        redactor = Redactor()
        redactor.learn(s for v in values for s in _strings(v))
        for v in values:
            _redact(v, redactor)
    return out.SerializeToString()


def rewrite_all(signal: str, bodies: Sequence[bytes], thread_from: Sequence[str], redact: bool) -> bytes:
    """``rewrite`` of each of ``bodies``, concatenated (what a sender sends); runs in the rewrite process."""
    return b"".join(rewrite(signal, b, thread_from=thread_from, redact=redact) for b in bodies)


def _add_thread(attributes: Any, rank: Mapping[str, int]) -> int:
    # One pass over the span's attributes (this runs for every span forwarded to LangSmith): the id
    # attribute that comes first in ``conversations.id_attributes`` wins.
    best, value = len(rank), None
    for kv in attributes:
        key = kv.key
        if key == THREAD_ATTRIBUTE:
            return 0
        r = rank.get(key, best)
        if r < best:
            best, value = r, kv.value
    if value is None:
        return 0
    kind = value.WhichOneof("value")
    text = value.string_value if kind == "string_value" else str(value.int_value) if kind == "int_value" else ""
    if not text:
        return 0
    attributes.add(key=THREAD_ATTRIBUTE, value=AnyValue(string_value=text))
    return 1


# ------------------------------------------------------------------ on the wire

_LEN = 2
_SKIP = {0: None, 1: 8, 5: 4}  # wire type -> fixed width (None: a varint)


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def _length_delimited(number: int, content: bytes) -> bytes:
    return _encode_varint(number << 3 | _LEN) + _encode_varint(len(content)) + content


def _encode_varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _fields(buf: bytes, pos: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(field number, start of its length, start and end of its value) of the length-delimited fields in
    ``buf[pos:end]``; other fields are stepped over."""
    while pos < end:
        tag_at = pos
        tag = buf[pos]  # one byte for fields 1-15, the common case, read inline: this runs for every span
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _varint(buf, pos)
        wire = tag & 7
        if wire == _LEN:
            length_at = pos
            n, pos = _varint(buf, pos)
            yield tag >> 3, length_at, pos, pos + n
            pos += n
        elif wire in _SKIP:
            width = _SKIP[wire]
            pos = _varint(buf, pos)[1] if width is None else pos + width
        else:
            raise ValueError(f"wire type {wire} at byte {tag_at}")
    if pos != end:
        raise ValueError(f"a field runs past its message at byte {end}")


Edit = tuple[int, int, bytes]
"""Replace ``cut`` bytes at ``at`` of the request with ``insert``."""


def add_thread(body: bytes, rank: Mapping[str, int]) -> bytes:
    """``body`` (a traces export request) with ``THREAD_ATTRIBUTE`` added to each span that carries one of
    ``rank``'s attributes and not it (the one ranked first wins); the bytes unchanged when none does.

    Only spans whose bytes hold one of the keys are decoded, to read their attributes exactly as a parser
    does. The rest is a list of edits: the attribute after each such span, and the new length of each
    message around it; the request is copied once, with the edits in.
    """
    hits: list[int] = []  # where a key's bytes may be
    for key in _needles(tuple(rank)):
        at = body.find(key)
        while at != -1:
            hits.append(at)
            at = body.find(key, at + 1)
    if not hits:
        return body
    hits.sort()

    def hit(start: int, end: int) -> bool:
        i = bisect_left(hits, start)
        return i < len(hits) and hits[i] < end

    def span(start: int, end: int) -> tuple[list[Edit], int]:
        parsed = Span.FromString(body[start:end])
        n = len(parsed.attributes)
        if not _add_thread(parsed.attributes, rank):
            return [], 0
        added = _length_delimited(9, parsed.attributes[n].SerializeToString())
        return [(end, 0, added)], len(added)

    def message(start: int, end: int, field: int, inner: Any) -> tuple[list[Edit], int]:
        """The edits of ``inner`` in each field ``field`` of the message in ``body[start:end]``."""
        edits: list[Edit] = []
        grown = 0
        for number, length_at, vstart, vend in _fields(body, start, end):
            if number != field or not hit(vstart, vend):
                continue
            child, delta = inner(vstart, vend)
            if delta:
                length = _encode_varint(vend - vstart + delta)
                edits.append((length_at, vstart - length_at, length))
                edits += child
                grown += delta + len(length) - (vstart - length_at)
        return edits, grown

    def scope_spans(start: int, end: int) -> tuple[list[Edit], int]:
        return message(start, end, 2, span)  # ScopeSpans.spans (not its scope, which has attributes too)

    def resource_spans(start: int, end: int) -> tuple[list[Edit], int]:
        return message(start, end, 2, scope_spans)  # ResourceSpans.scope_spans (not its resource)

    try:
        edits, _ = message(0, len(body), 1, resource_spans)
    except (ValueError, IndexError):  # not a request the walk can step through: a whole decode and encode
        return rewrite_parsed(body, rank)
    if not edits:
        return body
    pieces: list[bytes] = []
    copied = 0
    for at, cut, insert in edits:
        pieces += [body[copied:at], insert]
        copied = at + cut
    pieces.append(body[copied:])
    return b"".join(pieces)


@functools.lru_cache(maxsize=16)
def _needles(keys: tuple[str, ...]) -> tuple[bytes, ...]:
    """Fewer byte strings than ``keys`` such that each key holds one: the namespace that keys share
    (``traceloop.association.properties.``), and no needle that holds another (``session.id`` finds
    ``langfuse.session.id`` too). Each is a scan of the whole request."""
    groups: dict[str, list[str]] = {}
    for key in keys:
        groups.setdefault(key.rpartition(".")[0], []).append(key)
    found = {key for space, group in groups.items() for key in ([f"{space}."] if space and len(group) > 1 else group)}
    return tuple(sorted(n.encode() for n in found if n and not any(o != n and o in n for o in found)))


def rewrite_parsed(body: bytes, rank: Mapping[str, int]) -> bytes:
    """``add_thread`` through a whole decode and encode."""
    traces = ExportTraceServiceRequest.FromString(body)
    added = sum(_add_thread(span.attributes, rank) for rs in traces.resource_spans for ss in rs.scope_spans
                for span in ss.spans)
    return traces.SerializeToString() if added else body
