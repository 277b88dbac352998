"""Transcript assembly: the position merge, call dedup, fallbacks, robustness,
and hypothesis properties (any order, duplicates, any dialect -> same transcript).

Synthetic conversations are written as stored rows (``collector.ingest.batches`` column
names, JSON text columns) in several dialects, so the ground truth is known.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from collector.conversations.assemble import (
    NO_CONTENT_REASON,
    NO_GENAI_REASON,
    ParseMemo,
    build_transcript,
    conversation_key,
    group_traces,
    merge_history,
)
from collector.conversations.record import conversation_v1
from collector.conversations.transcript import DigestMemo
from collector.normalize import Message, ToolCall
from judges import Conversation, transcript_sha256

from ..support.genai_fixtures import by_trace, case_names, load_case, logs_by_trace

J = json.dumps


def _m(role: str, content: str = "", calls: tuple[str, ...] = (), call_id: str | None = None) -> Message:
    return Message(role, content, tool_calls=tuple(ToolCall(c, "f", {}) for c in calls),  # type: ignore[arg-type]
                   tool_call_id=call_id)


# ---------------------------------------------------------------- merge by position

U1, A1, U2, A2, U3, A3 = _m("user", "u1"), _m("assistant", "a1"), _m("user", "u2"), _m("assistant", "a2"), \
    _m("user", "u3"), _m("assistant", "a3")
YES, OK = _m("user", "yes"), _m("assistant", "ok")

MERGE_TABLE: list[tuple[str, list[Message], list[Message], int]] = [
    ("empty transcript takes all", [], [U1, A1], 0),
    ("history extended", [U1, A1], [U1, A1, U2, A2], 2),
    ("user says yes twice", [YES, OK], [YES, OK, YES, OK], 2),
    ("same call resent", [U1, A1], [U1, A1], 2),
    ("earlier call seen late", [U1, A1, U2, A2], [U1, A1], 2),
    ("compaction: summary replaces old turns", [U1, A1, U2, A2], [_m("user", "summary"), U2, A2, U3, A3], 3),
    ("compaction keeps the longest matching run", [YES, OK, U2, YES, OK],
     [_m("user", "summary"), YES, OK, U2, YES, OK, U3], 6),
    ("window: only the new turn was sent", [U1, A1], [U2, A2], 0),
    ("parallel call answered differently", [U1, A1], [U1, A2], 1),
    ("tool call ids tell calls apart", [U1, _m("assistant", "", ("c1",))],
     [U1, _m("assistant", "", ("c2",)), _m("tool", "r", call_id="c2")], 1),
]


@pytest.mark.parametrize("case_id,known,sent,start", MERGE_TABLE, ids=[r[0] for r in MERGE_TABLE])
def test_merge_history(case_id: str, known: list[Message], sent: list[Message], start: int) -> None:
    assert merge_history(known, sent) == start


# ---------------------------------------------------------------- synthetic rows


@dataclass
class Writer:
    """Writes a conversation's LLM calls as stored span/log rows in one dialect."""

    dialect: str
    conv_id: str | None = "conv-1"
    same_start: bool = False  # millisecond clocks: sibling calls start together
    spans: list[dict[str, Any]] = field(default_factory=list)
    logs: list[dict[str, Any]] = field(default_factory=list)
    clock: int = 1_000_000_000_000
    n: int = 0

    def _id(self, width: int) -> str:
        self.n += 1
        return hashlib.sha256(f"{self.dialect}{self.conv_id}{self.n}".encode()).hexdigest()[:width]

    def span(self, trace: str, parent: str | None, name: str, attrs: dict[str, Any], start: int,
             end: int) -> str:
        sid = self._id(16)
        self.spans.append({
            "trace_id": trace, "span_id": sid, "parent_span_id": parent, "trace_state": None, "flags": 1,
            "name": name, "kind": 1, "start_time_unix_nano": start, "end_time_unix_nano": end,
            "attributes": J(attrs, ensure_ascii=False), "events": None, "links": None, "status_code": 0,
            "status_message": None, "dropped": None, "resource": J({"service.name": "bot"}),
            "resource_schema_url": None, "scope_name": "test", "scope_version": None,
            "scope_attributes": None, "service": "bot"})
        return sid

    def log(self, trace: str, span: str, event: str, body: Any, attrs: dict[str, Any]) -> None:
        self.clock += 1
        lid = hashlib.blake2b(J([trace, span, event, body, attrs, self.clock]).encode(), digest_size=16).hexdigest()
        self.logs.append({
            "log_id": lid, "trace_id": trace, "span_id": span, "time_unix_nano": 0,
            "observed_time_unix_nano": self.clock, "severity_number": 0, "severity_text": None,
            "event_name": event, "body": None if body is None else J(body, ensure_ascii=False),
            "attributes": J(attrs, ensure_ascii=False), "flags": 0, "dropped_attributes_count": 0,
            "resource": J({"service.name": "bot"}), "scope_name": "test", "scope_version": None, "service": "bot"})

    def turn(self, system: str, calls: list[tuple[list[dict[str, Any]], dict[str, Any]]]) -> None:
        """One trace: an agent root with the id, then one LLM span per (history, answer)."""
        trace = self._id(32)
        t0 = self.clock = self.clock + 10_000
        root = self.span(trace, None, "invoke_agent bot",
                         {"gen_ai.operation.name": "invoke_agent",
                          **({"gen_ai.conversation.id": self.conv_id} if self.conv_id else {})},
                         t0, t0 + 9_000)
        for i, (hist, out) in enumerate(calls):
            start = t0 + (1 if self.same_start else 10 + i * 100)
            attrs: dict[str, Any] = {"gen_ai.operation.name": "chat", "gen_ai.request.model": "m",
                                     "gen_ai.response.model": "m-1", "gen_ai.usage.input_tokens": 10,
                                     "gen_ai.usage.output_tokens": 2}
            attrs.update(ENCODERS[self.dialect].span_attrs(system, hist, out))
            sid = self.span(trace, root, "chat m", attrs, start, start + 50 + i)
            ENCODERS[self.dialect].logs(self, trace, sid, system, hist, out)


def _a_msg(m: dict[str, Any]) -> dict[str, Any]:
    parts: list[dict[str, Any]] = []
    if m["role"] == "tool":
        parts.append({"type": "tool_call_response", "id": m["tool_call_id"], "response": m["content"]})
    else:
        if m["content"]:
            parts.append({"type": "text", "content": m["content"]})
        for tc in m.get("tool_calls", []):
            parts.append({"type": "tool_call", "id": tc["id"], "name": tc["name"], "arguments": tc["arguments"]})
    return {"role": m["role"], "parts": parts}


def _a_attrs(system: str, hist: list[dict[str, Any]], out: dict[str, Any]) -> dict[str, Any]:
    return {"gen_ai.input.messages": J([{"role": "system", "parts": [{"type": "text", "content": system}]}]
                                       + [_a_msg(m) for m in hist], ensure_ascii=False),
            "gen_ai.output.messages": J([_a_msg(out)], ensure_ascii=False)}


def _openai_msg(m: dict[str, Any]) -> dict[str, Any]:
    d: dict[str, Any] = {"role": m["role"], "content": m["content"] or None}
    if m.get("tool_calls"):
        d["tool_calls"] = [{"id": tc["id"], "type": "function",
                            "function": {"name": tc["name"], "arguments": J(tc["arguments"])}}
                           for tc in m["tool_calls"]]
    if m["role"] == "tool":
        d["tool_call_id"] = m["tool_call_id"]
    return d


def _indexed(prefix: str, i: int, m: dict[str, Any], leaf: Callable[[int, str], str],
             call: Callable[[int, int, str], str]) -> dict[str, Any]:
    d: dict[str, Any] = {prefix + leaf(i, "role"): m["role"]}
    if m["content"]:
        d[prefix + leaf(i, "content")] = m["content"]
    if m["role"] == "tool":
        d[prefix + leaf(i, "tool_call_id")] = m["tool_call_id"]
    for j, tc in enumerate(m.get("tool_calls", [])):
        d[prefix + call(i, j, "id")] = tc["id"]
        d[prefix + call(i, j, "name")] = tc["name"]
        d[prefix + call(i, j, "arguments")] = J(tc["arguments"])
    return d


def _openllmetry_attrs(system: str, hist: list[dict[str, Any]], out: dict[str, Any]) -> dict[str, Any]:
    msgs = [{"role": "system", "content": system}] + hist
    attrs: dict[str, Any] = {}
    leaf: Callable[[int, str], str] = lambda i, k: f"{i}.{k}"
    call: Callable[[int, int, str], str] = lambda i, j, k: f"{i}.tool_calls.{j}.{k}"
    for i, m in reversed(list(enumerate(msgs))):  # exporters do not keep key order
        attrs.update(_indexed("gen_ai.prompt.", i, m, leaf, call))
    attrs.update(_indexed("gen_ai.completion.", 0, out, leaf, call))
    return attrs


def _openinference_attrs(system: str, hist: list[dict[str, Any]], out: dict[str, Any]) -> dict[str, Any]:
    msgs = [{"role": "system", "content": system}] + hist
    attrs: dict[str, Any] = {"openinference.span.kind": "LLM",
                             "input.value": J({"messages": [_openai_msg(m) for m in msgs]}),
                             "input.mime_type": "application/json"}
    leaf: Callable[[int, str], str] = lambda i, k: f"{i}.message.{k}"
    call: Callable[[int, int, str], str] = lambda i, j, k: (
        f"{i}.message.tool_calls.{j}.tool_call." + ("id" if k == "id" else f"function.{k}"))
    for i, m in enumerate(msgs):
        attrs.update(_indexed("llm.input_messages.", i, m, leaf, call))
    attrs.update(_indexed("llm.output_messages.", 0, out, leaf, call))
    return attrs


def _anthropic_msg(m: dict[str, Any]) -> dict[str, Any]:
    if m["role"] == "tool":  # Anthropic: tool results are user turns
        return {"role": "user", "parts": [{"type": "tool_call_response", "id": m["tool_call_id"],
                                           "response": m["content"]}]}
    return _a_msg(m)


def _anthropic_attrs(system: str, hist: list[dict[str, Any]], out: dict[str, Any]) -> dict[str, Any]:
    msgs: list[dict[str, Any]] = []
    for m in map(_anthropic_msg, hist):
        if msgs and m["role"] == "user" and msgs[-1]["role"] == "user" and m["parts"][0]["type"] != "text":
            msgs[-1]["parts"].extend(m["parts"])  # parallel results share one user message
        else:
            msgs.append(m)
    return {"gen_ai.system_instructions": J([{"type": "text", "content": system}]),
            "gen_ai.input.messages": J(msgs, ensure_ascii=False),
            "gen_ai.output.messages": J([_a_msg(out)], ensure_ascii=False)}


def _langfuse_attrs(system: str, hist: list[dict[str, Any]], out: dict[str, Any]) -> dict[str, Any]:
    return {"langfuse.observation.type": "generation",
            "langfuse.observation.input": J({"tools": [], "messages": [{"role": "system", "content": system}]
                                             + [_openai_msg(m) for m in hist]}, ensure_ascii=False),
            "langfuse.observation.output": J(_openai_msg(out), ensure_ascii=False)}


def _details_logs(w: Writer, trace: str, span: str, system: str, hist: list[dict[str, Any]],
                  out: dict[str, Any]) -> None:
    w.log(trace, span, "gen_ai.client.inference.operation.details", None, {
        "gen_ai.operation.name": "chat",
        "gen_ai.system_instructions": [{"type": "text", "content": system}],
        "gen_ai.input.messages": [_a_msg(m) for m in hist], "gen_ai.output.messages": [_a_msg(out)]})


def _legacy_logs(w: Writer, trace: str, span: str, system: str, hist: list[dict[str, Any]],
                 out: dict[str, Any]) -> None:
    w.log(trace, span, "gen_ai.system.message", {"content": system}, {"gen_ai.system": "openai"})
    for m in hist:
        body = _openai_msg(m)
        body.pop("role")
        if m["role"] == "tool":
            body = {"content": m["content"], "id": m["tool_call_id"]}
        w.log(trace, span, f"gen_ai.{m['role']}.message", {k: v for k, v in body.items() if v is not None},
              {"gen_ai.system": "openai"})
    msg = {k: v for k, v in _openai_msg(out).items() if v is not None}
    w.log(trace, span, "gen_ai.choice", {"index": 0, "finish_reason": "stop", "message": msg},
          {"gen_ai.system": "openai"})


@dataclass
class Encoder:
    span_attrs: Callable[[str, list[dict[str, Any]], dict[str, Any]], dict[str, Any]]
    logs: Callable[[Writer, str, str, str, list[dict[str, Any]], dict[str, Any]], None]


def _no_attrs(system: str, hist: list[dict[str, Any]], out: dict[str, Any]) -> dict[str, Any]:
    return {}


def _no_logs(w: Writer, trace: str, span: str, system: str, hist: list[dict[str, Any]],
             out: dict[str, Any]) -> None:
    return None


ENCODERS: dict[str, Encoder] = {
    "otel-genai span": Encoder(_a_attrs, _no_logs),
    "otel-genai span and event": Encoder(_a_attrs, _details_logs),
    "otel-genai event only": Encoder(_no_attrs, _details_logs),
    "legacy log events": Encoder(_no_attrs, _legacy_logs),
    "openllmetry indexed": Encoder(_openllmetry_attrs, _no_logs),
    "openinference": Encoder(_openinference_attrs, _no_logs),
    "anthropic parts": Encoder(_anthropic_attrs, _no_logs),
    "langfuse openai": Encoder(_langfuse_attrs, _no_logs),
    "no content": Encoder(_no_attrs, _no_logs),
}

# ---------------------------------------------------------------- conversations

TEXTS = ["yes", "no", "ok", "hi", "Ciao, più tardi 🙂", "مرحبا", "[not json", "{\"a\": 1}", "same"]


@st.composite
def conversations(draw: st.DrawFn) -> list[list[dict[str, Any]]]:
    """Turns; each turn is the messages it adds: user, tool rounds, final answer."""
    turns = []
    call_n = 0
    for _ in range(draw(st.integers(1, 4))):
        msgs: list[dict[str, Any]] = [{"role": "user", "content": draw(st.sampled_from(TEXTS))}]
        for _ in range(draw(st.integers(0, 2))):
            calls = []
            for _ in range(draw(st.integers(1, 3))):  # parallel tool calls
                call_n += 1
                calls.append({"id": f"call_{call_n}", "name": draw(st.sampled_from(["lookup", "track"])),
                              "arguments": {"q": draw(st.sampled_from(TEXTS))}})
            msgs.append({"role": "assistant", "content": draw(st.sampled_from(["", "Let me check."])),
                         "tool_calls": calls})
            for c in calls:
                msgs.append({"role": "tool", "content": draw(st.sampled_from(TEXTS)), "tool_call_id": c["id"],
                             "name": c["name"]})
        msgs.append({"role": "assistant", "content": draw(st.sampled_from(TEXTS))})
        turns.append(msgs)
    return turns


def write(turns: list[list[dict[str, Any]]], dialect: str, same_start: bool = False,
          conv_id: str | None = "conv-1") -> Writer:
    w = Writer(dialect, conv_id=conv_id, same_start=same_start)
    hist: list[dict[str, Any]] = []
    for msgs in turns:
        calls = []
        for m in msgs:
            if m["role"] == "assistant":
                calls.append((list(hist), m))
            hist.append(m)
        w.turn("You are a bot.", calls)
    return w


def expected(turns: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    out = []
    for m in (m for t in turns for m in t):
        d: dict[str, Any] = {"role": m["role"], "content": m["content"]}
        if m.get("tool_calls"):
            d["tool_calls"] = m["tool_calls"]
        if m["role"] == "tool":
            d["tool_call_id"] = m["tool_call_id"]
            d["name"] = m["name"]
        out.append(d)
    return out


def got(w_spans: list[dict[str, Any]], w_logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    t = build_transcript(w_spans, w_logs)
    return [{k: v for k, v in m.to_dict().items() if k not in ("at", "span_id")} for m in t.messages]


def _shuffled_with_dupes(rows: list[dict[str, Any]], rnd: random.Random) -> list[dict[str, Any]]:
    out = rows + [dict(r) for r in rnd.sample(rows, k=rnd.randint(0, len(rows)))]
    rnd.shuffle(out)
    return out


CONTENT_DIALECTS = [d for d in ENCODERS if d != "no content"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turns=conversations(), dialect=st.sampled_from(CONTENT_DIALECTS), same_start=st.booleans())
def test_synthetic_conversation_rebuilt_exactly(turns: list[list[dict[str, Any]]], dialect: str,
                                                same_start: bool) -> None:
    w = write(turns, dialect, same_start)
    assert got(w.spans, w.logs) == expected(turns)
    t = build_transcript(w.spans, w.logs)
    assert t.system == "You are a bot."
    assert t.llm_calls == sum(1 for turn in turns for m in turn if m["role"] == "assistant")
    assert t.usage.input_tokens == 10 * t.llm_calls and t.usage.output_tokens == 2 * t.llm_calls
    assert t.models == ("m-1",)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turns=conversations(), dialect=st.sampled_from(list(ENCODERS)), same_start=st.booleans(),
       rnd=st.randoms(use_true_random=False))
def test_any_order_and_duplicates_same_transcript(turns: list[list[dict[str, Any]]], dialect: str,
                                                  same_start: bool, rnd: random.Random) -> None:
    w = write(turns, dialect, same_start)
    reference = build_transcript(w.spans, w.logs)
    again = build_transcript(_shuffled_with_dupes(w.spans, rnd), _shuffled_with_dupes(w.logs, rnd))
    assert again == reference
    assert again.content_hash() == reference.content_hash()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turns=conversations(), rnd=st.randoms(use_true_random=False))
def test_split_requests_and_retries_same_transcript(turns: list[list[dict[str, Any]]], rnd: random.Random) -> None:
    """Rows arriving over several requests, some retried whole: the union rebuilds the same."""
    w = write(turns, "otel-genai span and event")
    rows = w.spans + w.logs
    rnd.shuffle(rows)
    cuts = sorted(rnd.sample(range(len(rows) + 1), k=min(3, len(rows) + 1)))
    requests = [rows[a:b] for a, b in zip([0] + cuts, cuts + [len(rows)])]
    arrived = [r for req in requests for r in req] + [r for req in rnd.sample(requests, k=1) for r in req]
    spans = [r for r in arrived if "span_id" in r and "log_id" not in r]
    logs = [r for r in arrived if "log_id" in r]
    assert build_transcript(spans, logs) == build_transcript(w.spans, w.logs)


CASES = case_names()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(CASES), rnd=st.randoms(use_true_random=False))
def test_fixture_rows_any_order_same_transcripts(name: str, rnd: random.Random) -> None:
    case = load_case(name)
    groups = group_traces(by_trace(case.spans, case.logs), logs=logs_by_trace(case.logs))
    shuffled_spans = _shuffled_with_dupes(case.spans, rnd)
    shuffled_logs = _shuffled_with_dupes(case.logs, rnd)
    assert group_traces(by_trace(shuffled_spans, shuffled_logs), logs=logs_by_trace(shuffled_logs)) == groups
    for tids in groups.values():
        keep = set(tids)
        ref = build_transcript([r for r in case.spans if r["trace_id"] in keep],
                               [r for r in case.logs if r["trace_id"] in keep])
        assert build_transcript([r for r in shuffled_spans if r["trace_id"] in keep],
                                [r for r in shuffled_logs if r["trace_id"] in keep]) == ref


# ---------------------------------------------------------------- incremental rebuilds (ParseMemo)


def _arrivals(spans: list[dict[str, Any]], logs: list[dict[str, Any]],
              rnd: random.Random) -> list[tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    """The rows a daemon holds after each of several arrivals (any order, some retried)."""
    rows = _shuffled_with_dupes(spans, rnd) + _shuffled_with_dupes(logs, rnd)
    rnd.shuffle(rows)
    cuts = sorted(rnd.sample(range(len(rows) + 1), k=min(5, len(rows) + 1))) + [len(rows)]
    return [([r for r in rows[:c] if "log_id" not in r], [r for r in rows[:c] if "log_id" in r]) for c in cuts]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turns=conversations(), dialect=st.sampled_from(list(ENCODERS)), rnd=st.randoms(use_true_random=False))
def test_rebuild_with_memo_equals_rebuild_from_scratch(turns: list[list[dict[str, Any]]], dialect: str,
                                                       rnd: random.Random) -> None:
    w = write(turns, dialect, same_start=rnd.random() < 0.3)
    memo = ParseMemo()
    for spans, logs in _arrivals(w.spans, w.logs, rnd):
        again = build_transcript(spans, logs, memo)
        assert again == build_transcript(spans, logs)
        assert again.content_hash(memo.digest) == again.content_hash()  # the cached lines digest alike


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(CASES), rnd=st.randoms(use_true_random=False))
def test_fixture_rebuild_with_memo_equals_rebuild_from_scratch(name: str, rnd: random.Random) -> None:
    case = load_case(name)
    memo = ParseMemo()  # one for the whole case: rows of other conversations only miss
    for spans, logs in _arrivals(case.spans, case.logs, rnd):
        again = build_transcript(spans, logs, memo)
        assert again == build_transcript(spans, logs)
        assert again.content_hash(memo.digest) == again.content_hash()


def test_memo_rereads_a_row_that_changed_under_the_same_ids() -> None:
    turns = _turns("hi", "a long answer " + "x" * 200)
    w = write(turns, "otel-genai span")
    whole = w.spans[1]["attributes"]
    _cut_attr(w.spans[1], "gen_ai.output.messages", len(json.loads(whole)["gen_ai.output.messages"]) // 2)
    memo = ParseMemo()
    assert build_transcript(w.spans, [], memo).messages[-1].truncated
    w.spans[1] = {**w.spans[1], "attributes": whole}  # the stored row, now complete
    assert got(w.spans, []) == expected(turns)
    assert build_transcript(w.spans, [], memo) == build_transcript(w.spans, [])


def test_memo_rereads_a_span_whose_log_records_arrived_late() -> None:
    w = write(_turns("hi", "hello", "bye", "ciao"), "otel-genai event only")
    memo = ParseMemo()
    early = build_transcript(w.spans, w.logs[:1], memo)
    assert [m.content for m in early.messages] == ["hi", "hello"]
    assert build_transcript(w.spans, w.logs, memo) == build_transcript(w.spans, w.logs)


def test_memo_keeps_equal_values_that_read_differently_apart() -> None:
    w = write(_turns("hi", "hello"), "otel-genai span")
    chat = w.spans[1]
    memo = ParseMemo()
    for end in (chat["end_time_unix_nano"], float(chat["end_time_unix_nano"]), True, 1, 1.0):
        rows = [w.spans[0], {**chat, "end_time_unix_nano": end}]
        assert build_transcript(rows, [], memo) == build_transcript(rows, [])
    for attrs in (json.loads(chat["attributes"]), {**json.loads(chat["attributes"]), "gen_ai.usage.input_tokens": 10.0}):
        rows = [w.spans[0], {**chat, "attributes": attrs}]  # already decoded by the caller
        assert build_transcript(rows, [], memo) == build_transcript(rows, [])


def test_memo_holds_only_the_last_calls_rows() -> None:
    w = write(_turns("u1", "a1", "u2", "a2", "u3", "a3"), "legacy log events")
    first = w.spans[0]["trace_id"]
    some = ([r for r in w.spans if r["trace_id"] == first], [r for r in w.logs if r["trace_id"] == first])
    fresh = ParseMemo()
    build_transcript(*some, fresh)
    memo = ParseMemo()
    build_transcript(w.spans, w.logs, memo)
    assert len(memo) > len(fresh) > 0
    build_transcript(*some, memo)
    assert len(memo) == len(fresh)


# ---------------------------------------------------------------- rules


def _turns(*texts: str) -> list[list[dict[str, Any]]]:
    return [[{"role": "user", "content": u}, {"role": "assistant", "content": a}]
            for u, a in zip(texts[::2], texts[1::2])]


def test_user_says_yes_twice_kept_twice() -> None:
    turns = _turns("yes", "ok", "yes", "ok", "yes", "done")
    w = write(turns, "otel-genai span")
    assert got(w.spans, w.logs) == expected(turns)


def test_no_content_flagged_with_how_to_fix() -> None:
    w = write(_turns("hi", "hello", "bye", "ciao"), "no content")
    t = build_transcript(w.spans, w.logs)
    assert not t.content_captured and t.messages == ()
    assert t.no_content_reason == NO_CONTENT_REASON
    assert "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY" in NO_CONTENT_REASON
    assert t.llm_calls == 2 and t.usage.input_tokens == 20 and t.models == ("m-1",)
    assert conversation_v1(t, "c", "idle")["attributes"]["no_content_reason"] == NO_CONTENT_REASON


def test_no_genai_spans_at_all() -> None:
    w = Writer("otel-genai span")
    w.span("t" * 32, None, "GET /", {"http.method": "GET"}, 1, 2)
    t = build_transcript(w.spans, [])
    assert t.no_content_reason == NO_GENAI_REASON and t.llm_calls == 0


def test_agent_content_only_when_trace_has_no_llm_content() -> None:
    w = write(_turns("u1", "a1"), "otel-genai span")
    # Trace 2: the LLM span lost its content; the agent span has the turn.
    trace = "f" * 32
    root = w.span(trace, None, "invoke_agent bot", {
        "gen_ai.operation.name": "invoke_agent", "gen_ai.conversation.id": "conv-1",
        "gen_ai.input.messages": J([{"role": "user", "parts": [{"type": "text", "content": "u2"}]}]),
        "gen_ai.output.messages": J([{"role": "assistant", "parts": [{"type": "text", "content": "a2"}]}])},
        w.clock + 10**9, w.clock + 10**9 + 100)
    w.span(trace, root, "chat m", {"gen_ai.operation.name": "chat", "gen_ai.usage.input_tokens": 1,
                                   "gen_ai.usage.output_tokens": 1}, w.clock + 10**9 + 1, w.clock + 10**9 + 50)
    # And in trace 1, the agent copy of the turn is not counted again.
    first = w.spans[0]
    first["attributes"] = J({**json.loads(first["attributes"]), "gen_ai.input.messages": J(
        [{"role": "user", "parts": [{"type": "text", "content": "u1"}]}])})
    assert [m["content"] for m in got(w.spans, w.logs)] == ["u1", "a1", "u2", "a2"]
    assert build_transcript(w.spans, w.logs).llm_calls == 2


def _llm(w: Writer, trace: str, parent: str | None, attrs: dict[str, Any], start: int, end: int) -> str:
    return w.span(trace, parent, "llm", {"gen_ai.operation.name": "chat", **attrs}, start, end)


def test_one_llm_call_seen_by_two_instrumentations_counts_once() -> None:
    w = write(_turns("hi", "hello"), "otel-genai span")
    trace, root = w.spans[0]["trace_id"], w.spans[0]["span_id"]
    chat = w.spans[1]
    # Sibling without response id: same parent, same tokens, inside the other's time.
    _llm(w, trace, root, {"gen_ai.usage.input_tokens": 10, "gen_ai.usage.output_tokens": 2},
         chat["start_time_unix_nano"] + 1, chat["end_time_unix_nano"] - 1)
    # Same response id elsewhere in the trace.
    w.spans[1]["attributes"] = J({**json.loads(chat["attributes"]), "gen_ai.response.id": "r1"})
    _llm(w, trace, root, {"gen_ai.response.id": "r1", "gen_ai.usage.input_tokens": 10,
                          "gen_ai.usage.output_tokens": 2}, chat["start_time_unix_nano"] + 500, 10**15)
    # An SDK-level LLM span nested in the wrapper's LLM span.
    _llm(w, trace, chat["span_id"], {"gen_ai.usage.input_tokens": 99, "gen_ai.usage.output_tokens": 9},
         chat["start_time_unix_nano"] + 2, chat["start_time_unix_nano"] + 3)
    t = build_transcript(w.spans, w.logs)
    assert t.llm_calls == 1 and (t.usage.input_tokens, t.usage.output_tokens) == (10, 2)
    assert [m.content for m in t.messages] == ["hi", "hello"]


def test_two_real_calls_with_equal_tokens_count_twice() -> None:
    w = Writer("x")
    _llm(w, "a" * 32, None, {"gen_ai.usage.input_tokens": 5, "gen_ai.usage.output_tokens": 1}, 10, 20)
    _llm(w, "a" * 32, None, {"gen_ai.usage.input_tokens": 5, "gen_ai.usage.output_tokens": 1}, 30, 40)
    assert build_transcript(w.spans, []).llm_calls == 2


def test_llm_span_without_messages_or_tokens_beside_the_call_is_not_a_call() -> None:
    # LlamaIndex: OpenAI._prepare_chat_with_tools (LLM kind, no messages, no tokens) before OpenAI.achat.
    w = write(_turns("hi", "hello"), "otel-genai span")
    trace, root, chat = w.spans[0]["trace_id"], w.spans[0]["span_id"], w.spans[1]
    _llm(w, trace, root, {"gen_ai.request.model": "m"}, chat["start_time_unix_nano"] - 5,
         chat["start_time_unix_nano"] - 1)
    assert build_transcript(w.spans, w.logs).llm_calls == 1
    # With no content anywhere, such spans are the calls (content capture off, a stream without usage).
    w = Writer("x")
    _llm(w, "a" * 32, None, {"gen_ai.request.model": "m"}, 10, 20)
    _llm(w, "a" * 32, None, {"gen_ai.request.model": "m"}, 30, 40)
    assert build_transcript(w.spans, []).llm_calls == 2


def test_model_reported_by_a_later_span_is_the_previous_calls() -> None:
    w = write(_turns("hi", "hello"), "otel-genai span")
    trace, root, chat = w.spans[0]["trace_id"], w.spans[0]["span_id"], w.spans[1]
    ev = "AgentOutput(raw={'id': 'c', 'created': 1, 'model': 'm-reported', 'object': 'chat.completion'})"
    end = chat["end_time_unix_nano"]
    w.span(trace, root, "parse_agent_output", {"openinference.span.kind": "CHAIN",
                                               "input.value": J({"ev": ev})}, end + 1, end + 2)
    assert build_transcript(w.spans, w.logs).models == ("m-1",)  # the call's own response model wins
    chat_attrs = json.loads(chat["attributes"])
    chat["attributes"] = J({k: v for k, v in chat_attrs.items() if k != "gen_ai.response.model"})
    assert build_transcript(w.spans, w.logs).models == ("m-reported",)


def test_log_records_without_their_span_still_count() -> None:
    w = write(_turns("hi", "hello"), "otel-genai event only")
    spans = [s for s in w.spans if s["name"] != "chat m"]
    t = build_transcript(spans, w.logs)
    assert [m.content for m in t.messages] == ["hi", "hello"] and t.llm_calls == 1
    assert all(m.span_id for m in t.messages)


GARBAGE: list[dict[str, Any]] = [
    {"attributes": "{not json"},
    {"attributes": "[1, 2]"},
    {"attributes": J({"gen_ai.operation.name": "chat", "gen_ai.input.messages": J({"role": 5})})},
    {"attributes": J({"gen_ai.operation.name": "chat", "gen_ai.input.messages": 7,
                      "gen_ai.output.messages": J([None, "x", {"role": None}])})},
    {"events": "not json"},
    {"events": J([1, {"name": None, "attributes": None}])},
    {"span_id": None},
    {"trace_id": None},
    {"start_time_unix_nano": None, "end_time_unix_nano": None},
]


@pytest.mark.parametrize("damage", GARBAGE)
def test_malformed_span_skipped_and_counted(damage: dict[str, Any]) -> None:
    w = write(_turns("hi", "hello"), "otel-genai span")
    extra = dict(w.spans[0])
    extra.update({"span_id": "e" * 16, **damage})
    t = build_transcript(w.spans + [extra], w.logs)
    assert [m.content for m in t.messages] == ["hi", "hello"]
    assert t.unparsed_spans in (0, 1)


def test_malformed_rows_are_counted() -> None:
    w = write(_turns("hi", "hello"), "legacy log events")
    bad_span = {**w.spans[0], "span_id": "e" * 16, "attributes": "{cut"}
    bad_log = {**w.logs[0], "log_id": "x", "attributes": "{cut"}
    t = build_transcript(w.spans + [bad_span], w.logs + [bad_log])
    assert (t.unparsed_spans, t.unparsed_logs) == (1, 1)
    assert [m.content for m in t.messages] == ["hi", "hello"]
    assert conversation_v1(t, "c")["attributes"]["unparsed_spans"] == 1


@settings(max_examples=80, deadline=None)
@given(column=st.sampled_from(["attributes", "events", "name", "parent_span_id", "start_time_unix_nano"]),
       value=st.one_of(st.none(), st.text(max_size=30), st.integers(), st.lists(st.integers(), max_size=3),
                       st.builds(J, st.recursive(st.one_of(st.none(), st.text(max_size=5), st.integers()),
                                                 lambda c: st.lists(c, max_size=3) |
                                                 st.dictionaries(st.sampled_from(
                                                     ["role", "parts", "content", "type", "gen_ai.input.messages",
                                                      "tool_calls", "name", "attributes"]), c, max_size=3),
                                                 max_leaves=8))))
@example(column="start_time_unix_nano", value=-62_135_596_800_000_000_001)  # before year 1
def test_garbage_columns_never_crash(column: str, value: Any) -> None:
    w = write(_turns("hi", "hello"), "otel-genai span")
    bad = {**w.spans[1], "span_id": "d" * 16, column: value}
    t = build_transcript(w.spans + [bad], w.logs)
    assert [m.content for m in t.messages][:2] == ["hi", "hello"]


def test_conversation_v1_record_shape() -> None:
    turns: list[list[dict[str, Any]]] = [[{"role": "user", "content": "order?"},
              {"role": "assistant", "content": "", "tool_calls": [
                  {"id": "c1", "name": "lookup", "arguments": {"id": 1}},
                  {"id": "c2", "name": "track", "arguments": {"id": 2}}]},
              {"role": "tool", "content": "r1", "tool_call_id": "c1", "name": "lookup"},
              {"role": "tool", "content": "r2", "tool_call_id": "c2", "name": "track"},
              {"role": "assistant", "content": "shipped"}]]
    w = write(turns, "otel-genai span")
    t = build_transcript(w.spans, w.logs)
    rec = conversation_v1(t, "conv-1", "handover", sampling={"probability": 1.0, "rule": "all"})
    allowed = {"schema", "id", "source", "service", "started_at", "ended_at", "ended_by", "system", "messages",
               "models", "usage", "trace_ids", "sampling", "attributes"}
    assert set(rec) <= allowed
    assert (rec["schema"], rec["id"], rec["source"], rec["ended_by"]) == (
        "conversation/v1", "conv-1", "production", "handover")
    assert rec["service"] == "bot" and rec["started_at"].endswith("Z")
    msg_fields = {"role", "content", "tool_calls", "tool_call_id", "name", "at", "span_id", "truncated"}
    assert all(set(m) <= msg_fields for m in rec["messages"])
    assert [m.get("name") for m in rec["messages"]] == [None, None, "lookup", "track", None]
    assert rec["messages"][1]["tool_calls"][1] == {"id": "c2", "name": "track", "arguments": {"id": 2}}
    json.dumps(rec)  # serializable as is
    assert t.user_turns == 1 and len(t.content_hash()) == 64
    # The stored digest is the one the evaluator computes from the record: what the judge reads.
    assert t.content_hash() == transcript_sha256(Conversation.model_validate(rec).messages)
    renamed = replace(t, messages=tuple(replace(m, name="find") if m.name == "track" else m for m in t.messages))
    assert renamed.content_hash() != t.content_hash()
    # With the lines kept between calls (the stage's rebuilds): the same digests, a rename seen.
    memo = DigestMemo()
    assert t.content_hash(memo) == t.content_hash() and len(memo.states) == len(t.messages) + 1
    assert renamed.content_hash(memo) == renamed.content_hash()
    assert t.content_hash(memo) == t.content_hash()  # back again: hashed from the common start
    # A tool result without a name is named by the judge from the call before it: rendered whole.
    unnamed = replace(t, messages=tuple(replace(m, name=None) if m.role == "tool" else m for m in t.messages))
    assert unnamed.content_hash(memo) == unnamed.content_hash() == transcript_sha256(
        Conversation.model_validate({**rec, "messages": [{k: v for k, v in m.items() if k != "name"}
                                                         for m in rec["messages"]]}).messages)


# ---------------------------------------------------------------- content cut by length limits


def _cut_attr(row: dict[str, Any], key: str, keep: int) -> None:
    attrs = json.loads(row["attributes"])
    attrs[key] = attrs[key][:keep]
    row["attributes"] = J(attrs, ensure_ascii=False)


def test_answer_cut_short_is_kept_and_flagged() -> None:
    turns = _turns("hi", "hello there, " + "🙂" * 50)
    w = write(turns, "otel-genai span")
    chat = w.spans[1]
    full = json.loads(chat["attributes"])["gen_ai.output.messages"]
    _cut_attr(chat, "gen_ai.output.messages", len(full) // 2)
    t = build_transcript(w.spans, w.logs)
    last = t.messages[-1]
    assert last.truncated and last.role == "assistant"
    assert turns[0][1]["content"].startswith(last.content) and last.content
    assert t.truncated_spans == (chat["span_id"],)
    rec = conversation_v1(t, "c")
    assert rec["messages"][-1]["truncated"] is True and rec["attributes"]["truncated_spans"] == [chat["span_id"]]
    json.dumps(rec).encode("utf-8")  # a cut surrogate pair must not leak out


def test_cut_message_replaced_by_whole_copy_resent_later() -> None:
    turns = _turns("hi", "a long answer " + "x" * 200, "and then?", "done")
    w = write(turns, "otel-genai span")
    first_chat = w.spans[1]
    full = json.loads(first_chat["attributes"])["gen_ai.output.messages"]
    _cut_attr(first_chat, "gen_ai.output.messages", len(full) - 60)
    t = build_transcript(w.spans, w.logs)
    assert got(w.spans, w.logs) == expected(turns)
    assert not any(m.truncated for m in t.messages)


def test_history_cut_in_a_later_call_adds_nothing_twice() -> None:
    turns = _turns("hi", "hello", "more " * 30, "sure", "bye", "ciao")
    w = write(turns, "otel-genai span")
    second_chat = w.spans[3]
    full = json.loads(second_chat["attributes"])["gen_ai.input.messages"]
    _cut_attr(second_chat, "gen_ai.input.messages", len(full) - 40)
    assert got(w.spans, w.logs) == expected(turns)


SALVAGE_TABLE: list[tuple[str, Any]] = [
    ('[{"role": "user", "content": "hel', [{"role": "user", "content": "hel", "__truncated__": True}]),
    ('[{"a": 1}, {"b": tru', [{"a": 1}, {"b": None, "__truncated__": True}]),
    ('{"messages": [{"role": "user"}, ', {"messages": [{"role": "user", "__truncated__": True}],
                                        "__truncated__": True}),
    ('{"k', {"k": None, "__truncated__": True}),
    ('["x\\ud83d', ["x"]),
    ('["\\u00', [""]),
    ("not json at all {", None),
]


@pytest.mark.parametrize("text,value", SALVAGE_TABLE)
def test_salvage(text: str, value: Any) -> None:
    from collector.normalize._salvage import salvage
    assert salvage(text) == value


# ---------------------------------------------------------------- log records sharing a timestamp


def test_log_records_sharing_a_timestamp_keep_request_order() -> None:
    """Per-message events of one call on a coarse clock: request order, not their hashes, decides."""
    turns = _turns("hi", "hello", "yes", "ok", "yes", "done")
    w = write(turns, "legacy log events")
    for i, row in enumerate(w.logs):
        row["observed_time_unix_nano"] = 1_764_478_800_000_000_000  # one clock tick for every record
        row["arrival"] = (1, i)  # (commit, place in it), as the conversation stage passes them
    assert got(w.spans, w.logs) == expected(turns)
    rnd = random.Random(7)
    for _ in range(5):  # in any order, with retries
        assert got(_shuffled_with_dupes(w.spans, rnd), _shuffled_with_dupes(w.logs, rnd)) == expected(turns)


def test_a_retried_log_record_keeps_its_first_place() -> None:
    turns = _turns("hi", "hello", "more", "sure")
    w = write(turns, "legacy log events")
    for i, row in enumerate(w.logs):
        row["observed_time_unix_nano"] = 1_764_478_800_000_000_000
        row["arrival"] = (1, i)
    retried = [{**row, "arrival": (2, i)} for i, row in enumerate(reversed(w.logs))]
    assert got(w.spans, w.logs + retried) == expected(turns)


# ---------------------------------------------------------------- usage


def _chat(w: Writer, usage: dict[str, Any]) -> None:
    _llm(w, "b" * 32, None, {
        "gen_ai.request.model": "m",
        "gen_ai.input.messages": J([{"role": "user", "parts": [{"type": "text", "content": "hi"}]}]),
        "gen_ai.output.messages": J([{"role": "assistant", "parts": [{"type": "text", "content": "hello"}]}]),
        **usage}, 10, 20)


def test_usage_absent_when_no_call_reported_it() -> None:
    w = Writer("x")
    _chat(w, {})
    t = build_transcript(w.spans, [])
    assert t.llm_calls == 1 and t.usage is None
    assert "usage" not in conversation_v1(t, "c")


def test_usage_reported_as_zero_stays_zero() -> None:
    w = Writer("x")
    _chat(w, {"gen_ai.usage.input_tokens": 0, "gen_ai.usage.output_tokens": 0})
    t = build_transcript(w.spans, [])
    assert conversation_v1(t, "c")["usage"] == {"input_tokens": 0, "output_tokens": 0}


def test_a_stored_row_parses_each_json_column_once_until_released() -> None:
    from collector.conversations.keys import StoredRow, json_column

    row = StoredRow(attributes='{"gen_ai.conversation.id": "c-1"}', events="not json")
    first = json_column(row, "attributes")
    assert first == {"gen_ai.conversation.id": "c-1"} and json_column(row, "attributes") is first  # one parse
    for _ in range(2):  # a column that does not parse raises each time it is asked for
        with pytest.raises(ValueError):
            json_column(row, "events")
    row.release()
    again = json_column(row, "attributes")
    assert again == first and again is not first  # parsed anew after the release
    assert json_column({"attributes": '{"a": 1}'}, "attributes") == {"a": 1}  # any mapping is read as before


@pytest.mark.parametrize("dialect", ["otel-genai span", "legacy log events"])
def test_tool_arguments_that_are_not_an_object_are_kept_as_text(dialect: str) -> None:
    """conversation/v1 holds an object or the text as sent: a JSON list (or scalar) used to pass through
    as a list, which the judges' reader refuses, so such a conversation could never be judged."""
    turns: list[list[dict[str, Any]]] = [[
        {"role": "user", "content": "track both"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "name": "track", "arguments": ["B-1", "B-2"]},
            {"id": "c2", "name": "ping", "arguments": 7},
            {"id": "c3", "name": "lookup", "arguments": {"id": 1}}]},
        {"role": "tool", "content": "ok", "tool_call_id": "c1", "name": "track"},
        {"role": "assistant", "content": "Both are on their way."}]]
    w = write(turns, dialect)
    t = build_transcript(w.spans, w.logs)
    calls = t.messages[1].tool_calls
    assert [c.arguments for c in calls] == ['["B-1", "B-2"]', "7", {"id": 1}]
    rec = conversation_v1(t, "conv-args", "idle")
    judged = Conversation.model_validate(rec)  # what the evaluator reads: no longer refused
    assert [c.arguments for c in judged.messages[1].tool_calls] == ['["B-1", "B-2"]', "7", {"id": 1}]
    assert t.content_hash() == transcript_sha256(judged.messages)



class _Watched(dict):  # type: ignore[type-arg]
    """A row that records which of its columns were read."""

    read: set[str] = set()

    def get(self, key: Any, default: Any = None) -> Any:
        _Watched.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        _Watched.read.add(key)
        return super().__getitem__(key)


def test_the_stage_reads_only_the_columns_rows_are_read_back_with() -> None:
    """Rows read back carry only ``rows.SPAN_COLUMNS`` / ``LOG_COLUMNS``: keys, chains, end rules and
    transcripts of every fixture read no other column (one that did would see None in the stage)."""
    from collector.config import EndRule
    from collector.conversations.endings import ended_by_rule
    from collector.conversations.keys import has_messages, response_links
    from collector.conversations.rows import LOG_COLUMNS, SPAN_COLUMNS
    from collector.conversations.rows import TraceRows
    from collector.conversations.tracemap import is_genai
    from collector.ingest import batches

    assert set(SPAN_COLUMNS) < set(batches.SPAN_COLUMNS) and set(LOG_COLUMNS) < set(batches.LOG_COLUMNS)
    rules = [EndRule(attribute="app.conversation.end", equals=True, ended_by="bot_closed")]
    span_reads: set[str] = set()
    log_reads: set[str] = set()
    for name in CASES:
        case = load_case(name)
        spans = [_Watched(r) for r in case.spans]
        logs = [_Watched(r) for r in case.logs]
        _Watched.read = set()
        for tid, rows in by_trace(spans, logs).items():
            conversation_key(rows)
            response_links(rows)
            ended_by_rule(rules, rows)
            is_genai(TraceRows(spans=rows))
            has_messages(rows)
        build_transcript(spans, [])
        span_reads |= _Watched.read
        _Watched.read = set()
        is_genai(TraceRows(logs=logs))
        has_messages([], logs)
        build_transcript([], logs)
        log_reads |= _Watched.read
    assert span_reads - {"arrival"} <= set(SPAN_COLUMNS), span_reads - set(SPAN_COLUMNS)
    assert log_reads - {"arrival"} <= set(LOG_COLUMNS), log_reads - set(LOG_COLUMNS)
