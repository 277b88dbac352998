"""``simulate --baseline``: each scenario's status against the earlier run, the counts of both runs and
the significance of each change, and a baseline folder that is not one is a clear error."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from collector.errors import UserError
from replay.baseline import change_lines, compare, load_report

Counts = tuple[int, int] | tuple[int, int, int, int]
"""(fail, pass) or (fail, pass, not_applicable, error) of a criterion over a scenario's replicates."""


def scenario(sid: str, **criteria: Counts) -> dict[str, Any]:
    full = {name: (tuple(c) + (0, 0))[:4] for name, c in criteria.items()}
    return {
        "id": sid,
        "replicates": max(sum(c) for c in full.values()),
        "ended_by": {"goal_reached": 5, "user_done": 0, "turn_limit": 0, "handover": 0, "unanswered": 0, "error": 0},
        "criteria": {name: {"pass": p, "fail": f, "not_applicable": na, "error": e}
                     for name, (f, p, na, e) in full.items()},
        "failing": any(c[0] for c in full.values()),
    }


def report(run: str, *scenarios: dict[str, Any]) -> dict[str, Any]:
    return {
        "run": run, "out_dir": f"runs/{run}", "simulated_user": {"model": "scripted"},
        "scenarios": list(scenarios),
        "criteria": {},
        "summary": {"scenarios": len(scenarios), "failing": sum(s["failing"] for s in scenarios)},
        "tokens": {"input": 0, "output": 0},
    }


def written(folder: Path, content: dict[str, Any] | str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    text = content if isinstance(content, str) else json.dumps(content)
    (folder / "report.json").write_text(text, encoding="utf-8")
    return folder


BEFORE = report(
    "r1",
    scenario("prod-fixed", promises=(5, 0)),
    scenario("prod-broke", promises=(0, 5)),
    scenario("prod-still", promises=(3, 2)),
    scenario("prod-calm", promises=(0, 5)),
    scenario("prod-gone", promises=(2, 3)),
)
NOW = report(
    "r2",
    scenario("prod-fixed", promises=(0, 5)),
    scenario("prod-broke", promises=(2, 3)),
    scenario("prod-still", promises=(5, 0)),
    scenario("prod-calm", promises=(0, 5)),
    scenario("prod-new", promises=(1, 4)),
)


def test_every_status_and_the_summary(tmp_path: Path) -> None:
    baseline = load_report(written(tmp_path / "r1", BEFORE))
    now = copy.deepcopy(NOW)
    out = compare(now, baseline)

    assert {s["id"]: s["baseline"]["status"] for s in out["scenarios"]} == {
        "prod-fixed": "fixed", "prod-broke": "broke", "prod-still": "still_failing", "prod-calm": "passing",
        "prod-new": "new",
    }
    assert out["summary"] == {"scenarios": 5, "failing": 3, "fixed": 1, "broke": 1, "still_failing": 1,
                              "passing": 1, "new": 1, "not_evaluated": 0, "baseline_only": ["prod-gone"]}
    assert out["baseline"] == {"run": "r1", "out_dir": "runs/r1"}
    assert now == NOW and baseline == BEFORE  # a new report; the arguments stay as they were
    assert json.loads(json.dumps(out, allow_nan=False)) == out
    assert change_lines(out) == [
        "prod-broke  broke          promises 0/5 -> 2/5 (p = 0.44: cannot be told from chance with 5 replicates)",
        "prod-still  still_failing  promises 3/5 -> 5/5 (p = 0.44: cannot be told from chance with 5 replicates)",
        "prod-fixed  fixed          promises 5/5 -> 0/5 (p = 0.008)",
        "prod-new    new            promises 1/5",
        "prod-gone   baseline_only  not in this run",
    ]


def test_without_a_baseline_the_report_is_untouched_and_has_no_lines() -> None:
    assert change_lines(NOW) == []
    assert set(NOW["summary"]) == {"scenarios", "failing"}


def test_five_of_five_to_none_is_told_from_chance() -> None:
    out = compare(report("r2", scenario("prod-x-1a2b3c", **{"no-carrier-promises": (0, 5)})),
                  report("r1", scenario("prod-x-1a2b3c", **{"no-carrier-promises": (5, 0)})))
    change = out["scenarios"][0]["baseline"]
    assert change["status"] == "fixed"
    assert change["criteria"] == {"no-carrier-promises": {
        "fail_before": 5, "n_before": 5, "p_value": pytest.approx(2 / 252), "fail_now": 0, "n_now": 5}}
    assert change_lines(out) == ["prod-x-1a2b3c  fixed  no-carrier-promises 5/5 -> 0/5 (p = 0.008)"]


def test_one_of_five_to_none_cannot_be_told_from_chance() -> None:
    out = compare(report("r2", scenario("prod-y", promises=(0, 5))), report("r1", scenario("prod-y", promises=(1, 4))))
    change = out["scenarios"][0]["baseline"]
    assert change["status"] == "fixed"
    assert change["criteria"]["promises"]["p_value"] == 1.0
    assert change_lines(out) == [
        "prod-y  fixed  promises 1/5 -> 0/5 (p = 1.00: cannot be told from chance with 5 replicates)"]


def test_n_counts_only_the_replicates_judged_pass_or_fail() -> None:
    # 5 replicates each time; not_applicable and error verdicts are no outcome, so n is 3 before and 4 now
    out = compare(report("r2", scenario("s", triage=(0, 4, 1, 0))), report("r1", scenario("s", triage=(3, 0, 1, 1))))
    assert out["scenarios"][0]["baseline"]["criteria"]["triage"] == {
        "fail_before": 3, "n_before": 3, "p_value": pytest.approx(1 / 35), "fail_now": 0, "n_now": 4}
    assert change_lines(out) == ["s  fixed  triage 3/3 -> 0/4 (p = 0.029)"]


def test_a_change_with_unequal_n_says_both() -> None:
    out = compare(report("r2", scenario("s", triage=(0, 4, 1, 0))), report("r1", scenario("s", triage=(1, 2, 1, 1))))
    assert change_lines(out) == [
        "s  fixed  triage 1/3 -> 0/4 (p = 0.43: cannot be told from chance with 3 and 4 replicates)"]


def test_a_criterion_with_no_outcome_on_one_side_has_no_p_value() -> None:
    # every replicate errored now: the scenario is not failing, but nothing says the bot stopped failing
    out = compare(report("r2", scenario("s", triage=(0, 0, 0, 5))), report("r1", scenario("s", triage=(5, 0))))
    change = out["scenarios"][0]["baseline"]
    assert change["status"] == "fixed"
    assert change["criteria"]["triage"] == {"fail_before": 5, "n_before": 5, "p_value": None, "fail_now": 0, "n_now": 0}
    assert change_lines(out) == ["s  fixed  triage 5/5 -> 0/0 (no pass or fail now)"]


def test_the_same_rate_is_no_change_to_test() -> None:
    out = compare(report("r2", scenario("s", triage=(5, 0))), report("r1", scenario("s", triage=(5, 0))))
    assert out["scenarios"][0]["baseline"]["criteria"]["triage"]["p_value"] == 1.0
    assert change_lines(out) == ["s  still_failing  triage 5/5 -> 5/5"]


def test_criteria_added_and_removed_between_runs() -> None:
    before = report("r1", scenario("s", kept=(5, 0), dropped=(2, 3), quiet=(0, 5)))
    now = report("r2", scenario("s", kept=(0, 5), added=(1, 4), fresh=(0, 5)))
    change = compare(now, before)["scenarios"][0]["baseline"]
    assert change["status"] == "still_failing"
    assert change["criteria"] == {
        "kept": {"fail_before": 5, "n_before": 5, "p_value": pytest.approx(2 / 252), "fail_now": 0, "n_now": 5},
        "added": {"fail_before": None, "n_before": None, "p_value": None, "fail_now": 1, "n_now": 5},
        "fresh": {"fail_before": None, "n_before": None, "p_value": None, "fail_now": 0, "n_now": 5},
        "dropped": {"fail_before": 2, "n_before": 5, "p_value": None, "fail_now": None, "n_now": None},
        "quiet": {"fail_before": 0, "n_before": 5, "p_value": None, "fail_now": None, "n_now": None},
    }
    assert change_lines(compare(now, before)) == [
        "s  still_failing  kept 5/5 -> 0/5 (p = 0.008); added 1/5 (not expected before); dropped 2/5 -> not expected now"]


def test_a_new_scenario_lists_its_failures_or_none() -> None:
    out = compare(report("r2", scenario("a", promises=(2, 3), triage=(0, 5)), scenario("b", promises=(0, 5))),
                  report("r1"))
    assert out["scenarios"][0]["baseline"] == {"status": "new", "criteria": {
        "promises": {"fail_before": None, "n_before": None, "p_value": None, "fail_now": 2, "n_now": 5},
        "triage": {"fail_before": None, "n_before": None, "p_value": None, "fail_now": 0, "n_now": 5},
    }}
    assert change_lines(out) == ["a  new  promises 2/5", "b  new  no failures"]


def test_a_scenario_gone_from_this_run_is_listed_in_the_summary() -> None:
    out = compare(report("r2"), report("r1", scenario("a", promises=(0, 5)), scenario("b", promises=(1, 4))))
    assert out["summary"]["baseline_only"] == ["a", "b"]
    assert {k: out["summary"][k] for k in ("fixed", "broke", "still_failing", "passing", "new")} == dict.fromkeys(
        ("fixed", "broke", "still_failing", "passing", "new"), 0)
    assert change_lines(out) == ["a  baseline_only  not in this run", "b  baseline_only  not in this run"]


outcomes = st.tuples(st.integers(0, 5), st.integers(0, 5), st.integers(0, 2), st.integers(0, 2))
runs = st.dictionaries(st.sampled_from(["a", "b", "c", "d"]),
                       st.dictionaries(st.sampled_from(["x", "y"]), outcomes, min_size=1), max_size=4)


@given(runs, runs)
def test_every_scenario_is_counted_once_and_every_p_value_is_a_probability(
    before: dict[str, dict[str, Counts]], now: dict[str, dict[str, Counts]],
) -> None:
    out = compare(report("r2", *(scenario(sid, **c) for sid, c in now.items())),
                  report("r1", *(scenario(sid, **c) for sid, c in before.items())))
    summary = out["summary"]
    assert sum(summary[k] for k in ("fixed", "broke", "still_failing", "passing", "new")) == len(now)
    assert summary["baseline_only"] == [sid for sid in before if sid not in now]
    for s in out["scenarios"]:
        assert s["baseline"]["status"] in ("still_failing", "fixed", "broke", "passing", "new")
        assert set(s["baseline"]["criteria"]) == set(now[s["id"]]) | set(before.get(s["id"], {}))
        for c in s["baseline"]["criteria"].values():
            assert c["p_value"] is None or 0 < c["p_value"] <= 1
    lines = change_lines(out)
    assert len(lines) == len(now) - summary["passing"] + len(summary["baseline_only"])
    assert len({line.index(" ") for line in lines}) <= 1  # one column of ids, aligned


def test_one_replicate_is_singular() -> None:
    out = compare(report("r2", scenario("s", triage=(0, 1))), report("r1", scenario("s", triage=(1, 0))))
    assert change_lines(out) == ["s  fixed  triage 1/1 -> 0/1 (p = 1.00: cannot be told from chance with 1 replicate)"]


def test_a_tiny_p_value_is_shown_as_a_bound() -> None:
    out = compare(report("r2", scenario("s", triage=(0, 20))), report("r1", scenario("s", triage=(20, 0))))
    assert change_lines(out) == ["s  fixed  triage 20/20 -> 0/20 (p < 0.001)"]


def test_a_good_baseline_folder_loads_as_written(tmp_path: Path) -> None:
    assert load_report(written(tmp_path / "run", BEFORE)) == BEFORE


@pytest.mark.parametrize(("content", "message"), [
    (None, "no such file; .* is not the folder of a simulate run"),
    ("{", "not JSON: Expecting property name"),
    (b"\xff\xfe{}", "not JSON"),
    ([], "not a simulate report: the top level: Input should be a JSON object$"),
    ({"scenarios": [1]}, "not a simulate report: scenarios.0: Input should be a JSON object$"),
    ({"run": "r1"}, "not a simulate report: scenarios: Field required"),
    ({"scenarios": [{"id": "a", "criteria": {}}]}, "not a simulate report: scenarios.0.failing: Field required"),
    ({"scenarios": [{"id": "a", "failing": True, "criteria": {"c": {"pass": 1}}}]},
     "not a simulate report: scenarios.0.criteria.c.fail: Field required"),
    ({"scenarios": [{"id": "a", "failing": True, "criteria": {"c": {"pass": 1, "fail": -1}}}]},
     r"scenarios.0.criteria.c.fail: Input should be greater than or equal to 0"),
    ({"scenarios": [{"id": "a", "failing": False, "criteria": {}}] * 2}, "scenario ids given twice: a"),
])
def test_a_folder_that_is_no_run_is_one_clear_error(tmp_path: Path, content: Any, message: str) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    if isinstance(content, bytes):
        (folder / "report.json").write_bytes(content)
    elif content is not None:
        written(folder, content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(UserError, match=message) as caught:
        load_report(folder)
    assert str(caught.value).startswith(str(folder / "report.json") + ": ")
    assert "\n" not in str(caught.value)


def test_a_missing_folder_or_a_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such folder"):
        load_report(tmp_path / "nowhere")
    written(tmp_path / "run", BEFORE)
    with pytest.raises(UserError, match="not a folder; give the folder of an earlier simulate run, which holds report.json"):
        load_report(tmp_path / "run" / "report.json")


def test_a_scenario_with_nothing_judged_now_is_not_evaluated_never_fixed() -> None:
    before = {"run": "a", "out_dir": "a", "scenarios": [
        {"id": "s", "replicates": 5, "failing": True, "criteria": {"c": {"pass": 0, "fail": 5, "not_applicable": 0,
                                                                        "error": 0}}}], "summary": {}}
    now = {"run": "b", "out_dir": "b", "scenarios": [
        {"id": "s", "replicates": 5, "judged": 0, "failing": False,
         "criteria": {"c": {"pass": 0, "fail": 0, "not_applicable": 0, "error": 0}}}],
           "summary": {"scenarios": 1, "failing": 0}}
    report = compare(now, before)
    assert report["scenarios"][0]["baseline"]["status"] == "not_evaluated"
    assert report["summary"]["fixed"] == 0 and report["summary"]["not_evaluated"] == 1
