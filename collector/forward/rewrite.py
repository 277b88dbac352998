"""What an exporter changes in a request before it leaves, and nothing more.

- LangSmith builds threads from ``langsmith.metadata.thread_id``, not from
  ``gen_ai.conversation.id``: each span that carries a conversation id (one
  of ``conversations.id_attributes``) gets that attribute too, unless it has it.
- ``redact: content`` passes message content (the attributes below, and log
  bodies) through ``collector.redact``, one ``Redactor`` per request, so a
  value gets the same placeholder throughout it.

Ids, timestamps and every other attribute stay as they were. A request that
needs neither is sent as the bytes that came in.

The request is decoded and encoded again whole. Adding the attribute on the
wire instead (copying every span's bytes but those that get it) was measured
and dropped: with the default ``conversations.id_attributes`` it cost as much as
the whole decode when one span in four carries an id, and twice as much when
every span does, as the README advises. The rewrite runs in the exporter's
rewrite process (``send.Rewriter``), never on the receivers' interpreter.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

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
