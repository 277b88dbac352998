"""Conversations rebuilt by the real daemon from the captured payloads, over the wire."""

from __future__ import annotations

import json
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import yaml

from ..support.conversations import comparable_message, one_timestamp_per_call
from ..support.daemon import run_cli, wait_conversations, wait_until
from ..support.genai_fixtures import case_names
from ..support.wire import FIXTURES, add_attributes, fixture_requests, post, replay

pytestmark = pytest.mark.slow  # each test starts the daemon

HANDOVER = {"conversations": {"end_rules": [{"attribute": "app.handover", "equals": True, "ended_by": "handover"}]}}


def _cid(conv: dict[str, Any]) -> str:
    return conv["conversation_key"] or f"trace:{conv['trace_ids'][0]}"


@pytest.mark.parametrize("case", case_names())
def test_fixture_conversations_rebuilt_by_the_daemon(make_daemon: Any, case: str) -> None:
    daemon = make_daemon(**HANDOVER)
    for req in fixture_requests(case):
        replay(req, daemon.grpc, daemon.http)
    wait_conversations(daemon)
    _assert_rebuilt_as_expected(daemon, case)


def test_log_records_sharing_a_timestamp_keep_request_order(make_daemon: Any) -> None:
    """openai-v2's per-message events of one call on a coarse clock: each message once, in order."""
    case = "openai-v2-2.3b0-legacy-log-events-http"
    daemon = make_daemon(**HANDOVER)
    for req in one_timestamp_per_call(list(fixture_requests(case))):
        replay(req, daemon.grpc, daemon.http)
    wait_conversations(daemon)
    _assert_rebuilt_as_expected(daemon, case)


def _assert_rebuilt_as_expected(daemon: Any, case: str) -> None:
    expected = json.loads((FIXTURES / f"{case}.expected.json").read_text())
    listed = daemon.get("/api/conversations?limit=1000")[1]["conversations"]
    has_content = not str(expected.get("content_in_payload", "")).startswith("none")
    # No conversation from nothing: traces with neither an id nor content are stored as spans only.
    convs = [c for c in expected["conversations"] if has_content or c["conversation_key"]]
    nothing = [c for c in expected["conversations"] if c not in convs]
    assert {c["conversation_id"] for c in listed} == {_cid(c) for c in convs}
    for conv in convs:
        cid = _cid(conv)
        record = daemon.get("/api/conversations/" + urllib.parse.quote(cid, safe=""))[1]
        assert record["schema"] == "conversation/v1" and record["id"] == cid
        assert sorted(record["trace_ids"]) == sorted(conv["trace_ids"])
        assert record["usage"] == {"input_tokens": conv["usage"]["input_tokens"],
                                   "output_tokens": conv["usage"]["output_tokens"]}, cid
        assert record["models"] == [conv["model"]]
        assert record["ended_by"] == ("handover" if conv["handover"] else "open"), cid
        if not has_content:
            assert record["messages"] == [] and record["attributes"]["content_captured"] is False
            continue
        assert record["system"] == conv["system_prompt"]
        assert [comparable_message(m) for m in record["messages"]] == [comparable_message(m) for m in conv["messages"]]
    if not has_content:
        metrics = daemon.get("/metrics")[1]
        assert f"tracejudge_conversations_without_content {len(convs)}" in metrics
        # ... and the traces that made none are counted, with the same advice
        assert f"tracejudge_genai_traces_without_content_total {sum(len(c['trace_ids']) for c in nothing)}" in metrics
        assert "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY" in metrics


def test_requests_in_reverse_order_and_retried_give_the_same_conversations(make_daemon: Any) -> None:
    """Logs before spans, every request twice: the same transcripts as in order."""
    case = "openai-v2-latest-event-only-grpc"
    daemon = make_daemon(**HANDOVER)
    for req in reversed(list(fixture_requests(case))):
        replay(req, daemon.grpc, daemon.http)
        replay(req, daemon.grpc, daemon.http)
    wait_conversations(daemon)
    expected = json.loads((FIXTURES / f"{case}.expected.json").read_text())
    for conv in expected["conversations"]:
        record = daemon.get("/api/conversations/" + urllib.parse.quote(_cid(conv), safe=""))[1]
        assert [comparable_message(m) for m in record["messages"]] == [comparable_message(m) for m in conv["messages"]]


def test_idle_timeout_ends_and_new_trace_reopens(make_daemon: Any) -> None:
    """Idle is measured on arrival (daemon clock), not on the (old) span timestamps."""
    daemon = make_daemon(conversations={"idle_timeout": "4s"})
    reqs = list(fixture_requests("openai-v2-latest-span-only-grpc"))
    replay(reqs[0], daemon.grpc, daemon.http)
    wait_conversations(daemon)
    open_now = daemon.get("/api/conversations?state=open&limit=100")[1]["conversations"]
    assert open_now, "the fixture's conversations are open right after arrival, although their spans are old"
    wait_until(lambda: not daemon.get("/api/conversations?state=open")[1]["conversations"],
               "no conversation left open", timeout=30, interval=0.2)
    ended = daemon.get("/api/conversations?state=ended&limit=100")[1]["conversations"]
    assert {c["ended_by"] for c in ended} == {"idle"} and len(ended) == len(open_now)
    # the stage's child reports its counters with its status (every 0.2 s), so they trail the database
    ended_metric = 'tracejudge_conversations_ended_total{ended_by="idle"}'
    wait_until(lambda: daemon.metric(ended_metric, missing=0) == len(ended), "the idle endings counted in /metrics")


def test_conversations_cli_with_and_without_daemon(make_daemon: Any) -> None:
    daemon = make_daemon(**HANDOVER)
    for req in fixture_requests("openllmetry-anthropic-0.62-grpc"):
        replay(req, daemon.grpc, daemon.http)
    wait_conversations(daemon)
    expected = json.loads((FIXTURES / "openllmetry-anthropic-0.62-grpc.expected.json").read_text())
    handover = next(c for c in expected["conversations"] if c["handover"])
    for running in (True, False):
        if not running:
            assert daemon.stop() == 0
        res = run_cli("conversations", "list", "--config", str(daemon.config_path), "--json")
        assert res.returncode == 0, res.stderr
        listed = json.loads(res.stdout)
        assert len(listed) == len(expected["conversations"])
        res = run_cli("conversations", "list", "--config", str(daemon.config_path), "--state", "ended")
        assert res.returncode == 0 and handover["conversation_key"] in res.stdout
        res = run_cli("conversations", "show", handover["conversation_key"], "--config", str(daemon.config_path),
                      "--json")
        record = json.loads(res.stdout)
        assert record["ended_by"] == "handover"
        assert [comparable_message(m) for m in record["messages"]] == [comparable_message(m) for m in handover["messages"]]
        text = run_cli("conversations", "show", handover["conversation_key"], "--config",
                       str(daemon.config_path)).stdout
        assert "USER:" in text and handover["messages"][0]["content"][:30] in text
    missing = run_cli("conversations", "show", "no-such-id", "--config", str(daemon.config_path))
    assert missing.returncode == 2 and "no-such-id" in missing.stderr


# What a reindex writes as the live stage does; the times it records are its own (when it wrote,
# when it ended a conversation, which arrival of a trace it saw first), and so is where it wrote the
# messages (messages_batch, and messages.first_batch).
SAME = ("SELECT * EXCLUDE (updated_at, closed_at, first_arrival_at, messages_batch) FROM conversations ORDER BY ALL",
        "SELECT * EXCLUDE (first_batch) FROM messages ORDER BY ALL", "SELECT * FROM trace_map ORDER BY ALL")


def _every_fixture(daemon: Any) -> None:
    for case in case_names():
        for req in fixture_requests(case):
            replay(req, daemon.grpc, daemon.http)


def test_reindex_rebuilds_the_conversations_the_live_stage_built(make_daemon: Any) -> None:
    daemon = make_daemon(conversations={**HANDOVER["conversations"], "idle_timeout": "1s"})
    _every_fixture(daemon)
    wait_conversations(daemon)
    wait_until(lambda: daemon.get("/api/status")[1]["conversations_pending"] == 0 and not daemon.get(
        "/api/conversations?state=open")[1]["conversations"], "every conversation to end idle")
    assert daemon.stop() == 0
    live = [daemon.query(q) for q in SAME]
    assert len(live[0]) >= len(case_names())
    res = run_cli("reindex", "--config", str(daemon.config_path))
    assert res.returncode == 0, res.stderr
    assert f"reindexed: {len(live[0])} conversations rebuilt" in res.stdout, res.stdout
    assert [daemon.query(q) for q in SAME] == live


def test_a_restart_after_downtime_ends_the_overdue_conversations_as_a_rebuild_would(make_daemon: Any) -> None:
    daemon = make_daemon(conversations={"idle_timeout": "1h"})
    _every_fixture(daemon)
    wait_conversations(daemon)
    assert daemon.stop() == 0
    opened = daemon.query("SELECT count(*) FROM conversations WHERE state = 'open'")[0][0]
    assert opened >= len(case_names())

    # Down for longer than the idle timeout: at the next start every one of them is overdue.
    daemon.config["conversations"] = {"idle_timeout": "1s"}
    daemon.config_path.write_text(yaml.safe_dump(daemon.config), encoding="utf-8")
    daemon.start()
    wait_until(lambda: not daemon.get("/api/conversations?state=open")[1]["conversations"],
               "the overdue conversations to end")
    assert daemon.stop() == 0
    ended = [daemon.query(q) for q in SAME]
    assert daemon.query("SELECT count(*) FROM conversations WHERE ended_by = 'idle' AND ended_at IS NOT NULL "
                        "AND state = 'ended'")[0][0] == opened
    res = run_cli("reindex", "--config", str(daemon.config_path))  # each rebuilt from its rows
    assert res.returncode == 0, res.stderr
    assert [daemon.query(q) for q in SAME] == ended


def test_reindex_through_a_running_daemon_swaps_in_and_the_daemon_goes_on(make_daemon: Any) -> None:
    daemon = make_daemon(**HANDOVER)
    assert daemon.get("/api/reindex", check=False)[0] == 404
    status, _, body = post(daemon.api, "/api/reindex", b"{}", "text/plain")
    assert status == 415, body
    status, _, body = post(daemon.api, "/api/reindex", b'{"all": true}', "application/json")
    assert status == 400 and b"unknown field" in body, body
    *first, last = case_names()
    for case in first:
        for req in fixture_requests(case):
            replay(req, daemon.grpc, daemon.http)
    wait_conversations(daemon)
    before = {c["conversation_id"]: daemon.get("/api/conversations/" + urllib.parse.quote(
        c["conversation_id"], safe=""))[1] for c in daemon.get("/api/conversations?limit=1000")[1]["conversations"]}
    res = run_cli("reindex", "--config", str(daemon.config_path))  # through the API: the daemon holds the file
    assert res.returncode == 0, res.stderr
    assert f"reindexed: {len(before)} conversations rebuilt" in res.stdout, res.stdout
    assert daemon.get("/api/reindex")[1]["state"] == "finished"
    for req in fixture_requests(last):  # the live stage goes on from the swapped-in state
        replay(req, daemon.grpc, daemon.http)
    wait_conversations(daemon)
    for cid, rec in before.items():
        again = daemon.get("/api/conversations/" + urllib.parse.quote(cid, safe=""))[1]
        assert again["messages"] == rec["messages"], cid
        assert again["attributes"]["revision"] == rec["attributes"]["revision"], cid  # the same transcript
    expected = json.loads((FIXTURES / f"{last}.expected.json").read_text())
    for conv in expected["conversations"]:
        record = daemon.get("/api/conversations/" + urllib.parse.quote(_cid(conv), safe=""))[1]
        assert sorted(record["trace_ids"]) == sorted(conv["trace_ids"]), _cid(conv)
    assert daemon.stop() == 0


def test_traces_without_id_chain_by_previous_response_id(make_daemon: Any) -> None:
    """Responses-API style bots set no conversation id: each call names the previous response."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    daemon = make_daemon()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=daemon.grpc, insecure=True)))
    tracer = provider.get_tracer("tests")
    turns = [("Hi, is my order late?", "Let me check: it ships today."), ("Thanks!", "You are welcome.")]
    previous = None
    for i, (user, bot) in enumerate(turns):
        attrs = {
            "gen_ai.operation.name": "chat", "gen_ai.request.model": "gpt-5", "gen_ai.response.id": f"resp_{i}",
            "gen_ai.input.messages": json.dumps([{"role": "user", "parts": [{"type": "text", "content": user}]}]),
            "gen_ai.output.messages": json.dumps([{"role": "assistant",
                                                   "parts": [{"type": "text", "content": bot}]}]),
        }
        if previous:
            attrs["gen_ai.request.previous_response.id"] = previous
        with tracer.start_as_current_span("chat gpt-5", attributes=attrs):
            pass
        previous = f"resp_{i}"
        wait_conversations(daemon)
    provider.shutdown()
    listed = daemon.get("/api/conversations")[1]["conversations"]
    assert len(listed) == 1 and listed[0]["conversation_id"].startswith("trace:")
    record = daemon.get("/api/conversations/" + urllib.parse.quote(listed[0]["conversation_id"], safe=""))[1]
    assert [m["content"] for m in record["messages"]] == [t for pair in turns for t in pair]
    assert len(record["trace_ids"]) == 2


def test_kill9_before_conversations_caught_up_then_restart(make_daemon: Any) -> None:
    """Spans acknowledged but not yet turned into conversations are picked up after a restart."""
    case = "openllmetry-anthropic-0.47-legacy-http"
    daemon = make_daemon(**HANDOVER)
    for req in fixture_requests(case):
        replay(req, daemon.grpc, daemon.http)
    daemon.kill9()  # most likely before the stage's one-second rebuild
    daemon.start()
    wait_conversations(daemon)
    expected = json.loads((FIXTURES / f"{case}.expected.json").read_text())
    for conv in expected["conversations"]:
        record = daemon.get("/api/conversations/" + urllib.parse.quote(_cid(conv), safe=""))[1]
        assert [comparable_message(m) for m in record["messages"]] == [comparable_message(m) for m in conv["messages"]]
        assert record["ended_by"] == ("handover" if conv["handover"] else "open")


def _spans_request(spans: list[tuple[int, int, int | None, str, dict[str, Any]]]) -> bytes:
    """An export request of (trace, span, parent, name, attributes) spans, one service."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    kv = rs.resource.attributes.add()
    kv.key, kv.value.string_value = "service.name", "shopbot"
    ss = rs.scope_spans.add()
    for i, (trace, span, parent, name, attrs) in enumerate(spans):
        sp = ss.spans.add()
        sp.trace_id, sp.span_id, sp.name = trace.to_bytes(16, "big"), span.to_bytes(8, "big"), name
        if parent is not None:
            sp.parent_span_id = parent.to_bytes(8, "big")
        sp.start_time_unix_nano = 1_764_478_800_000_000_000 + i * 1000
        sp.end_time_unix_nano = sp.start_time_unix_nano + 900
        add_attributes(sp.attributes, attrs)
    return req.SerializeToString()


def test_system_texts_attachment_markers_and_unreported_usage(make_daemon: Any) -> None:
    """conversation-v1.md rules, over the wire: every system text once, attachments named by their
    modality, no ``usage`` where no call reported one."""
    from ..support.wire import post

    image = [{"type": "text", "text": "Is this the right shoe?"},
             {"type": "image_url", "image_url": {"url": "https://example.com/shoe.jpg"}}]
    spans = [
        # OpenLLMetry (indexed attributes), a streamed call that reported no token counts.
        (1, 1, None, "invoke_agent ShopBot", {"gen_ai.operation.name": "invoke_agent",
                                              "gen_ai.conversation.id": "c-image"}),
        (1, 2, 1, "openai.chat", {"llm.request.type": "chat", "gen_ai.request.model": "gpt-4o",
                                  "gen_ai.prompt.0.role": "system", "gen_ai.prompt.0.content": "Be brief.",
                                  "gen_ai.prompt.1.role": "user", "gen_ai.prompt.1.content": json.dumps(image),
                                  "gen_ai.completion.0.role": "assistant",
                                  "gen_ai.completion.0.content": "Yes, that is the Trail Runner X2."}),
        # v1.37+ attributes: system instructions beside a system message of the input.
        (2, 3, None, "invoke_agent ShopBot", {"gen_ai.operation.name": "invoke_agent",
                                              "gen_ai.conversation.id": "c-system"}),
        (2, 4, 3, "chat gpt-4o-mini", {
            "gen_ai.operation.name": "chat", "gen_ai.request.model": "gpt-4o-mini",
            "gen_ai.system_instructions": json.dumps([{"type": "text", "content": "You are ShopBot."}]),
            "gen_ai.input.messages": json.dumps([
                {"role": "system", "parts": [{"type": "text", "content": "The user is signed in as Ada."}]},
                {"role": "user", "parts": [{"type": "text", "content": "Where is my order?"}]}]),
            "gen_ai.output.messages": json.dumps([{"role": "assistant", "parts": [
                {"type": "text", "content": "It ships today, Ada."}], "finish_reason": "stop"}]),
            "gen_ai.usage.input_tokens": 0, "gen_ai.usage.output_tokens": 7}),
    ]
    daemon = make_daemon()
    assert post(daemon.http, "/v1/traces", _spans_request(spans))[0] == 200
    wait_conversations(daemon)
    image_rec = daemon.get("/api/conversations/c-image")[1]
    assert [m["content"] for m in image_rec["messages"]] == ["Is this the right shoe?\n[image]",
                                                             "Yes, that is the Trail Runner X2."]
    assert "usage" not in image_rec and image_rec["system"] == "Be brief."
    system_rec = daemon.get("/api/conversations/c-system")[1]
    assert system_rec["system"] == "You are ShopBot.\n\nThe user is signed in as Ada."
    assert system_rec["usage"] == {"input_tokens": 0, "output_tokens": 7}


# Framework captures with an id (tests/fixtures/frameworks): the daemon makes one conversation per id, and
# none from the traces that hold no conversation (LangChain's agent construction).
FRAMEWORKS = Path(__file__).resolve().parents[1] / "fixtures" / "frameworks" / "cases"


@pytest.mark.parametrize("case", ["langchain-agent-openllmetry-http", "agents-sdk-streamed-logfire-http",
                                  "crewai-agent-openinference-grpc"])
def test_framework_captures_rebuilt_by_the_daemon(make_daemon: Any, case: str) -> None:
    daemon = make_daemon()
    for req in fixture_requests(case, FRAMEWORKS):
        replay(req, daemon.grpc, daemon.http)
    wait_conversations(daemon)
    expected = json.loads((FRAMEWORKS / f"{case}.expected.json").read_text())
    listed = daemon.get("/api/conversations?limit=1000")[1]["conversations"]
    assert {c["conversation_id"] for c in listed} == {c["conversation_key"] for c in expected["conversations"]}
    for conv in expected["conversations"]:
        record = daemon.get("/api/conversations/" + urllib.parse.quote(conv["conversation_key"], safe=""))[1]
        assert sorted(record["trace_ids"]) == sorted(conv["trace_ids"])
        assert record["system"] == conv["system_prompt"]
        assert [comparable_message(m) for m in record["messages"]] == [comparable_message(m) for m in conv["messages"]]
