"""Blind calibration: people label judged conversations without seeing the verdict, and the judge is measured
against them.

As verdicts are stored, ``choose`` makes a labelling task (a calibration item)
of ``review.calibration_rate`` of the judged conversations per criterion,
passes and not_applicable included: a conversation is chosen when a hash of
its id, the criterion and ``sampling.seed`` falls under the rate, so the same
conversations are chosen on every run and the choice is independent of the
sampling's. An item holds no verdict: ``items`` and ``item`` return the
conversation and the criterion only, and a label is stored apart from the
review queue (it is not a review of the verdict). ``pairs`` then puts each
label beside the verdict for ``judges.calibrate``.

The same tasks go to spreadsheets: ``export_rows`` (topping the items up to a
sample size) and ``import_rows``, which checks every row before it stores any.
``frozen_items`` gives the labelled items with their transcripts for a judge
regression set (``review.regression``). A person has one label per item,
however their name is written (``names.reviewer_key``).

One criterion is built in: ``REALISM`` (``simulated_user_realistic``), whose
tasks are simulated conversations (``choose_simulated``, as they are imported),
labelled pass when the simulated user reads like a real user. Its item ids name
simulated conversations, a space of their own; no judge runs it, so it stays out
of the judge's calibration (``pairs``, ``frozen_items``) and its labels make the
realism figure of ``review.realism``.

Errors: ``ReviewNotFound`` (no such item), ``ReviewInputError`` (a bad label or
no reviewer), ``LabelImportError`` (every problem of an import, by row).
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import duckdb
import orjson

from judges import Conversation, Pair, calibrate, render_lines

from ..conversations.record import conversation_record
from ..evals.sampling import unit_hash
from ..evals.simulated_user import REALISM, SimulatedUser
from ..evals.simulations import present as simulations_present
from ..evals.simulations import simulated_record
from ..evals.verdicts import where_clause
from ..words import iso_utc
from ..names import clean_name, reviewer_key, spellings
from ..store.transactions import Transaction, one, utc_now
from .errors import ReviewError, ReviewInputError, ReviewNotFound
from .regression import KEY

SCHEMA = """
CREATE SEQUENCE IF NOT EXISTS calibration_item_seq;
CREATE TABLE IF NOT EXISTS calibration_items (
    id BIGINT PRIMARY KEY,
    conversation_id VARCHAR NOT NULL,
    criterion_id VARCHAR NOT NULL,
    created_at TIMESTAMPTZ NOT NULL,
    UNIQUE (conversation_id, criterion_id)
);
CREATE TABLE IF NOT EXISTS calibration_labels (
    item_id BIGINT NOT NULL,
    reviewer VARCHAR NOT NULL,
    label VARCHAR NOT NULL,
    note VARCHAR,
    source VARCHAR NOT NULL,
    labelled_at TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (item_id, reviewer)
);
"""

LABELS = ("pass", "fail", "not_applicable")
JUDGED = ("pass", "fail", "not_applicable")  # what a person can label too: an error is no verdict

REALISM_TEXT = """\
Does the simulated user read like a real user: the person its scenario describes, writing to this bot?
Judge the user's messages only, never the bot's answers.
Pass: a real person could have written them.
Fail: something gives the simulation away, for example:
- messages longer, tidier or more complete than people write (real users send short messages, spread one
  request over several, make typos, skip punctuation and capitals);
- facts told before the bot asked for them, or everything told at once;
- over-cooperative: every question answered fully and politely, never confused, impatient or off the
  point, whatever the bot proposes accepted;
- writing like an assistant or a form (lists, headings, restating the bot's words, thanking it at length),
  or naming the scenario's goal outright;
- a tone, vocabulary or language that does not fit the persona.
Not applicable: too little of the user to tell (the conversation broke off before the user said anything)."""
"""What a labeller reads for ``REALISM``."""


class LabelImportError(ReviewInputError):
    """Rows of a label import that cannot be stored; ``problems`` are (row index, message), all of them."""

    def __init__(self, problems: Sequence[tuple[int, str]]) -> None:
        self.problems = list(problems)
        super().__init__(f"{len(self.problems)} problem(s) in the labels; nothing was stored")


def chosen(conversation_id: str, criterion_id: str, rate: float, seed: int) -> bool:
    """Whether the conversation is a calibration task for the criterion (deterministic, apart from sampling)."""
    return rate > 0 and unit_hash(f"calibration\x00{criterion_id}\x00{conversation_id}", seed) < rate


def choose(cur: duckdb.DuckDBPyConnection, verdict_ids: Sequence[str], rate: float, seed: int, *,
           now: dt.datetime | None = None) -> int:
    """Make calibration items of the verdicts just stored that ``chosen`` picks; how many were made.

    Runs in the caller's transaction, if any.
    """
    if not verdict_ids or rate <= 0:
        return 0
    rows = cur.execute("SELECT DISTINCT conversation_id, criterion_id FROM verdicts WHERE list_contains(?, id) "
                       "AND NOT superseded AND NOT live AND list_contains(?, result)", [list(verdict_ids), list(JUDGED)]
                       ).fetchall()
    picked = [(c, k) for c, k in rows if chosen(c, k, rate, seed)]
    return _add(cur, picked, now)


def choose_simulated(cur: duckdb.DuckDBPyConnection, conversations: Sequence[Conversation], rate: float,
                     seed: int, *, now: dt.datetime | None = None) -> int:
    """Make ``REALISM`` items of the simulated conversations just imported that carry a simulated user
    (``SimulatedUser.of_record``) and that ``chosen`` picks; how many were made.

    Runs in the caller's transaction, if any.
    """
    picked = [(c.id, REALISM) for c in conversations
              if SimulatedUser.of_record(c.attributes) is not None and chosen(c.id, REALISM, rate, seed)]
    return _add(cur, picked, now)


def _add(cur: duckdb.DuckDBPyConnection, pairs: Sequence[tuple[str, str]], now: dt.datetime | None) -> int:
    made = 0
    with Transaction(cur):
        for conversation_id, criterion_id in pairs:
            row = one(cur.execute("INSERT OR IGNORE INTO calibration_items SELECT nextval('calibration_item_seq'), "
                              "?, ?, ? WHERE NOT EXISTS (SELECT 1 FROM calibration_items WHERE conversation_id = ? "
                              "AND criterion_id = ?)",
                              [conversation_id, criterion_id, utc_now(now), conversation_id, criterion_id]))
            made += int(row[0]) if row else 0
    return made


_ITEM = ("id", "conversation_id", "criterion_id", "created_at")


def items(cur: duckdb.DuckDBPyConnection, *, criterion: str | None = None, state: str = "unlabelled",
          reviewer: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
    """Calibration items, the oldest first: ``id``, ``conversation_id``, ``criterion_id``, ``created_at``,
    ``labels`` (how many people labelled it) and, given ``reviewer``, ``your_label``. Never a verdict.

    Args:
        state: ``unlabelled`` (by ``reviewer`` when given, else by anyone), ``labelled`` or ``all``.

    Raises:
        ReviewInputError: an unknown state.
    """
    if state not in ("unlabelled", "labelled", "all"):
        raise ReviewInputError(f"state must be unlabelled, labelled or all, got {state!r}")
    where, params = _of_criterion(criterion)
    names = _spelled(cur, reviewer) if reviewer else []
    mine = "list_contains(?, l.reviewer)" if reviewer else "true"
    if state != "all":
        where.append(("NOT " if state == "unlabelled" else "")
                     + f"EXISTS (SELECT 1 FROM calibration_labels l WHERE l.item_id = i.id AND {mine})")
        params += [names] if reviewer else []
    if state == "unlabelled":  # a task whose conversation retention deleted cannot be labelled any more
        # (retention never deletes a simulated one)
        where.append("(i.criterion_id = ? OR EXISTS (SELECT 1 FROM conversations c "
                     "WHERE c.conversation_id = i.conversation_id))")
        params.append(REALISM)
    rows = cur.execute(
        f"SELECT {', '.join('i.' + c for c in _ITEM)}, "
        "(SELECT count(*) FROM calibration_labels l WHERE l.item_id = i.id), "
        "(SELECT any_value(label) FROM calibration_labels l WHERE l.item_id = i.id AND list_contains(?, l.reviewer)) "
        f"FROM calibration_items i {where_clause(where)} ORDER BY i.created_at, i.id LIMIT ?",
        [names, *params, limit]).fetchall()
    return [{**{k: iso_utc(v) for k, v in zip(_ITEM, r)}, "labels": int(r[4]),
             **({"your_label": r[5]} if reviewer else {})} for r in rows]


def _spelled(cur: duckdb.DuckDBPyConnection, reviewer: str) -> list[str]:
    """Every spelling ``reviewer``'s labels are stored under."""
    return spellings((r for (r,) in cur.execute("SELECT DISTINCT reviewer FROM calibration_labels").fetchall()),
                     reviewer)


def _item_id(item_id: int | str) -> int:
    try:
        return int(item_id)
    except (TypeError, ValueError):
        raise ReviewNotFound(f"no calibration item {item_id!r}") from None


def _criterion(cur: duckdb.DuckDBPyConnection, criterion_id: str) -> dict[str, Any]:
    if criterion_id == REALISM:
        return {"id": REALISM, "version": 1, "text": REALISM_TEXT, "severity": None, "group": None}
    row = one(cur.execute("SELECT criterion_version, text, severity, criterion_group FROM criteria "
                      "WHERE criterion_id = ? ORDER BY criterion_version DESC LIMIT 1", [criterion_id]))
    return {"id": criterion_id, "version": row[0] if row else None, "text": row[1] if row else None,
            "severity": row[2] if row else None, "group": row[3] if row else None}


def item(cur: duckdb.DuckDBPyConnection, item_id: int | str, reviewer: str | None = None) -> dict[str, Any]:
    """One labelling task: ``{"item", "criterion", "conversation", "your_label"}``; nothing of the verdict.

    ``your_label`` is ``reviewer``'s own label (None when not labelled, or no reviewer given); other people's
    labels are never shown, so each label is made apart.

    Raises:
        ReviewNotFound: no such item.
    """
    found = _one(cur, _item_id(item_id))
    mine = None
    if reviewer:
        row = one(cur.execute("SELECT label, note, labelled_at FROM calibration_labels WHERE item_id = ? "
                              "AND list_contains(?, reviewer)", [found["id"], _spelled(cur, reviewer)]))
        mine = {"label": row[0], "note": row[1], "labelled_at": iso_utc(row[2])} if row else None
    return {"item": found, "criterion": _criterion(cur, found["criterion_id"]),
            "conversation": _record(cur, found["conversation_id"], found["criterion_id"]), "your_label": mine}


def _record(cur: duckdb.DuckDBPyConnection, conversation_id: str, criterion_id: str) -> dict[str, Any] | None:
    """The conversation/v1 record an item of ``criterion_id`` names: simulated for ``REALISM``."""
    if criterion_id == REALISM:
        return simulated_record(cur, conversation_id)
    return conversation_record(cur, conversation_id)


def _one(cur: duckdb.DuckDBPyConnection, item_id: int) -> dict[str, Any]:
    row = one(cur.execute(f"SELECT {', '.join(_ITEM)}, (SELECT count(*) FROM calibration_labels l WHERE l.item_id = i.id) "
                      "FROM calibration_items i WHERE id = ?", [item_id]))
    if row is None:
        raise ReviewNotFound(f"no calibration item {item_id!r}")
    return {**{k: iso_utc(v) for k, v in zip(_ITEM, row)}, "labels": int(row[4])}


def _check(label: str, reviewer: str) -> tuple[str, str]:
    if label not in LABELS:
        raise ReviewInputError(f"label must be one of {', '.join(LABELS)}, got {label!r}")
    if not clean_name(reviewer or ""):
        raise ReviewInputError("a reviewer is required")
    return label, clean_name(reviewer)


def _upsert(cur: duckdb.DuckDBPyConnection, item_id: int, label: str, reviewer: str, note: str | None,
            source: str, at: dt.datetime) -> str:
    """Store one label; ``added``, ``changed`` or ``unchanged`` (the same label and note again). A label the
    same person gave under another spelling of their name is the one replaced, and keeps that spelling."""
    row = next((r for r in cur.execute("SELECT reviewer, label, note FROM calibration_labels WHERE item_id = ?",
                                       [item_id]).fetchall() if reviewer_key(r[0]) == reviewer_key(reviewer)), None)
    if row is not None and (row[1], row[2] or None) == (label, note or None):
        return "unchanged"
    cur.execute("INSERT OR REPLACE INTO calibration_labels VALUES (?, ?, ?, ?, ?, ?)",
                [item_id, reviewer if row is None else row[0], label, note or None, source, at])
    return "added" if row is None else "changed"


def label(cur: duckdb.DuckDBPyConnection, item_id: int | str, label: str, reviewer: str, note: str | None = None,
          *, source: str = "page", now: dt.datetime | None = None) -> dict[str, Any]:
    """Label an item (pass, fail or not_applicable) as ``reviewer``; a second label by the same person replaces
    the first. Returns the item (as in ``items``).

    Raises:
        ReviewInputError: an unknown label or no reviewer (400).
        ReviewNotFound: no such item (404).
    """
    label, reviewer = _check(label, reviewer)
    with Transaction(cur):
        found = _one(cur, _item_id(item_id))
        _upsert(cur, found["id"], label, reviewer, note, source, utc_now(now))
    return _one(cur, found["id"])


def export_rows(cur: duckdb.DuckDBPyConnection, criterion: str, *, sample: int | None = None, seed: int = 0,
                reviewer: str | None = None, now: dt.datetime | None = None) -> list[dict[str, Any]]:
    """The spreadsheet rows of a criterion's unlabelled items, for labelling by hand: the items nobody labelled,
    or given ``reviewer``, those ``reviewer`` has not (a second rater's, whoever else labelled them).

    With ``sample``, first tops the criterion's items up to ``sample`` from its judged conversations (for
    ``REALISM``: the simulated conversations that carry a simulated user), in the order of the same hash
    ``chosen`` uses (so the same ones on every run). Each row: ``item_id``, ``conversation_id``,
    ``criterion_id``, ``criterion`` (its text), ``transcript`` (one message per line), an empty ``label`` and
    ``note``, and ``reviewer`` (given, else empty). Nothing of the verdict, nor of anyone's label: each
    label is made apart.

    Raises:
        ReviewInputError: no judged conversation has this criterion (no simulated user, for ``REALISM``).
    """
    judged = _pool(cur, criterion)
    if not judged:
        raise ReviewInputError(f"no simulated conversation carries attributes.simulated_user: nothing to label on "
                               f"{REALISM!r}" if criterion == REALISM else
                               f"no conversation was judged on criterion {criterion!r}")
    if sample is not None:
        have = {c for (c,) in cur.execute("SELECT conversation_id FROM calibration_items WHERE criterion_id = ?",
                                          [criterion]).fetchall()}
        order = sorted((c for c in judged if c not in have),
                       key=lambda c: unit_hash(f"calibration\x00{criterion}\x00{c}", seed))
        _add(cur, [(c, criterion) for c in order[:max(0, sample - len(have))]], now)
    text = _criterion(cur, criterion)["text"] or ""
    out = []
    for it in items(cur, criterion=criterion, state="unlabelled", reviewer=reviewer, limit=sample or 1 << 31):
        record = _record(cur, it["conversation_id"], criterion)
        transcript = "\n".join(render_lines(Conversation.model_validate(record).messages)) if record else ""
        out.append({"item_id": it["id"], "conversation_id": it["conversation_id"], "criterion_id": criterion,
                    "criterion": text, "transcript": transcript, "label": "", "reviewer": reviewer or "",
                    "note": ""})
    return out


def _pool(cur: duckdb.DuckDBPyConnection, criterion: str) -> list[str]:
    """The conversations a criterion's items may be drawn from: its judged ones, or for ``REALISM`` the
    simulated ones with a simulated user."""
    if criterion == REALISM:
        if not simulations_present(cur):  # a file no daemon of this version has opened
            return []
        rows = cur.execute("SELECT conversation_id, json_extract(record, '$.attributes') FROM "
                           "simulated_conversations").fetchall()
        return [c for c, attributes in rows
                if attributes and SimulatedUser.of_record(orjson.loads(attributes)) is not None]
    return [c for (c,) in cur.execute(
        "SELECT DISTINCT conversation_id FROM verdicts WHERE criterion_id = ? AND NOT superseded AND NOT live "
        "AND list_contains(?, result)", [criterion, list(JUDGED)]).fetchall()]


def import_rows(cur: duckdb.DuckDBPyConnection, rows: Sequence[Mapping[str, Any]], *, reviewer: str | None = None,
                who: Callable[[str], str] = clean_name, now: dt.datetime | None = None) -> dict[str, int]:
    """Store the labels of spreadsheet rows (``export_rows``' columns), all or none.

    A row without a label is left out (counted ``missing``: unlabelled is not agreement). ``reviewer`` is
    used where a row names none. ``who`` gives the reviewer a row's labels are recorded for, from the name
    it has (``identity.Identity.recorder``: with reviewer tokens, the token's reviewer); a ``ReviewError``
    it raises is that row's problem. Importing the same rows again changes nothing.

    Returns:
        ``{"added", "changed", "unchanged", "missing"}``.

    Raises:
        LabelImportError: every row that cannot be stored, with its index in ``rows`` and why.
    """
    problems: list[tuple[int, str]] = []
    todo: list[tuple[int, str, str, str | None]] = []
    known = {r[0]: (r[1], r[2]) for r in cur.execute(
        "SELECT id, conversation_id, criterion_id FROM calibration_items").fetchall()}
    counts = {"added": 0, "changed": 0, "unchanged": 0, "missing": 0}
    for n, row in enumerate(rows):
        value = str(row.get("label") or "").strip().lower()
        try:
            item_id = int(str(row.get("item_id") or "").strip())
        except ValueError:
            problems.append((n, f"item_id {row.get('item_id')!r} is not a number"))
            continue
        if item_id not in known:
            problems.append((n, f"no calibration item {item_id}"))
            continue
        conv, crit = known[item_id]
        for key, want in (("conversation_id", conv), ("criterion_id", crit)):
            if str(row.get(key) or "").strip() not in ("", want):
                problems.append((n, f"item {item_id} is {key} {want!r}, the row says {row.get(key)!r}"))
        if not value:
            counts["missing"] += 1
            continue
        if value not in LABELS:
            problems.append((n, f"label {row.get('label')!r} is not one of {', '.join(LABELS)} (or empty)"))
            continue
        try:
            name = clean_name(who(clean_name(str(row.get("reviewer") or "")) or clean_name(reviewer or "")))
        except ReviewError as exc:
            problems.append((n, str(exc)))
            continue
        if not name:
            problems.append((n, "no reviewer: fill the reviewer column, or give --reviewer"))
            continue
        note = str(row.get("note") or "").strip() or None
        todo.append((item_id, value, name, note))
    if problems:
        raise LabelImportError(problems)
    at = utc_now(now)
    with Transaction(cur):
        for item_id, value, name, note in todo:
            counts[_upsert(cur, item_id, value, name, note, "import", at)] += 1
    return counts


def _of_criterion(criterion: str | None) -> tuple[list[str], list[Any]]:
    """The WHERE clauses and parameters that keep the items (``i``) of one criterion, or all."""
    return (["i.criterion_id = ?"], [criterion]) if criterion is not None else ([], [])


def _of_judge(criterion: str | None) -> tuple[list[str], list[Any]]:
    """``_of_criterion`` without ``REALISM``'s items: no judge runs it, so it has no calibration."""
    where, params = _of_criterion(criterion)
    return [*where, "i.criterion_id <> ?"], [*params, REALISM]


def pairs(cur: duckdb.DuckDBPyConnection, criterion: str | None = None) -> list[Pair]:
    """Every label beside the judge's current verdict on the same conversation and criterion (None when there
    is none: the verdict was superseded and not judged again yet); never ``REALISM``'s."""
    where, params = _of_judge(criterion)
    rows = cur.execute(
        "SELECT i.criterion_id, i.conversation_id, l.reviewer, l.label, "
        "(SELECT v.result FROM verdicts v WHERE v.conversation_id = i.conversation_id "
        " AND v.criterion_id = i.criterion_id AND NOT v.superseded AND NOT v.live ORDER BY v.seq DESC LIMIT 1) "
        f"FROM calibration_labels l JOIN calibration_items i ON i.id = l.item_id {where_clause(where)} "
        "ORDER BY i.id, l.reviewer", params).fetchall()
    return [Pair(criterion_id=c, item=conv, reviewer=who, human=h, judge=j) for c, conv, who, h, j in rows]


NEWEST_ITEMS = 100
"""How many labelled tasks ``newest_pairs`` takes: enough for kappa to tell, few enough that a judge (or a
kind of traffic) that changed shows within a hundred labels."""


def newest_pairs(cur: duckdb.DuckDBPyConnection, criterion: str) -> list[Pair]:
    """The labels of a criterion's newest ``NEWEST_ITEMS`` labelled tasks (by their last label) beside the judge's
    current verdict, as ``pairs`` gives them; each task with all its labels, older ones included, for its
    majority."""
    newest = {conv for (conv,) in cur.execute(
        "SELECT i.conversation_id FROM calibration_labels l JOIN calibration_items i ON i.id = l.item_id "
        "WHERE i.criterion_id = ? GROUP BY i.conversation_id ORDER BY max(l.labelled_at) DESC, "
        "i.conversation_id DESC LIMIT ?", [criterion, NEWEST_ITEMS]).fetchall()}
    return [p for p in pairs(cur, criterion) if p.item in newest]


def report(cur: duckdb.DuckDBPyConnection, criterion: str | None, max_false_pass: float) -> dict[str, Any]:
    """``judges.calibrate`` on every label (of ``criterion``): the JSON of ``tracejudge calibrate --json``."""
    return report_of(pairs(cur, criterion), max_false_pass)


def report_of(labelled: Sequence[Pair], max_false_pass: float) -> dict[str, Any]:
    out: dict[str, Any] = calibrate(labelled, max_false_pass=max_false_pass).model_dump(mode="json")
    return out


def frozen_items(cur: duckdb.DuckDBPyConnection, criterion: str | None = None) -> dict[str, Any]:
    """The labelled items as ``tracejudge calibrate --freeze`` writes them (``review.regression``'s lines).

    One entry per labelled (conversation, criterion): the conversation/v1 record with the ``KEY``
    (``tracejudge_calibration``) beside it. An item whose labels tie, or whose conversation is gone
    (retention), is left out and counted.

    Returns:
        ``{"items": [record, ...], "left_out": {"ties": n, "no_transcript": n}}``, in item order; never
        ``REALISM``'s (no judge to rerun).
    """
    where, params = _of_judge(criterion)
    rows = cur.execute(
        "SELECT i.id, i.conversation_id, i.criterion_id, l.reviewer, l.label, l.note "
        f"FROM calibration_labels l JOIN calibration_items i ON i.id = l.item_id {where_clause(where)} "
        "ORDER BY i.id, l.reviewer", params).fetchall()
    by_item: dict[int, list[tuple[Any, ...]]] = {}
    for row in rows:
        by_item.setdefault(row[0], []).append(row)
    out, ties, gone = [], 0, 0
    for labels in by_item.values():
        _, conversation_id, criterion_id = labels[0][:3]
        human = majority([r[4] for r in labels])
        if human is None:
            ties += 1
            continue
        record = conversation_record(cur, conversation_id)
        if record is None:
            gone += 1
            continue
        verdict = one(cur.execute(
            "SELECT result, judge_model, judge_provider, criterion_version FROM verdicts WHERE conversation_id = ? "
            "AND criterion_id = ? AND NOT superseded AND NOT live ORDER BY seq DESC LIMIT 1",
            [conversation_id, criterion_id]))
        version = verdict[3] if verdict else _criterion(cur, criterion_id)["version"]
        out.append({**record, KEY: {
            "criterion_id": criterion_id, "criterion_version": version, "label": human,
            "labels": [{"reviewer": r[3], "label": r[4], "note": r[5]} for r in labels],
            "judge": {"result": verdict[0], "model": verdict[1], "provider": verdict[2]} if verdict else None}})
    return {"items": out, "left_out": {"ties": ties, "no_transcript": gone}}


def majority(labels: Sequence[str]) -> str | None:
    """The most frequent label; None on a tie (``judges.calibrate``'s rule)."""
    (top, count), *rest = Counter(labels).most_common()
    return None if rest and rest[0][1] == count else top
