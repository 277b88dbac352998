"""The scenarios a simulation runs: scenario YAML files (``docs/scenario.md``) and case JSONL lines, given as
files or folders.

A folder is read whole, its subfolders too: ``*.yaml`` / ``*.yml`` files and
``*.jsonl`` case files, in name order. ``scenarios export`` writes each scenario
twice into its folder (``<id>.yaml`` and a line of ``cases.jsonl``): the same id
in a YAML file and in a case line is one scenario, the YAML's (it has
``expected`` and ``source``). The same id in two YAML files, or two case lines,
is an error naming both places.

Lenient where the format allows it: ``facts`` may be prose or a mapping whose
values are any scalar (``smoker: yes`` reads as ``"yes"``); ids need not start
with ``prod-`` (the team's own suite). Strict where a typo would silently change
a run: unknown keys, a missing ``persona`` or ``goal``, ``expected.criteria``
that is not a list of ids.

Errors: ``UserError`` naming the file (and the line of a case file) and the key.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from judges import split_json_lines

from collector.errors import UserError

SUFFIXES = (".yaml", ".yml", ".jsonl")


class SuiteScenario(BaseModel):
    """One scenario to simulate."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, max_length=200)
    persona: str = Field(min_length=1)
    goal: str = Field(min_length=1)
    facts: dict[str, str] | str = {}
    """What the simulated user knows and reveals only when asked: a mapping, or prose."""
    opening: str | None = None
    """The first message, verbatim."""
    max_turns: int | None = Field(None, ge=1, le=200)
    expected: dict[str, Any] = {}
    """``criteria`` (ids the scenario must pass; absent: every criterion) and deterministic expectations."""
    source: dict[str, Any] | None = None
    """Where a scenario written from a production failure came from (kept as read, for ``scenarios verify``)."""
    path: str = ""
    """The file it was read from (a case line: ``file:line``)."""

    @field_validator("facts", mode="before")
    @classmethod
    def _scalar_facts(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {str(k): _scalar(v, f"facts.{k}") for k, v in value.items()}
        return value

    @field_validator("expected")
    @classmethod
    def _criteria_ids(cls, value: dict[str, Any]) -> dict[str, Any]:
        criteria = value.get("criteria")
        if criteria is not None and not (isinstance(criteria, list) and criteria
                                         and all(isinstance(c, str) and c for c in criteria)):
            raise ValueError("criteria: a list of criterion ids")
        return value

    @property
    def criteria(self) -> list[str] | None:
        """The criteria this scenario must pass; None: all of them."""
        criteria = self.expected.get("criteria")
        return list(criteria) if criteria else None

    def facts_text(self) -> str:
        """The facts as the simulated user is told them: one ``- key: value`` line each, or the prose."""
        if isinstance(self.facts, str):
            return self.facts.strip() or "(none)"
        return "\n".join(f"- {k}: {v}" for k, v in self.facts.items()) or "(none)"


def _scalar(value: Any, where: str) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (str, int, float)):
        return str(value)
    raise ValueError(f"{where}: a fact is one text, not a {type(value).__name__}")


def _problem(exc: ValidationError) -> str:
    e = exc.errors()[0]
    where = ".".join(str(p) for p in e["loc"]) or "scenario"
    what = "unknown key" if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
    return f"{where}: {what}"


def _files(paths: Sequence[Path]) -> Iterator[Path]:
    for path in paths:
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
            if not found:
                raise UserError(f"{path}: no scenario files (*.yaml, *.yml, *.jsonl) in this folder")
            yield from found
        elif path.is_file():
            if path.suffix not in SUFFIXES:
                raise UserError(f"{path}: not a scenario file (*.yaml, *.yml or a *.jsonl case file)")
            yield path
        else:
            raise UserError(f"{path}: no such file or folder")


def _yaml(path: Path) -> SuiteScenario:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot be read ({exc})") from None
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: not YAML ({' '.join(str(exc).split())})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: not a scenario (a mapping with id, persona, goal, facts)")
    try:
        return SuiteScenario.model_validate({**data, "path": str(path)})
    except ValidationError as exc:
        raise UserError(f"{path}: {_problem(exc)}") from None


def _cases(path: Path) -> Iterator[SuiteScenario]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot be read ({exc})") from None
    for n, line in enumerate(split_json_lines(text), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            case = json.loads(line)
        except ValueError as exc:
            raise UserError(f"{where}: not JSON ({exc})") from None
        persona = case.get("input", {}).get("persona") if isinstance(case, dict) and \
            isinstance(case.get("input"), dict) else None
        if not isinstance(persona, dict):
            raise UserError(f"{where}: input.persona: missing; a case line is "
                            '{"id": ..., "input": {"persona": {"description": ..., "goal": ...}}}')
        fields = {"persona" if k == "description" else k: v for k, v in persona.items()}
        try:
            yield SuiteScenario.model_validate({"id": case.get("id"), **fields, "expected": case.get("expected") or {},
                                                "path": where})
        except ValidationError as exc:
            raise UserError(f"{where}: {_problem(exc).replace('persona:', 'input.persona.description:')}") from None


def load_suite(paths: Iterable[Path]) -> list[SuiteScenario]:
    """Every scenario in ``paths`` (files or folders), in the order found.

    Raises:
        UserError: a path, a file or a key is wrong; an id is given twice.
    """
    by_id: dict[str, SuiteScenario] = {}
    for path in _files(list(paths)):
        found = _cases(path) if path.suffix == ".jsonl" else iter([_yaml(path)])
        for s in found:
            before = by_id.get(s.id)
            from_case = s.path.rsplit(":", 1)[0].endswith(".jsonl")
            if before is not None:
                before_case = before.path.rsplit(":", 1)[0].endswith(".jsonl")
                if from_case and not before_case:
                    continue  # the YAML of the same scenario, read first
                if not (before_case and not from_case):
                    raise UserError(f"{s.path}: scenario {s.id!r} is also in {before.path}")
            by_id[s.id] = s
    if not by_id:
        raise UserError("no scenarios given")
    return list(by_id.values())
