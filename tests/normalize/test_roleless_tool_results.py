"""Tool results whose message role does not map, and results that do not name their tool.

opentelemetry-instrumentation-google-genai 1.3b0 writes Gemini's ``role: "tool"`` contents (the
function responses an app sends back) with ``role: ""`` and without the function's name
(``tests/fixtures/frameworks/cases/google-genai-*``).
"""

from __future__ import annotations

import json

from collector.conversations.assemble import build_transcript
from collector.normalize import Message
from collector.normalize._messages import read_messages


def test_a_roleless_message_of_tool_results_is_tool_messages() -> None:
    items = [{"role": "", "parts": [{"type": "tool_call_response", "id": "a_0", "response": {"result": "x"}},
                                    {"type": "tool_call_response", "id": "b_1", "response": "y"}]}]
    assert read_messages(items) == [Message("tool", '{"result":"x"}', tool_call_id="a_0"),
                                    Message("tool", "y", tool_call_id="b_1")]


def test_a_roleless_message_of_anything_else_is_still_not_read() -> None:
    assert read_messages([{"role": "", "parts": [{"type": "text", "content": "hi"}]}]) == []
    assert read_messages([{"role": "", "parts": [{"type": "text", "content": "hi"},
                                                 {"type": "tool_call_response", "id": "a", "response": 1}]}]) == []


def test_a_tool_result_without_a_name_is_named_after_its_call() -> None:
    history = [{"role": "user", "parts": [{"type": "text", "content": "where is B-1?"}]},
               {"role": "assistant", "parts": [{"type": "tool_call", "id": "lookup_order_0", "name": "lookup_order",
                                                "arguments": {"order_id": "B-1"}}]},
               {"role": "", "parts": [{"type": "tool_call_response", "id": "lookup_order_0",
                                       "response": {"result": "shipped"}}]}]
    span = {"trace_id": "ab" * 16, "span_id": "cd" * 8, "parent_span_id": None, "name": "generate_content m",
            "kind": 3, "start_time_unix_nano": 1, "end_time_unix_nano": 2, "service": "s",
            "attributes": {"gen_ai.operation.name": "generate_content", "gen_ai.request.model": "m",
                           "gen_ai.input.messages": json.dumps(history),
                           "gen_ai.output.messages": '[{"role":"assistant","parts":[{"type":"text",'
                                                     '"content":"It shipped."}]}]'}}
    t = build_transcript([span], [])
    tool = [m for m in t.messages if m.role == "tool"]
    assert [(m.tool_call_id, m.name, m.content) for m in tool] == [("lookup_order_0", "lookup_order",
                                                                    '{"result":"shipped"}')]


def test_a_block_whose_type_is_not_text_is_no_tool_result() -> None:
    """Found by test_readers_never_raise_on_odd_values: a block typed with a list raised TypeError."""
    assert read_messages([{"role": "", "content": {"type": []}}]) == []
