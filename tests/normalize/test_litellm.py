"""LiteLLM's otel callback, read from the real capture (``collector.normalize.litellm``)."""

from __future__ import annotations

import json

from collector.normalize import read_span

from ..support.genai_fixtures import load_case
from .test_framework_captures import CAPTURES


def _read(name: str) -> list[tuple[str, list[tuple[str | None, str]], str]]:
    """Per span named ``name``: (answer text, its tool calls as (id, name), source)."""
    out = []
    for row in load_case("litellm-otel-callback-http", CAPTURES).spans:
        if row["name"] == name:
            _, content = read_span(json.loads(row["attributes"]), name)
            if content is not None and content.output:
                msg = content.output[0]
                out.append((msg.content, [(c.id, c.name) for c in msg.tool_calls], content.source))
    return out


def test_an_answer_of_tool_calls_reads_them_from_the_function_call_attributes() -> None:
    """A streamed call's own span: the parallel calls, without ids (LiteLLM exports none)."""
    answers = _read("litellm_request")
    assert ("", [(None, "lookup_order"), (None, "track_parcel")], "litellm/span") in answers
    assert all(text or calls for text, calls, _ in answers)


def test_a_text_answer_keeps_no_calls_left_behind_by_an_earlier_call() -> None:
    """On the app's span the second call's text answer sits beside the first call's function_call attributes."""
    answers = _read("invoke_agent ShopBot")
    assert answers and all(text and not calls for text, calls, _ in answers)
