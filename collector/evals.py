"""Online evals in DuckDB: sampling decisions, verdicts, not-run records and stats.

Every function takes a DuckDB cursor of the caller's (no globals, no threads);
the writers (``store_*``, ``record_sampling``, ``decide``) run in a transaction
of their own, so call them outside one.

Verdicts are stored once per (conversation, criterion, criterion version, judge
model, transcript hash): a judge call repeated after a crash stores nothing
new. The newest transcript of a conversation holds the current verdicts; those
of an older transcript are kept with ``superseded = true``. A verdict whose
result is in ``queue_results`` (and every flagged fail) opens a ``pending``
review item; ``error`` verdicts are never queued. A verdict replaces the
not-run record of its criterion on its conversation. The review queue is read and
decided in ``collector.review``.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import duckdb
import orjson
import pyarrow as pa
from pydantic import ValidationError

from judges import Criterion, LLMCriterion, Message, NotRun, Verdict, transcript_sha256, weighted_proportion

from .queries import conversation_record, iso_utc

SCHEMA = """
CREATE TABLE IF NOT EXISTS sampling_decisions (
    conversation_id VARCHAR PRIMARY KEY,
    revision INTEGER,
    transcript_hash VARCHAR,
    sampled BOOLEAN NOT NULL,
    probability DOUBLE NOT NULL,
    rule VARCHAR,
    skipped_reason VARCHAR,
    decided_at TIMESTAMPTZ NOT NULL
);
CREATE TABLE IF NOT EXISTS criteria (
    criterion_id VARCHAR NOT NULL,
    criterion_version INTEGER NOT NULL,
    kind VARCHAR NOT NULL,
    severity VARCHAR,
    criterion_group VARCHAR,
    text VARCHAR NOT NULL,
    first_seen_at TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (criterion_id, criterion_version)
);
CREATE SEQUENCE IF NOT EXISTS verdict_seq;
CREATE TABLE IF NOT EXISTS verdicts (
    id VARCHAR PRIMARY KEY,
    seq BIGINT NOT NULL,
    conversation_id VARCHAR NOT NULL,
    criterion_id VARCHAR NOT NULL,
    criterion_version INTEGER NOT NULL,
    judge_provider VARCHAR NOT NULL,
    judge_model VARCHAR NOT NULL,
    transcript_sha256 VARCHAR NOT NULL,
    result VARCHAR NOT NULL,
    error_reason VARCHAR,
    reasoning VARCHAR,
    evidence VARCHAR,
    evidence_verified BOOLEAN NOT NULL,
    flagged BOOLEAN NOT NULL,
    input_tokens BIGINT NOT NULL,
    output_tokens BIGINT NOT NULL,
    raw_reply VARCHAR,
    inclusion_probability DOUBLE NOT NULL,
    sampling_rule VARCHAR,
    judged_at TIMESTAMPTZ NOT NULL,
    superseded BOOLEAN NOT NULL
);
CREATE TABLE IF NOT EXISTS not_run (
    conversation_id VARCHAR NOT NULL,
    criterion_id VARCHAR NOT NULL,
    criterion_version INTEGER NOT NULL,
    reason VARCHAR NOT NULL,
    "at" TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (conversation_id, criterion_id, criterion_version)
);
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


_VERDICT_COLUMNS = (
    "id", "conversation_id", "criterion_id", "criterion_version", "judge_provider", "judge_model",
    "transcript_sha256", "result", "error_reason", "reasoning", "evidence", "evidence_verified", "flagged",
    "input_tokens", "output_tokens", "raw_reply", "inclusion_probability", "sampling_rule", "judged_at",
    "superseded",
)


def ensure_schema(cur: duckdb.DuckDBPyConnection) -> None:
    """Create the tables of this module when they do not exist yet."""
    cur.execute(SCHEMA)


def _now(now: dt.datetime | None) -> dt.datetime:
    return now if now is not None else dt.datetime.now(dt.timezone.utc)


class Transaction:
    """BEGIN ... COMMIT, or ROLLBACK when the block raises; inside another on the same cursor, part of it.

    The writers of this module each run in one; a caller that stores several
    things at once opens one around them all (one commit instead of many).
    """

    _open: set[int] = set()  # ids of cursors with a transaction open

    def __init__(self, cur: duckdb.DuckDBPyConnection) -> None:
        self.cur = cur
        self.outer = False

    def __enter__(self) -> duckdb.DuckDBPyConnection:
        if id(self.cur) not in Transaction._open:
            self.cur.execute("BEGIN TRANSACTION")
            Transaction._open.add(id(self.cur))
            self.outer = True
        return self.cur

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if self.outer:
            Transaction._open.discard(id(self.cur))
            self.cur.execute("COMMIT" if kind is None else "ROLLBACK")


# --- sampling decisions -------------------------------------------------------------------------


class SamplingRecord(NamedTuple):
    """One sampling decision as stored (see ``record_samplings``)."""

    conversation_id: str
    sampled: bool
    """Picked for judging (False also when a budget stopped it: see ``skipped_reason``)."""
    probability: float
    """Its inclusion probability under the matching rule, in [0, 1]."""
    rule: str | None
    """The rule that matched: ``rules[0]``, ... or ``default``."""
    revision: int | None = None
    """The conversation's revision when it was decided."""
    transcript_hash: str | None = None
    """The conversation's transcript hash when it was decided."""
    skipped_reason: str | None = None
    """Why a picked conversation is not judged (``budget:...``); kept out of the estimates."""


def record_samplings(cur: duckdb.DuckDBPyConnection, records: Sequence[SamplingRecord], *,
                     now: dt.datetime | None = None) -> None:
    """Store sampling decisions in one transaction, once each: a conversation's first decision stands."""
    if not records:
        return
    columns = {name: [getattr(r, name) for r in records] for name in SamplingRecord._fields}
    columns["decided_at"] = [_now(now)] * len(records)
    with Transaction(cur):
        _insert(cur, "_decisions", columns)
        cur.execute("INSERT INTO sampling_decisions SELECT conversation_id, revision, transcript_hash, sampled, "
                    "probability, rule, skipped_reason, decided_at FROM _decisions ON CONFLICT DO NOTHING")
        cur.unregister("_decisions")


def record_sampling(cur: duckdb.DuckDBPyConnection, conversation_id: str, *, sampled: bool, probability: float,
                    rule: str | None, revision: int | None = None, transcript_hash: str | None = None,
                    skipped_reason: str | None = None, now: dt.datetime | None = None) -> dict[str, Any]:
    """Store the sampling decision of one conversation (see ``SamplingRecord``), once: the first decision stands.

    Returns:
        The decision stored for the conversation, which is the earlier one if there was one.
    """
    record_samplings(cur, [SamplingRecord(conversation_id, sampled, probability, rule, revision, transcript_hash,
                                          skipped_reason)], now=now)
    decision = sampling_decision(cur, conversation_id)
    assert decision is not None  # just written or already there
    return decision


def sampling_decision(cur: duckdb.DuckDBPyConnection, conversation_id: str) -> dict[str, Any] | None:
    """The stored sampling decision of a conversation, or None when it was never decided."""
    cols = ("conversation_id", "revision", "transcript_hash", "sampled", "probability", "rule", "skipped_reason",
            "decided_at")
    row = cur.execute(f"SELECT {', '.join(cols)} FROM sampling_decisions WHERE conversation_id = ?",
                      [conversation_id]).fetchone()
    return None if row is None else {k: iso_utc(v) for k, v in zip(cols, row)}


# --- criteria, verdicts, not run ------------------------------------------------------------------


def _criterion_text(c: Criterion) -> str:
    if isinstance(c, LLMCriterion):
        return c.prompt
    params = c.params.model_dump(mode="json", exclude_defaults=True)
    text = f"Code check {c.check}" + (f" {orjson.dumps(params).decode()}" if params else "")
    if c.applies_if is not None:
        text += f"; applies if {orjson.dumps(c.applies_if.model_dump(mode='json', exclude_none=True)).decode()}"
    return text


def store_criteria(cur: duckdb.DuckDBPyConnection, criteria: Sequence[Criterion], *,
                   now: dt.datetime | None = None) -> None:
    """Remember each criterion version's text, group and severity.

    The review page shows the exact text a verdict was judged against, and stats
    group criteria as they were when judged, even after the files change.
    """
    at = _now(now)
    with Transaction(cur):
        for c in criteria:
            cur.execute("INSERT INTO criteria VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                        [c.id, c.version, c.kind, c.severity, c.group, _criterion_text(c), at])


def verdict_id(v: Verdict) -> str:
    """The id of a verdict: a digest of what makes it unique, so a repeated call maps to the same row."""
    key = "\x1f".join([v.conversation_id, v.criterion_id, str(v.criterion_version), v.judge.model,
                       v.transcript_sha256])
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]


def _current_sha256(cur: duckdb.DuckDBPyConnection, conversation_id: str) -> str | None:
    """The hash the judges see of the stored transcript; None when unknown (then storage order decides)."""
    record = conversation_record(cur, conversation_id)
    if record is None:
        return None
    try:
        return transcript_sha256([Message.model_validate(m) for m in record["messages"]])
    except ValidationError:
        return None


def store_verdicts(cur: duckdb.DuckDBPyConnection, verdicts: Iterable[Verdict], *, probability: float,
                   rule: str | None, queue_results: Sequence[str] = ("fail",), now: dt.datetime | None = None,
                   current: Mapping[str, str] | None = None) -> list[str]:
    """Store verdicts, supersede older transcripts' verdicts, and queue what needs a reviewer.

    Idempotent per (conversation, criterion, criterion version, judge model,
    transcript hash): storing the same verdict again changes nothing, except
    that an ``error`` is replaced by a later real verdict for the same key
    (errors are retried; the retry's answer is the verdict). A verdict judged
    on the conversation's current transcript marks the conversation's verdicts
    for that criterion on other transcripts superseded; one judged on a
    transcript that is no longer current (a late reply) is stored superseded.
    "Current" is the ``judges.transcript_sha256`` of the stored messages
    (``conversation_record``), or, for a conversation not stored, the last hash
    in the batch. A verdict on the current transcript replaces the criterion's
    not-run record on that conversation (a provider came, content was captured).

    Args:
        verdicts: from ``judges.run_judges`` / ``arun_judges``.
        probability: the inclusion probability of the conversations judged, in (0, 1].
        rule: the sampling rule that picked them.
        queue_results: results that open a pending review item (config ``review.queue_results``);
            every flagged fail is queued too, an ``error`` never.
        now: the daemon's clock (UTC).
        current: the current transcript hash of conversations the caller has just read
            (saves reading them again); the others are read.

    Returns:
        The ids of the verdicts stored or replaced by this call (not those already there).
    """
    if not 0 < probability <= 1:
        raise ValueError(f"probability must be in (0, 1], got {probability}")
    at = _now(now)
    # One verdict per key within the batch too: the first wins, unless it is an error and a real verdict follows.
    batch: dict[str, Verdict] = {}
    for v in verdicts:
        vid = verdict_id(v)
        if vid not in batch or (batch[vid].result == "error" and v.result != "error"):
            batch[vid] = v
    if not batch:
        return []
    known = current or {}
    hashes: dict[str, str | None] = {cid: known[cid] if cid in known else _current_sha256(cur, cid)
                                     for cid in {v.conversation_id for v in batch.values()}}
    # Without a stored transcript, the last hash in the batch is the newest.
    latest = {(v.conversation_id, v.criterion_id): v.transcript_sha256 for v in batch.values()}
    with Transaction(cur):
        existing = dict(cur.execute("SELECT id, result FROM verdicts WHERE list_contains(?, id)",
                                    [list(batch)]).fetchall())
        new = {vid: v for vid, v in batch.items()
               if vid not in existing or (existing[vid] == "error" and v.result != "error")}
        if not new:
            return []
        replaced = [vid for vid in new if vid in existing]
        if replaced:
            cur.execute("DELETE FROM verdicts WHERE list_contains(?, id)", [replaced])
        stale = {vid: (hashes[v.conversation_id] or latest[(v.conversation_id, v.criterion_id)])
                 != v.transcript_sha256 for vid, v in new.items()}
        fresh = [v for vid, v in new.items() if not stale[vid]]
        if fresh:
            _insert(cur, "_supersede", {
                "conversation_id": [v.conversation_id for v in fresh],
                "criterion_id": [v.criterion_id for v in fresh],
                "criterion_version": [v.criterion_version for v in fresh],
                "transcript_sha256": [v.transcript_sha256 for v in fresh]})
            cur.execute("UPDATE verdicts SET superseded = true FROM _supersede n "
                        "WHERE verdicts.conversation_id = n.conversation_id AND verdicts.criterion_id = n.criterion_id "
                        "AND verdicts.transcript_sha256 <> n.transcript_sha256 AND NOT verdicts.superseded")
            cur.execute("DELETE FROM not_run USING _supersede n WHERE not_run.conversation_id = n.conversation_id "
                        "AND not_run.criterion_id = n.criterion_id "
                        "AND not_run.criterion_version = n.criterion_version")
        rows = list(new.values())
        _insert(cur, "_new_verdicts", {
            "id": list(new), "conversation_id": [v.conversation_id for v in rows],
            "criterion_id": [v.criterion_id for v in rows], "criterion_version": [v.criterion_version for v in rows],
            "judge_provider": [v.judge.provider for v in rows], "judge_model": [v.judge.model for v in rows],
            "transcript_sha256": [v.transcript_sha256 for v in rows], "result": [v.result for v in rows],
            "error_reason": [v.error_reason for v in rows], "reasoning": [v.reasoning for v in rows],
            "evidence": [orjson.dumps(v.evidence).decode() for v in rows],
            "evidence_verified": [v.evidence_verified for v in rows], "flagged": [v.flagged for v in rows],
            "input_tokens": [v.usage.input_tokens for v in rows],
            "output_tokens": [v.usage.output_tokens for v in rows],
            "raw_reply": [v.raw_reply for v in rows], "inclusion_probability": [probability] * len(rows),
            "sampling_rule": [rule] * len(rows), "judged_at": [at] * len(rows),
            "superseded": [stale[vid] for vid in new], "batch_order": list(range(len(rows))),
        })
        cur.execute(f"INSERT INTO verdicts ({', '.join(_VERDICT_COLUMNS)}, seq) "
                    f"SELECT {', '.join(_VERDICT_COLUMNS)}, nextval('verdict_seq') "
                    "FROM (SELECT * FROM _new_verdicts ORDER BY batch_order)")
        queued = [vid for vid, v in new.items() if not stale[vid] and v.result != "error"
                  and (v.result in queue_results or (v.result == "fail" and v.flagged))]
        if queued:
            cur.execute("INSERT INTO review_items (id, verdict_id, conversation_id, criterion_id, state, created_at) "
                        "SELECT nextval('review_item_seq'), id, conversation_id, criterion_id, 'pending', ? "
                        "FROM (SELECT * FROM _new_verdicts WHERE list_contains(?, id) "
                        "AND id NOT IN (SELECT verdict_id FROM review_items) ORDER BY batch_order)",
                        [at, queued])
        for name in ("_supersede", "_new_verdicts"):
            cur.unregister(name)
    return list(new)


def _insert(cur: duckdb.DuckDBPyConnection, name: str, columns: dict[str, list[Any]]) -> None:
    """Register columns as a view for one bulk statement (row-by-row inserts are slow in DuckDB)."""
    cur.register(name, pa.table(columns))


def store_not_run(cur: duckdb.DuckDBPyConnection, not_run: Iterable[NotRun], *,
                  now: dt.datetime | None = None) -> None:
    """Record criteria that could not run (no provider, no content, budget), the latest reason winning."""
    at = _now(now)
    with Transaction(cur):
        for r in not_run:
            cur.execute('INSERT INTO not_run VALUES (?, ?, ?, ?, ?) ON CONFLICT DO UPDATE SET '
                        'reason = excluded.reason, "at" = excluded."at"',
                        [r.conversation_id, r.criterion_id, r.criterion_version, r.reason, at])


def _verdict_dict(row: Sequence[Any]) -> dict[str, Any]:
    d = dict(zip(_VERDICT_COLUMNS, row))
    return {
        "id": d["id"], "conversation_id": d["conversation_id"], "criterion_id": d["criterion_id"],
        "criterion_version": d["criterion_version"], "result": d["result"], "error_reason": d["error_reason"],
        "reasoning": d["reasoning"] or "", "evidence": orjson.loads(d["evidence"] or "[]"),
        "evidence_verified": d["evidence_verified"], "flagged": d["flagged"],
        "judge": {"provider": d["judge_provider"], "model": d["judge_model"]},
        "usage": {"input_tokens": d["input_tokens"], "output_tokens": d["output_tokens"]},
        "transcript_sha256": d["transcript_sha256"], "raw_reply": d["raw_reply"] or "",
        "inclusion_probability": d["inclusion_probability"], "sampling_rule": d["sampling_rule"],
        "judged_at": iso_utc(d["judged_at"]), "superseded": d["superseded"],
    }


def list_verdicts(cur: duckdb.DuckDBPyConnection, result: str | None = None, criterion: str | None = None,
                  since: dt.datetime | None = None, *, conversation: str | None = None,
                  include_superseded: bool = False, limit: int | None = None) -> list[dict[str, Any]]:
    """Stored verdicts, the newest first (``tracejudge verdicts --result error`` lists errors with reasons).

    Args:
        result: only this result (``pass``, ``fail``, ``not_applicable``, ``error``).
        criterion: only this criterion id.
        since: only verdicts judged at or after this time.
        conversation: only verdicts on this conversation id.
        include_superseded: also verdicts of older transcripts.
        limit: at most this many.

    Returns:
        Verdicts in the shape of docs/criteria.md, plus ``id``, ``inclusion_probability``,
        ``sampling_rule``, ``judged_at`` and ``superseded``.
    """
    where, params = _filters(result=result, criterion=criterion, since=since)
    if conversation is not None:
        where.append("conversation_id = ?")
        params.append(conversation)
    if not include_superseded:
        where.append("NOT superseded")
    sql = (f"SELECT {', '.join(_VERDICT_COLUMNS)} FROM verdicts {_where(where)} ORDER BY seq DESC"
           + (" LIMIT ?" if limit is not None else ""))
    rows = cur.execute(sql, params + ([limit] if limit is not None else [])).fetchall()
    return [_verdict_dict(r) for r in rows]


def _filters(*, result: str | None = None, criterion: str | None = None, since: dt.datetime | None = None,
             prefix: str = "") -> tuple[list[str], list[Any]]:
    where: list[str] = []
    params: list[Any] = []
    for column, value in (("result", result), ("criterion_id", criterion)):
        if value is not None:
            where.append(f"{prefix}{column} = ?")
            params.append(value)
    if since is not None:
        where.append(f"{prefix}judged_at >= ?")
        params.append(since)
    return where, params


def _where(where: list[str]) -> str:
    return "WHERE " + " AND ".join(where) if where else ""


# --- stats -------------------------------------------------------------------------------------------

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
                "count": rate.count, "n": rate.n, "method": rate.method},
            "review": {"pending": self.review["pending"], "confirmed": self.review["confirmed"],
                       "rejected": self.review["rejected"],
                       "fails_rejected_share": self.fail_review["rejected"] / decided if decided else None},
            "errors": dict(self.errors), "not_run_reasons": dict(self.not_run_reasons),
        }


def _current(since: dt.datetime | None, criterion: str | None) -> tuple[str, list[Any]]:
    """The verdicts that count, per (conversation, criterion): current transcript, newest version, newest."""
    where, params = _filters(criterion=criterion, since=since)
    where.append("NOT superseded")
    return (f"SELECT * FROM verdicts {_where(where)} QUALIFY row_number() OVER (PARTITION BY conversation_id, "
            "criterion_id ORDER BY criterion_version DESC, seq DESC) = 1"), params


def stats(cur: duckdb.DuckDBPyConnection, since: dt.datetime | None = None,
          criterion: str | None = None) -> dict[str, Any]:
    """Counts, honest failure rates and review outcomes, per criterion and per group.

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

    Returns:
        ``{"criteria": [...], "groups": [...], "conversations": {"ended", "sampled",
        "not_sampled", "skipped", "judged"}, "tokens": {"input_tokens", "output_tokens"}}``;
        each criterion entry has ``criterion_id``, ``criterion_version``, ``group``,
        ``judged``, ``pass``, ``fail``, ``not_applicable``, ``error``, ``not_run``,
        ``pass_unverified``, ``flagged``, ``failure_rate`` ({``estimate``, ``low``,
        ``high``, ``n_eff``, ``count``, ``n``, ``method``} or None), ``review``
        ({``pending``, ``confirmed``, ``rejected``, ``fails_rejected_share``}),
        ``errors`` (by reason code) and ``not_run_reasons``; group entries have
        ``group`` in place of the criterion's id, version and group.
    """
    current, params = _current(since, criterion)
    # Aggregated in DuckDB: a few rows per criterion however many verdicts there are.
    rows = cur.execute(
        "SELECT v.criterion_id, max(v.criterion_version), v.result, v.evidence_verified, v.flagged, "
        "CASE WHEN v.result = 'error' THEN split_part(coalesce(v.error_reason, ''), ':', 1) END AS code, "
        "v.inclusion_probability, r.state, count(*) "
        f"FROM ({current}) v LEFT JOIN review_items r ON r.verdict_id = v.id "
        "GROUP BY v.criterion_id, v.result, v.evidence_verified, v.flagged, code, v.inclusion_probability, r.state",
        params).fetchall()
    nr_where = ["NOT EXISTS (SELECT 1 FROM verdicts v WHERE v.conversation_id = n.conversation_id "
                "AND v.criterion_id = n.criterion_id AND NOT v.superseded)"]
    nr_params: list[Any] = []
    if criterion is not None:
        nr_where.append("n.criterion_id = ?")
        nr_params.append(criterion)
    if since is not None:
        nr_where.append('n."at" >= ?')
        nr_params.append(since)
    not_run = cur.execute(
        "SELECT criterion_id, max(criterion_version), reason, count(*) FROM (SELECT * FROM not_run n "
        f"{_where(nr_where)} QUALIFY row_number() OVER (PARTITION BY conversation_id, criterion_id "
        "ORDER BY criterion_version DESC) = 1) GROUP BY criterion_id, reason", nr_params).fetchall()
    groups_of: dict[str, str | None] = dict(cur.execute(
        "SELECT criterion_id, criterion_group FROM criteria QUALIFY row_number() OVER "
        "(PARTITION BY criterion_id ORDER BY criterion_version DESC) = 1").fetchall())

    crits: dict[str, _Tally] = defaultdict(_Tally)
    groups: dict[str, _Tally] = defaultdict(_Tally)
    versions: dict[str, int] = {}
    for cid, version, result, verified, flagged, code, p, review, n in rows:
        versions[cid] = max(versions.get(cid, 0), version)
        for t in (crits[cid], *([groups[g]] if (g := groups_of.get(cid)) else [])):
            t.add(result, verified, flagged, code, p, review, n)
    for cid, version, reason, n in not_run:
        versions[cid] = max(versions.get(cid, 0), version)
        for t in (crits[cid], *([groups[g]] if (g := groups_of.get(cid)) else [])):
            t.counts["not_run"] += n
            t.not_run_reasons[reason] += n
    judged = cur.execute(f"SELECT count(DISTINCT conversation_id) FROM ({current})", params).fetchone()
    return {
        "criteria": [{"criterion_id": cid, "criterion_version": versions[cid], "group": groups_of.get(cid),
                      **crits[cid].entry()} for cid in sorted(crits)],
        "groups": [{"group": g, **groups[g].entry()} for g in sorted(groups)],
        "conversations": {**_conversation_counts(cur, since), "judged": int(judged[0]) if judged else 0},
        "tokens": _tokens(cur, since, criterion),
    }


def _conversation_counts(cur: duckdb.DuckDBPyConnection, since: dt.datetime | None) -> dict[str, Any]:
    ended_sql = "SELECT count(*) FROM conversations WHERE state = 'ended'"
    params: list[Any] = []
    if since is not None:
        ended_sql += " AND closed_at >= ?"
        params.append(since)
    ended_row = cur.execute(ended_sql, params).fetchone()
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


def _tokens(cur: duckdb.DuckDBPyConnection, since: dt.datetime | None, criterion: str | None) -> dict[str, int]:
    # Tokens are money spent: superseded verdicts count too.
    where, params = _filters(criterion=criterion, since=since)
    row = cur.execute(f"SELECT coalesce(sum(input_tokens), 0), coalesce(sum(output_tokens), 0) FROM verdicts "
                      f"{_where(where)}", params).fetchone()
    return {"input_tokens": int(row[0]) if row else 0, "output_tokens": int(row[1]) if row else 0}
