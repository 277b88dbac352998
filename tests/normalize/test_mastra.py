"""Mastra (``@mastra/otel-exporter`` 1.x): a model call put together from the spans around it.

The real captures are ``tests/fixtures/frameworks/cases/node-mastra-agent-otel-proto*``; this is the
same layout, small: a generation with the history, two steps (a tool call, then the answer), each
with its ``chat`` call (usage, no input, text only) and the first with its ``execute_tool`` span.
"""

from __future__ import annotations

import json
from typing import Any

from collector.conversations.assemble import build_transcript
from collector.normalize import Message, ToolCall, read_span

TRACE = "ab" * 16
SYSTEM = "Be brief."


def _span(sid: str, parent: str | None, start: int, end: int, attrs: dict[str, Any]) -> dict[str, Any]:
    return {"trace_id": TRACE, "span_id": sid * 8, "parent_span_id": parent and parent * 8, "name": "x",
            "kind": 1, "start_time_unix_nano": start, "end_time_unix_nano": end, "service": "s",
            "attributes": attrs}


def _chat(text: str, tokens: int) -> dict[str, Any]:
    return {"gen_ai.operation.name": "chat", "mastra.span.type": "model_inference",
            "gen_ai.request.model": "m", "gen_ai.response.model": "m-1",
            "gen_ai.usage.input_tokens": tokens, "gen_ai.usage.output_tokens": 1,
            "gen_ai.output.messages": json.dumps([{"role": "assistant", "parts": [{"type": "text", "content": text}]}])}


def _step(output: dict[str, Any]) -> dict[str, Any]:
    return {"gen_ai.operation.name": "agent_step", "mastra.span.type": "model_step",
            "mastra.model_step.input": json.dumps([{"role": "assistant", "content": "[tool: lookup]"}]),
            "mastra.model_step.output": json.dumps(output)}


HISTORY = [{"role": "system", "content": SYSTEM},
           {"role": "user", "content": [{"type": "text", "text": "hi"}]},
           {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
           {"role": "user", "content": [{"type": "text", "text": "where is A-1?"}]}]
SPANS = [
    _span("01", None, 1, 100, {"gen_ai.operation.name": "invoke_agent", "mastra.span.type": "agent_run",
                               "gen_ai.system_instructions": SYSTEM, "mastra.agent_run.input": "where is A-1?",
                               "gen_ai.conversation.id": "c1"}),
    _span("02", "01", 2, 90, {"gen_ai.operation.name": "model_generation", "mastra.span.type": "model_generation",
                              "mastra.model_generation.input": json.dumps({"messages": HISTORY}),
                              "mastra.model_generation.output": json.dumps({"text": "It shipped."})}),
    _span("03", "02", 4, 40, _step({"text": "", "toolCalls": [
        {"toolCallId": "c_1", "toolName": "lookup", "args": {"id": "A-1"}},
        {"toolCallId": "c_2", "toolName": "track", "args": {"n": "7"}}]})),
    _span("04", "03", 3, 20, _chat("", 10)),  # the call may start before its step
    # the results in the order the tools finished, not the order they were called in
    _span("05", "03", 21, 30, {"gen_ai.operation.name": "execute_tool", "mastra.span.type": "tool_call",
                               "gen_ai.tool.name": "track", "gen_ai.tool.call.id": "c_2",
                               "gen_ai.tool.call.result": '{"at":"Leeds"}'}),
    _span("06", "03", 22, 31, {"gen_ai.operation.name": "execute_tool", "mastra.span.type": "tool_call",
                               "gen_ai.tool.name": "lookup", "gen_ai.tool.call.id": "c_1",
                               "gen_ai.tool.call.result": '{"status":"shipped"}'}),
    _span("07", "02", 41, 80, _step({"text": "It shipped.", "toolCalls": []})),
    _span("08", "07", 42, 70, _chat("It shipped.", 20)),
]


def test_each_call_is_its_generation_input_then_the_earlier_steps() -> None:
    t = build_transcript(SPANS, [])
    assert t.llm_calls == 2 and t.usage is not None and t.usage.input_tokens == 30
    assert t.system == SYSTEM and t.models == ("m-1",)
    got = [(m.role, m.content, tuple((tc.id, tc.name) for tc in m.tool_calls), m.tool_call_id, m.name)
           for m in t.messages]
    assert got == [
        ("user", "hi", (), None, None),
        ("assistant", "hello", (), None, None),
        ("user", "where is A-1?", (), None, None),
        ("assistant", "", (("c_1", "lookup"), ("c_2", "track")), None, None),
        ("tool", '{"status":"shipped"}', (), "c_1", "lookup"),
        ("tool", '{"at":"Leeds"}', (), "c_2", "track"),
        ("assistant", "It shipped.", (), None, None),
    ]


def test_the_step_preview_is_not_read() -> None:
    _, content = read_span(SPANS[2]["attributes"])
    assert content is not None and content.input is None
    assert content.output == [Message("assistant", "", tool_calls=(ToolCall("c_1", "lookup", {"id": "A-1"}),
                                                                    ToolCall("c_2", "track", {"n": "7"})))]


def test_without_mastra_spans_around_it_a_call_keeps_its_own_content() -> None:
    t = build_transcript([SPANS[7]], [])
    assert [(m.role, m.content) for m in t.messages] == [("assistant", "It shipped.")]
