"""The code checks' worker processes: how many run at once, and that an idle one does not stay for good."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pydantic
import pytest

from collector.config import Config
from judges import Conversation, Criterion, load_criteria, run_judges, set_check_workers

from .conftest import chest_pain
from .test_judges_check_limits import until

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
    until(lambda: not Path(f"/proc/{first}").exists(), f"idle worker {first} to be stopped")
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
