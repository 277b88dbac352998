"""Is the simulated user realistic? People's blind labels of the built-in criterion ``simulated_user_realistic``.

Imported simulated conversations that carry ``attributes.simulated_user`` are
sampled into blind labelling tasks (``calibration.choose_simulated``): pass when
the simulated user reads like a real user, fail when it does not. Here the
labels are counted per simulated-user identity (provider, model, prompt and
temperature, all four: ``SimulatedUser``), each task by the majority of its
labels (a tie, or not_applicable, leaves it out), with the Wilson 95% interval
of the share judged realistic. The simulated user is validated once the lower
end of that interval reaches ``simulate.min_realism``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import duckdb
import orjson

from judges import weighted_proportion

from ..evals.simulated_user import REALISM, SimulatedUser
from .calibration import majority


def figure(who: SimulatedUser, tasks: Iterable[Sequence[str]], min_realism: float) -> dict[str, Any]:
    """The realism figure of one simulated user from its tasks' labels (one list per task, empty: unlabelled).

    Returns:
        ``{"simulated_user", "labelled", "realistic", "share", "lower", "validated", "min_realism",
        "not_applicable", "unlabelled"}``: ``labelled`` counts the tasks whose labels say pass or fail,
        ``realistic`` those that say pass; ``share`` and ``lower`` (the Wilson 95% lower bound) are None while
        nothing is labelled.
    """
    said = [majority(labels) if labels else "" for labels in tasks]
    outcomes = [(s == "pass", 1.0) for s in said if s in ("pass", "fail")]  # each task weighs 1: not a sample
    share = weighted_proportion(outcomes)
    lower = None if share is None else share.low
    return {"simulated_user": who.to_dict(), "labelled": len(outcomes), "realistic": sum(ok for ok, _ in outcomes),
            "share": None if share is None else share.estimate, "lower": lower,
            "validated": lower is not None and lower >= min_realism, "min_realism": min_realism,
            "not_applicable": said.count("not_applicable"), "unlabelled": said.count("")}


def _tasks(cur: duckdb.DuckDBPyConnection) -> dict[SimulatedUser, list[list[str]]]:
    """The labels of every realism task, per simulated user."""
    rows = cur.execute(
        "SELECT json_extract(s.record, '$.attributes'), "
        "(SELECT list(l.label) FROM calibration_labels l WHERE l.item_id = i.id) "
        "FROM calibration_items i JOIN simulated_conversations s ON s.conversation_id = i.conversation_id "
        "WHERE i.criterion_id = ? ORDER BY i.id", [REALISM]).fetchall()
    out: dict[SimulatedUser, list[list[str]]] = {}
    for attributes, labels in rows:
        who = SimulatedUser.of_record(orjson.loads(attributes)) if attributes else None
        if who is not None:
            out.setdefault(who, []).append(list(labels or []))
    return out


def realism(cur: duckdb.DuckDBPyConnection, who: SimulatedUser, min_realism: float) -> dict[str, Any]:
    """The realism figure of one simulated user (``figure``): labels of another model, prompt or temperature
    never count."""
    return figure(who, _tasks(cur).get(who, []), min_realism)


def realism_by_user(cur: duckdb.DuckDBPyConnection, min_realism: float) -> list[dict[str, Any]]:
    """The realism figure of every simulated user with a task, by provider, model, prompt and temperature."""
    found = _tasks(cur)
    order = sorted(found, key=lambda w: (w.provider, w.model, w.prompt_sha256,
                                         -1.0 if w.temperature is None else w.temperature))
    return [figure(who, found[who], min_realism) for who in order]
