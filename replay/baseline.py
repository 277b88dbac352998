"""A simulate run beside an earlier one (``tracejudge simulate --baseline DIR``): what got fixed, what broke.

Scenarios are matched by id, and each run's own ``failing`` (a replicate failed
a criterion the scenario expects) gives the scenario's ``baseline.status``:

    fixed          failing in the baseline, not now
    broke          passing in the baseline, failing now
    still_failing  failing in both
    passing        passing in both
    new            not in the baseline
    not_evaluated  nothing judged now (the simulated user's provider failed on every replicate): never "fixed"

``baseline.criteria`` holds every criterion the scenario expects in either run:
``fail_before`` of ``n_before`` replicates and ``fail_now`` of ``n_now``, where n
counts the replicates the criterion judged pass or fail. A not_applicable or
error verdict says nothing about whether the bot fails, so it stays out of n
(its count stays in the scenario's own ``criteria``). A criterion the scenario
did not expect in a run (added or removed between the runs, or the scenario is
new) has null counts on that side. ``p_value`` is Fisher's exact test,
two-sided, on fails and passes before against now; null unless both sides
judged the criterion at least once. With 5 replicates only a large change is
told from chance: 5/5 -> 0/5 has p = 0.008, 1/5 -> 0/5 has p = 1.

``summary`` gains the count of each status and ``baseline_only``, the ids of
the baseline's scenarios that are not in this run; the report gains
``baseline``, the ``run`` and ``out_dir`` the baseline report gives itself.
``change_lines`` says the same for a person, a line per scenario that is not
simply passing.

Only ``load_report`` reads anything; the rest is pure. Its errors are
``collector.errors.UserError``, one line naming the file.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from judges import fisher_exact

from collector.errors import UserError

REPORT_FILE = "report.json"
"""The file of a run folder that ``load_report`` reads."""

STATUSES = ("fixed", "broke", "still_failing", "passing", "new", "not_evaluated")
"""The words of ``baseline.status``; each is also a count in ``summary``."""

ALPHA = 0.05
"""A change whose p-value is at least this is said to be one that cannot be told from chance."""

_STATUS = {(True, False): "fixed", (False, True): "broke", (True, True): "still_failing", (False, False): "passing"}
"""By (failing before, failing now)."""

_LINE_ORDER = ("broke", "still_failing", "not_evaluated", "fixed", "new", "baseline_only")
"""``change_lines`` puts what needs attention first."""


class _Counts(BaseModel):
    pass_: int = Field(alias="pass", ge=0)
    fail: int = Field(ge=0)


class _Scenario(BaseModel):
    id: str
    failing: bool
    criteria: dict[str, _Counts]


class _Report(BaseModel):
    """What ``compare`` reads of a baseline report; any other key may be there."""

    scenarios: list[_Scenario]


def load_report(run_dir: Path) -> dict[str, Any]:
    """The ``report.json`` of a run folder, checked for what ``compare`` reads of it.

    Raises:
        UserError: the folder or its report.json is missing or unreadable, is not
            JSON, or is not a simulate report (the first problem's key path named),
            or names a scenario twice.
    """
    path = run_dir / REPORT_FILE
    if not run_dir.exists():
        raise UserError(f"{run_dir}: no such folder; a baseline is the folder of an earlier simulate run")
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: not a folder; give the folder of an earlier simulate run, which holds {REPORT_FILE}")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path}: no such file; {run_dir} is not the folder of a simulate run") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        report: dict[str, Any] = json.loads(data)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError alike
        raise UserError(f"{path}: not JSON: {exc}") from None
    try:
        checked = _Report.model_validate(report)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the top level"
        # pydantic would name our private model classes here
        what = "Input should be a JSON object" if first["type"] == "model_type" else first["msg"]
        raise UserError(f"{path}: not a simulate report: {where}: {what}") from None
    twice = sorted(sid for sid, n in Counter(s.id for s in checked.scenarios).items() if n > 1)
    if twice:
        raise UserError(f"{path}: not a simulate report: scenario ids given twice: {', '.join(twice)}")
    return report


def compare(current: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    """``current`` with each scenario's ``baseline`` block and the summary counts filled in.

    Args:
        current: this run's report.
        baseline: the earlier run's report (``load_report``).

    Returns:
        A new report; neither argument is changed.
    """
    report = copy.deepcopy(current)
    before = {s["id"]: s for s in baseline["scenarios"]}
    tally: Counter[str] = Counter()
    for scenario in report["scenarios"]:
        block = _block(before.get(scenario["id"]), scenario)
        scenario["baseline"] = block
        tally[block["status"]] += 1
    now = {s["id"] for s in report["scenarios"]}
    report["summary"].update({status: tally[status] for status in STATUSES})
    report["summary"]["baseline_only"] = [sid for sid in before if sid not in now]
    report["baseline"] = {"run": baseline.get("run"), "out_dir": baseline.get("out_dir")}
    return report


def _block(before: dict[str, Any] | None, now: dict[str, Any]) -> dict[str, Any]:
    old = before["criteria"] if before else {}
    names = list(now["criteria"]) + [name for name in old if name not in now["criteria"]]
    return {
        "status": ("not_evaluated" if now.get("judged") == 0 else
                   _STATUS[(before["failing"], now["failing"])] if before else "new"),
        "criteria": {name: _criterion(old.get(name), now["criteria"].get(name)) for name in names},
    }


def _criterion(before: dict[str, int] | None, now: dict[str, int] | None) -> dict[str, Any]:
    n_before = before["fail"] + before["pass"] if before else None
    n_now = now["fail"] + now["pass"] if now else None
    p_value = None
    if before and now and n_before and n_now:  # among judged replicates, not failing is passing
        p_value = fisher_exact(before["fail"], before["pass"], now["fail"], now["pass"])
    return {
        "fail_before": before["fail"] if before else None, "n_before": n_before, "p_value": p_value,
        "fail_now": now["fail"] if now else None, "n_now": n_now,
    }


def change_lines(report: dict[str, Any]) -> list[str]:
    """A line per scenario that is not simply passing, for a person: broke first, then still failing,
    fixed, new and the baseline's scenarios not in this run. Each names the criteria that failed in
    either run with both counts and the p-value of the change, e.g.
    ``prod-x-1a2b3c  fixed  no-carrier-promises 5/5 -> 0/5 (p = 0.008)``.

    Args:
        report: a report from ``compare``; one not compared with a baseline has no lines.

    Returns:
        The lines, their columns aligned, without line breaks.
    """
    if "baseline" not in report:
        return []
    rows = [
        (s["id"], s["baseline"]["status"], _describe(s["baseline"]))
        for s in report["scenarios"] if s["baseline"]["status"] != "passing"
    ]
    rows += [(sid, "baseline_only", "not in this run") for sid in report["summary"]["baseline_only"]]
    rows.sort(key=lambda row: _LINE_ORDER.index(row[1]))
    id_width = max((len(row[0]) for row in rows), default=0)
    status_width = max((len(row[1]) for row in rows), default=0)
    return [f"{sid:<{id_width}}  {status:<{status_width}}  {text}" for sid, status, text in rows]


def _describe(block: dict[str, Any]) -> str:
    parts = [
        _criterion_text(name, c, block["status"] == "new")
        for name, c in block["criteria"].items() if (c["fail_before"] or 0) + (c["fail_now"] or 0) > 0
    ]
    return "; ".join(parts) or "no failures"


def _criterion_text(name: str, c: dict[str, Any], new_scenario: bool) -> str:
    fb, nb, fn, nn = c["fail_before"], c["n_before"], c["fail_now"], c["n_now"]
    if nb is None:
        return f"{name} {fn}/{nn}" + ("" if new_scenario else " (not expected before)")
    if nn is None:
        return f"{name} {fb}/{nb} -> not expected now"
    text = f"{name} {fb}/{nb} -> {fn}/{nn}"
    if not nb or not nn:
        return text + f" (no pass or fail {'before' if not nb else 'now'})"
    if fb * nn == fn * nb:
        return text  # the same rate: no change to test
    p = c["p_value"]
    shown = "< 0.001" if p < 0.001 else f"= {p:.3f}" if p < 0.1 else f"= {p:.2f}"
    if p < ALPHA:
        return text + f" (p {shown})"
    replicates = f"{nb}" if nb == nn else f"{nb} and {nn}"
    noun = "replicate" if nb == nn == 1 else "replicates"
    return text + f" (p {shown}: cannot be told from chance with {replicates} {noun})"
