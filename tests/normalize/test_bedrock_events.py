"""The per-message events of opentelemetry-instrumentation-botocore (Bedrock Converse).

0.66b2 writes an answer's calls twice on a ``gen_ai.assistant.message`` event (the
content's ``toolUse`` blocks and ``tool_calls``), and each tool result twice: a
``gen_ai.tool.message`` event per result, then the ``gen_ai.user.message`` that
carried them as ``toolResult`` blocks (``tests/fixtures/frameworks/cases/bedrock-*``).
"""

from __future__ import annotations

from collector.normalize import Event, Message, ToolCall, read_events

SYSTEM = {"gen_ai.system": "aws.bedrock"}
CALL = {"toolUseId": "tooluse_1", "name": "lookup_order", "input": {"order_id": "B-1"}}


def _events(user_text: str | None = None) -> list[Event]:
    results: list[dict[str, object]] = [{"toolResult": {"toolUseId": "tooluse_1",
                                                        "content": [{"text": '{"status": "shipped"}'}]}}]
    if user_text:
        results.append({"text": user_text})
    return [
        Event("gen_ai.system.message", SYSTEM, {"content": [{"text": "Be brief."}]}),
        Event("gen_ai.user.message", SYSTEM, {"content": [{"text": "where is B-1?"}]}),
        Event("gen_ai.assistant.message", SYSTEM, {
            "content": [{"toolUse": CALL}],
            "tool_calls": [{"type": "function", "id": "tooluse_1",
                            "function": {"name": "lookup_order", "arguments": {"order_id": "B-1"}}}]}),
        Event("gen_ai.tool.message", SYSTEM, {"id": "tooluse_1", "content": [{"text": '{"status": "shipped"}'}]}),
        Event("gen_ai.user.message", SYSTEM, {"content": results}),
        Event("gen_ai.choice", SYSTEM, {"finish_reason": "end_turn", "index": 0,
                                        "message": {"role": "assistant", "content": [{"text": "It shipped."}]}}),
    ]


def test_each_call_and_each_result_once() -> None:
    content = read_events(_events())
    assert content is not None
    assert content.system == "Be brief."
    assert content.input == [
        Message("user", "where is B-1?"),
        Message("assistant", "", tool_calls=(ToolCall("tooluse_1", "lookup_order", {"order_id": "B-1"}),)),
        Message("tool", '{"status": "shipped"}', tool_call_id="tooluse_1"),
    ]
    assert content.output == [Message("assistant", "It shipped.")]


def test_text_sent_beside_the_results_stays_a_user_turn() -> None:
    content = read_events(_events("thanks, and B-2?"))
    assert content is not None and content.input is not None
    assert [(m.role, m.content) for m in content.input[2:]] == [("tool", '{"status": "shipped"}'),
                                                                ("user", "thanks, and B-2?")]
