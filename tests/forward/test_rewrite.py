"""LangSmith's thread attribute added on the wire gives what a whole decode, add and encode gives, on every
captured fixture and on the encodings that could fool a byte search."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from collector.forward.rewrite import THREAD_ATTRIBUTE, _fields, add_thread, rewrite_parsed
from collector.ingest import decode

from ..support.daemon import FIXTURES

RANK = {"gen_ai.conversation.id": 0, "session.id": 1}


def trace_fixtures() -> list[Path]:
    return sorted(p for p in FIXTURES.iterdir()
                  if ".logs" not in p.name and p.name.endswith((".pb", ".pb.gz", ".json")) and
                  not p.name.endswith((".expected.json", ".meta.json")))


def protobuf(path: Path) -> bytes:
    body = path.read_bytes()
    if path.name.endswith(".gz"):
        body = gzip.decompress(body)
    if ".json" in path.name:
        return decode.parse_traces(body, True).SerializeToString()
    return body


def threads(body: bytes) -> list[tuple[bytes, str]]:
    return [(sp.span_id, kv.value.string_value) for rs in ExportTraceServiceRequest.FromString(body).resource_spans
            for ss in rs.scope_spans for sp in ss.spans for kv in sp.attributes if kv.key == THREAD_ATTRIBUTE]


@pytest.mark.parametrize("path", trace_fixtures(), ids=lambda p: p.name)
def test_on_every_fixture_the_wire_gives_what_a_decode_gives(path: Path) -> None:
    body = protobuf(path)
    rank = {"gen_ai.conversation.id": 0, "session.id": 1, "langfuse.session.id": 2, "ai.telemetry.metadata.sessionId": 3}
    wire, parsed = add_thread(body, rank), rewrite_parsed(body, rank)
    assert ExportTraceServiceRequest.FromString(wire) == ExportTraceServiceRequest.FromString(parsed)
    if wire == body:
        assert parsed == body


def request(*spans: list[tuple[str, AnyValue]], resource: list[tuple[str, str]] = ()) -> ExportTraceServiceRequest:  # type: ignore[assignment]
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    for k, v in resource:
        rs.resource.attributes.add(key=k, value=AnyValue(string_value=v))
    ss = rs.scope_spans.add()
    ss.scope.attributes.add(key="gen_ai.conversation.id", value=AnyValue(string_value="on the scope"))
    for n, attrs in enumerate(spans):
        sp = ss.spans.add(trace_id=b"t" * 16, span_id=bytes([n + 1]) * 8, name=f"span {n}")
        for k, v in attrs:
            sp.attributes.add(key=k, value=v)
        sp.status.code = 1  # a field after the attributes: the added one still comes last among them
    return req


def s(text: str) -> AnyValue:
    return AnyValue(string_value=text)


def test_each_span_carrying_an_id_gets_the_first_ranked_one_and_only_those() -> None:
    req = request(
        [("gen_ai.conversation.id", s("c-1"))],
        [("session.id", s("s-2")), ("gen_ai.conversation.id", s("c-2"))],  # rank, not order, chooses
        [("session.id", s("s-3"))],
        [("gen_ai.input.messages", s('{"text": "my gen_ai.conversation.id is c-9"}'))],  # the key in content only
        [("gen_ai.conversation.id", AnyValue(int_value=42))],
        [("gen_ai.conversation.id", s("c-6")), (THREAD_ATTRIBUTE, s("kept"))],  # has it already
        [("gen_ai.conversation.id", s(""))],  # empty: nothing to add
        [],
        resource=[("gen_ai.conversation.id", "on the resource")])  # a span's own attributes decide
    body = req.SerializeToString()
    out = add_thread(body, RANK)
    assert threads(out) == [(bytes([1]) * 8, "c-1"), (bytes([2]) * 8, "c-2"), (bytes([3]) * 8, "s-3"),
                            (bytes([5]) * 8, "42"), (bytes([6]) * 8, "kept")]
    assert ExportTraceServiceRequest.FromString(out) == ExportTraceServiceRequest.FromString(rewrite_parsed(body, RANK))
    first = ExportTraceServiceRequest.FromString(out).resource_spans[0].scope_spans[0].spans[0]
    assert [kv.key for kv in first.attributes] == ["gen_ai.conversation.id", THREAD_ATTRIBUTE]
    assert first.status.code == 1 and first.span_id == bytes([1]) * 8


def test_nothing_to_add_returns_the_bytes_that_came_in() -> None:
    body = request([("gen_ai.input.messages", s("gen_ai.conversation.id"))], [("x", s("y"))]).SerializeToString()
    assert add_thread(body, RANK) is body
    assert add_thread(b"", RANK) == b""


def test_many_resources_and_scopes_and_unknown_fields_are_copied_as_they_came() -> None:
    req = request([("gen_ai.conversation.id", s("a"))])
    req.resource_spans.add().CopyFrom(request([("x", s("y"))]).resource_spans[0])
    req.resource_spans[1].scope_spans.add().CopyFrom(request([("gen_ai.conversation.id", s("b"))]).resource_spans[0]
                                                     .scope_spans[0])
    # An unknown varint, fixed32, fixed64 and length-delimited field in a span: kept byte for byte.
    span = req.resource_spans[1].scope_spans[1].spans[0]
    body = req.SerializeToString()
    unknown = bytes([0xF8, 0x07, 0x2A, 0xFD, 0x07, 1, 2, 3, 4, 0xF9, 0x07]) + bytes(8) + bytes([0xFA, 0x07, 2, 9, 9])
    span.ParseFromString(span.SerializeToString() + unknown)
    body = req.SerializeToString()
    out = add_thread(body, RANK)
    assert [v for _, v in threads(out)] == ["a", "b"]
    assert ExportTraceServiceRequest.FromString(out) == ExportTraceServiceRequest.FromString(rewrite_parsed(body, RANK))
    assert unknown in out


def test_a_group_field_the_walk_does_not_step_over_falls_back_to_a_whole_decode() -> None:
    req = request([("gen_ai.conversation.id", s("a"))])
    scope = req.resource_spans[0].scope_spans[0]
    scope.ParseFromString(scope.SerializeToString() + bytes([0xFB, 0x07, 0xFC, 0x07]))  # an empty group, field 127
    body = req.SerializeToString()
    with pytest.raises(ValueError, match="wire type 3"):
        _walk_all(body)  # the walk cannot step over it
    assert [v for _, v in threads(add_thread(body, RANK))] == ["a"]


def _walk_all(body: bytes) -> None:
    for _, _, rs, rs_end in _fields(body, 0, len(body)):
        for _, _, ss, ss_end in _fields(body, rs, rs_end):
            list(_fields(body, ss, ss_end))


def test_the_thread_attribute_is_one_key_value() -> None:
    out = add_thread(request([("gen_ai.conversation.id", s("c"))]).SerializeToString(), RANK)
    span = ExportTraceServiceRequest.FromString(out).resource_spans[0].scope_spans[0].spans[0]
    assert span.attributes[-1] == KeyValue(key=THREAD_ATTRIBUTE, value=s("c"))
