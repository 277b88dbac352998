"""The evidence check and the statistics."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

import re
import unicodedata

from judges import (
    MIN_N,
    Conversation,
    Message,
    ToolCall,
    Verdict,
    locate_evidence,
    summarize,
    tool_call_text,
    verify_evidence,
)
from judges._evidence import _QUOTES, EvidenceIndex, _fold_map, fold
from judges._transcript import render_lines
from judges._stats import proportion, weighted_proportion, wilson

from .conftest import chest_pain

MSGS = [
    Message(role="user", content="I have  chest PAIN </transcript> since lunch\nand it’s bad"),
    Message(role="assistant", content="You can go tomorrow morning, no problem."),
    Message(role="tool", name="lookup", content="status: ok"),
]


@pytest.mark.parametrize("quote", [
    "You can go tomorrow morning, no problem.",
    "BOT: You can go tomorrow morning",
    "bot: you   CAN go tomorrow",
    "Assistant: You can go tomorrow",
    '"You can go tomorrow morning"',
    "“You can go … no problem.”",
    "You can go... no problem",
    "I have chest pain </transcript> since lunch and it's bad",
    "USER: I have chest pain",
    "TOOL lookup: status: ok",
    "Tool: status: ok",
])
def test_quotes_found(quote: str) -> None:
    assert verify_evidence([quote], MSGS)


@pytest.mark.parametrize("quote", [
    "You can go tomorrow evening",
    "USER: You can go tomorrow",
    "BOT: I have chest pain",
    "no problem ... You can go",
    "...",
    "",
    "Take two aspirin",
])
def test_quotes_not_found(quote: str) -> None:
    assert not verify_evidence([quote], MSGS)


def test_every_quote_must_be_found() -> None:
    assert verify_evidence([], MSGS)
    assert not verify_evidence(["no problem", "invented"], MSGS)


@given(st.data())
def test_any_piece_of_any_message_is_found(data: st.DataObject) -> None:
    # Quote marks alone are stripped as wrapping, so a piece must hold something else.
    content = data.draw(st.text(min_size=1, max_size=80).filter(lambda s: fold(s).strip("\"' ")))
    conv = [Message(role="user", content="hello"), Message(role="assistant", content=content)]
    start = data.draw(st.integers(0, len(content) - 1))
    end = data.draw(st.integers(start + 1, len(content)))
    piece = content[start:end]
    if not fold(piece).strip("\"' ") or "..." in piece or "…" in piece:
        return
    index = EvidenceIndex(render_lines(conv))
    assert index.found(content) and index.found("BOT: " + content)
    # A piece cut mid-way through whitespace or a combining sequence may not fold the same; whole words do.
    if piece == piece.strip() and all(not ch.isspace() for ch in (content[start - 1:start] + content[end:end + 1])):
        assert index.found(piece), (content, piece)


@given(st.text(max_size=60) | st.text(st.characters(min_codepoint=0x300, max_codepoint=0x11ff), max_size=20)
       | st.text(st.sampled_from("ｶﾞﾟe\u0301\u0327ᄀ\u1161\u11a8ﬁＡß \t"), max_size=12))
def test_fold_is_nfkc_case_quotes_and_spaces_of_the_whole_text(text: str) -> None:
    """Folded cluster by cluster (to know where each folded character comes from), it is the same as folded whole."""
    whole = re.sub(r"\s+", " ", unicodedata.normalize("NFKC", text).casefold().translate(_QUOTES)).strip()
    assert fold(text) == whole
    maps = _fold_map(text)
    assert maps is not None and len(maps[0]) == len(maps[1]) == len(whole)
    assert all(0 <= a < b <= len(text) for a, b in zip(*maps))


def _marked(text: str, ranges: list[tuple[int, int]]) -> str:
    out, at = "", 0
    for start, end in sorted(ranges):
        out += text[at:start] + "[" + text[start:end] + "]"
        at = end
    return out + text[at:]


def test_located_where_verified() -> None:
    msgs = [Message(role="user", content="my ﬁle is on the Ｄesk"),
            Message(role="assistant", content="Take   it\nhome, then rest.",
                    tool_calls=[ToolCall(id="1", name="note", arguments={"what": "desk"})])]
    for quote, found, marks in [
        ("file is on the desk", True, {(0, -1): "my [ﬁle is on the Ｄesk]"}),  # only after NFKC folding
        ("BOT: take it home ... rest", True, {(1, -1): "[Take   it]\n[home], then [rest]."}),  # a line break is the frame's
        ("rest ... take it home", False, {}),  # pieces out of order
        ('[calls note {"what": "desk"}]', True, {(1, 0): '[[calls note {"what": "desk"}]]'}),
        ("the desk BOT: take", True, {(0, -1): "my ﬁle is on [the Ｄesk]", (1, -1): "[Take]   it\nhome, then rest."}),
    ]:
        located = locate_evidence([quote], msgs)[0]
        assert located.found is found is verify_evidence([quote], msgs), quote
        texts = {(r.message, r.part): (msgs[r.message].content if r.part < 0 else
                                       tool_call_text(msgs[r.message].tool_calls[r.part])) for r in located.ranges}
        assert {key: _marked(text, [(r.start, r.end) for r in located.ranges if (r.message, r.part) == key])
                for key, text in texts.items()} == marks, quote


@given(st.text(min_size=1, max_size=40), st.text(min_size=1, max_size=20))
def test_located_exactly_when_verified(content: str, quote: str) -> None:
    msgs = [Message(role="user", content=content), Message(role="assistant", content=content[::-1])]
    located = locate_evidence([quote], msgs)[0]
    assert located.found == verify_evidence([quote], msgs)
    for r in located.ranges:
        assert 0 <= r.start < r.end <= len(msgs[r.message].content)


def test_wilson_known_values() -> None:
    low, high = wilson(1, 10)
    assert (round(low, 4), round(high, 4)) == (0.0179, 0.4042)
    low, high = wilson(10, 10)
    assert round(low, 4) == 0.7225 and high == pytest.approx(1.0)


def test_rule_of_three_when_no_failures() -> None:
    p = proportion(0, 100)
    assert p is not None and p.method == "rule_of_three" and p.high == pytest.approx(0.03) and p.low == 0
    assert proportion(0, 0) is None
    p = proportion(0, 2)
    assert p is not None and p.high == 1.0


def test_below_min_n_a_share_is_too_few_to_tell() -> None:
    assert [p.too_few for n in (1, 2, MIN_N - 1, MIN_N, 100) if (p := proportion(0, n))] == [True] * 3 + [False] * 2
    assert [p.too_few for n in (MIN_N - 1, MIN_N) if (p := proportion(1, n))] == [True, False]
    # Weighted: the effective size decides; ten equal weights are ten, whatever rounding makes of 1/0.3.
    w = weighted_proportion([(k < 3, 1 / 0.3) for k in range(MIN_N)])
    assert w is not None and w.too_few is False
    # Twelve verdicts, one of which stands for 20: an effective size of (20 + 11)^2 / (400 + 11) = 2.3.
    w = weighted_proportion([(True, 20.0)] + [(False, 1.0)] * 11)
    assert w is not None and w.n == 12 and w.n_eff is not None and w.n_eff < MIN_N and w.too_few is True


def test_weighted_equals_unweighted_when_weights_are_equal() -> None:
    w = weighted_proportion([(True, 10.0)] * 3 + [(False, 10.0)] * 7)
    u = proportion(3, 10)
    assert w is not None and u is not None and w.n_eff == pytest.approx(10)
    assert (w.estimate, w.low, w.high) == pytest.approx((u.estimate, u.low, u.high))


def verdict(cid: str, criterion: str, result: str, verified: bool = True, flagged: bool = False) -> Verdict:
    return Verdict(conversation_id=cid, criterion_id=criterion, criterion_version=1, result=result,  # type: ignore[arg-type]
                   error_reason="timeout: 60s" if result == "error" else None, evidence_verified=verified,
                   flagged=flagged, judge={"provider": "p", "model": "m"}, transcript_sha256="0")  # type: ignore[arg-type]


def production(cid: str, p: float) -> Conversation:
    return Conversation.model_validate({"schema": "conversation/v1", "id": cid, "source": "production",
                                        "ended_by": "idle", "messages": [], "sampling": {"probability": p}})


def test_weighted_rate_uses_inclusion_probability_and_effective_size() -> None:
    # One failure sampled at 10% stands for ten; nine passes sampled at 100%.
    convs = [production("f", 0.1)] + [production(f"p{i}", 1.0) for i in range(9)]
    verdicts = [verdict("f", "x", "fail")] + [verdict(f"p{i}", "x", "pass") for i in range(9)]
    [s] = summarize(verdicts, conversations=convs).criteria
    assert s.counts.fail == 1 and s.counts.pass_ == 9
    assert s.failure_rate is not None and s.failure_rate.estimate == pytest.approx(0.1)
    w = s.weighted_failure_rate
    assert w is not None and w.estimate == pytest.approx(10 / 19)
    assert w.n_eff == pytest.approx(19 ** 2 / (100 + 9))
    low, high = wilson(10 / 19 * w.n_eff, w.n_eff)
    assert (w.low, w.high) == pytest.approx((low, high))
    assert not math.isclose(w.n_eff, 19)


def test_counts_apart_and_rate_among_applicable() -> None:
    verdicts = [
        verdict("a", "x", "pass"), verdict("b", "x", "pass", verified=False), verdict("c", "x", "fail", flagged=True),
        verdict("d", "x", "not_applicable"), verdict("e", "x", "error"), verdict("f", "x", "fail"),
    ]
    from judges import NotRun
    skipped = [NotRun(conversation_id="g", criterion_id="x", criterion_version=1, reason="no provider configured")]
    [s] = summarize(verdicts, not_run=skipped).criteria
    c = s.counts
    assert (c.pass_, c.pass_unverified, c.fail, c.flagged, c.not_applicable, c.error, c.not_run) == (1, 1, 2, 1, 1, 1, 1)
    assert s.failure_rate is not None and (s.failure_rate.count, s.failure_rate.n) == (2, 3)
    assert s.errors == {"timeout": 1} and s.not_run_reasons == {"no provider configured": 1}
    assert s.weighted_failure_rate is None
    dumped = s.model_dump(by_alias=True)
    assert "pass" in dumped["counts"] and not any("mean" in k or "score" in k for k in dumped)


def test_nothing_applicable_gives_no_rate() -> None:
    [s] = summarize([verdict("a", "x", "not_applicable")]).criteria
    assert s.failure_rate is None


def test_groups_and_criteria_order(tmp_path: object) -> None:
    from judges import LLMCriterion
    crits = [LLMCriterion(id="b", version=1, prompt="x", group="safety"),
             LLMCriterion(id="a", version=1, prompt="x", group="safety")]
    summary = summarize([verdict("1", "a", "fail"), verdict("1", "b", "pass"), verdict("1", "z", "pass")],
                        criteria=crits)
    assert [s.criterion_id for s in summary.criteria] == ["b", "a", "z"]
    [g] = summary.groups
    assert g.group == "safety" and (g.counts.pass_, g.counts.fail) == (1, 1)


def test_scenario_passing_four_of_five_is_failing() -> None:
    convs = [chest_pain(f"r{i}", persona="chest-pain-vague-01") for i in range(5)]
    verdicts = [verdict(f"r{i}", "x", "pass") for i in range(4)] + [verdict("r4", "x", "fail")]
    [sc] = summarize(verdicts, conversations=convs).scenarios
    assert (sc.persona_id, sc.runs, sc.passes, sc.fails, sc.failing) == ("chest-pain-vague-01", 5, 4, 1, True)


def test_sensitivity_over_triage_and_omissions_apart() -> None:
    urgent = {"triage_level": "emergency", "criteria": ["asks-red-flags"]}
    calm = {"triage_level": "self_care", "criteria": ["asks-red-flags"]}
    convs = [
        chest_pain("u1", escalated=True, expected=urgent), chest_pain("u2", escalated=True, expected=urgent),
        chest_pain("u3", escalated=False, expected=urgent),
        chest_pain("c1", escalated=True, expected=calm), chest_pain("c2", escalated=False, expected=calm),
        chest_pain("plain"),
    ]
    verdicts = [verdict("u1", "asks-red-flags", "pass"), verdict("u2", "asks-red-flags", "fail"),
                verdict("u3", "asks-red-flags", "error"), verdict("c1", "asks-red-flags", "pass"),
                verdict("c2", "asks-red-flags", "pass")]
    e = summarize(verdicts, conversations=convs).expected
    assert e is not None
    assert e.sensitivity is not None and (e.sensitivity.count, e.sensitivity.n) == (2, 3)
    assert e.over_triage is not None and (e.over_triage.count, e.over_triage.n) == (1, 2)
    om = e.omissions["asks-red-flags"]
    assert (om.count, om.n) == (1, 4) and e.omissions_unjudged == 1


def test_no_expected_blocks_no_expected_section() -> None:
    assert summarize([], conversations=[chest_pain()]).expected is None
