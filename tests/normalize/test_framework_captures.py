"""The agent-framework captures (``tests/fixtures/frameworks/cases``) rebuilt against their ground truth.

Each case is a real OTLP capture of a framework bot (``tests/fixtures/frameworks/README.md``)
with the transcripts its fake LLM saw. A case the normalizer does not rebuild
exactly yet is listed in ``GAPS`` with what is missing; it xfails with that
reason and the differences found, and fails once it passes (remove it from
``GAPS`` then). A case not listed must rebuild exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from collector.conversations.assemble import build_transcript, group_traces
from collector.conversations.record import conversation_v1

from ..support.conversations import comparable_messages
from ..support.genai_fixtures import Case, by_trace, case_names, load_case, logs_by_trace
from .test_normalize import _assert_rebuilt_exactly

CAPTURES = Path(__file__).resolve().parents[1] / "fixtures" / "frameworks" / "cases"
CASES = case_names(CAPTURES)

# case -> what today's normalizer gets wrong (the precise reason the case xfails).
STREAMED_MODEL = ("OpenLLMetry's streamed ChatOpenAI.chat spans carry the request model as gen_ai.response.model "
                  "(the library's doing: the model the server reported, gpt-4o-mini-2024-07-18, is nowhere in "
                  "those spans), so the streamed conversations' models read gpt-4o-mini")
STRANDS_MODEL = ("lost by the library: Strands 1.62's spans carry the request model only (gen_ai.request.model "
                 "gpt-4o-mini; the model the server reported, gpt-4o-mini-2024-07-18, is nowhere in the capture), "
                 "so every conversation's models read gpt-4o-mini; messages, system prompt, usage, calls and "
                 "grouping are exact")
SEMANTIC_KERNEL_MODEL = (
    "lost by the library: Semantic Kernel 1.45's chat spans carry gen_ai.request.model only, never "
    "gen_ai.response.model, and its gen_ai.choice log records hold the message without the response's model: "
    "the model the server reported, gpt-4o-mini-2024-07-18, is nowhere in the spans or logs, so every model "
    "reads gpt-4o-mini; messages, system prompt, tool names, usage, calls and grouping exact")
GAPS: dict[str, str] = {
    # What LiteLLM 1.110's otel callback loses (collector/normalize/litellm.py): the transcripts of bob and
    # dave (not streamed) are exact, their usage and call counts cannot be.
    "litellm-otel-callback-http": (
        "lost by the library: a non-streamed call is written onto the app's current span (`invoke_agent "
        "ShopBot`), so the second call of a tool-using turn overwrites the first (bob and dave: messages exact, "
        "but one call and its tokens per tool-using turn are gone); a streamed call is logged from a worker "
        "thread as a `litellm_request` root span of a trace of its own, without the app's conversation id "
        "(alice and carol have no content under their id; their calls are 7 id-less traces); "
        "metadata.session_id is not exported; tool calls carry no ids in the answer"),
    "litellm-otel-callback-http-noid": (
        "lost by the library, as with an id: the second call of a non-streamed turn overwrites the first on the "
        "app's span and streamed calls are traces of their own; carol's first turn has no content, so her second "
        "is stitched to dave's first (the same two messages)"),
    "langchain-agent-openllmetry-http": STREAMED_MODEL,
    "langchain-agent-openllmetry-http-noid": STREAMED_MODEL,
    "strands-agent-grpc": STRANDS_MODEL,
    "strands-agent-grpc-noid": STRANDS_MODEL,
    "semantic-kernel-agent-grpc": SEMANTIC_KERNEL_MODEL,
    "semantic-kernel-agent-grpc-noid": SEMANTIC_KERNEL_MODEL,
}


def differences(case: Case) -> list[str]:
    """Every way the rebuilt conversations differ from the expected ones (empty: rebuilt exactly).

    The same checks as ``test_normalize._assert_rebuilt_exactly``, collected instead of stopping at the first.
    """
    out: list[str] = []
    groups = group_traces(by_trace(case.spans, case.logs), logs=logs_by_trace(case.logs))
    expected = case.expected["conversations"]
    want = {c["conversation_key"] or f"trace:{c['trace_ids'][0]}": c for c in expected}
    extra = sorted(set(groups) - set(want))
    if extra:
        ignored = set(case.expected.get("non_conversation_trace_ids") or [])
        from_ignored = [g for g in extra if set(groups[g]) <= ignored]
        if from_ignored:
            out.append(f"{len(from_ignored)} conversation(s) made of traces that hold no conversation "
                       f"(started outside any turn): {from_ignored}")
        rest = [g for g in extra if g not in from_ignored]
        if rest:
            out.append(f"{len(rest)} conversation(s) not expected: {rest}")
    for cid, conv in want.items():
        label = f"{conv.get('scenario')} ({cid})"
        if cid not in groups:
            owners = sorted({g for g, ts in groups.items() if set(ts) & set(conv["trace_ids"])})
            out.append(f"{label}: not found; its traces are in {owners}")
            traces = set(conv["trace_ids"])
        else:
            traces = set(groups[cid])
            if sorted(groups[cid]) != sorted(conv["trace_ids"]):
                out.append(f"{label}: traces {sorted(groups[cid])} != expected {sorted(conv['trace_ids'])}")
        t = build_transcript([r for r in case.spans if r["trace_id"] in traces],
                             [r for r in case.logs if r["trace_id"] in traces])
        record = conversation_v1(t, cid, "handover" if conv.get("handover") else "idle")
        # no usage when no call reported token counts (a stream without include_usage)
        usage = conv["usage"] and {"input_tokens": conv["usage"]["input_tokens"],
                                   "output_tokens": conv["usage"]["output_tokens"]}
        if record.get("usage") != usage:
            out.append(f"{label}: usage {record.get('usage')} != {usage}")
        if record.get("models") != [conv["model"]]:
            out.append(f"{label}: models {record.get('models')} != {[conv['model']]}")
        if t.llm_calls != conv["llm_calls"]:
            out.append(f"{label}: llm_calls {t.llm_calls} != {conv['llm_calls']}")
        if t.unparsed_spans or t.unparsed_logs:
            out.append(f"{label}: unparsed spans {t.unparsed_spans}, logs {t.unparsed_logs}")
        if not t.content_captured:
            out.append(f"{label}: no content found ({t.no_content_reason})")
            continue
        if record["system"] != conv["system_prompt"]:
            out.append(f"{label}: system {_short(record['system'])} != {_short(conv['system_prompt'])}")
        got, exp = comparable_messages(record["messages"], conv["messages"])
        if got != exp:
            out.append(f"{label}: messages differ: {_message_diff(got, exp)}")
    return out


def _short(value: Any, n: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def _message_diff(got: list[dict[str, Any]], exp: list[dict[str, Any]]) -> str:
    for i, (g, e) in enumerate(zip(got, exp)):
        if g != e:
            return f"first at #{i}: got {_short(g, 160)} expected {_short(e, 160)} ({len(got)} vs {len(exp)} messages)"
    return f"{len(got)} messages rebuilt, {len(exp)} expected"


def test_captures_found() -> None:
    assert CASES, f"no *.expected.json under {CAPTURES}"
    assert set(GAPS) <= set(CASES), sorted(set(GAPS) - set(CASES))


@pytest.mark.parametrize("name", CASES)
def test_framework_capture(name: str) -> None:
    case = load_case(name, CAPTURES)
    found = differences(case)
    if name in GAPS:
        assert found, f"{name} is rebuilt exactly now: remove it from GAPS"
        pytest.xfail(f"{GAPS[name]} | seen: " + " ; ".join(found)[:600])
    assert not found, found
    if all(c["usage"] for c in case.expected["conversations"]):
        _assert_rebuilt_exactly(case)
