"""The review queue: its tables, the items verdicts open, and reviewers' decisions.

The evals stage stores verdicts; ``open_items`` (called with the ids it stored,
in its transaction) opens an item for each one that needs a reviewer: every
verdict whose result is in ``review.queue_results``, and every flagged fail.
A live fail (a live criterion failed on an open conversation) opens its item at
once (``open_live_item``), marked ``live`` and first in the queue while pending;
it stands for its conversation and criterion: no other live fail, nor the fail
at the end, opens a second one.
This module lists, shows and decides them. Decisions are history: each one is
a row of ``review_history`` with the state it replaced. Reviewers are compared
by ``names.reviewer_key`` (``Eve`` and ``eve`` are one) and kept as
``names.clean_name`` spells them; who may act as whom is ``identity``'s.

Errors: ``errors.ReviewError`` and its kinds (not found, conflict, bad input).
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable, Sequence
from typing import Any

import duckdb

from ..config import Config
from ..conversations.record import conversation_record
from . import REVIEW_STATES, ReviewState, calibration
from .errors import ReviewConflict, ReviewInputError, ReviewNotFound
from .errors import ReviewError as ReviewError  # re-exported: the API catches it here
from ..evals.verdicts import VERDICT_COLUMNS, verdict_dict, where_clause
from ..words import iso_utc
from ..names import clean_name, reviewer_key, spellings
from ..store.transactions import Transaction, one, utc_now

SCHEMA = """
CREATE SEQUENCE IF NOT EXISTS review_item_seq;
CREATE TABLE IF NOT EXISTS review_items (
    id BIGINT PRIMARY KEY,
    verdict_id VARCHAR NOT NULL UNIQUE,
    conversation_id VARCHAR NOT NULL,
    criterion_id VARCHAR NOT NULL,
    state VARCHAR NOT NULL,
    reviewer VARCHAR,
    note VARCHAR,
    created_at TIMESTAMPTZ NOT NULL,
    decided_at TIMESTAMPTZ
);
-- Opened by a live fail, on an open conversation. Added to older files, whose items are all of ended ones.
ALTER TABLE review_items ADD COLUMN IF NOT EXISTS live BOOLEAN DEFAULT false;
CREATE TABLE IF NOT EXISTS review_claims (
    item_id BIGINT PRIMARY KEY,
    reviewer VARCHAR NOT NULL,
    assigned_by VARCHAR,
    until TIMESTAMPTZ NOT NULL
);
CREATE SEQUENCE IF NOT EXISTS review_history_seq;
CREATE TABLE IF NOT EXISTS review_history (
    id BIGINT PRIMARY KEY,
    item_id BIGINT NOT NULL,
    decision VARCHAR NOT NULL,
    previous_state VARCHAR NOT NULL,
    previous_reviewer VARCHAR,
    previous_note VARCHAR,
    state VARCHAR NOT NULL,
    reviewer VARCHAR NOT NULL,
    note VARCHAR,
    forced BOOLEAN NOT NULL,
    decided_at TIMESTAMPTZ NOT NULL
);
"""

_DECIDED: dict[str, ReviewState] = {"confirm": "confirmed", "reject": "rejected", "unclear": "unclear"}
"""``unclear``: the reviewer cannot say, because the criterion is ambiguous (neither a confirmed failure nor a
judge error; the criterion's authors have work to do)."""
SEVERITY_ORDER = ("high", "medium", "low")
_ITEM_COLUMNS = ("id", "verdict_id", "conversation_id", "criterion_id", "state", "reviewer", "note",
                 "created_at", "decided_at", "live")
_DECIDING = threading.Lock()


def ensure_schema(cur: duckdb.DuckDBPyConnection) -> None:
    """Create the review tables, the calibration ones included, when they do not exist yet (after the evals
    stage's: items name verdicts)."""
    cur.execute(SCHEMA)
    cur.execute(calibration.SCHEMA)


def open_items(cur: duckdb.DuckDBPyConnection, verdict_ids: Sequence[str], queue_results: Sequence[str], *,
               now: dt.datetime | None = None) -> int:
    """Queue, as pending items, the verdicts just stored that need a reviewer.

    Those on the current transcript whose result is in ``queue_results`` (config
    ``review.queue_results``) and every flagged fail; an ``error`` never. A verdict
    queued before is not queued again, nor a fail whose conversation and criterion
    have a live item (``open_live_item``). Runs in the caller's transaction, if any.

    Returns:
        How many items were opened.
    """
    if not verdict_ids:
        return 0
    with Transaction(cur):
        row = one(cur.execute(
            "INSERT INTO review_items (id, verdict_id, conversation_id, criterion_id, state, created_at) "
            "SELECT nextval('review_item_seq'), id, conversation_id, criterion_id, 'pending', ? "
            "FROM (SELECT * FROM verdicts WHERE list_contains(?, id) AND NOT superseded AND result <> 'error' "
            "AND (list_contains(?, result) OR (result = 'fail' AND flagged)) "
            "AND id NOT IN (SELECT verdict_id FROM review_items) AND NOT (result = 'fail' AND EXISTS "
            "(SELECT 1 FROM review_items r WHERE r.live AND r.conversation_id = verdicts.conversation_id "
            "AND r.criterion_id = verdicts.criterion_id)) ORDER BY seq)",
            [utc_now(now), list(verdict_ids), list(queue_results)]))
    return int(row[0]) if row else 0


def open_live_item(cur: duckdb.DuckDBPyConnection, verdict_id: str, *, now: dt.datetime | None = None) -> int:
    """The live item of a live fail's conversation and criterion: the one opened by an earlier live fail, else
    a new pending one for this verdict. Runs in the caller's transaction, if any.

    Returns:
        The item's id.
    """
    with Transaction(cur):
        row = one(cur.execute(
            "SELECT r.id FROM review_items r JOIN verdicts v ON v.conversation_id = r.conversation_id "
            "AND v.criterion_id = r.criterion_id WHERE v.id = ? AND r.live", [verdict_id]))
        if row is None:
            row = one(cur.execute(
                "INSERT INTO review_items (id, verdict_id, conversation_id, criterion_id, state, created_at, live) "
                "SELECT nextval('review_item_seq'), id, conversation_id, criterion_id, 'pending', ?, true "
                "FROM verdicts WHERE id = ? RETURNING id", [utc_now(now), verdict_id]))
    assert row is not None, "a live item is opened for a verdict just stored"
    return int(row[0])


def item_opener(cfg: Config) -> Callable[[duckdb.DuckDBPyConnection, list[str], dt.datetime], int]:
    """What the evals stage calls as it stores: ``open_items`` with ``review.queue_results``, and
    ``calibration.choose`` with ``review.calibration_rate`` and ``sampling.seed``."""
    review, seed = cfg.review, cfg.sampling.seed

    def opened(cur: duckdb.DuckDBPyConnection, verdict_ids: list[str], now: dt.datetime) -> int:
        calibration.choose(cur, verdict_ids, review.calibration_rate, seed, now=now)
        return open_items(cur, verdict_ids, review.queue_results, now=now)

    return opened


def check_state(state: str) -> None:
    """Raise ``ReviewInputError`` unless ``state`` is a review state or ``all``."""
    if state != "all" and state not in REVIEW_STATES:
        raise ReviewInputError(f"state must be one of {', '.join(REVIEW_STATES)} or all, got {state!r}")


def list_reviews(cur: duckdb.DuckDBPyConnection, state: str = "pending", criterion: str | None = None,
                 limit: int = 100, *, severity: str | None = None, service: str | None = None,
                 flagged: bool | None = None, since: dt.datetime | None = None, assignee: str | None = None,
                 order: str = "severity", now: dt.datetime | None = None) -> list[dict[str, Any]]:
    """Review items in the queue's order: pending live items first (a conversation may still be going
    on), then high severity, then the oldest (``order="age"``: the oldest first after the live ones).

    Args:
        state: ``pending`` (default), ``confirmed``, ``rejected``, ``unclear`` or ``all``.
        criterion, severity, service: only items of this criterion id, criterion severity, bot service.
        flagged: only flagged fails (True) or only the others (False).
        since: only items queued since then.
        assignee: only items claimed by or assigned to this reviewer (a claim that has not run out).
        limit: at most this many.

    Returns:
        Items with ``id``, ``conversation_id``, ``criterion_id``, ``state``, ``reviewer``,
        ``note``, ``created_at``, ``decided_at``, ``live``, ``verdict_id``; from the verdict
        ``criterion_version``, ``result``, ``flagged``, ``evidence_verified`` and ``superseded``;
        ``severity``, ``service``, and ``claimed_by`` / ``claimed_until`` (None when nobody holds it).

    Raises:
        ReviewInputError: an unknown state, severity or order.
    """
    check_state(state)
    if severity is not None and severity not in SEVERITY_ORDER:
        raise ReviewInputError(f"severity must be one of {', '.join(SEVERITY_ORDER)}, got {severity!r}")
    if order not in ("severity", "age"):
        raise ReviewInputError(f"order must be severity or age, got {order!r}")
    where: list[str] = []
    params: list[Any] = []
    for clause, value in (("r.state = ?", None if state == "all" else state), ("r.criterion_id = ?", criterion),
                          ("c.severity = ?", severity), ("conv.service = ?", service),
                          ("v.flagged = ?", flagged), ("r.created_at >= ?", since)):
        if value is not None:
            where.append(clause)
            params.append(value)
    if assignee is not None:
        held = [r for (r,) in cur.execute("SELECT DISTINCT reviewer FROM review_claims").fetchall()]
        where.append("list_contains(?, k.reviewer) AND k.until > ?")
        params += [spellings(held, assignee), utc_now(now)]
    return _items(cur, where, params, limit, order=order, now=now)


_ITEM_KEYS = (*_ITEM_COLUMNS, "criterion_version", "result", "flagged", "evidence_verified", "superseded",
              "severity", "service", "claimed_by", "claimed_until")
_SEVERITY_RANK = ("CASE c.severity " + " ".join(f"WHEN '{s}' THEN {n}" for n, s in enumerate(SEVERITY_ORDER))
                  + f" ELSE {len(SEVERITY_ORDER)} END")


def _items(cur: duckdb.DuckDBPyConnection, where: list[str], params: list[Any], limit: int, *,
           order: str = "severity", now: dt.datetime | None = None) -> list[dict[str, Any]]:
    at = utc_now(now)
    rows = cur.execute(
        f"SELECT {', '.join('r.' + c for c in _ITEM_COLUMNS)}, v.criterion_version, v.result, v.flagged, "
        "v.evidence_verified, v.superseded, c.severity, conv.service, "
        "CASE WHEN k.until > ? THEN k.reviewer END, CASE WHEN k.until > ? THEN k.until END "
        "FROM review_items r JOIN verdicts v ON v.id = r.verdict_id "
        "LEFT JOIN criteria c ON c.criterion_id = v.criterion_id AND c.criterion_version = v.criterion_version "
        "LEFT JOIN conversations conv ON conv.conversation_id = r.conversation_id "
        "LEFT JOIN review_claims k ON k.item_id = r.id "
        f"{where_clause(where)} ORDER BY r.live AND r.state = 'pending' DESC, "
        f"{_SEVERITY_RANK + ', ' if order == 'severity' else ''}r.created_at, r.id "
        "LIMIT ?", [at, at, *params, limit]).fetchall()
    return [{k: iso_utc(v) for k, v in zip(_ITEM_KEYS, r)} for r in rows]


def progress(cur: duckdb.DuckDBPyConnection, *, now: dt.datetime | None = None) -> dict[str, Any]:
    """``{"pending", "done_today", "by_reviewer": {name: items decided today}}``, today being the UTC day of
    ``now`` (the daemon's clock).

    Both count items, not decisions: an item decided again today counts once. ``done_today`` counts the
    items that are decided (with ``reviewers_per_item`` above 1, once the last reviewer decides);
    ``by_reviewer`` the items each reviewer decided, their vote on a still pending one included.
    """
    day = utc_now(now).replace(hour=0, minute=0, second=0, microsecond=0)
    pending = one(cur.execute("SELECT count(*) FROM review_items WHERE state = 'pending'"))
    done = one(cur.execute("SELECT count(*) FROM review_items WHERE state <> 'pending' AND decided_at >= ?",
                           [day]))
    # By reviewer_key ("Eve" and "eve" are one): the spelling first decided with today, the items.
    items: dict[str, tuple[str, set[int]]] = {}
    for name, item_id in cur.execute("SELECT reviewer, item_id FROM review_history WHERE decided_at >= ? "
                                     "ORDER BY id", [day]).fetchall():
        items.setdefault(reviewer_key(name), (name, set()))[1].add(int(item_id))
    by = dict(sorted(((name, len(ids)) for name, ids in items.values()), key=lambda c: (-c[1], c[0])))
    return {"pending": int(pending[0]) if pending else 0, "done_today": int(done[0]) if done else 0,
            "by_reviewer": by}


def claim(cur: duckdb.DuckDBPyConnection, item_id: int | str, reviewer: str, timeout: float, *,
          assigned_by: str | None = None, now: dt.datetime | None = None) -> dict[str, Any]:
    """Hold a pending item for ``reviewer`` for ``timeout`` seconds (``review.lock_timeout``); meanwhile
    another reviewer's decision on it is refused. ``assigned_by``: an assignment, which takes the item from
    whoever held it. Claiming it again extends the claim.

    Raises:
        ReviewNotFound: no such item.
        ReviewInputError: no reviewer.
        ReviewConflict: someone else holds it (and this is not an assignment), or it is decided.
    """
    reviewer, at = _reviewer(reviewer), utc_now(now)
    with _DECIDING, Transaction(cur):
        item = _item(cur, item_id)
        if item["state"] != "pending":
            raise ReviewConflict(f"review item {item['id']} was already {item['state']}: nothing to claim")
        held = _holder(cur, item["id"], at)
        if held is not None and reviewer_key(held) != reviewer_key(reviewer) and assigned_by is None:
            raise ReviewConflict(f"review item {item['id']} is claimed by {held}")
        cur.execute("INSERT OR REPLACE INTO review_claims VALUES (?, ?, ?, ?)",
                    [item["id"], reviewer, clean_name(assigned_by) if assigned_by is not None else None,
                     at + dt.timedelta(seconds=timeout)])
    return _items(cur, ["r.id = ?"], [item["id"]], 1, now=now)[0]


def _reviewer(name: str | None) -> str:
    """``name`` as kept (``names.clean_name``).

    Raises:
        ReviewInputError: no name, or one of invisible characters only.
    """
    kept = clean_name(name or "")
    if not kept:
        raise ReviewInputError("a reviewer is required")
    return kept


def _votes(cur: duckdb.DuckDBPyConnection, item_id: int) -> dict[str, tuple[str, str]]:
    """Each reviewer's decision of a pending item (the decisions made since it was last pending), by
    ``reviewer_key``: the name as written with it, and the state."""
    rows = cur.execute("SELECT reviewer, state FROM review_history WHERE item_id = ? AND previous_state = "
                       "'pending' AND id > coalesce((SELECT max(id) FROM review_history WHERE item_id = ? "
                       "AND previous_state <> 'pending'), 0) ORDER BY id", [item_id, item_id]).fetchall()
    return {reviewer_key(name): (name, state) for name, state in rows}


def _majority(votes: dict[str, tuple[str, str]]) -> str:
    states = [state for _, state in votes.values()]
    counts = sorted(((states.count(v), v) for v in set(states)), reverse=True)
    return "unclear" if len(counts) > 1 and counts[0][0] == counts[1][0] else counts[0][1]


def _holder(cur: duckdb.DuckDBPyConnection, item_id: int, at: dt.datetime) -> str | None:
    row = one(cur.execute("SELECT reviewer FROM review_claims WHERE item_id = ? AND until > ?", [item_id, at]))
    return str(row[0]) if row else None


def _item_id(item_id: int | str) -> int:
    # Ids arrive from URLs and command lines as text.
    try:
        return int(item_id)
    except (TypeError, ValueError):
        raise ReviewNotFound(f"no review item {item_id!r}") from None


def _item(cur: duckdb.DuckDBPyConnection, item_id: int | str) -> dict[str, Any]:
    row = one(cur.execute(f"SELECT {', '.join(_ITEM_COLUMNS)} FROM review_items WHERE id = ?",
                      [_item_id(item_id)]))
    if row is None:
        raise ReviewNotFound(f"no review item {item_id!r}")
    return dict(zip(_ITEM_COLUMNS, row))


def review_history(cur: duckdb.DuckDBPyConnection, item_id: int | str) -> list[dict[str, Any]]:
    """Every decision on an item, the oldest first, each with the state, reviewer and note it replaced."""
    cols = ("decision", "previous_state", "previous_reviewer", "previous_note", "state", "reviewer", "note",
            "forced", "decided_at")
    rows = cur.execute(f"SELECT {', '.join(cols)} FROM review_history WHERE item_id = ? ORDER BY id",
                       [_item_id(item_id)]).fetchall()
    return [{k: iso_utc(v) for k, v in zip(cols, r)} for r in rows]


def review_item(cur: duckdb.DuckDBPyConnection, item_id: int | str, *, viewer: str | None = None,
                reviewers_per_item: int = 1) -> dict[str, Any]:
    """One review item with everything a reviewer needs.

    With ``reviewers_per_item`` above 1, a pending item's history shows ``viewer`` only their own decision:
    each reviewer decides before seeing the others'. ``decisions`` says how many there are so far.

    Returns:
        ``{"item", "verdict", "criterion", "history", "conversation"}``: the item
        (as in ``list_reviews``), the full verdict (reasoning, evidence, judge),
        the criterion ``{"id", "version", "text", "group", "severity"}`` (text and
        group are None when ``store_criteria`` never saw that version), the
        decisions so far, and the conversation/v1 record (None if it is gone).

    Raises:
        ReviewNotFound: no item with that id.
    """
    found = _items(cur, ["r.id = ?"], [_item_id(item_id)], 1)
    if not found:
        raise ReviewNotFound(f"no review item {item_id!r}")
    item = found[0]
    row = one(cur.execute(f"SELECT {', '.join(VERDICT_COLUMNS)} FROM verdicts WHERE id = ?",
                      [item["verdict_id"]]))
    assert row is not None  # items are only made with their verdict
    verdict = verdict_dict(row)
    history = review_history(cur, item["id"])
    votes = _votes(cur, item["id"]) if item["state"] == "pending" else {}
    if reviewers_per_item > 1 and item["state"] == "pending":  # blind to the others until one's own is in
        history = [h for h in history if viewer is not None and reviewer_key(h["reviewer"]) == reviewer_key(viewer)]
    crit = one(cur.execute("SELECT text, criterion_group, severity FROM criteria WHERE criterion_id = ? "
                       "AND criterion_version = ?", [verdict["criterion_id"], verdict["criterion_version"]]
                       ))
    return {
        "item": item,
        "verdict": verdict,
        "criterion": {"id": verdict["criterion_id"], "version": verdict["criterion_version"],
                      "text": crit[0] if crit else None, "group": crit[1] if crit else None,
                      "severity": crit[2] if crit else None},
        "history": history,
        "decisions": len(votes),
        "reviewers_per_item": reviewers_per_item,
        "conversation": conversation_record(cur, verdict["conversation_id"]),
    }


def decide(cur: duckdb.DuckDBPyConnection, item_id: int | str, decision: str, reviewer: str,
           note: str | None = None, force: bool = False, *, reviewers_per_item: int = 1,
           now: dt.datetime | None = None) -> dict[str, Any]:
    """Confirm, reject or mark unclear a review item; the decision is added to the item's history.

    With ``reviewers_per_item`` above 1 (``review.reviewers_per_item``) the item stays pending until that
    many different reviewers have decided it; each decision is a row of its history, and the last one
    gives the item the majority's state (a tie: ``unclear``: people disagree on what the criterion asks).

    Args:
        item_id: the item.
        decision: ``confirm`` (the judge was right), ``reject`` (it was wrong) or ``unclear`` (the criterion
            does not say).
        reviewer: who decided (required: provenance of every human edit).
        note: why, in the reviewer's words.
        force: decide an item that was decided already; the earlier decision stays in the history.
        reviewers_per_item: how many different reviewers decide an item before it is decided.
        now: the clock (UTC).

    Returns:
        The item after the decision (as in ``list_reviews``).

    Raises:
        ReviewInputError: an unknown decision or an empty reviewer (400).
        ReviewNotFound: no item with that id (404).
        ReviewConflict: another reviewer holds a claim on it, or it was decided already and ``force`` is
            false (409); decisions made
            at the same moment are taken one after the other, so all but the first get it.
    """
    if decision not in _DECIDED:
        raise ReviewInputError(f"decision must be confirm, reject or unclear, got {decision!r}")
    reviewer = _reviewer(reviewer)
    state = _DECIDED[decision]
    at = utc_now(now)
    # One decision at a time in this process: two at once on one item would meet in DuckDB as a
    # "Conflict on update" instead of the second reading the first and hearing "already decided".
    with _DECIDING:
        try:
            with Transaction(cur):
                item = _item(cur, item_id)
                held = _holder(cur, item["id"], at)
                if held is not None and reviewer_key(held) != reviewer_key(reviewer):
                    raise ReviewConflict(f"review item {item['id']} is claimed by {held}; it is theirs to decide "
                                         "until the claim runs out (review.lock_timeout)")
                if item["state"] != "pending" and not force:
                    raise ReviewConflict(f"review item {item['id']} was already {item['state']} by "
                                         f"{item['reviewer']}; decide again with force (--force; \"force\": true "
                                         "in the API)")
                votes = _votes(cur, item["id"]) if item["state"] == "pending" else {}
                if reviewer_key(reviewer) in votes and not force:
                    raise ReviewConflict(f"you ({votes[reviewer_key(reviewer)][0]}) decided review item {item['id']} "
                                         f"already: it waits for {reviewers_per_item - len(votes)} more reviewer(s)")
                cur.execute("INSERT INTO review_history VALUES (nextval('review_history_seq'), "
                            "?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                            [item["id"], decision, item["state"], item["reviewer"], item["note"], state, reviewer,
                             note, item["state"] != "pending", at])
                votes[reviewer_key(reviewer)] = (reviewer, state)
                cur.execute("DELETE FROM review_claims WHERE item_id = ?", [item["id"]])
                if item["state"] != "pending" or len(votes) >= reviewers_per_item:
                    final, who = ((state, reviewer) if len(votes) <= 1 else
                                  (_majority(votes), ", ".join(sorted(name for name, _ in votes.values()))))
                    cur.execute("UPDATE review_items SET state = ?, reviewer = ?, note = ?, decided_at = ? "
                                "WHERE id = ?", [final, who, note if len(votes) <= 1 else None, at, item["id"]])
        except duckdb.TransactionException:  # another writer of this item, outside this process's decisions
            raise ReviewConflict(f"review item {item_id} changed while it was being decided; "
                                 "read it again and decide") from None
    return _items(cur, ["r.id = ?"], [item["id"]], 1)[0]
