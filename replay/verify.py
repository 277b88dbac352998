"""``tracejudge scenarios verify``: does a scenario written from a production failure reproduce it?

A scenario from ``scenarios export`` is a regression test only once it has been
shown to fail, against the bot as it is, the criterion a person confirmed. The
scenarios of ``scenarios.out_dir`` that carry a ``source.criterion`` and no
``source.reproduced`` yet are simulated (``replay.simulate``), and each gets,
in its YAML file::

    source:
      reproduced: {failed: 4, replicates: 5, criterion: chest-pain-red-flags,
                   at: 2026-12-07T10:00:00Z, bot: "shopbot:reply"}

``failed: 0``: it does not reproduce; the persona, goal or facts need editing
before it joins the suite, and it is never called a regression test.
"""

from __future__ import annotations

import datetime as dt
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from collector.errors import UserError

from .scenarios import dump_yaml
from .suite import SuiteScenario, load_suite


def unverified(out_dir: Path, since: dt.datetime | None = None) -> list[SuiteScenario]:
    """The scenarios in ``out_dir`` written from a production failure and not verified yet (confirmed since
    ``since``, when given)."""
    if not out_dir.is_dir():
        raise UserError(f"{out_dir}: no such folder (scenarios.out_dir): export scenarios first, "
                        "with tracejudge scenarios export")
    found = [p for p in sorted(out_dir.glob("*.y*ml"))]
    if not found:
        return []
    chosen = []
    for s in load_suite(found):
        source = s.source or {}
        if not source.get("criterion") or source.get("reproduced"):
            continue
        if since is not None and not _after(source.get("confirmed_at"), since):
            continue
        chosen.append(s)
    return chosen


def _after(at: Any, since: dt.datetime) -> bool:
    try:
        when = at if isinstance(at, dt.datetime) else dt.datetime.fromisoformat(str(at).replace("Z", "+00:00"))
    except ValueError:
        return True  # no readable time: verify it rather than skip it
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return when >= since


def reproduced(scenario: SuiteScenario, entry: dict[str, Any], bot: str, at: dt.datetime) -> dict[str, Any]:
    """``source.reproduced`` from the scenario's entry of a simulate report."""
    criterion = str((scenario.source or {}).get("criterion"))
    counts = entry["criteria"].get(criterion, {})
    return {"failed": int(counts.get("fail", 0)), "replicates": int(entry["replicates"]), "criterion": criterion,
            "at": at.strftime("%Y-%m-%dT%H:%M:%SZ"), "bot": bot}


def record(scenarios: Sequence[SuiteScenario], report: dict[str, Any], bot: str) -> list[dict[str, Any]]:
    """Write ``source.reproduced`` into each scenario's file; what was written, one entry per scenario.

    Raises:
        UserError: a file cannot be rewritten.
    """
    at = dt.datetime.now(dt.timezone.utc)
    entries = {e["id"]: e for e in report["scenarios"]}
    out: list[dict[str, Any]] = []
    for s in scenarios:
        entry = entries.get(s.id)
        if entry is None or entry["judged"] == 0:
            out.append({"id": s.id, "path": s.path, "reproduced": None,
                        "problem": "not judged: the simulated user's provider failed on every replicate"})
            continue
        found = reproduced(s, entry, bot, at)
        _write_source(Path(s.path), found)
        out.append({"id": s.id, "path": s.path, "reproduced": found, "reproduces": found["failed"] > 0})
    return out


def _write_source(path: Path, found: dict[str, Any]) -> None:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        data.setdefault("source", {})["reproduced"] = found
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(dump_yaml(data))
        os.replace(tmp, path)
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"{path}: cannot record source.reproduced ({exc})") from None
