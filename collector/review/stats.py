"""Failure rates of production traffic, with what reviewers made of the failures (``tracejudge stats``).

Per criterion and per group: raw counts of current verdicts, the failure rate
among applicable verdicts estimated for all traffic (each verdict weighs 1 / its
inclusion probability; the 95% interval uses the effective sample size), the
criteria that could not run and why, and the review outcomes of the fails.
It lives with the review stage because it reads both the evals stage's verdicts
and the queue's decisions.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter, defaultdict
from typing import Any, Literal, NamedTuple

import duckdb

from judges import CriterionCalibration, Pair, Proportion, calibrate, weighted_proportion

from ..config import Review
from ..evals import simulations
from ..evals.verdicts import not_run_table, verdict_filters, verdicts_table, where_clause
from ..store.transactions import Transaction, one
from . import calibration

Source = Literal["production", "simulation"]
SOURCES: tuple[Source, ...] = ("production", "simulation")

_COUNTED = ("pass", "fail", "not_applicable", "error", "not_run", "pass_unverified", "flagged")


class _Tally:
    """Raw counts of one criterion or group, and the (failed, weight) pairs of its applicable verdicts."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.not_run_reasons: Counter[str] = Counter()
        self.review: Counter[str] = Counter()
        self.fail_review: Counter[str] = Counter()
        self.pairs: list[tuple[bool, float]] = []
        self.judged = 0

    def add(self, result: str, verified: bool, flagged: bool, error_code: str | None, p: float,
            review: str | None, n: int) -> None:
        self.judged += n
        if result == "pass" and not verified:
            self.counts["pass_unverified"] += n  # never a clean pass, kept out of the rate
        else:
            self.counts[result] += n
        if result == "fail" and flagged:
            self.counts["flagged"] += n
        if result == "error":
            self.errors[error_code or ""] += n
        if result == "fail" or (result == "pass" and verified):
            self.pairs += [(result == "fail", 1 / p)] * n
        if review is not None:
            self.review[review] += n
            if result == "fail":
                self.fail_review[review] += n

    def entry(self) -> dict[str, Any]:
        rate = weighted_proportion(self.pairs)
        decided = self.fail_review["confirmed"] + self.fail_review["rejected"]
        return {
            "judged": self.judged, **{k: self.counts[k] for k in _COUNTED},
            "failure_rate": None if rate is None else {
                "estimate": rate.estimate, "low": rate.low, "high": rate.high, "n_eff": rate.n_eff,
                "count": rate.count, "n": rate.n, "method": rate.method, "too_few": rate.too_few},
            "review": {"pending": self.review["pending"], "confirmed": self.review["confirmed"],
                       "rejected": self.review["rejected"], "unclear": self.review["unclear"],
                       "fails_rejected_share": self.fail_review["rejected"] / decided if decided else None},
            "errors": dict(self.errors), "not_run_reasons": dict(self.not_run_reasons),
        }


def _current(table: str, since: dt.datetime | None, criterion: str | None) -> tuple[str, list[Any]]:
    """The verdicts that count, per (conversation, criterion): current transcript, newest version, newest;
    never a live one (made on the open conversation: the verdict at its end counts)."""
    where, params = verdict_filters(criterion=criterion, since=since)
    where.append("NOT superseded AND NOT live")
    return (f"SELECT * FROM {table} {where_clause(where)} QUALIFY row_number() OVER (PARTITION BY conversation_id, "
            "criterion_id ORDER BY criterion_version DESC, seq DESC) = 1"), params


def stats(cur: duckdb.DuckDBPyConnection, since: dt.datetime | None = None,
          criterion: str | None = None, source: Source = "production",
          max_false_pass: float | None = None) -> dict[str, Any]:
    """Counts, honest failure rates and review outcomes, per criterion and per group.

    Of production traffic by default; ``source="simulation"`` gives the same figures for the
    simulated conversations ``replay import`` stored (each verdict weighs 1: a suite is not a sample),
    whose ``conversations`` are ``{"imported", "judged"}``.

    Counts are raw counts of current verdicts: for each conversation and
    criterion the verdict on its current transcript with the newest criterion
    version. ``failure_rate`` is the estimate for all production traffic among
    applicable verdicts (clean pass + fail), each weighted by 1/inclusion
    probability, with a 95% interval from the effective sample size (the
    statistics of ``judges``); None when nothing was applicable. Passes with
    unverified evidence are counted apart and kept out of the rate. Groups are
    those ``store_criteria`` recorded for each criterion's newest version.

    Args:
        since: only verdicts judged (and conversations ended, decided, not run) at or after this time.
        criterion: only this criterion id.
        source: ``production`` or ``simulation``.
        max_false_pass: ``review.max_false_pass`` for ``calibrated`` [default: the config's default].

    Returns:
        ``{"criteria": [...], "groups": [...], "conversations": {"ended", "sampled",
        "not_sampled", "skipped", "judged"}, "tokens": {"input_tokens", "output_tokens"}}``;
        each criterion entry has ``criterion_id``, ``criterion_version``, ``group``,
        ``judged``, ``pass``, ``fail``, ``not_applicable``, ``error``, ``not_run``,
        ``pass_unverified``, ``flagged``, ``failure_rate`` ({``estimate``, ``low``,
        ``high``, ``n_eff``, ``count``, ``n``, ``method``, ``too_few``} or None), ``review``
        ({``pending``, ``confirmed``, ``rejected``, ``fails_rejected_share``}),
        ``errors`` (by reason code), ``not_run_reasons`` and ``calibrated`` (``judges.calibrate`` on
        every blind label of the criterion, whatever ``since`` and ``source``: true, false, or None
        without labels) with ``calibration_reason`` (its reason code when false, else None); group
        entries have ``group`` in place of the criterion's id, version and group, and neither.
    """
    return stats_of([stats_rows(cur, since=since, criterion=criterion, source=source)], max_false_pass)


class Window(NamedTuple):
    """The current production verdicts judged since a time (``window``)."""

    judged: int
    """Verdicts, whatever their result (a conversation counts once per criterion)."""
    error: int
    """Of them, judge errors."""
    failure_rate: Proportion | None
    """Weighted, among clean passes and fails, as ``stats`` gives it; None when there were none."""


def window(cur: duckdb.DuckDBPyConnection, since: dt.datetime, criterion: str | None = None) -> Window:
    """The current production verdicts (of ``criterion``, else of every criterion) judged at or after ``since``,
    counted and weighted as ``stats`` counts them: what a monitor reads over its window."""
    current, params = _current("verdicts", since, criterion)
    tally = _Tally()
    # Sorted: the weighted sums then add up in one order, and a reading taken twice is the same.
    for result, verified, flagged, p, n in cur.execute(
            f"SELECT result, evidence_verified, flagged, inclusion_probability, count(*) FROM ({current}) "
            "GROUP BY ALL ORDER BY ALL", params).fetchall():
        tally.add(result, verified, flagged, None, p, None, n)
    return Window(judged=tally.judged, error=tally.counts["error"], failure_rate=weighted_proportion(tally.pairs))


def stats_rows(cur: duckdb.DuckDBPyConnection, since: dt.datetime | None = None,
               criterion: str | None = None, source: Source = "production") -> dict[str, Any]:
    """What ``stats`` is computed from, as JSON: the current verdicts and not-run records counted per
    distinct value, the newest group of each criterion, and the conversation and token counts.

    The rows of several stores (daemons behind a load balancer, each with its file) put together are the
    rows of one store holding all of theirs, so ``stats_of`` over them gives the figures of the whole
    sample (conversation ids being unique to one store each).

    Returns:
        ``{"verdicts": [[criterion_id, criterion_version, result, evidence_verified, flagged, error_code,
        inclusion_probability, review_state, n], ...], "not_run": [[criterion_id, criterion_version, reason,
        n], ...], "criteria": [[criterion_id, criterion_version, group], ...], "judged": n,
        "conversations": {...}, "tokens": {...}, "calibration": [[criterion_id, conversation_id, reviewer,
        label, current verdict's result or None], ...]}``.
    """
    with Transaction(cur):  # one snapshot: counted apart, conversations and verdicts judged meanwhile would not agree
        return _stats_rows(cur, since, criterion, source)


def _stats_rows(cur: duckdb.DuckDBPyConnection, since: dt.datetime | None, criterion: str | None,
                source: Source) -> dict[str, Any]:
    simulated = source == "simulation"
    if simulated and not simulations.present(cur):  # nothing was imported into this file
        return {"verdicts": [], "not_run": [], "criteria": [], "judged": 0, "conversations": {"imported": 0},
                "tokens": {"input_tokens": 0, "output_tokens": 0}, "calibration": _labels(cur, criterion)}
    table, not_run_of = verdicts_table(simulated), not_run_table(simulated)
    current, params = _current(table, since, criterion)
    # Aggregated in DuckDB: a few rows per criterion however many verdicts there are. A fail whose
    # conversation and criterion had a live item opened none of its own: the live item is its review.
    rows = cur.execute(
        "SELECT v.criterion_id, max(v.criterion_version), v.result, v.evidence_verified, v.flagged, "
        "CASE WHEN v.result = 'error' THEN split_part(coalesce(v.error_reason, ''), ':', 1) END AS code, "
        "v.inclusion_probability, coalesce(r.state, l.state) AS review_state, count(*) "
        f"FROM ({current}) v LEFT JOIN review_items r ON r.verdict_id = v.id "
        "LEFT JOIN review_items l ON l.live AND v.result = 'fail' AND l.conversation_id = v.conversation_id "
        "AND l.criterion_id = v.criterion_id "
        "GROUP BY v.criterion_id, v.result, v.evidence_verified, v.flagged, code, v.inclusion_probability, "
        "review_state",
        params).fetchall()
    nr_where = [f"NOT EXISTS (SELECT 1 FROM {table} v WHERE v.conversation_id = n.conversation_id "
                "AND v.criterion_id = n.criterion_id AND NOT v.superseded AND NOT v.live)"]
    nr_params: list[Any] = []
    if criterion is not None:
        nr_where.append("n.criterion_id = ?")
        nr_params.append(criterion)
    if since is not None:
        nr_where.append('n."at" >= ?')
        nr_params.append(since)
    not_run = cur.execute(
        f"SELECT criterion_id, max(criterion_version), reason, count(*) FROM (SELECT * FROM {not_run_of} n "
        f"{where_clause(nr_where)} QUALIFY row_number() OVER (PARTITION BY conversation_id, criterion_id "
        "ORDER BY criterion_version DESC) = 1) GROUP BY criterion_id, reason", nr_params).fetchall()
    criteria = cur.execute(
        "SELECT criterion_id, criterion_version, criterion_group FROM criteria QUALIFY row_number() OVER "
        "(PARTITION BY criterion_id ORDER BY criterion_version DESC) = 1").fetchall()
    judged_row = one(cur.execute(f"SELECT count(DISTINCT conversation_id) FROM ({current})", params))
    return {
        "verdicts": [list(r) for r in rows],
        "not_run": [list(r) for r in not_run],
        "criteria": [list(r) for r in criteria],
        "judged": int(judged_row[0]) if judged_row else 0,
        "conversations": {"imported": simulations.count(cur)} if simulated else _conversation_counts(cur, since),
        "tokens": _tokens(cur, table, since, criterion),
        "calibration": _labels(cur, criterion),
    }


def _sortable(value: Any) -> tuple[bool, Any]:
    return (value is not None, "" if value is None else value)


def _sum_counts(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Conversation counts added up, ``skipped`` per reason."""
    out: dict[str, Any] = {}
    for counts in parts:
        for k, v in counts.items():
            if isinstance(v, dict):
                into = out.setdefault(k, {})
                for reason, n in v.items():
                    into[reason] = into.get(reason, 0) + n
            else:
                out[k] = out.get(k, 0) + v
    return out


def _labels(cur: duckdb.DuckDBPyConnection, criterion: str | None) -> list[list[Any]]:
    """Every blind label beside the current verdict (``calibration.pairs``); none in a file without the tables."""
    found = one(cur.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = 'calibration_labels'"
                        ))
    return [list(p) for p in calibration.pairs(cur, criterion)] if found and found[0] else []


def _calibrated(parts: list[dict[str, Any]], max_false_pass: float | None) -> dict[str, CriterionCalibration] | None:
    """criterion id -> its calibration, on the labels of all the stores; None when a store gave no labels (an
    older daemon's rows): a verdict on part of the labels would mislead."""
    if any("calibration" not in part for part in parts):
        return None
    # Items are told apart by store, as verdicts are counted: a conversation id two stores hold is two items.
    pairs = [Pair(c, f"{n}\x00{item}", who, human, judge)
             for n, part in enumerate(parts) for c, item, who, human, judge in part["calibration"]]
    limit = Review().max_false_pass if max_false_pass is None else max_false_pass
    return {c.criterion_id: c for c in calibrate(pairs, max_false_pass=limit).criteria}


def _mark(c: CriterionCalibration | None) -> dict[str, Any]:
    """``calibrated`` and ``calibration_reason`` of a criterion's stats entry; both None without labels."""
    return {"calibrated": c.calibrated if c else None, "calibration_reason": c.reason if c else None}


def stats_of(parts: list[dict[str, Any]], max_false_pass: float | None = None) -> dict[str, Any]:
    """The figures of ``stats`` over the ``stats_rows`` of one or more stores, computed once over all the rows.

    Rows equal in every value but the count are counted together, and visited in one order whatever store
    they came from, so the rows of two stores give exactly what one store holding both would. ``calibrated``
    is likewise computed on the union of the stores' labels (None everywhere when a store sent none).
    """
    verdict_rows: dict[tuple[Any, ...], list[int]] = {}
    for part in parts:
        for cid, version, result, verified, flagged, code, p, review, n in part["verdicts"]:
            key = (cid, result, bool(verified), bool(flagged), code, float(p), review)
            seen = verdict_rows.setdefault(key, [0, 0])
            seen[0], seen[1] = max(seen[0], version), seen[1] + n
    not_run_rows: dict[tuple[str, str], list[int]] = {}
    for part in parts:
        for cid, version, reason, n in part["not_run"]:
            seen = not_run_rows.setdefault((cid, reason), [0, 0])
            seen[0], seen[1] = max(seen[0], version), seen[1] + n
    newest: dict[str, tuple[int, str | None]] = {}  # the group recorded for each criterion's newest version
    for part in parts:
        for cid, version, group in part["criteria"]:
            if cid not in newest or version > newest[cid][0]:
                newest[cid] = (version, group)
    groups_of = {cid: group for cid, (_, group) in newest.items()}

    crits: dict[str, _Tally] = defaultdict(_Tally)
    groups: dict[str, _Tally] = defaultdict(_Tally)
    versions: dict[str, int] = {}
    for key in sorted(verdict_rows, key=lambda k: tuple(_sortable(x) for x in k)):
        cid, result, verified, flagged, code, p, review = key
        version, n = verdict_rows[key]
        versions[cid] = max(versions.get(cid, 0), version)
        for t in (crits[cid], *([groups[g]] if (g := groups_of.get(cid)) else [])):
            t.add(result, verified, flagged, code, p, review, n)
    for (cid, reason), (version, n) in sorted(not_run_rows.items()):
        versions[cid] = max(versions.get(cid, 0), version)
        for t in (crits[cid], *([groups[g]] if (g := groups_of.get(cid)) else [])):
            t.counts["not_run"] += n
            t.not_run_reasons[reason] += n
    tokens = _sum_counts([part["tokens"] for part in parts])
    marks = _calibrated(parts, max_false_pass) or {}
    return {
        "criteria": [{"criterion_id": cid, "criterion_version": versions[cid], "group": groups_of.get(cid),
                      **crits[cid].entry(), **_mark(marks.get(cid))} for cid in sorted(crits)],
        "groups": [{"group": g, **groups[g].entry()} for g in sorted(groups)],
        "conversations": {**_sum_counts([part["conversations"] for part in parts]),
                          "judged": sum(part["judged"] for part in parts)},
        "tokens": {"input_tokens": tokens.get("input_tokens", 0), "output_tokens": tokens.get("output_tokens", 0)},
    }


def _conversation_counts(cur: duckdb.DuckDBPyConnection, since: dt.datetime | None) -> dict[str, Any]:
    ended_sql = "SELECT count(*) FROM conversations WHERE state = 'ended'"
    params: list[Any] = []
    if since is not None:
        ended_sql += " AND closed_at >= ?"
        params.append(since)
    ended_row = one(cur.execute(ended_sql, params))
    decided = cur.execute(
        "SELECT sampled, skipped_reason, count(*) FROM sampling_decisions "
        + ("WHERE decided_at >= ? " if since is not None else "") + "GROUP BY ALL",
        [since] if since is not None else []).fetchall()
    skipped: dict[str, int] = {}
    for _, reason, n in decided:
        if reason is not None:
            skipped[reason] = skipped.get(reason, 0) + n
    return {
        "ended": int(ended_row[0]) if ended_row else 0,
        "sampled": sum(n for sampled, reason, n in decided if sampled and reason is None),
        "not_sampled": sum(n for sampled, reason, n in decided if not sampled and reason is None),
        "skipped": skipped,
    }


def _tokens(cur: duckdb.DuckDBPyConnection, table: str, since: dt.datetime | None,
            criterion: str | None) -> dict[str, int]:
    # Tokens are money spent: superseded and live verdicts count too.
    where, params = verdict_filters(criterion=criterion, since=since)
    row = one(cur.execute(f"SELECT coalesce(sum(input_tokens), 0), coalesce(sum(output_tokens), 0) FROM {table} "
                          f"{where_clause(where)}", params))
    return {"input_tokens": int(row[0]) if row else 0, "output_tokens": int(row[1]) if row else 0}
