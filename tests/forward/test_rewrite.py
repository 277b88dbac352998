"""LangSmith's thread attribute: added to each span that carries a conversation id, on every captured
fixture and on the cases that are easy to get wrong (rank, an attribute there already, an id only in content,
on the resource or the scope), and nothing else changed."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from collector.config import DEFAULT_ID_ATTRIBUTES
from collector.forward.rewrite import THREAD_ATTRIBUTE, Redaction, rewrite
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


def add_thread(body: bytes, rank: dict[str, int]) -> bytes:
    return rewrite("traces", body, thread_from=sorted(rank, key=rank.__getitem__))


def without_threads(body: bytes) -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest.FromString(body)
    for rs in req.resource_spans:
        for ss in rs.scope_spans:
            for sp in ss.spans:
                kept = [kv for kv in sp.attributes if kv.key != THREAD_ATTRIBUTE]
                del sp.attributes[:]
                sp.attributes.extend(kept)
    return req


@pytest.mark.parametrize("path", trace_fixtures(), ids=lambda p: p.name)
def test_on_every_fixture_each_span_with_an_id_gets_it_and_nothing_else_changes(path: Path) -> None:
    body = protobuf(path)
    out = rewrite("traces", body, thread_from=DEFAULT_ID_ATTRIBUTES)
    assert threads(out), "every captured fixture carries a conversation id"
    assert without_threads(out) == ExportTraceServiceRequest.FromString(body)


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
    first = ExportTraceServiceRequest.FromString(out).resource_spans[0].scope_spans[0].spans[0]
    assert [kv.key for kv in first.attributes] == ["gen_ai.conversation.id", THREAD_ATTRIBUTE]
    assert first.status.code == 1 and first.span_id == bytes([1]) * 8


def test_nothing_to_add_returns_the_bytes_that_came_in() -> None:
    body = request([("gen_ai.input.messages", s("gen_ai.conversation.id"))], [("x", s("y"))]).SerializeToString()
    assert add_thread(body, RANK) is body
    assert add_thread(b"", RANK) == b""


def test_the_thread_attribute_is_one_key_value() -> None:
    out = add_thread(request([("gen_ai.conversation.id", s("c"))]).SerializeToString(), RANK)
    span = ExportTraceServiceRequest.FromString(out).resource_spans[0].scope_spans[0].spans[0]
    assert span.attributes[-1] == KeyValue(key=THREAD_ATTRIBUTE, value=s("c"))


# ---------------------------------------------------------------- redact: content, by allowlist

def redacted(req: ExportTraceServiceRequest, **kw: object) -> ExportTraceServiceRequest:
    return ExportTraceServiceRequest.FromString(rewrite("traces", req.SerializeToString(),
                                                        redact=Redaction(key=b"k" * 32, **kw)))  # type: ignore[arg-type]


def attrs(kvs: object) -> dict[str, object]:
    return {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in kvs}  # type: ignore[attr-defined]


def test_every_string_but_the_structural_ones_is_redacted_at_any_depth() -> None:
    req = request([
        ("gen_ai.request.model", s("claude-sonnet-4")), ("gen_ai.operation.name", s("chat")),
        ("my.app.note", s("call anna@example.com")),  # a key no list knows
        ("user.email", s("bob@example.org")), ("gen_ai.usage.input_tokens", AnyValue(int_value=12)),
        ("blob", AnyValue(bytes_value="card 4111 1111 1111 1111".encode())),
        ("binary", AnyValue(bytes_value=b"\xff\xfe anna@example.com")),
        ("nested", AnyValue(kvlist_value={"values": [KeyValue(key="deep", value=AnyValue(
            array_value={"values": [s("or +44 20 7946 0958")]}))]})),
        ("ai.prompt.messages", s('[{"role": "user", "content": "mail \\u0061nna@example.com"}]')),
    ])
    span = req.resource_spans[0].scope_spans[0].spans[0]
    span.name = "lookup anna@example.com"
    span.status.message = "no account for bob@example.org"
    ev = span.events.add(name="exception")
    ev.attributes.add(key="exception.message", value=s("KeyError: 'anna@example.com'"))
    out = redacted(req, keep=("my.app.*",))
    got = out.resource_spans[0].scope_spans[0].spans[0]
    a = attrs(got.attributes)
    assert a["gen_ai.request.model"] == "claude-sonnet-4" and a["gen_ai.operation.name"] == "chat"
    assert a["my.app.note"] == "call anna@example.com"  # kept by keep_attributes
    anna, bob = got.name.removeprefix("lookup "), a["user.email"]  # one placeholder per value, in the request
    assert {anna, bob} == {"<EMAIL_1>", "<EMAIL_2>"} and a["gen_ai.usage.input_tokens"] == 12
    assert a["blob"] == b"card <CARD_1>" and a["binary"] == b""
    assert "<PHONE_1>" in str(got.attributes)
    assert json.loads(str(a["ai.prompt.messages"])) == [{"role": "user", "content": f"mail {anna}"}]
    assert got.status.message == f"no account for {bob}"
    assert attrs(got.events[0].attributes)["exception.message"] == f"KeyError: '{anna}'"
    assert got.span_id == span.span_id and got.trace_id == span.trace_id and got.status.code == 1


def test_a_conversation_id_leaves_as_it_is_unless_it_is_personal_data_then_as_the_same_pseudonym() -> None:
    def conv(cid: str, key: str = "gen_ai.conversation.id") -> str:
        out = redacted(request([(key, s(cid))]), ids=("my.thread",))
        return str(attrs(out.resource_spans[0].scope_spans[0].spans[0].attributes)[key])

    assert conv("conv-42") == "conv-42" and conv("alice.smith@example.com", "my.thread").startswith("pseudonym-")
    assert conv("alice.smith@example.com") == conv("alice.smith@example.com") != conv("bob@example.com")
    assert "alice" not in conv("alice.smith@example.com") and conv("+44 20 7946 0958").startswith("pseudonym-")


def test_names_given_in_the_request_are_redacted_wherever_they_occur() -> None:
    req = request([("user.name", s("Anna Rossi")), ("gen_ai.input.messages", s("Anna asked to move"))],
                  resource=[("service.name", "triage-bot")])
    out = redacted(req)
    a = attrs(out.resource_spans[0].scope_spans[0].spans[0].attributes)
    assert "Anna" not in str(a) and attrs(out.resource_spans[0].resource.attributes)["service.name"] == "triage-bot"


def test_a_request_with_nothing_to_redact_is_the_bytes_that_came_in() -> None:
    body = request([("gen_ai.request.model", s("m")), ("gen_ai.input.messages", s("hello there"))]).SerializeToString()
    assert rewrite("traces", body, redact=Redaction()) is body
