"""What the evals stage stores: sampling decisions, criteria texts, verdicts and not-run records.

Every function takes a DuckDB cursor of the caller's (no globals, no threads);
each writer runs in a transaction of its own, or in the caller's when one is open
on that cursor (``store.Transaction``).

Verdicts are stored once per (conversation, criterion, criterion version, judge
model, transcript hash): a judge call repeated after a crash stores nothing
new. The newest transcript of a conversation holds the current verdicts; those
of an older transcript are kept with ``superseded = true``. A verdict replaces
the not-run record of its criterion on its conversation. Which verdicts a
reviewer sees is the review stage's to decide (``review.queue.open_items``),
from the ids ``store_verdicts`` returns.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import duckdb
import orjson
from pydantic import ValidationError

from judges import Criterion, LLMCriterion, Message, NotRun, Verdict, transcript_sha256

from ..conversations.record import conversation_record
from ..words import iso_utc
from ..store.arrow import Table
from ..store.schema import drop_primary_key
from ..store.transactions import Transaction, one, registered, registered_rows, utc_now

# ``sampling_decisions``, ``verdicts`` and ``not_run`` have no key: a key's index stays whole in DuckDB's
# memory for as long as the rows are kept, and theirs with ``eval_progress``'s took 244-257 bytes a
# conversation kept against 94-99 without (``bench/conversation_keys.py``). Nothing read them by key: the
# evaluator's scans join whole tables. A row is stored once by reading first, in the same transaction:
# sampling decisions by the evaluator's scan alone, the rest by ``Judging.store``, whose stores take
# turns (``judging.STORING``).
UNKEYED = {
    "sampling_decisions": """CREATE TABLE IF NOT EXISTS {name} (
    conversation_id VARCHAR NOT NULL,
    revision INTEGER,
    transcript_hash VARCHAR,
    sampled BOOLEAN NOT NULL,
    probability DOUBLE NOT NULL,
    rule VARCHAR,
    skipped_reason VARCHAR,
    decided_at TIMESTAMPTZ NOT NULL
)""",
    "verdicts": """CREATE TABLE IF NOT EXISTS {name} (
    id VARCHAR NOT NULL,
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
    superseded BOOLEAN NOT NULL,
    live BOOLEAN NOT NULL DEFAULT false
)""",
    "not_run": """CREATE TABLE IF NOT EXISTS {name} (
    conversation_id VARCHAR NOT NULL,
    criterion_id VARCHAR NOT NULL,
    criterion_version INTEGER NOT NULL,
    reason VARCHAR NOT NULL,
    "at" TIMESTAMPTZ NOT NULL
)""",
}
SCHEMA = f"""
{UNKEYED["sampling_decisions"].format(name="sampling_decisions")};
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
{UNKEYED["verdicts"].format(name="verdicts")};
{UNKEYED["not_run"].format(name="not_run")};
CREATE TABLE IF NOT EXISTS evals_state (key VARCHAR PRIMARY KEY, value VARCHAR);
"""


NOT_RUN_COLUMNS = ("conversation_id", "criterion_id", "criterion_version", "reason", "at")
VERDICT_COLUMNS = (
    "id", "conversation_id", "criterion_id", "criterion_version", "judge_provider", "judge_model",
    "transcript_sha256", "result", "error_reason", "reasoning", "evidence", "evidence_verified", "flagged",
    "input_tokens", "output_tokens", "raw_reply", "inclusion_probability", "sampling_rule", "judged_at",
    "superseded", "live",
)


def verdicts_table(simulated: bool = False) -> str:
    """Where verdicts are kept: production's in ``verdicts``, simulated conversations' apart (``simulations``)."""
    return "simulated_verdicts" if simulated else "verdicts"


def not_run_table(simulated: bool = False) -> str:
    """Where not-run records are kept, as ``verdicts_table``."""
    return "simulated_not_run" if simulated else "not_run"


def ensure_schema(cur: duckdb.DuckDBPyConnection) -> None:
    """Create the tables of this module when they do not exist yet, and bring older verdicts' digests up to date."""
    cur.execute(SCHEMA)
    for table, ddl in UNKEYED.items():
        drop_primary_key(cur, table, ddl.format(name=f"{table}_unkeyed"), "its index grew with what is kept")
    add_live_column(cur, "verdicts")
    migrate_digests(cur)


def add_live_column(cur: duckdb.DuckDBPyConnection, table: str) -> None:
    """``live`` on a verdicts table of a file older than live criteria: its verdicts were all made at the end."""
    cur.execute(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS live BOOLEAN DEFAULT false")


# --- the transcript digest across upgrades -----------------------------------------------------------

DIGEST = "rendered"
"""What ``judges.transcript_sha256`` hashes: the transcript block as rendered for a judge."""


def _json_digest(messages: Sequence[Message]) -> str:
    # The digest before it covered the rendered block (tool names on TOOL lines were left out).
    # Kept only to recognise verdicts stored under it; see ``migrate_digests``.
    reduced = [{"role": m.role, "content": m.content, "tool_calls": [{"name": c.name, "arguments": c.arguments}
                                                                      for c in m.tool_calls],
                "tool_call_id": m.tool_call_id} for m in messages]
    canonical = json.dumps(reduced, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def migrate_digests(cur: duckdb.DuckDBPyConnection) -> int:
    """Once per file: move verdicts judged under the earlier digest formula to the current one.

    A verdict whose digest is the earlier formula's digest of its conversation's
    stored transcript was judged on that transcript; it gets the current digest
    of the same transcript, so a changed formula alone judges nothing again.
    Other verdicts were judged on a transcript since replaced and keep their
    digest, which no current transcript has. Error verdicts also get the id of
    their new key, so that their retry replaces them as before. A conversation's
    own ``transcript_hash`` takes the current formula at its next rebuild.

    Returns:
        How many verdicts moved.
    """
    row = one(cur.execute("SELECT value FROM evals_state WHERE key = 'transcript_digest'"))
    if row is not None and row[0] == DIGEST:
        return 0
    moved = 0
    with Transaction(cur):
        for (cid,) in cur.execute("SELECT DISTINCT conversation_id FROM verdicts").fetchall():
            record = conversation_record(cur, cid)
            if record is None:
                continue
            try:
                messages = [Message.model_validate(m) for m in record["messages"]]
            except ValidationError:
                continue
            old, new = _json_digest(messages), transcript_sha256(messages)
            if old == new:
                continue
            errors = cur.execute("SELECT id, criterion_id, criterion_version, judge_model FROM verdicts "
                                 "WHERE conversation_id = ? AND transcript_sha256 = ? AND result = 'error'",
                                 [cid, old]).fetchall()
            for vid, criterion, version, model in errors:
                cur.execute("UPDATE verdicts SET id = ? WHERE id = ?",
                            [_verdict_key(cid, criterion, version, model, new), vid])
            n = one(cur.execute("UPDATE verdicts SET transcript_sha256 = ? WHERE conversation_id = ? "
                            "AND transcript_sha256 = ?", [new, cid, old]))
            moved += int(n[0]) if n else 0
        cur.execute("INSERT OR REPLACE INTO evals_state VALUES ('transcript_digest', ?)", [DIGEST])
    return moved


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
    first = list({r.conversation_id: r for r in reversed(records)}.values())
    if not first:
        return
    columns = {name: [getattr(r, name) for r in first] for name in SamplingRecord._fields}
    columns["decided_at"] = [utc_now(now)] * len(first)
    with Transaction(cur), registered(cur, "_decisions", Table(columns)):
        cur.execute("INSERT INTO sampling_decisions SELECT conversation_id, revision, transcript_hash, sampled, "
                    "probability, rule, skipped_reason, decided_at FROM _decisions d WHERE NOT EXISTS "
                    "(SELECT 1 FROM sampling_decisions s WHERE s.conversation_id = d.conversation_id)")


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
    row = one(cur.execute(f"SELECT {', '.join(cols)} FROM sampling_decisions WHERE conversation_id = ?",
                      [conversation_id]))
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
    at = utc_now(now)
    with Transaction(cur):
        for c in criteria:
            cur.execute("INSERT INTO criteria VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                        [c.id, c.version, c.kind, c.severity, c.group, _criterion_text(c), at])


def verdict_id(v: Verdict, *, live: bool = False) -> str:
    """The id of a verdict: a digest of what makes it unique, so a repeated call maps to the same row.

    A live verdict (made on an open conversation) has an id of its own: the verdict made at the end on
    the same transcript is another one, and is still made."""
    return _verdict_key(v.conversation_id, v.criterion_id, v.criterion_version, v.judge.model, v.transcript_sha256,
                        live)


def _verdict_key(conversation_id: str, criterion_id: str, version: int, model: str, sha256: str,
                 live: bool = False) -> str:
    key = "\x1f".join([conversation_id, criterion_id, str(version), model, sha256, *(["live"] if live else [])])
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
                   rule: str | None, now: dt.datetime | None = None,
                   current: Mapping[str, str] | None = None, simulated: bool = False,
                   live: bool = False) -> list[str]:
    """Store verdicts and supersede older transcripts' verdicts.

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
        now: the daemon's clock (UTC).
        current: the current transcript hash of conversations the caller has just read
            (saves reading them again); the others are read (production ones only).
        simulated: the verdicts are on simulated conversations (``verdicts_table``).
        live: live verdicts, made on an open conversation (``evals.live``): kept apart, they supersede
            only the conversation's earlier live verdicts, and replace no not-run record.

    Returns:
        The ids of the verdicts stored or replaced by this call (not those already there),
        in the order given: what the review queue looks at (``review.queue.open_items``).
    """
    if not 0 < probability <= 1:
        raise ValueError(f"probability must be in (0, 1], got {probability}")
    at = utc_now(now)
    # One verdict per key within the batch too: the first wins, unless it is an error and a real verdict follows.
    batch: dict[str, Verdict] = {}
    for v in verdicts:
        vid = verdict_id(v, live=live)
        if vid not in batch or (batch[vid].result == "error" and v.result != "error"):
            batch[vid] = v
    if not batch:
        return []
    known = current or {}
    table, not_run = verdicts_table(simulated), not_run_table(simulated)
    hashes: dict[str, str | None] = {
        cid: known[cid] if cid in known else None if simulated else _current_sha256(cur, cid)
        for cid in {v.conversation_id for v in batch.values()}}
    # Without a stored transcript, the last hash in the batch is the newest.
    latest = {(v.conversation_id, v.criterion_id): v.transcript_sha256 for v in batch.values()}
    with Transaction(cur):
        existing = dict(cur.execute(f"SELECT id, result FROM {table} WHERE list_contains(?, id)",
                                    [list(batch)]).fetchall())
        new = {vid: v for vid, v in batch.items()
               if vid not in existing or (existing[vid] == "error" and v.result != "error")}
        if not new:
            return []
        replaced = [vid for vid in new if vid in existing]
        if replaced:
            cur.execute(f"DELETE FROM {table} WHERE list_contains(?, id)", [replaced])
        stale = {vid: (hashes[v.conversation_id] or latest[(v.conversation_id, v.criterion_id)])
                 != v.transcript_sha256 for vid, v in new.items()}
        fresh = [v for vid, v in new.items() if not stale[vid]]
        if fresh:
            with registered(cur, "_supersede", Table({
                    "conversation_id": [v.conversation_id for v in fresh],
                    "criterion_id": [v.criterion_id for v in fresh],
                    "criterion_version": [v.criterion_version for v in fresh],
                    "transcript_sha256": [v.transcript_sha256 for v in fresh]})):
                cur.execute(f"UPDATE {table} v SET superseded = true FROM _supersede n "
                            "WHERE v.conversation_id = n.conversation_id AND v.criterion_id = n.criterion_id "
                            "AND v.transcript_sha256 <> n.transcript_sha256 AND NOT v.superseded "
                            "AND v.live = ?", [live])
                if not live:
                    cur.execute(f"DELETE FROM {not_run} r USING _supersede n WHERE r.conversation_id = "
                                "n.conversation_id AND r.criterion_id = n.criterion_id "
                                "AND r.criterion_version = n.criterion_version")
        rows = list(new.values())
        new_verdicts = Table({
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
            "superseded": [stale[vid] for vid in new], "live": [live] * len(rows),
            "batch_order": list(range(len(rows))),
        })
        with registered(cur, "_new_verdicts", new_verdicts):
            cur.execute(f"INSERT INTO {table} ({', '.join(VERDICT_COLUMNS)}, seq) "
                        f"SELECT {', '.join(VERDICT_COLUMNS)}, nextval('verdict_seq') "
                        "FROM (SELECT * FROM _new_verdicts ORDER BY batch_order)")
    return list(new)


def store_not_run(cur: duckdb.DuckDBPyConnection, not_run: Iterable[NotRun], *,
                  now: dt.datetime | None = None, simulated: bool = False) -> None:
    """Record criteria that could not run (no provider, no content, budget), the latest reason winning;
    with ``simulated``, on simulated conversations (``not_run_table``)."""
    at = utc_now(now)
    latest = {(r.conversation_id, r.criterion_id, r.criterion_version): r.reason for r in not_run}
    if not latest:
        return
    table = not_run_table(simulated)
    with Transaction(cur), registered_rows(cur, "_not_run", NOT_RUN_COLUMNS,
                                           [(*key, reason, at) for key, reason in latest.items()]):
        cur.execute(f"DELETE FROM {table} r USING _not_run n WHERE r.conversation_id = n.conversation_id "
                    "AND r.criterion_id = n.criterion_id AND r.criterion_version = n.criterion_version")
        cur.execute(f"INSERT INTO {table} SELECT * FROM _not_run")


def verdict_dict(row: Sequence[Any]) -> dict[str, Any]:
    d = dict(zip(VERDICT_COLUMNS, row))
    return {
        "id": d["id"], "conversation_id": d["conversation_id"], "criterion_id": d["criterion_id"],
        "criterion_version": d["criterion_version"], "result": d["result"], "error_reason": d["error_reason"],
        "reasoning": d["reasoning"] or "", "evidence": orjson.loads(d["evidence"] or "[]"),
        "evidence_verified": d["evidence_verified"], "flagged": d["flagged"],
        "judge": {"provider": d["judge_provider"], "model": d["judge_model"]},
        "usage": {"input_tokens": d["input_tokens"], "output_tokens": d["output_tokens"]},
        "transcript_sha256": d["transcript_sha256"], "raw_reply": d["raw_reply"] or "",
        "inclusion_probability": d["inclusion_probability"], "sampling_rule": d["sampling_rule"],
        "judged_at": iso_utc(d["judged_at"]), "superseded": d["superseded"], "live": bool(d["live"]),
    }


def list_verdicts(cur: duckdb.DuckDBPyConnection, result: str | None = None, criterion: str | None = None,
                  since: dt.datetime | None = None, *, conversation: str | None = None,
                  include_superseded: bool = False, limit: int | None = None,
                  simulated: bool = False) -> list[dict[str, Any]]:
    """Stored verdicts, the newest first (``tracejudge verdicts --result error`` lists errors with reasons).

    Args:
        result: only this result (``pass``, ``fail``, ``not_applicable``, ``error``).
        criterion: only this criterion id.
        since: only verdicts judged at or after this time.
        conversation: only verdicts on this conversation id.
        include_superseded: also verdicts of older transcripts.
        limit: at most this many.
        simulated: the verdicts on simulated conversations instead (``tracejudge eval --source simulation``).

    Returns:
        Verdicts in the shape of docs/criteria.md, plus ``id``, ``inclusion_probability``,
        ``sampling_rule``, ``judged_at`` and ``superseded``.
    """
    where, params = verdict_filters(result=result, criterion=criterion, since=since)
    if conversation is not None:
        where.append("conversation_id = ?")
        params.append(conversation)
    if not include_superseded:
        where.append("NOT superseded")
    sql = (f"SELECT {', '.join(VERDICT_COLUMNS)} FROM {verdicts_table(simulated)} {where_clause(where)} "
           "ORDER BY seq DESC"
           + (" LIMIT ?" if limit is not None else ""))
    rows = cur.execute(sql, params + ([limit] if limit is not None else [])).fetchall()
    return [verdict_dict(r) for r in rows]


def verdict_filters(*, result: str | None = None, criterion: str | None = None, since: dt.datetime | None = None,
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


def where_clause(where: list[str]) -> str:
    return "WHERE " + " AND ".join(where) if where else ""
