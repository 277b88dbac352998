"""The OpenAI Responses API, read from each place the Agents SDK captures record it.

The OpenAI Agents SDK captures (``tests/fixtures/frameworks/cases``) carry every
model call twice: OpenInference as flattened ``llm.*_messages`` and as the raw
``input.value`` items and ``output.value`` response object; Logfire as
``raw_input`` items and the ``response`` object, and as its own ``events``.
Each copy alone must rebuild the conversations exactly, as a deployment that
hides the other copy sends them (OpenInference's
``OPENINFERENCE_HIDE_INPUT_MESSAGES`` / ``..._OUTPUT_MESSAGES``).
"""

from __future__ import annotations

import json
from typing import Any, Callable

import pytest

from collector.normalize import Message, ToolCall, responses
from collector.normalize._messages import read_messages

from ..support.genai_fixtures import Case, load_case
from .test_framework_captures import CAPTURES, differences

OPENINFERENCE = "agents-sdk-streamed-openinference-grpc"
LOGFIRE = "agents-sdk-streamed-logfire-http"


def _without(case: Case, drop: Callable[[str], bool]) -> Case:
    """The case with the span attributes ``drop`` names removed from every span."""
    spans = []
    for row in case.spans:
        attrs = json.loads(row["attributes"])
        spans.append({**row, "attributes": json.dumps({k: v for k, v in attrs.items() if not drop(k)})})
    return Case(case.name, case.expected, spans, case.logs)


def test_openinference_raw_values_alone() -> None:
    """``input.value`` items and the ``output.value`` response object, without the flattened messages."""
    case = _without(load_case(OPENINFERENCE, CAPTURES), lambda k: k.startswith(("llm.input_messages.",
                                                                                 "llm.output_messages.")))
    assert differences(case) == []


def test_logfire_response_object_alone() -> None:
    case = _without(load_case(LOGFIRE, CAPTURES), lambda k: k == "events")
    assert differences(case) == []


def test_logfire_events_alone() -> None:
    """Logfire's events send each parallel call as an assistant message of its own: one answer still."""
    case = _without(load_case(LOGFIRE, CAPTURES), lambda k: k in ("raw_input", "response"))
    assert differences(case) == []


def _first_response_with_calls() -> dict[str, Any]:
    for row in load_case(LOGFIRE, CAPTURES).spans:
        value = json.loads(row["attributes"]).get("response")
        if isinstance(value, str) and '"function_call"' in value:
            response: dict[str, Any] = json.loads(value)
            return response
    raise AssertionError("no response with function calls in the capture")


def test_parallel_calls_are_one_answer() -> None:
    response = _first_response_with_calls()
    answer = responses.output(response)
    assert answer is not None and len(answer) == 1
    assert [c.name for c in answer[0].tool_calls] == ["lookup_order", "track_parcel"]
    assert all(c.id and c.id.startswith("call_") for c in answer[0].tool_calls)  # call_id, not the item id
    assert responses.instructions(response) and responses.instructions(response).startswith("You are ShopBot")


def test_reasoning_items_are_no_content() -> None:
    """A reasoning model puts a reasoning item (its summary) before the calls: never message content."""
    response = _first_response_with_calls()
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Check both."}]}
    with_reasoning = {**response, "output": [reasoning, *response["output"]]}
    assert responses.output(with_reasoning) == responses.output(response)
    assert responses.output({**response, "output": [reasoning]}) is None


@pytest.mark.parametrize("items, expected", [
    # a text answer followed by a call: one message
    ([{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]},
      {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}],
     [Message("assistant", "Let me check.", (ToolCall("c1", "f", {}),))]),
    # two calls answered, then a text answer: the text is a message of its own
    ([{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
      {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
      {"type": "function_call_output", "call_id": "c1", "output": "1"},
      {"type": "function_call_output", "call_id": "c2", "output": "2"},
      {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]}],
     [Message("assistant", "", (ToolCall("c1", "f", {}), ToolCall("c2", "g", {}))),
      Message("tool", "1", tool_call_id="c1"), Message("tool", "2", tool_call_id="c2"),
      Message("assistant", "Done.")]),
])
def test_items_fold(items: list[dict[str, Any]], expected: list[Message]) -> None:
    assert read_messages(items) == expected


def test_fold_resets_when_a_resent_history_diverges_inside_a_group() -> None:
    """The history cache (``_messages._LastHistory``) never keeps a call folded in from items that changed."""
    call = {"type": "function_call", "name": "f", "arguments": "{}"}
    user = {"role": "user", "content": "hi"}
    first = [user, {**call, "call_id": "c1"}, {**call, "call_id": "c2"}]
    second = [user, {**call, "call_id": "c1"}, {**call, "call_id": "c3"}]
    assert [c.id for c in read_messages(first)[1].tool_calls] == ["c1", "c2"]
    assert [c.id for c in read_messages(second)[1].tool_calls] == ["c1", "c3"]
    assert [c.id for c in read_messages(first[:2] + [user])[1].tool_calls] == ["c1"]
