"""Code checks have a time limit: a slow regex or an endless ``python`` check records ``error``, never a pass.

Checks run in worker processes, so a check can be stopped whatever it does (a
regex inside ``re`` holds the interpreter lock until it returns). The checks
here never end by themselves: only the limit ends them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from judges import (
    CheckParams,
    CheckResult,
    CodeCheck,
    CodeCriterion,
    Conversation,
    CriteriaError,
    Criterion,
    Message,
    arun_judges,
    load_criteria,
    register_check,
    run_judges,
)

from judges._checks import CHECKS

from ..support.daemon import wait_until
from .conftest import chest_pain

CHECKS_PY = """
import os, re, sys, time
from pathlib import Path

def forever(conversation):
    if "mark" in conversation.attributes:  # tells the test that it runs, and where
        Path(conversation.attributes["mark"]).write_text(str(os.getpid()))
    while True:
        pass

def catastrophic(conversation):
    # Exponential backtracking inside re: the interpreter lock is held until it returns.
    re.search(r"(a+)+$", "a" * 64 + "b")
    return {"result": "pass"}

def fine(conversation):
    print("a check may print")
    return {"result": "pass", "evidence": [conversation.messages[0].content]}
"""

CRITERIA = """
criteria:
  - id: script-tags
    version: 1
    kind: code
    check: regex
    role: user
    pattern: "(?s).*(<script|javascript:).*"
    must: not_match
    timeout: 500ms
  - id: refund-only
    version: 1
    kind: code
    check: max_user_turns
    max: 3
    applies_if: {user_matches: "(?i)refund.*guarantee"}
    timeout: 0.5
  - id: endless
    version: 1
    kind: code
    check: python
    function: limit_checks_for_tests:forever
    timeout: 1s
  - id: catastrophic
    version: 1
    kind: code
    check: python
    function: limit_checks_for_tests:catastrophic
    timeout: 1s
  - id: fine
    version: 1
    kind: code
    check: python
    function: limit_checks_for_tests:fine
"""


@pytest.fixture
def criteria(tmp_path: Path) -> dict[str, Criterion]:
    (tmp_path / "limit_checks_for_tests.py").write_text(CHECKS_PY, encoding="utf-8")
    (tmp_path / "criteria.yaml").write_text(CRITERIA, encoding="utf-8")
    return {c.id: c for c in load_criteria(tmp_path / "criteria.yaml")}


def refunds() -> Conversation:
    """A long user message on which both regexes above backtrack for minutes."""
    return Conversation(id="long", source="production", ended_by="idle", messages=[
        Message(role="user", content="refund " * 40_000),
        Message(role="assistant", content="Let me look into it."),
    ])


@pytest.mark.timeout(120)
def test_slow_regexes_record_error_with_the_reason(criteria: dict[str, Criterion]) -> None:
    run = run_judges([criteria["script-tags"], criteria["refund-only"]], [refunds()])
    assert [(v.criterion_id, v.result, v.error_reason) for v in run.verdicts] == [
        ("script-tags", "error", "timeout: check ran longer than 0.5s"),
        ("refund-only", "error", "timeout: check ran longer than 0.5s"),
    ]
    assert all(not v.evidence_verified for v in run.verdicts)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_endless_python_checks_record_error_and_the_next_check_runs(criteria: dict[str, Criterion]) -> None:
    chosen = [criteria["endless"], criteria["catastrophic"], criteria["fine"]]
    run = run_judges(chosen, [chest_pain("a"), chest_pain("b")], concurrency=3)
    got = {(v.conversation_id, v.criterion_id): (v.result, v.error_reason) for v in run.verdicts}
    for cid in ("a", "b"):
        assert got[(cid, "endless")] == ("error", "timeout: check ran longer than 1s")
        assert got[(cid, "catastrophic")] == ("error", "timeout: check ran longer than 1s")
        assert got[(cid, "fine")] == ("pass", None)
    assert all(v.evidence_verified for v in run.verdicts if v.result == "pass")


@pytest.mark.timeout(120)
def test_a_cancelled_run_stops_the_check_it_was_waiting_for(criteria: dict[str, Criterion], tmp_path: Path) -> None:
    mark = tmp_path / "running"

    async def main() -> None:
        conversation = chest_pain().model_copy(update={"attributes": {"mark": str(mark)}})
        task = asyncio.ensure_future(arun_judges([criteria["endless"]], [conversation]))
        await asyncio.to_thread(wait_until, lambda: mark.exists() and mark.read_text(), "the check to run")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    pid = int(mark.read_text())
    # The worker running the check is killed and reaped, not left spinning.
    wait_until(lambda: not Path(f"/proc/{pid}").exists(), f"worker process {pid} to end")


def test_the_limit_defaults_to_5s_and_reads_durations(tmp_path: Path) -> None:
    def load(extra: str) -> CodeCriterion:
        (tmp_path / "c.yaml").write_text(
            f"criteria:\n  - {{id: a, version: 1, kind: code, check: max_user_turns, max: 3{extra}}}\n")
        [c] = load_criteria(tmp_path / "c.yaml")
        assert isinstance(c, CodeCriterion)
        return c

    assert load("").timeout == 5.0
    assert [load(f", timeout: {v}").timeout for v in ("250ms", "2s", "1m", "1h", "1.5", "3")] == [
        0.25, 2.0, 60.0, 3600.0, 1.5, 3.0]
    for bad in ("fast", "0s", "-1", "5 parsecs"):
        with pytest.raises(CriteriaError, match="criterion 'a': timeout: ") as info:
            load(f", timeout: {bad}")
        assert "a duration like 5s or 500ms" in str(info.value)


def test_the_limit_is_for_code_criteria(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("criteria:\n  - {id: a, version: 1, kind: llm, prompt: p, timeout: 5s}\n")
    with pytest.raises(CriteriaError, match="criterion 'a': timeout: unknown key"):
        load_criteria(tmp_path / "c.yaml")


class MentionsChest:
    """An outside check, registered by the suite, defined in an importable module."""

    class Params(CheckParams):
        word: str = "chest"

    def run(self, conversation: Conversation, params: Params) -> CheckResult:
        hit = any(params.word in m.content for m in conversation.messages)
        return CheckResult(result="pass" if hit else "fail")


@pytest.fixture
def register(monkeypatch: pytest.MonkeyPatch) -> Callable[[str, CodeCheck], None]:
    """``register_check`` for one test: the registry is as it was afterwards."""
    def add(name: str, check: CodeCheck) -> None:
        monkeypatch.setitem(CHECKS, name, check)
        register_check(name, check)
    return add


def test_an_outside_check_runs_in_the_worker_too(register: Callable[[str, CodeCheck], None]) -> None:
    register("mentions_chest", MentionsChest())
    crit = CodeCriterion(id="chest", version=1, check="mentions_chest", params=MentionsChest.Params())
    assert [v.result for v in run_judges([crit], [chest_pain()]).verdicts] == ["pass"]


def test_a_check_that_cannot_reach_its_worker_records_error(register: Callable[[str, CodeCheck], None]) -> None:
    class Local:  # defined in a function: a worker process cannot import it
        Params = CheckParams

        def run(self, conversation: Conversation, params: CheckParams) -> CheckResult:
            return CheckResult(result="pass")

    register("local_check_for_tests", Local())
    crit = CodeCriterion(id="local", version=1, check="local_check_for_tests", params=CheckParams())
    [v] = run_judges([crit], [chest_pain()]).verdicts
    assert v.result == "error" and v.error_reason is not None
    assert v.error_reason.startswith("check_failed: cannot send the check to its worker process")
    assert "define it at the top level of an importable module" in v.error_reason

