"""Normalizer and transcript assembly against every shared fixture case, plus
table-driven checks of each dialect reader on small hand-written spans.

The fixture test is data-driven: any case added to ``../shared/fixtures/otlp``
is picked up and compared with its ``.expected.json``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collector.conversations.assemble import DEFAULT_ID_ATTRIBUTES, build_transcript, conversation_key, group_traces
from collector.conversations.record import conversation_v1
from collector.normalize import (
    SPAN_DIALECTS,
    Event,
    Message,
    ToolCall,
    read_events,
    read_meta,
    read_span,
    span_dialects,
)
from collector.normalize._model import Attrs, Truncated, _last_arrays

from ..support.conversations import comparable_messages
from ..support.genai_fixtures import FIXTURES, Case, by_trace, case_names, load_case, logs_by_trace

CASES = case_names()


def test_fixture_cases_found() -> None:
    assert CASES, "no *.expected.json under ../shared/fixtures/otlp"


@pytest.mark.parametrize("name", CASES)
def test_fixture_case(name: str) -> None:
    _assert_rebuilt_exactly(load_case(name))


LOG_CASES = [c for c in CASES if any(FIXTURES.glob(f"{c}.logs*"))]


@pytest.mark.parametrize("name", LOG_CASES)
def test_fixture_case_with_one_timestamp_per_call(name: str) -> None:
    """A coarse clock gives every log record of a call the same time: request order still holds."""
    case = load_case(name)
    first: dict[Any, int] = {}
    for row in case.logs:
        t = first.setdefault((row["trace_id"], row["span_id"]), row["observed_time_unix_nano"])
        row["time_unix_nano"] = row["observed_time_unix_nano"] = t
    _assert_rebuilt_exactly(case)


def _assert_rebuilt_exactly(case: Case) -> None:
    groups = group_traces(by_trace(case.spans, case.logs), logs=logs_by_trace(case.logs))
    expected = case.expected["conversations"]
    if not case.has_content:
        # No conversation from nothing: a trace with neither an id nor content is stored as spans only.
        nothing = [c for c in expected if not c["conversation_key"]]
        assert not {t for c in nothing for t in c["trace_ids"]} & {t for ts in groups.values() for t in ts}
        expected = [c for c in expected if c["conversation_key"]]
    want_ids = {c["conversation_key"] or f"trace:{c['trace_ids'][0]}" for c in expected}
    assert set(groups) == want_ids
    for conv in expected:
        cid = conv["conversation_key"] or f"trace:{conv['trace_ids'][0]}"
        assert sorted(groups[cid]) == sorted(conv["trace_ids"]), cid
        traces = set(groups[cid])
        t = build_transcript([r for r in case.spans if r["trace_id"] in traces],
                             [r for r in case.logs if r["trace_id"] in traces])
        record = conversation_v1(t, cid, "handover" if conv.get("handover") else "idle")
        assert record["id"] == cid
        assert sorted(record["trace_ids"]) == sorted(conv["trace_ids"])
        assert record["usage"] == {"input_tokens": conv["usage"]["input_tokens"],
                                   "output_tokens": conv["usage"]["output_tokens"]}, cid
        assert record["models"] == [conv["model"]], cid
        assert t.llm_calls == conv["llm_calls"], cid
        assert t.unparsed_spans == 0 and t.unparsed_logs == 0
        if not case.has_content:
            assert not t.content_captured and record["messages"] == []
            assert "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY" in (t.no_content_reason or "")
            assert record["attributes"]["content_captured"] is False
            continue
        assert t.content_captured and t.no_content_reason is None
        assert record["system"] == conv["system_prompt"], cid
        got, exp = comparable_messages(record["messages"], conv["messages"])
        assert got == exp, cid
        assert all(m.get("span_id") for m in record["messages"])
        assert t.user_turns == sum(1 for m in conv["messages"] if m["role"] == "user")


def test_service_and_times_from_spans() -> None:
    case = load_case(CASES[0])
    t = build_transcript(case.spans, case.logs)
    assert t.service is not None
    assert t.started_at is not None and t.ended_at is not None and t.started_at <= t.ended_at
    assert t.started_at.tzinfo is not None


# ---------------------------------------------------------------- dialect readers

def _m(role: str, content: str = "", calls: tuple[ToolCall, ...] = (), call_id: str | None = None,
       name: str | None = None) -> Message:
    return Message(role, content, tool_calls=calls, tool_call_id=call_id, name=name)  # type: ignore[arg-type]


LOOKUP = ToolCall("call_1", "lookup", {"id": "A-1"})
J = json.dumps

# (case id, span attributes, expected input, expected output, expected system, source)
SPAN_TABLE: list[tuple[str, dict[str, Any], list[Message] | None, list[Message] | None, str | None, str]] = [
    ("otel-genai structured values", {
        "gen_ai.operation.name": "chat",
        "gen_ai.system_instructions": [{"type": "text", "content": "Be brief."}],
        "gen_ai.input.messages": [{"role": "user", "parts": [{"type": "text", "content": "hi"}]}],
        "gen_ai.output.messages": [{"role": "assistant", "parts": [
            {"type": "tool_call", "id": "call_1", "name": "lookup", "arguments": '{"id": "A-1"}'}]}],
    }, [_m("user", "hi")], [_m("assistant", "", (LOOKUP,))], "Be brief.", "otel-genai/span"),
    ("otel-genai two choices: first only", {
        "gen_ai.output.messages": J([{"role": "assistant", "parts": [{"type": "text", "content": "a"}]},
                                     {"role": "assistant", "parts": [{"type": "text", "content": "b"}]}]),
    }, None, [_m("assistant", "a")], None, "otel-genai/span"),
    ("semconv 1.26 gen_ai.prompt json", {
        "gen_ai.prompt": J([{"role": "system", "content": "sys"}, {"role": "user", "content": "q"}]),
        "gen_ai.completion": J([{"role": "assistant", "content": "r"}]),
    }, [_m("user", "q")], [_m("assistant", "r")], "sys", "otel-genai/span"),
    ("openllmetry pre-0.5 llm.prompts", {
        "llm.request.type": "chat",
        "llm.prompts.1.role": "user", "llm.prompts.1.content": "second",
        "llm.prompts.0.role": "system", "llm.prompts.0.content": "sys",
        "llm.completions.0.role": "assistant", "llm.completions.0.content": "ok",
    }, [_m("user", "second")], [_m("assistant", "ok")], "sys", "openllmetry/span"),
    ("openllmetry anthropic tool_result blocks", {
        "gen_ai.prompt.0.role": "user",
        "gen_ai.prompt.0.content": J([{"type": "tool_result", "tool_use_id": "t1",
                                       "content": [{"type": "text", "text": "42"}]},
                                      {"type": "text", "text": "and?"}]),
    }, [_m("tool", "42", call_id="t1"), _m("user", "and?")], None, None, "openllmetry/span"),
    ("openinference contents list", {
        "openinference.span.kind": "LLM",
        "llm.input_messages.0.message.role": "user",
        "llm.input_messages.0.message.contents.0.message_content.type": "text",
        "llm.input_messages.0.message.contents.0.message_content.text": "look",
        "llm.output_messages.0.message.role": "assistant",
        "llm.output_messages.0.message.content": "seen",
    }, [_m("user", "look")], [_m("assistant", "seen")], None, "openinference/span"),
    ("openinference raw input.value only", {
        "openinference.span.kind": "LLM",
        "input.value": J({"model": "m", "messages": [{"role": "user", "content": "raw q"}]}),
        "input.mime_type": "application/json",
        "output.value": J({"choices": [{"message": {"role": "assistant", "content": "raw a"}}]}),
    }, [_m("user", "raw q")], [_m("assistant", "raw a")], None, "openinference/span"),
    ("openinference agent plain text that looks like json", {
        "openinference.span.kind": "AGENT",
        "input.value": "[not json", "input.mime_type": "text/plain",
        "output.value": "done", "output.mime_type": "text/plain",
    }, [_m("user", "[not json")], [_m("assistant", "done")], None, "openinference/span"),
    ("vercel outer ai.prompt", {
        "ai.operationId": "ai.generateText",
        "ai.prompt": J({"system": "sys", "prompt": "hello"}),
        "ai.response.text": "hey",
    }, [_m("user", "hello")], [_m("assistant", "hey")], "sys", "vercel-ai/span"),
    ("vercel step with tool calls only", {
        "ai.operationId": "ai.streamText.doStream",
        "ai.prompt.messages": J([{"role": "user", "content": [{"type": "text", "text": "q"}]}]),
        "ai.response.toolCalls": J([{"toolCallId": "call_1", "toolName": "lookup", "args": '{"id":"A-1"}'}]),
    }, [_m("user", "q")], [_m("assistant", "", (LOOKUP,))], None, "vercel-ai/span"),
    ("langfuse anthropic request", {
        "langfuse.observation.type": "generation",
        "langfuse.observation.input": J({"system": "sys", "messages": [{"role": "user", "content": "q"}]}),
        "langfuse.observation.output": J({"content": [{"type": "text", "text": "a"},
                                                      {"type": "tool_use", "id": "call_1", "name": "lookup",
                                                       "input": {"id": "A-1"}}]}),
    }, [_m("user", "q")], [_m("assistant", "a", (LOOKUP,))], "sys", "langfuse/span"),
    ("logfire v1 openai payloads", {
        "request_data": J({"model": "gpt", "messages": [{"role": "system", "content": "sys"},
                                                        {"role": "user", "content": "q"}]}),
        "response_data": J({"message": {"role": "assistant", "content": "a"},
                            "usage": {"prompt_tokens": 3, "completion_tokens": 1}}),
    }, [_m("user", "q")], [_m("assistant", "a")], "sys", "logfire/span"),
    ("logfire v1 stream", {
        "request_data": J({"model": "claude", "system": "sys", "messages": [{"role": "user", "content": "q"}]}),
        "response_data": J({"combined_chunk_content": "streamed", "chunk_count": 3}),
    }, [_m("user", "q")], [_m("assistant", "streamed")], "sys", "logfire/span"),
    ("adk gemini parts", {
        "gcp.vertex.agent.llm_request": J({
            "model": "gemini-2.0", "config": {"system_instruction": "sys"},
            "contents": [{"role": "user", "parts": [{"text": "q"}]},
                         {"role": "model", "parts": [{"function_call": {"id": "call_1", "name": "lookup",
                                                                        "args": {"id": "A-1"}}}]},
                         {"role": "user", "parts": [{"function_response": {"id": "call_1", "name": "lookup",
                                                                           "response": {"ok": True}}}]}]}),
        "gcp.vertex.agent.llm_response": J({"content": {"role": "model", "parts": [{"text": "a"}]},
                                            "usage_metadata": {"prompt_token_count": 5,
                                                               "candidates_token_count": 2}}),
    }, [_m("user", "q"), _m("assistant", "", (LOOKUP,)), _m("tool", '{"ok":true}', call_id="call_1", name="lookup")],
       [_m("assistant", "a")], "sys", "adk/span"),
    ("sentry request messages", {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.messages": J([{"role": "user", "content": "q"}]),
        "gen_ai.response.text": J(["a"]),
    }, [_m("user", "q")], [_m("assistant", "a")], None, "sentry/span"),
    ("pydantic-ai agent all_messages, tool results as user", {
        "gen_ai.operation.name": "invoke_agent",
        "pydantic_ai.all_messages": J([
            {"role": "user", "parts": [{"type": "text", "content": "q"}]},
            {"role": "assistant", "parts": [{"type": "tool_call", "id": "call_1", "name": "lookup",
                                             "arguments": {"id": "A-1"}}]},
            {"role": "user", "parts": [{"type": "tool_call_response", "id": "call_1", "name": "lookup",
                                        "result": "found"}]},
            {"role": "assistant", "parts": [{"type": "text", "content": "a"}]}]),
    }, [_m("user", "q"), _m("assistant", "", (LOOKUP,)), _m("tool", "found", call_id="call_1", name="lookup"),
        _m("assistant", "a")], None, None, "pydantic-ai/span"),
    ("responses api items use call_id", {
        "gen_ai.input.messages": J([
            {"role": "user", "content": "q"},
            {"type": "function_call", "id": "fc_9", "call_id": "call_1", "name": "lookup",
             "arguments": '{"id": "A-1"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "found"}]),
    }, [_m("user", "q"), _m("assistant", "", (LOOKUP,)), _m("tool", "found", call_id="call_1")],
       None, None, "otel-genai/span"),
    ("roles spelled differently", {
        "gen_ai.input.messages": J([{"role": "developer", "content": "sys"}, {"role": "Human", "content": "q"},
                                    {"role": "AI", "content": "a"}]),
    }, [_m("user", "q"), _m("assistant", "a")], None, "sys", "otel-genai/span"),
]


@pytest.mark.parametrize("case_id,attrs,want_in,want_out,want_system,source", SPAN_TABLE,
                         ids=[row[0] for row in SPAN_TABLE])
def test_span_dialect(case_id: str, attrs: dict[str, Any], want_in: list[Message] | None,
                      want_out: list[Message] | None, want_system: str | None, source: str) -> None:
    _, content = read_span(attrs)
    assert content is not None
    assert content.input == want_in
    assert content.output == want_out
    assert content.system == want_system
    assert content.source == source


# (case id, events, expected input, expected output, expected system)
EVENT_TABLE: list[tuple[str, list[Event], list[Message] | None, list[Message] | None, str | None]] = [
    ("azure span events with gen_ai.event.content", [
        Event("gen_ai.system.message", {"gen_ai.event.content": J({"role": "system", "content": "sys"})}, None),
        Event("gen_ai.user.message", {"gen_ai.event.content": J({"role": "user", "content": "q"})}, None),
        Event("gen_ai.choice", {"gen_ai.event.content": J(
            {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "a"}})}, None),
    ], [_m("user", "q")], [_m("assistant", "a")], "sys"),
    ("strands events with bedrock blocks as json strings", [
        Event("gen_ai.user.message", {"content": J([{"text": "q"}])}, None),
        Event("gen_ai.assistant.message", {"content": J([{"toolUse": {"toolUseId": "call_1", "name": "lookup",
                                                                     "input": {"id": "A-1"}}}])}, None),
        Event("gen_ai.tool.message", {"content": J([{"toolResult": {"toolUseId": "call_1",
                                                                   "content": [{"text": "found"}]}}]),
                                      "id": "call_1"}, None),
        Event("gen_ai.choice", {"message": J([{"text": "a"}]), "finish_reason": "end_turn"}, None),
    ], [_m("user", "q"), _m("assistant", "", (LOOKUP,)), _m("tool", "found", call_id="call_1")],
       [_m("assistant", "a")], None),
    ("azure ai agents message content", [
        Event("gen_ai.user.message", {"gen_ai.event.content": J(
            {"role": "user", "content": {"text": {"value": "q", "annotations": []}}})}, None),
        Event("gen_ai.assistant.message", {"gen_ai.event.content": J(
            {"role": "assistant", "content": {"text": {"value": "a"}}})}, None),
    ], [_m("user", "q"), _m("assistant", "a")], None, None),
    ("legacy log bodies, choice index 1 ignored", [
        Event("gen_ai.user.message", {}, {"content": "q"}),
        Event("gen_ai.choice", {}, {"index": 1, "message": {"content": "other"}}),
        Event("gen_ai.choice", {}, {"index": 0, "message": {"content": "a"}}),
    ], [_m("user", "q")], [_m("assistant", "a")], None),
    ("legacy events without content (capture off)", [
        Event("gen_ai.user.message", {}, {}),
        Event("gen_ai.choice", {}, {"index": 0, "finish_reason": "stop", "message": {"role": "assistant"}}),
    ], None, None, None),
    ("operation details as span event", [
        Event("gen_ai.client.inference.operation.details", {
            "gen_ai.input.messages": [{"role": "user", "parts": [{"type": "text", "content": "q"}]}],
            "gen_ai.output.messages": [{"role": "assistant", "parts": [{"type": "text", "content": "a"}]}]}, None),
    ], [_m("user", "q")], [_m("assistant", "a")], None),
    ("semconv 1.26 content events", [
        Event("gen_ai.content.prompt", {"gen_ai.prompt": J([{"role": "user", "content": "q"}])}, None),
        Event("gen_ai.content.completion", {"gen_ai.completion": J([{"role": "assistant", "content": "a"}])}, None),
    ], [_m("user", "q")], [_m("assistant", "a")], None),
]


@pytest.mark.parametrize("case_id,events,want_in,want_out,want_system", EVENT_TABLE,
                         ids=[row[0] for row in EVENT_TABLE])
def test_event_dialect(case_id: str, events: list[Event], want_in: list[Message] | None,
                       want_out: list[Message] | None, want_system: str | None) -> None:
    content = read_events(events)
    if want_in is None and want_out is None:
        assert content is None or not content.has_messages()
        return
    assert content is not None
    assert content.input == want_in
    assert content.output == want_out
    assert content.system == want_system


def test_truncated_json_is_read_up_to_the_cut_and_flagged() -> None:
    _, content = read_span({"gen_ai.operation.name": "chat",
                            "gen_ai.input.messages": '[{"role":"user","parts":[{"type":"text","content":"cut',
                            "gen_ai.output.messages": J([{"role": "assistant", "content": "a"}])})
    assert content is not None and content.truncated
    assert content.input == [Message("user", "cut", truncated=True)]
    assert content.output == [_m("assistant", "a")]


def test_unreadable_json_is_flagged_not_fatal() -> None:
    _, content = read_span({"gen_ai.operation.name": "chat", "gen_ai.input.messages": '[{"role": "user"}}',
                            "gen_ai.output.messages": J([{"role": "assistant", "content": "a"}])})
    assert content is not None and content.truncated
    assert content.input is None and content.output == [_m("assistant", "a")]


# (attributes, kind, request model, response model, input tokens, output tokens)
META_TABLE: list[tuple[dict[str, Any], str, str | None, str | None, int | None, int | None]] = [
    ({"gen_ai.operation.name": "chat", "gen_ai.request.model": "m", "gen_ai.response.model": "m-1",
      "gen_ai.usage.input_tokens": 3, "gen_ai.usage.output_tokens": 1}, "llm", "m", "m-1", 3, 1),
    ({"gen_ai.operation.name": "embeddings", "gen_ai.usage.input_tokens": 3}, "other", None, None, 3, None),
    ({"gen_ai.operation.name": "invoke_agent"}, "agent", None, None, None, None),
    ({"gen_ai.operation.name": "execute_tool", "gen_ai.tool.call.id": "c"}, "tool", None, None, None, None),
    ({"openinference.span.kind": "LLM", "llm.model_name": "m-1", "llm.token_count.prompt": "7",
      "llm.token_count.completion": 2, "llm.invocation_parameters": J({"model": "m"})}, "llm", "m", "m-1", 7, 2),
    ({"langfuse.observation.type": "generation", "langfuse.observation.model.name": "m-1",
      "langfuse.observation.usage_details": J({"input": 4, "output": 5})}, "llm", None, "m-1", 4, 5),
    ({"ai.operationId": "ai.generateText", "ai.usage.inputTokens": 9}, "agent", None, None, 9, None),
    ({"ai.operationId": "ai.generateText.doGenerate", "ai.model.id": "m", "ai.response.model": "m-1",
      "ai.usage.promptTokens": 9, "ai.usage.completionTokens": 1}, "llm", "m", "m-1", 9, 1),
    ({"llm.request.type": "completion", "gen_ai.usage.prompt_tokens": 5,
      "gen_ai.usage.completion_tokens": 6}, "llm", None, None, 5, 6),
    ({"gen_ai.system": "openai", "gen_ai.request.model": "m", "gen_ai.usage.input_tokens": 1}, "llm", "m", None, 1,
     None),
    ({"http.method": "POST"}, "other", None, None, None, None),
    # OpenInference, LangChain streamed: llm.model_name is the request model; the LLMResult names the reported one.
    ({"openinference.span.kind": "LLM", "llm.model_name": "m", "llm.invocation_parameters": J({"model": "m"}),
      "output.mime_type": "application/json", "output.value": J({"generations": [[{"generation_info": {
          "model_name": "m-1"}}]], "llm_output": None})}, "llm", "m", "m-1", None, None),
    # ... but a model of its own is kept, and text is not parsed as JSON.
    ({"openinference.span.kind": "LLM", "llm.model_name": "m-2", "llm.invocation_parameters": J({"model": "m"}),
      "output.mime_type": "application/json", "output.value": J({"llm_output": {"model_name": "m-1"}})},
     "llm", "m", "m-2", None, None),
    ({"openinference.span.kind": "LLM", "llm.model_name": "m", "llm.invocation_parameters": J({"model_name": "m"}),
      "output.mime_type": "text/plain", "output.value": J({"llm_output": {"model_name": "m-1"}})},
     "llm", "m", "m", None, None),
]


def test_output_value_cut_short_is_no_model_and_no_cut_message() -> None:
    attrs = {"openinference.span.kind": "LLM", "llm.model_name": "m", "llm.invocation_parameters": J({"model": "m"}),
             "llm.input_messages.0.message.role": "user", "llm.input_messages.0.message.content": "hi",
             "output.mime_type": "application/json",
             "output.value": J({"generations": [[{"generation_info": {"model_name": "m-1"}}]]})[:30]}
    meta, content = read_span(attrs)
    assert meta.response_model == "m" and content is not None and not content.truncated


def test_llamaindex_agent_output_names_the_reported_model() -> None:
    ev = ("AgentOutput(response=ChatMessage(blocks=[TextBlock(text=\"'created': 1, 'model': 'no', 'object': "
          "'chat.completion'\")]), raw={'id': 'chatcmpl-1', 'choices': [], 'created': 1741000000, "
          "'model': 'm-1', 'object': 'chat.completion.chunk', 'usage': None}, tool_calls=[])")
    chain = {"openinference.span.kind": "CHAIN", "input.value": J({"ctx": "<Context>", "ev": ev})}
    assert read_meta(Attrs(chain)).reported_model == "m-1"
    assert read_meta(Attrs({**chain, "openinference.span.kind": "LLM"})).reported_model is None
    assert read_meta(Attrs({**chain, "input.value": J({"ev": "AgentOutput(raw=None)"})})).reported_model is None


@pytest.mark.parametrize("attrs,kind,req,resp,tin,tout", META_TABLE)
def test_meta_table(attrs: dict[str, Any], kind: str, req: str | None, resp: str | None,
                    tin: int | None, tout: int | None) -> None:
    meta = read_meta(Attrs(attrs))
    assert (meta.kind, meta.request_model, meta.response_model, meta.input_tokens, meta.output_tokens) == (
        kind, req, resp, tin, tout)


# ---------------------------------------------------------------- conversation key


def _row(trace: str, span: str, attrs: dict[str, Any], resource: dict[str, Any] | None = None,
         start: int = 1) -> dict[str, Any]:
    return {"trace_id": trace, "span_id": span, "parent_span_id": None, "name": "s",
            "start_time_unix_nano": start, "end_time_unix_nano": start + 1,
            "attributes": J(attrs), "events": None, "resource": J(resource or {}), "service": None}


def test_conversation_key_order_and_sources() -> None:
    rows = [_row("t", "a", {"session.id": "sess"}, {"gen_ai.conversation.id": "from-resource"}),
            _row("t", "b", {"langfuse.session.id": "lf"}, start=5)]
    # attribute order decides before span-vs-resource
    assert conversation_key(rows, DEFAULT_ID_ATTRIBUTES) == "from-resource"
    assert conversation_key(rows, ["session.id", "langfuse.session.id"]) == "sess"
    assert conversation_key(rows, ["langfuse.session.id"]) == "lf"
    assert conversation_key(rows, ["nothing"]) is None
    assert conversation_key([_row("t", "a", {"ai.settings.context.b": "x", "ai.settings.context.a": "y"})],
                            ["ai.settings.context.*"]) == "y"
    assert conversation_key([{"trace_id": "t", "span_id": "x", "attributes": "{bad"}]) is None
    assert conversation_key([_row("t", "a", {"gen_ai.conversation.id": ""})]) is None


def test_group_traces_chains_previous_response() -> None:
    traces = {
        "t1": [_row("t1", "a", {"gen_ai.conversation.id": "c", "gen_ai.response.id": "resp_1"})],
        "t2": [_row("t2", "b", {"gen_ai.request.previous_response.id": "resp_1", "gen_ai.response.id": "resp_2"})],
        "t3": [_row("t3", "c", {"gen_ai.request.previous_response.id": "resp_2"})],
        "t4": [_row("t4", "d", {"gen_ai.request.previous_response.id": "unknown",
                                "gen_ai.input.messages": J([{"role": "user", "parts": [{"type": "text",
                                                                                        "content": "hi"}]}])})],
        # neither an id nor content: no conversation
        "t5": [_row("t5", "e", {"gen_ai.request.previous_response.id": "unknown", "gen_ai.operation.name": "chat"})],
    }
    assert group_traces(traces) == {"c": ["t1", "t2", "t3"], "trace:t4": ["t4"]}


# ---------------------------------------------------------------- fuzz

CONTENT_KEYS = [
    "gen_ai.input.messages", "gen_ai.output.messages", "gen_ai.system_instructions", "gen_ai.prompt",
    "gen_ai.completion", "gen_ai.prompt.0.content", "gen_ai.prompt.0.role", "gen_ai.prompt.0.tool_calls.0.arguments",
    "gen_ai.completion.0.tool_calls.0.name", "llm.input_messages.0.message.content",
    "llm.input_messages.0.message.contents.0.message_content.text",
    "llm.output_messages.0.message.tool_calls.0.tool_call.function.arguments", "input.value", "output.value",
    "openinference.span.kind", "ai.prompt.messages", "ai.prompt", "ai.response.toolCalls", "ai.response.text",
    "langfuse.observation.input", "langfuse.observation.output", "langfuse.observation.type",
    "langfuse.observation.usage_details", "request_data", "response_data", "events",
    "gcp.vertex.agent.llm_request", "gcp.vertex.agent.llm_response", "gen_ai.request.messages",
    "gen_ai.response.text", "gen_ai.response.tool_calls", "pydantic_ai.all_messages", "gen_ai.usage.input_tokens",
    "llm.invocation_parameters", "gen_ai.operation.name",
]
EVENT_NAMES = ["gen_ai.system.message", "gen_ai.user.message", "gen_ai.assistant.message", "gen_ai.tool.message",
               "gen_ai.choice", "gen_ai.client.inference.operation.details", "gen_ai.content.prompt",
               "gen_ai.content.completion"]
_WORDS = st.sampled_from(["role", "parts", "content", "type", "text", "tool_calls", "id", "name", "arguments",
                          "function", "messages", "message", "choices", "system", "user", "assistant", "tool",
                          "tool_call", "tool_call_response", "tool_use", "tool_result", "toolUse", "function_call",
                          "response", "value", "input", "output", "0", "LLM", "generation"])
_JSONISH = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), _WORDS, st.text(max_size=8)),
                        lambda c: st.lists(c, max_size=4) | st.dictionaries(_WORDS, c, max_size=4), max_leaves=20)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(attrs=st.dictionaries(st.sampled_from(CONTENT_KEYS),
                             st.one_of(_JSONISH, _JSONISH.map(json.dumps),
                                       _JSONISH.map(lambda v: json.dumps(v)[:-1])), max_size=6))
def test_readers_never_raise_on_odd_values(attrs: dict[str, Any]) -> None:
    read_span(attrs)
    for name in EVENT_NAMES:
        read_events([Event(name, attrs, v) for v in attrs.values()])
        read_events([Event(name, {"gen_ai.event.content": v, **attrs}, None) for v in attrs.values()])
        read_events([Event(name, {k: v}, None) for k, v in attrs.items()])


@settings(max_examples=300, deadline=None)
@given(attrs=st.dictionaries(st.sampled_from(CONTENT_KEYS + ["gen_ai.prompt.x", "llm.completions.0", "other"]),
                             st.one_of(_JSONISH, _JSONISH.map(json.dumps)), max_size=6))
def test_skipped_dialects_would_read_nothing(attrs: dict[str, Any]) -> None:
    """``read_span`` runs only ``span_dialects``: every other reader must find nothing."""
    chosen = span_dialects(attrs)
    for d in SPAN_DIALECTS:
        if d not in chosen:
            assert d.read(Attrs(attrs)) is None, d.name


_ITEMS = st.lists(_JSONISH, min_size=1, max_size=4)
# What may follow the last array's items: more items, or text that is not a plain extension.
_TAILS = st.one_of(_ITEMS.map(lambda v: ", " + json.dumps(v)[1:]), _ITEMS.map(lambda v: "," + json.dumps(v)[1:-1]),
                   st.sampled_from([",]", " ]", "]", ",1] x", "1]", ".5]", "e3, 2]", " , 2 ]  ", ",[", ",\"x"]))


def _outcome(text: str) -> Any:
    try:
        return ("value", json.dumps(Attrs({"k": text}).json("k")))  # dumps: 1 and 1.0 and True differ
    except Truncated:
        return ("truncated",)
    except RecursionError:
        return ("recursion",)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(first=st.lists(_JSONISH, min_size=2, max_size=5), tail=_TAILS, spaced=st.booleans())
def test_history_tail_parse_equals_a_full_parse(first: list[Any], tail: str, spaced: bool) -> None:
    text = json.dumps(first, separators=(", ", ": ") if spaced else (",", ":"))
    _last_arrays.by_key.clear()
    assert _outcome(text) == ("value", json.dumps(first))  # now remembered as the last array
    extended = text[:-1] + tail
    reused = _outcome(extended)
    _last_arrays.by_key.clear()
    assert reused == _outcome(extended)


def test_conversation_key_skips_unreadable_rows() -> None:
    deep = "[" * 100_000 + "]" * 100_000  # nested past the JSON parser's recursion limit
    rows = [{"trace_id": "t", "span_id": "a", "attributes": deep, "resource": "{}"},
            {"trace_id": "t", "span_id": "b", "attributes": 17, "resource": None},
            _row("t", "c", {"session.id": "s"})]
    assert conversation_key(rows) == "s"
    assert group_traces({"t": rows}) == {"s": ["t"]}


# ---------------------------------------------------------------- system instructions (conversation-v1.md)

SI = "You are ShopBot. Be brief."
# (case id, span attributes, expected system) in the shapes the libraries emit.
SYSTEM_TABLE: list[tuple[str, dict[str, Any], str | None]] = [
    ("otel-genai: system_instructions and a system message, instructions first", {
        "gen_ai.operation.name": "chat",
        "gen_ai.system_instructions": J([{"type": "text", "content": SI}]),
        "gen_ai.input.messages": J([{"role": "system", "parts": [{"type": "text", "content": "Today is Monday."}]},
                                    {"role": "user", "parts": [{"type": "text", "content": "hi"}]}]),
    }, f"{SI}\n\nToday is Monday."),
    ("otel-genai: a developer message beside the instructions", {
        "gen_ai.system_instructions": J([{"type": "text", "content": SI}, {"type": "text", "content": "No jokes."}]),
        "gen_ai.input.messages": J([{"role": "developer", "parts": [{"type": "text", "content": "Use tools."}]},
                                    {"role": "user", "parts": [{"type": "text", "content": "hi"}]}]),
    }, f"{SI}\n\nNo jokes.\n\nUse tools."),
    ("otel-genai: the same text in both is kept once", {
        "gen_ai.system_instructions": J([{"type": "text", "content": SI}]),
        "gen_ai.input.messages": J([{"role": "system", "parts": [{"type": "text", "content": SI}]},
                                    {"role": "user", "parts": [{"type": "text", "content": "hi"}]}]),
    }, SI),
    ("vercel outer ai.prompt: system and a system message", {
        "ai.operationId": "ai.generateText",
        "ai.prompt": J({"system": SI, "messages": [{"role": "system", "content": "Today is Monday."},
                                                   {"role": "user", "content": "hi"}]}),
    }, f"{SI}\n\nToday is Monday."),
]


@pytest.mark.parametrize("case_id,attrs,want", SYSTEM_TABLE, ids=[row[0] for row in SYSTEM_TABLE])
def test_system_instructions_and_system_messages_are_both_kept(case_id: str, attrs: dict[str, Any],
                                                                want: str) -> None:
    _, content = read_span(attrs)
    assert content is not None
    assert content.system == want
    assert [m.role for m in content.input or []] == ["user"]


def test_system_instructions_of_the_operation_details_event_beside_a_system_message() -> None:
    content = read_events([Event("gen_ai.client.inference.operation.details", {
        "gen_ai.system_instructions": [{"type": "text", "content": SI}],
        "gen_ai.input.messages": [{"role": "system", "parts": [{"type": "text", "content": "Today is Monday."}]},
                                  {"role": "user", "parts": [{"type": "text", "content": "hi"}]}]}, None)])
    assert content is not None and content.system == f"{SI}\n\nToday is Monday."


# ---------------------------------------------------------------- attachment markers (conversation-v1.md)

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
# (case id, span attributes, expected content of the first input message)
MARKER_TABLE: list[tuple[str, dict[str, Any], str]] = [
    ("openllmetry openai image_url block in indexed content", {
        "llm.request.type": "chat",
        "gen_ai.prompt.0.role": "user",
        "gen_ai.prompt.0.content": J([{"type": "text", "text": "What is in this image?"},
                                      {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}}]),
    }, "What is in this image?\n[image]"),
    ("openai input_audio block", {
        "gen_ai.input.messages": J([{"role": "user", "content": [
            {"type": "text", "text": "Transcribe this."},
            {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]}]),
    }, "Transcribe this.\n[audio]"),
    ("openai responses input_image and input_file", {
        "gen_ai.input.messages": J([{"role": "user", "content": [
            {"type": "input_text", "text": "Compare them."},
            {"type": "input_image", "image_url": f"data:image/png;base64,{PNG}"},
            {"type": "input_file", "file_id": "file-1"}]}]),
    }, "Compare them.\n[image]\n[file]"),
    ("otel parts: blob, uri and file with their modality", {
        "gen_ai.input.messages": J([{"role": "user", "parts": [
            {"type": "text", "content": "See attached."},
            {"type": "blob", "modality": "image", "mime_type": "image/png", "content": PNG},
            {"type": "uri", "modality": "video", "uri": "https://example.com/a.mp4"},
            {"type": "file", "modality": "document", "file_id": "file-2"}]}]),
    }, "See attached.\n[image]\n[video]\n[document]"),
    ("otel parts: a file without modality is named by its type", {
        "gen_ai.input.messages": J([{"role": "user", "parts": [{"type": "file", "file_id": "file-3"},
                                                                {"type": "text", "content": "Summarize."}]}]),
    }, "Summarize.\n[file]"),
    ("anthropic image block before the text: markers come after the text", {
        "gen_ai.input.messages": J([{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
            {"type": "text", "text": "What is this?"}]}]),
    }, "What is this?\n[image]"),
    ("an image only", {
        "gen_ai.input.messages": J([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}]}]),
    }, "[image]"),
]


@pytest.mark.parametrize("case_id,attrs,want", MARKER_TABLE, ids=[row[0] for row in MARKER_TABLE])
def test_attachment_markers_follow_the_modality(case_id: str, attrs: dict[str, Any], want: str) -> None:
    _, content = read_span(attrs)
    assert content is not None and content.input
    assert content.input[0].content == want


def test_attachment_in_a_tool_result_is_a_marker_not_its_bytes() -> None:
    _, content = read_span({"gen_ai.input.messages": J([{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "text", "text": "Here is the chart."},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}]}]}])})
    assert content is not None
    assert content.input == [_m("tool", "Here is the chart.\n[image]", call_id="toolu_1")]
