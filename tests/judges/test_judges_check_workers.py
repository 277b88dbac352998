"""The code checks' worker processes: how many run at once, that an idle one does not stay for good, and which
checks need none."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pydantic
import pytest

from collector.config import Config
from judges import (
    CheckParams,
    CheckResult,
    CodeCheck,
    CodeCriterion,
    Conversation,
    Criterion,
    load_criteria,
    run_judges,
    set_check_workers,
)

from ..support.daemon import wait_until
from .conftest import chest_pain
from .test_judges_check_limits import register  # noqa: F401 - register is a fixture

CHECKS_PY = """
import os
from pathlib import Path

def marked(conversation):
    with open(conversation.attributes["mark"], "a") as f:  # which worker ran it
        f.write(f"{os.getpid()}\\n")
    return {"result": "pass"}
"""

CRITERIA = """
criteria:
  - id: marked
    version: 1
    kind: code
    check: python
    function: worker_checks_for_tests:marked
"""


@pytest.fixture
def marked(tmp_path: Path) -> Criterion:
    (tmp_path / "worker_checks_for_tests.py").write_text(CHECKS_PY, encoding="utf-8")
    (tmp_path / "criteria.yaml").write_text(CRITERIA, encoding="utf-8")
    return load_criteria(tmp_path / "criteria.yaml")[0]


@pytest.fixture(autouse=True)
def default_pool() -> Iterator[None]:
    yield
    set_check_workers(None)  # the next test starts the usual pool


def marking(tmp_path: Path, *names: str) -> list[Conversation]:
    return [chest_pain(n).model_copy(update={"attributes": {"mark": str(tmp_path / "pids")}}) for n in names]


def pids(tmp_path: Path) -> list[int]:
    return [int(line) for line in (tmp_path / "pids").read_text().split()]


def test_an_idle_worker_is_stopped_and_the_next_check_starts_another(marked: Criterion, tmp_path: Path) -> None:
    set_check_workers(1, idle_limit=0.2)
    run = run_judges([marked], marking(tmp_path, "a"))
    assert [v.result for v in run.verdicts] == ["pass"]
    [first] = pids(tmp_path)
    wait_until(lambda: not Path(f"/proc/{first}").exists(), f"idle worker {first} to be stopped")
    run = run_judges([marked], marking(tmp_path, "b"))
    assert [v.result for v in run.verdicts] == ["pass"]
    assert pids(tmp_path)[1] != first


def test_one_worker_runs_the_checks_one_after_the_other(marked: Criterion, tmp_path: Path) -> None:
    set_check_workers(1)
    run = run_judges([marked], marking(tmp_path, "a", "b", "c", "d"), concurrency=4)
    assert [v.result for v in run.verdicts] == ["pass"] * 4
    assert len(set(pids(tmp_path))) == 1, "one worker, kept between checks"


def test_the_number_of_workers_is_checked() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        set_check_workers(0)
    with pytest.raises(ValueError, match="above 0"):
        set_check_workers(1, idle_limit=0)
    with pytest.raises(pydantic.ValidationError, match="check_workers"):
        Config.model_validate({"judges": {"check_workers": 0}})
    assert Config.model_validate({}).judges.check_workers == 1


BOUNDED = """
criteria:
  - {id: escalated, version: 1, kind: code, check: tool_called, name: set_triage_level}
  - {id: ended, version: 1, kind: code, check: ended_by, one_of: [goal_reached]}
  - {id: short, version: 1, kind: code, check: max_user_turns, max: 1, applies_if: {tool_called: set_triage_level}}
"""


def children() -> set[int]:
    return {int(c) for task in Path(f"/proc/{os.getpid()}/task").glob("*/children") for c in task.read_text().split()}


def test_checks_that_only_walk_the_messages_start_no_worker(tmp_path: Path) -> None:
    set_check_workers(1, idle_limit=600)  # a worker started would still be there at the end
    (tmp_path / "criteria.yaml").write_text(BOUNDED, encoding="utf-8")
    before = children()
    run = run_judges(load_criteria(tmp_path / "criteria.yaml"), [chest_pain("a"), chest_pain("b", escalated=False)])
    assert [(v.conversation_id, v.criterion_id, v.result) for v in run.verdicts] == [
        ("a", "escalated", "pass"), ("a", "ended", "pass"), ("a", "short", "fail"),
        ("b", "escalated", "fail"), ("b", "ended", "pass"), ("b", "short", "not_applicable")]
    assert not children() - before, "no worker process was started"

    # The same check with a pattern in its applies_if goes to a worker, which stays idle for the next check.
    (tmp_path / "criteria.yaml").write_text(BOUNDED.replace("{tool_called: set_triage_level}",
                                                            '{user_matches: "arm"}'), encoding="utf-8")
    run = run_judges(load_criteria(tmp_path / "criteria.yaml")[2:], [chest_pain("a")])
    assert [v.result for v in run.verdicts] == ["fail"]
    assert len(children() - before) == 1, "one worker, for the pattern"


class Exploding:
    """An outside check that says it is bounded: it runs in the caller's process, and what it raises is its error."""

    bounded = True
    Params = CheckParams

    def run(self, conversation: Conversation, params: CheckParams) -> CheckResult:
        raise ValueError(f"no luck in {os.getpid()}")


def test_a_bounded_check_that_raises_records_error_in_the_callers_process(
        register: Callable[[str, CodeCheck], None]) -> None:  # noqa: F811 - the fixture
    register("exploding_for_tests", Exploding())
    crit = CodeCriterion(id="boom", version=1, check="exploding_for_tests", params=CheckParams())
    [v] = run_judges([crit], [chest_pain()]).verdicts
    assert (v.result, v.error_reason) == ("error", f"check_failed: ValueError: no luck in {os.getpid()}")
