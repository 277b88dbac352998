"""Code checks on real transcripts (../shared/fixtures/otlp/*.expected.json), with no provider."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from judges import CheckResult, Conversation, Criterion, load_criteria, run_judges

from .conftest import chest_pain, fixture_conversations

CRITERIA = """
criteria:
  - id: looks-up-orders
    version: 1
    kind: code
    check: tool_called
    name: lookup_order
    applies_if: {user_matches: "(?i)order|ordine|طلب"}
  - id: hands-over
    version: 1
    kind: code
    check: ended_by
    one_of: [handover]
  - id: short
    version: 1
    kind: code
    check: max_user_turns
    max: 3
  - id: no-dosage
    version: 1
    kind: code
    check: regex
    role: assistant
    pattern: "(?i)\\\\b\\\\d+ ?mg\\\\b"
    must: not_match
  - id: greets
    version: 1
    kind: code
    check: regex
    role: assistant
    pattern: "(?i)\\\\b(hi|hello|ciao)\\\\b"
  - id: message-count
    version: 1
    kind: code
    check: python
    function: fixture_checks_for_tests:even_messages
"""

CHECKS_PY = """
from judges import CheckResult

def even_messages(conversation):
    if any("explode" in m.content for m in conversation.messages):
        raise ValueError("boom")
    return {"result": "pass" if len(conversation.messages) % 2 == 0 else "fail"}
"""


@pytest.fixture(scope="module")
def criteria(tmp_path_factory: pytest.TempPathFactory) -> list[Criterion]:
    folder: Path = tmp_path_factory.mktemp("criteria")
    (folder / "fixture_checks_for_tests.py").write_text(CHECKS_PY, encoding="utf-8")
    (folder / "criteria.yaml").write_text(CRITERIA, encoding="utf-8")
    return load_criteria(folder / "criteria.yaml")


@pytest.fixture(scope="module")
def fixtures() -> list[tuple[dict[str, Any], Conversation]]:
    found = fixture_conversations()
    assert len(found) > 40
    return found


def test_checks_on_every_fixture_transcript(criteria: list[Criterion],
                                             fixtures: list[tuple[dict[str, Any], Conversation]]) -> None:
    run = run_judges(criteria, [conv for _, conv in fixtures])
    assert run.not_run == [] and len(run.verdicts) == len(criteria) * len(fixtures)
    got = {(v.conversation_id, v.criterion_id): v for v in run.verdicts}
    for truth, conv in fixtures:
        calls = {c["name"] for m in truth["messages"] for c in m.get("tool_calls") or []}
        mentions_order = any(re.search(r"(?i)order|ordine|طلب", m["content"] or "")
                             for m in truth["messages"] if m["role"] == "user")
        lookup = got[(conv.id, "looks-up-orders")]
        expected = ("pass" if "lookup_order" in calls else "fail") if mentions_order else "not_applicable"
        assert lookup.result == expected, conv.id
        assert got[(conv.id, "hands-over")].result == ("pass" if truth["handover"] else "fail")
        assert got[(conv.id, "short")].result == ("pass" if truth["user_turns"] <= 3 else "fail")
        assert got[(conv.id, "message-count")].result == ("pass" if len(truth["messages"]) % 2 == 0 else "fail")
        assert got[(conv.id, "no-dosage")].result == "pass"
    for v in run.verdicts:
        assert v.judge.provider == "code" and v.usage.input_tokens == 0
        assert v.evidence_verified, (v.conversation_id, v.criterion_id, v.evidence)
    # The fixtures hold both outcomes for the checks that matter.
    assert {got[(c.id, "looks-up-orders")].result for _, c in fixtures} == {"pass", "fail", "not_applicable"}
    assert {got[(c.id, "hands-over")].result for _, c in fixtures} == {"pass", "fail"}
    assert {got[(c.id, "short")].result for _, c in fixtures} == {"pass", "fail"}


def test_tool_called_quotes_the_call_as_the_judge_sees_it(criteria: list[Criterion],
                                                          fixtures: list[tuple[dict[str, Any], Conversation]]) -> None:
    convs = [c for t, c in fixtures if any(call["name"] == "lookup_order"
                                           for m in t["messages"] for call in m.get("tool_calls") or [])]
    run = run_judges(criteria[:1], convs)
    for v in run.verdicts:
        if v.result == "pass":
            assert v.evidence[0].startswith("[calls lookup_order {") and v.evidence_verified


def test_regex_match_quotes_the_match(criteria: list[Criterion],
                                      fixtures: list[tuple[dict[str, Any], Conversation]]) -> None:
    greets = [c for c in criteria if c.id == "greets"]
    run = run_judges(greets, [c for _, c in fixtures])
    passes = [v for v in run.verdicts if v.result == "pass"]
    assert passes and all(v.evidence and v.evidence_verified for v in passes)
    assert {e.casefold() for v in passes for e in v.evidence} <= {"hi", "hello", "ciao"}


def test_tool_called_with_argument_subset(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("""
criteria:
  - {id: emergency, version: 1, kind: code, check: tool_called, name: set_triage_level, args: {level: emergency}}
  - {id: urgent, version: 1, kind: code, check: tool_called, name: set_triage_level, args: {level: urgent}}
""", encoding="utf-8")
    run = run_judges(load_criteria(tmp_path / "c.yaml"), [chest_pain()])
    assert [v.result for v in run.verdicts] == ["pass", "fail"]
    assert run.verdicts[1].reasoning == "set_triage_level was never called with {'level': 'urgent'}"


def test_a_check_that_raises_records_error(criteria: list[Criterion]) -> None:
    conv = chest_pain().model_copy(update={"messages": [*chest_pain().messages[:1],
                                                         chest_pain().messages[1].model_copy(update={"content": "explode"})]})
    [v] = run_judges([c for c in criteria if c.id == "message-count"], [conv]).verdicts
    assert v.result == "error" and v.error_reason == "check_failed: ValueError: boom"


def test_code_check_result_model() -> None:
    assert CheckResult(result="fail", evidence=["x"]).reasoning == ""
    with pytest.raises(ValueError):
        CheckResult(result="error")  # type: ignore[arg-type]
