"""Criteria files: the team's criteria as data (see docs/criteria.md).

Every problem in a file is reported at once, each naming the file, the
criterion id and the key, so a domain expert can fix a file in one pass.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ._checks import CHECKS, AppliesIf, CheckParams
from ._errors import CriteriaError

_ID = r"^[a-z0-9]+(?:-[a-z0-9]+)*$"
_DURATION = re.compile(r"(\d+(?:\.\d*)?)(ms|s|m|h)?")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}

DEFAULT_CHECK_TIMEOUT = 5.0
"""Seconds a code check may run when its criterion does not say (``timeout:``)."""


def _seconds(value: Any) -> float:
    """``5s``, ``500ms``, ``1m``, ``1h`` or a number of seconds; above zero."""
    text = str(value).strip() if isinstance(value, (str, int, float)) and not isinstance(value, bool) else ""
    found = _DURATION.fullmatch(text)
    seconds = float(found.group(1)) * _UNIT[found.group(2)] if found else 0.0
    if seconds <= 0:
        raise ValueError(f"{value!r} is not a duration like 5s or 500ms (above zero)")
    return seconds


class _Criterion(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(pattern=_ID)
    """Stable, kebab-case."""
    version: int = Field(ge=1)
    """Bumped when the meaning changes; part of the cache key."""
    severity: Literal["high", "medium", "low"] = "medium"
    group: str | None = None
    """For per-group reporting."""
    live: bool = False
    """Also judged on open conversations, turn by turn (by the daemon; offline it is data only)."""


class LLMCriterion(_Criterion):
    """A criterion an LLM judge decides from a prompt written by the team."""

    kind: Literal["llm"] = "llm"
    prompt: str = Field(min_length=1)
    """The criterion in the team's words; ``{transcript}`` places the transcript."""


class CodeCriterion(_Criterion):
    """A criterion decided in code by a registered check."""

    kind: Literal["code"] = "code"
    check: str
    """The check's name in ``CHECKS``."""
    params: CheckParams
    """The check's parameters: the criterion's other keys, validated by the check."""
    applies_if: AppliesIf | None = None
    """When it does not hold, the verdict is ``not_applicable``."""
    timeout: float = DEFAULT_CHECK_TIMEOUT
    """Seconds the check (its ``applies_if`` included) may run; past them it records ``error``.

    Written ``5s``, ``500ms``, ``1m`` or as a number of seconds.
    """

    @field_validator("timeout", mode="before")
    @classmethod
    def _timeout(cls, v: Any) -> float:
        return _seconds(v)


Criterion = LLMCriterion | CodeCriterion

_CODE_KEYS = {"id", "version", "kind", "severity", "group", "live", "check", "applies_if", "timeout"}
_LLM_KEYS = set(LLMCriterion.model_fields)


def _unknown(key: str, known: Collection[str]) -> str:
    """``unknown key``, and the known key it is likely a typo of: ``unknown key (did you mean check?)``."""
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.7)
    return f"unknown key (did you mean {close[0]}?)" if close else "unknown key"


def _typos(raw: Mapping[str, Any], known: Collection[str]) -> list[tuple[str, str]]:
    """Keys of ``raw`` that look like a known key it lacks (``chek`` where ``check`` is missing), each named:
    without it only the missing key would be."""
    absent = [k for k in known if k not in raw]
    return [(k, _unknown(k, absent)) for k in raw
            if k not in known and difflib.get_close_matches(k, absent, n=1, cutoff=0.7)]


def _loc(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc if not str(p).startswith("function-"))


def _problems(exc: ValidationError, known: Collection[str] = ()) -> list[tuple[str, str]]:
    """(key, message) of each error; an unknown top-level key with the ``known`` key it may be a typo of."""
    out = []
    for e in exc.errors():
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = _unknown(str(e["loc"][0]), known) if len(e["loc"]) == 1 else "unknown key"
        if e["type"] == "missing":
            msg = "missing"
        out.append((_loc(e["loc"]), msg))
    return out


def _parse_one(raw: dict[str, Any], base: Path) -> tuple[Criterion | None, list[tuple[str, str]]]:
    """Validate one criterion mapping; returns it, or the (key, message) problems."""
    kind = raw.get("kind")
    try:
        if kind == "llm":
            return LLMCriterion.model_validate(raw), []
        if kind != "code":
            return None, [*_typos(raw, _CODE_KEYS | _LLM_KEYS),
                          ("kind", "missing" if kind is None else f"{kind!r} is not llm or code")]
    except ValidationError as exc:
        return None, _problems(exc, _LLM_KEYS)
    common = {k: v for k, v in raw.items() if k in _CODE_KEYS}
    rest = {k: v for k, v in raw.items() if k not in _CODE_KEYS}
    problems: list[tuple[str, str]] = []
    check_name = raw.get("check")
    check = CHECKS.get(check_name) if isinstance(check_name, str) else None
    params: CheckParams | None = None
    if check_name is None:  # the other keys are the check's parameters: only a likely typo can be told apart
        problems += [*_typos(rest, _CODE_KEYS), ("check", "missing")]
    elif check is None:
        problems.append(("check", f"unknown check {check_name!r} (known: {', '.join(sorted(CHECKS))})"))
    else:
        try:
            params = check.Params.model_validate(rest, context={"base": base})
        except ValidationError as exc:
            problems += _problems(exc, _CODE_KEYS | set(check.Params.model_fields))
    if check_name == "ended_by" and raw.get("live") is True:
        problems.append(("live", "an ended_by check has nothing to decide while the conversation is open"))
    try:
        crit = CodeCriterion.model_validate({**common, "params": params or CheckParams()})
    except ValidationError as exc:
        reported = {k for k, _ in problems}  # ``check: missing`` once, not again from the model
        problems += [(k, m) for k, m in _problems(exc) if k != "params" and k not in reported]
        crit = None
    return (crit if not problems else None), problems


def _load_file(path: Path) -> list[Criterion]:
    file = str(path)
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CriteriaError(file, [(None, None, f"cannot read: {exc.strerror}")]) from None
    except yaml.YAMLError as exc:
        raise CriteriaError(file, [(None, None, "not valid YAML: " + str(exc).replace("\n", " "))]) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("criteria"), list):
        raise CriteriaError(file, [(None, "criteria", "the file must be a mapping with a 'criteria' list")])
    extra = sorted(set(doc) - {"criteria"})
    problems: list[tuple[str | None, str | None, str]] = [(None, k, "unknown key") for k in extra]
    out: list[Criterion] = []
    seen: set[str] = set()
    for i, raw in enumerate(doc["criteria"]):
        if not isinstance(raw, dict):
            problems.append((None, f"criteria[{i}]", "expected a mapping"))
            continue
        cid = raw.get("id")
        name = str(cid) if cid is not None else None
        crit, found = _parse_one(raw, path.resolve().parent)
        if name is None:
            problems += [(None, f"criteria[{i}].{k}", m) for k, m in found]
        else:
            problems += [(name, k, m) for k, m in found]
        if name is not None and name in seen:
            problems.append((name, "id", "duplicate id"))
        if name is not None:
            seen.add(name)
        if crit is not None:
            out.append(crit)
    if problems:
        raise CriteriaError(file, problems)
    return out


def load_criteria(paths: str | Path | Iterable[str | Path]) -> list[Criterion]:
    """Load and validate criteria files.

    Args:
        paths: one file or several; ids must be unique across all of them.

    Returns:
        The criteria in file order.

    Raises:
        CriteriaError: naming the file, the criterion id and the key of every
            problem (unknown check, missing prompt, duplicate id, bad regex, a
            ``python`` check whose function cannot be imported, ...).
    """
    files = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    out: list[Criterion] = []
    where: dict[str, Path] = {}
    for path in files:
        for crit in _load_file(path):
            if crit.id in where:
                raise CriteriaError(str(path), [(crit.id, "id", f"duplicate id (also in {where[crit.id]})")])
            where[crit.id] = path
            out.append(crit)
    return out
