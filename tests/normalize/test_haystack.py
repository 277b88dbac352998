"""Haystack's ``haystack.agent.step.llm`` spans (opentelemetry-haystack), read from the real capture.

The call's input is the Python ``repr`` of its ChatMessages (``collector.normalize.haystack``);
the whole case is rebuilt exactly by ``test_framework_captures``.
"""

from __future__ import annotations

import json
from typing import Any

from collector.normalize import read_span
from collector.normalize.haystack import INPUT

from ..support.genai_fixtures import load_case
from .test_framework_captures import CAPTURES

CASE = "haystack-agent-grpc"


def _llm_spans() -> list[dict[str, Any]]:
    spans = [r for r in load_case(CASE, CAPTURES).spans if r["name"] == "haystack.agent.step.llm"]
    assert spans
    return [json.loads(r["attributes"]) for r in spans]


def test_every_call_reads_its_history_and_answer() -> None:
    for attrs in _llm_spans():
        meta, content = read_span(attrs, "haystack.agent.step.llm")
        assert meta.kind == "llm" and meta.response_model == "gpt-4o-mini-2024-07-18"
        assert content is not None and not content.truncated
        assert content.system and content.system.startswith("You are ShopBot")
        assert content.input and content.input[0].role == "user"
        assert content.output and len(content.output) == 1 and content.output[0].role == "assistant"
        # a tool result answers a call the history holds
        calls = {c.id for m in content.input for c in m.tool_calls}
        assert all(m.tool_call_id in calls for m in content.input if m.role == "tool")


def test_a_repr_cut_short_is_flagged_not_misread() -> None:
    """An attribute length limit cuts the repr: the call is flagged truncated; its answer is still read."""
    attrs = max(_llm_spans(), key=lambda a: len(a[INPUT]))
    cut = {**attrs, INPUT: attrs[INPUT][: len(attrs[INPUT]) // 2]}
    _, content = read_span(cut, "haystack.agent.step.llm")
    assert content is not None and content.truncated
    assert content.output and content.output[0].role == "assistant"
