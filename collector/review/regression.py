"""Judge regression sets: the blind-labelled transcripts frozen in a file, judged again after a change.

``tracejudge calibrate --freeze NAME`` writes ``<duckdb file>.calibration/NAME.jsonl``
(``Config.calibration_dir``), one line per labelled (conversation, criterion) whose labels do not tie::

    {"schema": "conversation/v1", "id": "c-1042", ..., "messages": [...],   <- the record, as stored
     "tracejudge_calibration": {
        "criterion_id": "no-carrier-promises", "criterion_version": 1,
        "label": "fail",                                   <- the majority of the people's labels
        "labels": [{"reviewer": "Ana", "label": "fail", "note": "..."}],
        "judge": {"result": "pass", "model": "...", "provider": "..."}   <- the verdict when frozen, or null
     }}

The key sits beside the record's fields, not under ``attributes``: conversation/v1 readers (and
``judges.Conversation``) drop unknown keys, so the label never reaches a judge on a rerun.

``--rerun NAME`` judges every line again on its criterion with the criteria and provider of now, and
``judges.compare_reruns`` says per criterion what was fixed and what broke. It reads only the file: no
daemon, no DuckDB.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from judges import Conversation, Criterion, Provider, compare_reruns, json_line, run_judges, split_json_lines

from ..errors import UserError

KEY = "tracejudge_calibration"
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


def set_path(folder: Path, name: str) -> Path:
    """``folder/NAME.jsonl``.

    Raises:
        UserError: NAME is not letters, digits, ``-``, ``_`` and ``.``, or starts with ``.``.
    """
    if not _NAME.fullmatch(name):
        raise UserError(f"set name {name[:60]!r}: use letters, digits, '-', '_' and '.' (not first), "
                        "at most 128 characters")
    return folder / f"{name}.jsonl"


def write_set(path: Path, items: Sequence[dict[str, Any]], *, force: bool) -> None:
    """Write the frozen items (``calibration.frozen_items``), all or nothing.

    Raises:
        UserError: the set exists and ``force`` is not given.
    """
    if path.exists() and not force:
        raise UserError(f"{path} exists: give another name, or --force to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for item in items:
            f.write(json_line(item))
    os.replace(tmp, path)  # a reader never sees half a set


class Frozen(NamedTuple):
    """One line of a set."""

    conversation: Conversation
    criterion_id: str
    criterion_version: int | None
    label: str
    judge: str | None
    """The verdict's result when frozen; None when there was none."""


def read_set(path: Path) -> list[Frozen]:
    """The lines of a set.

    Raises:
        UserError: no such file, or a line that is not a frozen item (naming the line).
    """
    if not path.is_file():
        have = sorted(p.stem for p in path.parent.glob("*.jsonl")) if path.parent.is_dir() else []
        raise UserError(f"no regression set {path.stem!r} in {path.parent} (there: {', '.join(have) or 'none'}); "
                        "make one with `tracejudge calibrate --freeze NAME`")
    out: list[Frozen] = []
    seen: set[tuple[str, str]] = set()
    for n, line in enumerate(split_json_lines(path.read_text(encoding="utf-8")), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            meta = record[KEY]
            judge = meta.get("judge") or {}
            item = Frozen(Conversation.model_validate(record), str(meta["criterion_id"]),
                          meta.get("criterion_version"), str(meta["label"]), judge.get("result"))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UserError(f"{path}:{n}: not a frozen calibration item ({type(exc).__name__}: "
                            f"{str(exc)[:200]})") from None
        key = (item.conversation.id, item.criterion_id)
        if key in seen:
            raise UserError(f"{path}:{n}: conversation {key[0]!r} is in the set twice for criterion {key[1]!r}")
        seen.add(key)
        out.append(item)
    return out


def rerun(frozen: Sequence[Frozen], criteria: Sequence[Criterion], provider: Provider | None, *,
          concurrency: int, timeout: float) -> dict[str, Any]:
    """Judge each frozen conversation again on its criterion and compare with the frozen verdicts.

    A criterion the set has and ``criteria`` no longer has is not judged: its items are all missing
    (``current_version`` None). Not-run verdicts (an LLM criterion with no provider) are missing too;
    judge errors are judged results that never agree.

    Returns:
        ``{"criteria": [{"criterion_id", "frozen_versions", "current_version", "not_run": {reason: n},
        "errors": {reason: n}, **RerunDiff JSON}], "counts": {"fixed", "broken", "same", "missing"}}``,
        sorted by criterion id.
    """
    current = {c.id: c for c in criteria}
    by_criterion: dict[str, list[Frozen]] = defaultdict(list)
    for f in frozen:
        by_criterion[f.criterion_id].append(f)
    entries, total = [], Counter[str]()
    for cid in sorted(by_criterion):
        items = by_criterion[cid]
        after: dict[str, str | None] = {}
        errors: Counter[str] = Counter()
        not_run: Counter[str] = Counter()
        crit = current.get(cid)
        if crit is not None:
            run = run_judges([crit], [f.conversation for f in items], provider, concurrency=concurrency,
                             timeout=timeout)
            for v in run.verdicts:
                after[v.conversation_id] = v.result
                if v.result == "error":
                    errors[v.error_reason or ""] += 1
            not_run.update(r.reason for r in run.not_run)
        diff = compare_reruns({f.conversation.id: f.label for f in items},
                              {f.conversation.id: f.judge for f in items}, after).to_json()
        total.update(diff["counts"])
        entries.append({"criterion_id": cid,
                        "frozen_versions": sorted({f.criterion_version for f in items if f.criterion_version}),
                        "current_version": crit.version if crit else None, "not_run": dict(not_run),
                        "errors": dict(errors), **diff})
    return {"criteria": entries, "counts": {k: total[k] for k in ("fixed", "broken", "same", "missing")}}
