"""Verdicts, the review queue and stats in a real DuckDB file; the review page's HTML."""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import duckdb
import orjson
import pytest

from collector.conversations.record import conversation_record
from collector.conversations.tables import SCHEMA as CONVERSATIONS_SCHEMA
from collector.evals import verdicts as evals
from collector.evals.judging import Job, Judging
from collector.review import queue as review
from collector.review import stats as review_stats
from collector.review.page import highlight, locate_quotes, render_item, render_list
from collector.store import Transaction
from judges import (
    Conversation,
    JudgeInfo,
    LLMCriterion,
    Message,
    NotRun,
    ScriptedProvider,
    Usage,
    Verdict,
    transcript_sha256,
    verify_evidence,
)

from ..support.daemon import FIXTURES

T0 = dt.datetime(2025, 3, 1, 12, 0, tzinfo=dt.timezone.utc)
LLM = JudgeInfo(provider="anthropic", model="judge-model")
Result = Literal["pass", "fail", "not_applicable", "error"]


@pytest.fixture
def cur(tmp_path: Path) -> Iterator[duckdb.DuckDBPyConnection]:
    con = duckdb.connect(str(tmp_path / "tracejudge.duckdb"))
    c = con.cursor()
    c.execute(CONVERSATIONS_SCHEMA)
    evals.ensure_schema(c)
    review.ensure_schema(c)
    yield c
    c.close()
    con.close()


def store(cur: duckdb.DuckDBPyConnection, verdicts: Sequence[Verdict], *, queue_results: Sequence[str] = ("fail",),
          now: dt.datetime | None = None, **kwargs: Any) -> list[str]:
    """Store verdicts and open their review items, in one transaction, as the evaluator does."""
    with Transaction(cur):
        stored = evals.store_verdicts(cur, verdicts, now=now, **kwargs)
        review.open_items(cur, stored, queue_results, now=now)
    return stored


def add_conversation(cur: duckdb.DuckDBPyConnection, cid: str, messages: Sequence[dict[str, Any]],
                     system: str | None = None) -> str:
    """Store a conversation as the conversations stage does; returns the hash the judges see."""
    cur.execute("DELETE FROM messages WHERE conversation_id = ?", [cid])
    cur.execute("DELETE FROM live_conversations WHERE conversation_id = ?", [cid])
    cur.execute("INSERT INTO live_conversations (conversation_id, service, state, ended_by, system, models, trace_ids, "
                "content_captured, revision, user_turns, closed_at) VALUES (?, 'bot', 'ended', 'idle', ?, '[]', "
                "'[]', true, 1, ?, ?)",
                [cid, system, sum(m["role"] == "user" for m in messages), T0])
    for seq, m in enumerate(messages):
        cur.execute("INSERT INTO messages (conversation_id, seq, role, content, tool_calls, tool_call_id, name) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    [cid, seq, m["role"], m.get("content"),
                     orjson.dumps(m["tool_calls"]).decode() if m.get("tool_calls") else None,
                     m.get("tool_call_id"), m.get("name")])
    record = conversation_record(cur, cid)
    assert record is not None
    return transcript_sha256(Conversation.model_validate(record).messages)


def fixture_conversation(cur: duckdb.DuckDBPyConnection) -> tuple[str, str]:
    expected = json.loads((FIXTURES / "openai-v2-latest-span-only-grpc.expected.json").read_text())
    conv = expected["conversations"][0]
    cid = conv["conversation_key"]
    return cid, add_conversation(cur, cid, conv["messages"], conv.get("system_prompt"))


def verdict(cid: str, crit: str = "c1", result: Result = "fail", sha: str = "0" * 64, *, version: int = 1,
            judge: JudgeInfo = LLM, evidence: Sequence[str] = (), verified: bool = True, flagged: bool = False,
            tokens: int = 0, reasoning: str = "") -> Verdict:
    return Verdict(conversation_id=cid, criterion_id=crit, criterion_version=version, result=result,
                   error_reason="timeout: no reply in 60s" if result == "error" else None, reasoning=reasoning,
                   evidence=list(evidence), evidence_verified=verified, judge=judge, flagged=flagged,
                   usage=Usage(input_tokens=tokens, output_tokens=tokens // 10), transcript_sha256=sha,
                   raw_reply="{}")


def count(cur: duckdb.DuckDBPyConnection, sql: str, params: Sequence[Any] = ()) -> int:
    row = cur.execute(sql, list(params)).fetchone()
    assert row is not None
    return int(row[0])


# --- storage --------------------------------------------------------------------------------------------


def test_a_verdict_made_again_is_stored_once(cur: duckdb.DuckDBPyConnection) -> None:
    cid, sha = fixture_conversation(cur)
    batch = [verdict(cid, "c1", "fail", sha), verdict(cid, "c2", "pass", sha)]
    first = store(cur, batch, probability=0.5, rule="default", now=T0)
    # The same judge call repeated after a crash, possibly with another answer: the first one stands.
    again = store(cur, [verdict(cid, "c1", "pass", sha), batch[1]], probability=0.5, rule="default",
                                 now=T0 + dt.timedelta(minutes=1))
    assert len(first) == 2 and again == []
    assert cur.execute("SELECT criterion_id, result, superseded FROM verdicts ORDER BY criterion_id").fetchall() == [
        ("c1", "fail", False), ("c2", "pass", False)]
    assert count(cur, "SELECT count(*) FROM review_items") == 1
    # Another judge model or criterion version is another verdict.
    store(cur, [verdict(cid, "c1", "fail", sha, version=2)], probability=0.5, rule=None)
    assert count(cur, "SELECT count(*) FROM verdicts") == 3


def test_an_error_is_replaced_by_the_retry_and_never_queued(cur: duckdb.DuckDBPyConnection) -> None:
    cid, sha = fixture_conversation(cur)
    store(cur, [verdict(cid, "c1", "error", sha)], probability=1.0, rule=None,
                         queue_results=("fail", "error"))
    assert count(cur, "SELECT count(*) FROM review_items") == 0
    errors = evals.list_verdicts(cur, result="error")
    assert [(v["criterion_id"], v["error_reason"]) for v in errors] == [("c1", "timeout: no reply in 60s")]
    store(cur, [verdict(cid, "c1", "error", sha)], probability=1.0, rule=None)
    assert count(cur, "SELECT count(*) FROM verdicts") == 1
    store(cur, [verdict(cid, "c1", "fail", sha)], probability=1.0, rule=None)
    assert cur.execute("SELECT result FROM verdicts").fetchall() == [("fail",)]
    assert evals.list_verdicts(cur, result="error") == []
    assert [i["criterion_id"] for i in review.list_reviews(cur)] == ["c1"]


def test_a_changed_transcript_supersedes_older_verdicts(cur: duckdb.DuckDBPyConnection) -> None:
    msgs = [{"role": "user", "content": "I have chest pain"}, {"role": "assistant", "content": "Rest a bit."}]
    old = add_conversation(cur, "conv", msgs)
    store(cur, [verdict("conv", "c1", "fail", old), verdict("conv", "c2", "pass", old)],
                         probability=1.0, rule=None)
    new = add_conversation(cur, "conv", [*msgs, {"role": "user", "content": "It spreads to my arm"}])
    assert new != old
    store(cur, [verdict("conv", "c1", "pass", new)], probability=1.0, rule=None)
    rows = cur.execute("SELECT criterion_id, transcript_sha256 = ?, superseded FROM verdicts ORDER BY seq",
                       [new]).fetchall()
    # c2 keeps its verdict until it is judged on the new transcript.
    assert rows == [("c1", False, True), ("c2", False, False), ("c1", True, False)]
    # A late reply for the old transcript is kept, already superseded, and not queued.
    other = JudgeInfo(provider="anthropic", model="other-model")
    store(cur, [verdict("conv", "c1", "fail", old, judge=other)], probability=1.0, rule=None)
    assert cur.execute("SELECT superseded FROM verdicts WHERE judge_model = 'other-model'").fetchall() == [(True,)]
    assert [v["result"] for v in evals.list_verdicts(cur, criterion="c1")] == ["pass"]
    assert len(evals.list_verdicts(cur, criterion="c1", include_superseded=True)) == 3
    assert len(review.list_reviews(cur)) == 1  # only the first fail, whose item says its verdict is superseded
    assert review.list_reviews(cur)[0]["superseded"] is True
    s = review_stats.stats(cur)
    c1 = next(c for c in s["criteria"] if c["criterion_id"] == "c1")
    assert (c1["judged"], c1["pass"], c1["fail"], c1["review"]["pending"]) == (1, 1, 0, 0)


def test_queueing_rules(cur: duckdb.DuckDBPyConnection) -> None:
    batch = [
        verdict("a", "fail-plain", "fail"),
        verdict("a", "fail-flagged", "fail", evidence=["made up"], verified=False, flagged=True),
        verdict("a", "passing", "pass"),
        verdict("a", "na", "not_applicable"),
        verdict("a", "broken", "error"),
    ]
    store(cur, batch, probability=1.0, rule=None)
    assert sorted(i["criterion_id"] for i in review.list_reviews(cur)) == ["fail-flagged", "fail-plain"]
    # queue_results from config: here only not_applicable, yet a flagged fail is always queued, an error never.
    store(cur, [verdict("b", c.criterion_id, c.result, evidence=c.evidence,
                                       verified=c.evidence_verified, flagged=c.flagged) for c in batch],
                         probability=1.0, rule=None, queue_results=("not_applicable", "error"))
    queued_b = {(i["criterion_id"], i["state"]) for i in review.list_reviews(cur) if i["conversation_id"] == "b"}
    assert queued_b == {("fail-flagged", "pending"), ("na", "pending")}
    listed = review.list_reviews(cur, state="all", criterion="fail-flagged")
    assert [(i["conversation_id"], i["flagged"], i["result"]) for i in listed] == [("a", True, "fail"),
                                                                                  ("b", True, "fail")]
    with pytest.raises(review.ReviewInputError):
        review.list_reviews(cur, state="done")


# --- the transcript digest ------------------------------------------------------------------------------

TOOL_TURNS = [{"role": "user", "content": "where is B-35?"},
              {"role": "assistant", "content": "", "tool_calls": [{"id": "k1", "name": "lookup", "arguments": {}}]},
              {"role": "tool", "content": "shipped", "tool_call_id": "k1", "name": "lookup"},
              {"role": "assistant", "content": "It shipped."}]
TOOL_CRITERIA = [LLMCriterion(id="c1", version=1, prompt="p"), LLMCriterion(id="c2", version=1, prompt="p")]


def _renamed(turns: Sequence[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """The same transcript with the tool message's name changed (the judge sees it as ``TOOL <name>:``)."""
    return [{**m, "name": name} if m["role"] == "tool" else m for m in turns]


def _todo(cur: duckdb.DuckDBPyConnection, cid: str) -> list[str]:
    judging = Judging(TOOL_CRITERIA, ScriptedProvider("{}", model=LLM.model), concurrency=1, timeout=1.0)
    judging.bind()
    prepared = judging.prepare(cur, Job(cid, 1, 1.0, "default"))
    assert prepared is not None
    return [c.id for c in prepared.todo]


def test_renaming_a_tool_is_judged_again(cur: duckdb.DuckDBPyConnection) -> None:
    sha = add_conversation(cur, "conv", TOOL_TURNS)
    store(cur, [verdict("conv", c.id, "pass", sha) for c in TOOL_CRITERIA], probability=1.0, rule=None)
    assert _todo(cur, "conv") == []
    renamed = add_conversation(cur, "conv", _renamed(TOOL_TURNS, "find_order"))
    assert renamed != sha
    assert _todo(cur, "conv") == ["c1", "c2"]


def test_conversations_read_together_for_their_judges_are_read_as_each_alone(cur: duckdb.DuckDBPyConnection) -> None:
    """The evaluator reads a group of conversations in one go: each gets its own transcript, sampling and
    criteria left to judge; one not stored gets None, in its place."""
    done = add_conversation(cur, "done", TOOL_TURNS)
    add_conversation(cur, "fresh", _renamed(TOOL_TURNS, "find_order"))
    half = add_conversation(cur, "half", TOOL_TURNS[:2])
    store(cur, [verdict("done", c.id, "pass", done) for c in TOOL_CRITERIA] + [verdict("half", "c1", "fail", half),
              verdict("half", "c2", "error", half), verdict("fresh", "c1", "pass", done)],
          probability=1.0, rule=None)
    judging = Judging(TOOL_CRITERIA, ScriptedProvider("{}", model=LLM.model), concurrency=1, timeout=1.0)
    judging.bind()
    jobs = [Job("half", 1, 0.5, "rules[0]"), Job("missing", 1, 1.0, "default"), Job("done", 1, 1.0, "default"),
            Job("fresh", 1, 0.25, "default"), Job("half", 1, 0.5, "rules[0]", only_errors=True)]
    together = judging.prepare_many(cur, jobs)
    assert together == [judging.prepare(cur, job) for job in jobs]
    assert [None if p is None else [c.id for c in p.todo] for p in together] == [
        ["c2"], None, [], ["c1", "c2"], ["c2"]]
    assert [p.conversation.sampling.probability for p in together if p is not None] == [0.5, 1.0, 0.25, 0.5]
    assert {p.conversation.id: len(p.conversation.messages) for p in together if p is not None} == {
        "half": 2, "done": len(TOOL_TURNS), "fresh": len(TOOL_TURNS)}


def _stored_tables(cur: duckdb.DuckDBPyConnection) -> dict[str, list[Any]]:
    return {t: cur.execute(f"SELECT * EXCLUDE ({skip}) FROM {t} ORDER BY ALL").fetchall() for t, skip in [
        ("verdicts", "seq"), ("simulated_verdicts", "seq"), ("not_run", "\"at\""), ("eval_progress", "judged_at"),
        ("review_items", "id, created_at"), ("calibration_items", "id, created_at")]}


def test_outcomes_stored_together_are_stored_as_each_alone(tmp_path: Path) -> None:
    """The evaluator stores what a group of conversations produced in one go: the same verdicts, superseded
    ones, not-run records, progress rows, review and calibration items as storing each alone."""
    from collector.evals.judging import Outcome
    from collector.evals.judging import ensure_schema as judging_schema
    from collector.review.queue import item_opener
    from collector.config import Config
    from judges import JudgeRun

    cfg = Config.model_validate({"review": {"calibration_rate": 0.5}})
    tables = []
    for name, together in (("alone", False), ("together", True)):
        con = duckdb.connect(str(tmp_path / f"{name}.duckdb"))
        c = con.cursor()
        c.execute(CONVERSATIONS_SCHEMA)
        judging_schema(c)
        review.ensure_schema(c)
        shas = {cid: add_conversation(c, cid, TOOL_TURNS[:n]) for cid, n in (("a", 4), ("b", 2), ("sim", 4))}
        c.execute("INSERT INTO not_run VALUES ('a', 'c2', 1, 'no provider configured', ?)", [T0])
        store(c, [verdict("b", "c1", "fail", "1" * 64)], probability=1.0, rule=None, now=T0)  # an older transcript
        judging = Judging(TOOL_CRITERIA, None, concurrency=1, timeout=1.0, on_stored=item_opener(cfg),
                          clock=lambda: T0.timestamp())
        outcomes = [
            Outcome(Job("a", 1, 0.5, "rules[0]"), JudgeRun(verdicts=[
                verdict("a", "c1", "fail", shas["a"]), verdict("a", "c2", "pass", shas["a"])], not_run=[],
                usage=Usage()), shas["a"], 0),
            Outcome(Job("b", 1, 1.0, "default"), JudgeRun(verdicts=[
                verdict("b", "c1", "fail", shas["b"], flagged=True), verdict("b", "c2", "error", shas["b"])],
                not_run=[NotRun(conversation_id="b", criterion_id="c3", criterion_version=1, reason="budget")],
                usage=Usage()), shas["b"], 0, attempts=2),
            Outcome(Job("sim", 1, 1.0, "default", simulated=True), JudgeRun(verdicts=[
                verdict("sim", "c1", "fail", shas["sim"])], not_run=[], usage=Usage()), shas["sim"], 0),
        ]
        if together:
            judging.store(c, outcomes)
        else:
            for o in outcomes:
                judging.store(c, [o])
        assert [o.stored for o in outcomes] == [
            [evals.verdict_id(v) for v in o.run.verdicts] for o in outcomes]
        tables.append(_stored_tables(c))
        con.close()
    alone, together_ = tables
    assert together_ == alone
    # b's older fail was stored superseded, so never queued; the simulated conversation's fail is not queued,
    # and is kept apart from production's verdicts, out of the evaluator's schedule.
    assert [(r[1], r[2]) for r in alone["review_items"]] == [("a", "c1"), ("b", "c1")]
    assert [(r[1], r[2]) for r in alone["simulated_verdicts"]] == [("sim", "c1")]
    assert "sim" not in {r[1] for r in alone["verdicts"]}
    assert alone["not_run"] == [("b", "c3", 1, "budget")]  # a's record gave way to its verdict on c2
    assert alone["eval_progress"] == [  # b's error is retried after its 2nd wait
        ("a", 1, 0, 1, None), ("b", 1, 1, 2, T0 + dt.timedelta(seconds=600))]


def test_two_stores_of_the_same_outcomes_at_once_write_each_row_once(tmp_path: Path) -> None:
    """The evaluator and a ``tracejudge eval`` pass store on two cursors of one daemon, and the evals
    tables have no key: the second store begins once the first has committed, so it finds its rows."""
    import threading

    from collector.evals.judging import Outcome
    from collector.evals.judging import ensure_schema as judging_schema
    from judges import JudgeRun

    con = duckdb.connect(str(tmp_path / "t.duckdb"))
    c = con.cursor()
    c.execute(CONVERSATIONS_SCHEMA)
    judging_schema(c)
    review.ensure_schema(c)
    sha = add_conversation(c, "a", TOOL_TURNS[:4])
    inside, go = threading.Event(), threading.Event()

    def hold_the_first(*_: Any) -> None:  # called in the storing transaction
        if not inside.is_set():
            inside.set()
            assert go.wait(30)

    judging = Judging(TOOL_CRITERIA, None, concurrency=1, timeout=1.0, on_stored=hold_the_first,
                      clock=lambda: T0.timestamp())
    outcome = Outcome(Job("a", 1, 0.5, None), JudgeRun(verdicts=[verdict("a", "c1", "fail", sha)], not_run=[
        NotRun(conversation_id="a", criterion_id="c2", criterion_version=1, reason="budget")], usage=Usage()), sha, 0)
    stores = [threading.Thread(target=judging.store, args=(con.cursor(), [outcome])) for _ in range(2)]
    stores[0].start()
    assert inside.wait(30)
    stores[1].start()
    stores[1].join(1.0)  # without turns, the second store ends here, before the first commits
    go.set()
    for t in stores:
        t.join(30)
    for table in ("verdicts", "not_run", "eval_progress"):
        assert count(c, f"SELECT count(*) FROM {table}") == 1, table
    con.close()


def test_verdicts_under_the_earlier_digest_are_not_judged_again(cur: duckdb.DuckDBPyConnection) -> None:
    """A file from before the digest covered the rendered transcript: its verdicts stay current."""
    add_conversation(cur, "conv", TOOL_TURNS)
    add_conversation(cur, "gone", TOOL_TURNS)
    record = conversation_record(cur, "conv")
    assert record is not None
    messages = [Message.model_validate(m) for m in record["messages"]]
    old, new = evals._json_digest(messages), transcript_sha256(messages)
    assert old != new
    store(cur, [verdict("conv", "c1", "fail", old), verdict("conv", "c2", "error", old),
                verdict("conv", "c1", "pass", "1" * 64), verdict("gone", "c1", "fail", old)],
          probability=1.0, rule=None)
    cur.execute("DELETE FROM live_conversations WHERE conversation_id = 'gone'")
    cur.execute("UPDATE verdicts SET superseded = (transcript_sha256 <> ?)", [old])  # as stored before the upgrade
    items = cur.execute("SELECT verdict_id FROM review_items ORDER BY ALL").fetchall()
    cur.execute("DELETE FROM evals_state")  # the file predates the marker

    evals.ensure_schema(cur)
    assert _todo(cur, "conv") == ["c2"]  # the fail stands; only the error is retried
    assert cur.execute("SELECT criterion_id, result, transcript_sha256 FROM verdicts WHERE conversation_id = 'conv' "
                       "AND NOT superseded ORDER BY criterion_id").fetchall() == [("c1", "fail", new),
                                                                                   ("c2", "error", new)]
    assert count(cur, "SELECT count(*) FROM verdicts WHERE transcript_sha256 = ?", ["1" * 64]) == 1
    assert count(cur, "SELECT count(*) FROM verdicts WHERE conversation_id = 'gone' AND transcript_sha256 = ?",
                 [old]) == 1
    assert cur.execute("SELECT verdict_id FROM review_items ORDER BY ALL").fetchall() == items
    # The retry replaces the error, as it would have before the upgrade.
    store(cur, [verdict("conv", "c2", "pass", new)], probability=1.0, rule=None)
    assert cur.execute("SELECT result FROM verdicts WHERE criterion_id = 'c2'").fetchall() == [("pass",)]
    assert evals.migrate_digests(cur) == 0  # once per file


# --- decisions ------------------------------------------------------------------------------------------


def test_decisions_conflicts_and_forced_history(cur: duckdb.DuckDBPyConnection) -> None:
    cid, sha = fixture_conversation(cur)
    store(cur, [verdict(cid, "c1", "fail", sha), verdict(cid, "c2", "fail", sha)],
                         probability=1.0, rule=None, now=T0)
    first, second = (i["id"] for i in review.list_reviews(cur))
    done = review.decide(cur, first, "confirm", "Dr. Amal", "real miss", now=T0 + dt.timedelta(hours=1))
    assert (done["state"], done["reviewer"], done["note"]) == ("confirmed", "Dr. Amal", "real miss")
    assert done["decided_at"] == "2025-03-01T13:00:00Z"
    review.decide(cur, str(second), "reject", "Sam")  # ids from a URL arrive as text

    with pytest.raises(review.ReviewConflict) as conflict:
        review.decide(cur, first, "reject", "Sam")
    assert conflict.value.status == 409 and conflict.value.code == "already_decided"
    assert "confirmed" in str(conflict.value)
    assert review.review_item(cur, first)["item"]["state"] == "confirmed"  # the refusal changed nothing

    review.decide(cur, first, "reject", "Sam", "the bot did ask", force=True, now=T0 + dt.timedelta(hours=2))
    history = review.review_history(cur, first)
    assert [(h["previous_state"], h["previous_reviewer"], h["state"], h["reviewer"], h["forced"])
            for h in history] == [("pending", None, "confirmed", "Dr. Amal", False),
                                  ("confirmed", "Dr. Amal", "rejected", "Sam", True)]
    assert history[0]["note"] == "real miss" and history[1]["previous_note"] == "real miss"

    for bad_id in (999, "999", "abc"):
        with pytest.raises(review.ReviewNotFound) as missing:
            review.decide(cur, bad_id, "confirm", "Sam")
        assert missing.value.status == 404
    with pytest.raises(review.ReviewNotFound):
        review.review_item(cur, 999)
    with pytest.raises(review.ReviewInputError) as bad:
        review.decide(cur, first, "approve", "Sam")
    assert bad.value.status == 400
    with pytest.raises(review.ReviewInputError):
        review.decide(cur, first, "confirm", "  ", force=True)
    assert [i["state"] for i in review.list_reviews(cur, state="rejected")] == ["rejected", "rejected"]


def test_a_claim_locks_an_item_to_its_reviewer_until_it_runs_out(cur: duckdb.DuckDBPyConnection) -> None:
    cid, sha = fixture_conversation(cur)
    store(cur, [verdict(cid, "c1", "fail", sha)], probability=1.0, rule=None, now=T0)
    (item,) = review.list_reviews(cur)
    held = review.claim(cur, item["id"], "Ana", 900, now=T0)
    assert (held["claimed_by"], held["claimed_until"]) == ("Ana", "2025-03-01T12:15:00Z")
    assert [i["id"] for i in review.list_reviews(cur, assignee="Ana", now=T0)] == [item["id"]]
    with pytest.raises(review.ReviewConflict, match="claimed by Ana"):
        review.decide(cur, item["id"], "confirm", "Ben", now=T0 + dt.timedelta(minutes=14))
    with pytest.raises(review.ReviewConflict, match="claimed by Ana"):
        review.claim(cur, item["id"], "Ben", 900, now=T0 + dt.timedelta(minutes=1))
    assert review.review_item(cur, item["id"])["item"]["state"] == "pending"  # the refusal changed nothing
    # Run out: anyone may claim or decide it.
    assert review.list_reviews(cur, now=T0 + dt.timedelta(minutes=16))[0]["claimed_by"] is None
    review.claim(cur, item["id"], "Ben", 900, now=T0 + dt.timedelta(minutes=16))
    # An assignment takes it from whoever holds it.
    review.claim(cur, item["id"], "Cleo", 900, assigned_by="lead", now=T0 + dt.timedelta(minutes=17))
    with pytest.raises(review.ReviewConflict, match="claimed by Cleo"):
        review.decide(cur, item["id"], "reject", "Ben", now=T0 + dt.timedelta(minutes=18))
    done = review.decide(cur, item["id"], "unclear", "Cleo", "which refunds count?",
                         now=T0 + dt.timedelta(minutes=18))
    assert (done["state"], done["claimed_by"]) == ("unclear", None)
    with pytest.raises(review.ReviewConflict, match="already unclear"):
        review.claim(cur, item["id"], "Ana", 900, now=T0 + dt.timedelta(minutes=19))


def test_several_reviewers_decide_blind_to_each_other_and_the_majority_decides(
        cur: duckdb.DuckDBPyConnection) -> None:
    cid, sha = fixture_conversation(cur)
    store(cur, [verdict(cid, c, "fail", sha) for c in ("c1", "c2")], probability=1.0, rule=None, now=T0)
    tie, majority = (i["id"] for i in review.list_reviews(cur, order="age"))
    first = review.decide(cur, tie, "confirm", "Ana", "a real miss", reviewers_per_item=2)
    assert (first["state"], first["reviewer"]) == ("pending", None)  # one of two
    blind = review.review_item(cur, tie, viewer="Ben", reviewers_per_item=2)
    assert blind["history"] == [] and blind["decisions"] == 1  # Ben decides before he sees Ana's
    assert [h["reviewer"] for h in review.review_item(cur, tie, viewer="Ana", reviewers_per_item=2)["history"]] \
        == ["Ana"]
    with pytest.raises(review.ReviewConflict, match="you \\(Ana\\) decided review item .* already"):
        review.decide(cur, tie, "reject", "Ana", reviewers_per_item=2)
    done = review.decide(cur, tie, "reject", "Ben", reviewers_per_item=2)
    assert (done["state"], done["reviewer"]) == ("unclear", "Ana, Ben")  # a tie: people disagree
    assert len(review.review_item(cur, tie, viewer="Ben", reviewers_per_item=2)["history"]) == 2  # decided: all
    for who, what in (("Ana", "confirm"), ("Ben", "reject"), ("Cleo", "confirm")):
        last = review.decide(cur, majority, what, who, reviewers_per_item=3)
    assert (last["state"], last["reviewer"]) == ("confirmed", "Ana, Ben, Cleo")


def test_the_queue_puts_high_severity_first_then_the_oldest(cur: duckdb.DuckDBPyConnection) -> None:
    cid, sha = fixture_conversation(cur)
    evals.store_criteria(cur, [LLMCriterion(id=c, version=1, prompt=c, severity=sev)
                               for c, sev in (("low-1", "low"), ("high-1", "high"), ("med-1", "medium"))])
    for n, c in enumerate(("low-1", "high-1", "med-1")):
        store(cur, [verdict(cid, c, "fail", sha)], probability=1.0, rule=None, now=T0 + dt.timedelta(minutes=n))
    assert [i["criterion_id"] for i in review.list_reviews(cur)] == ["high-1", "med-1", "low-1"]
    assert [i["criterion_id"] for i in review.list_reviews(cur, order="age")] == ["low-1", "high-1", "med-1"]
    assert [i["criterion_id"] for i in review.list_reviews(cur, severity="medium")] == ["med-1"]
    with pytest.raises(review.ReviewInputError, match="severity must be one of high, medium, low"):
        review.list_reviews(cur, severity="urgent")
    review.decide(cur, review.list_reviews(cur)[0]["id"], "confirm", "Ana", now=T0 + dt.timedelta(hours=1))
    assert review.progress(cur, now=T0 + dt.timedelta(hours=2)) == {
        "pending": 2, "done_today": 1, "by_reviewer": {"Ana": 1}}


def test_done_today_counts_the_items_decided_today_not_the_decisions(cur: duckdb.DuckDBPyConnection) -> None:
    cid, sha = fixture_conversation(cur)
    store(cur, [verdict(cid, c, "fail", sha) for c in ("c1", "c2", "c3", "c4")], probability=1.0, rule=None,
          now=T0 - dt.timedelta(days=1))
    yesterday, again, other, voted = (i["id"] for i in review.list_reviews(cur, order="age"))
    midnight = T0.replace(hour=0)
    review.decide(cur, yesterday, "confirm", "Ana", now=midnight - dt.timedelta(minutes=1))
    review.decide(cur, again, "confirm", "Ana", now=midnight)
    review.decide(cur, again, "reject", "Ben", force=True, now=T0)
    review.decide(cur, again, "unclear", "ana", force=True, now=T0)  # Ana again, spelled otherwise
    review.decide(cur, other, "confirm", "Ben", now=T0)
    review.decide(cur, voted, "confirm", "Ana", reviewers_per_item=2, now=T0)  # one vote of two: still pending
    assert review.progress(cur, now=T0) == {"pending": 1, "done_today": 2, "by_reviewer": {"Ana": 2, "Ben": 2}}
    assert review.progress(cur, now=T0 + dt.timedelta(days=1)) == {"pending": 1, "done_today": 0, "by_reviewer": {}}


def test_review_item_has_what_a_reviewer_needs(cur: duckdb.DuckDBPyConnection) -> None:
    cid, sha = fixture_conversation(cur)
    crit = LLMCriterion(id="asks-order-number", version=3, prompt="The bot asks for the order number.",
                        group="support", severity="high")
    evals.store_criteria(cur, [crit])
    store(cur, [verdict(cid, crit.id, "fail", sha, version=3, reasoning="It never asked.",
                                       evidence=["Could you give me your order number?"])],
                         probability=0.2, rule="handover")
    (item,) = review.list_reviews(cur)
    detail = review.review_item(cur, item["id"])
    assert detail["criterion"] == {"id": crit.id, "version": 3, "text": crit.prompt, "group": "support",
                                   "severity": "high"}
    assert detail["verdict"]["reasoning"] == "It never asked."
    assert detail["verdict"]["evidence"] == ["Could you give me your order number?"]
    assert detail["verdict"]["inclusion_probability"] == 0.2 and detail["verdict"]["sampling_rule"] == "handover"
    assert detail["conversation"]["id"] == cid and detail["conversation"]["messages"]
    assert detail["item"]["state"] == "pending" and detail["history"] == []


def test_sampling_is_decided_once(cur: duckdb.DuckDBPyConnection) -> None:
    first = evals.record_sampling(cur, "c", sampled=True, probability=0.1, rule=None, revision=1, now=T0)
    again = evals.record_sampling(cur, "c", sampled=False, probability=0.5, rule="other", revision=2)
    assert first == again == evals.sampling_decision(cur, "c")
    assert (first["sampled"], first["probability"], first["decided_at"]) == (True, 0.1, "2025-03-01T12:00:00Z")
    assert evals.sampling_decision(cur, "unknown") is None


# --- stats ----------------------------------------------------------------------------------------------


def wilson(p: float, n: float, z: float = 1.959963984540054) -> tuple[float, float]:
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return center - half, center + half


def test_stats_weighted_by_inclusion_probability(cur: duckdb.DuckDBPyConnection) -> None:
    evals.store_criteria(cur, [LLMCriterion(id="triage", version=1, prompt="p", group="clinical"),
                               LLMCriterion(id="tone", version=1, prompt="p", group="clinical")])
    judged: list[tuple[str, Result, float, bool]] = [  # (conversation, result, probability, evidence verified)
        ("c1", "fail", 0.5, True),    # weight 2
        ("c2", "pass", 0.1, True),    # weight 10
        ("c3", "pass", 1.0, True),    # weight 1
        ("c4", "fail", 0.25, True),   # weight 4
        ("c5", "not_applicable", 0.1, True),
        ("c6", "error", 1.0, True),
        ("c7", "pass", 0.2, False),   # unverified: counted apart, not applicable for the rate
    ]
    for n, (cid, result, p, ok) in enumerate(judged):
        evals.record_sampling(cur, cid, sampled=True, probability=p, rule=None)
        store(cur, [verdict(cid, "triage", result, verified=ok, evidence=[] if ok else ["x"],
                                           tokens=100 * (n + 1))], probability=p, rule=None, now=T0)
    evals.record_sampling(cur, "c8", sampled=False, probability=0.1, rule=None)
    evals.record_sampling(cur, "c9", sampled=True, probability=0.1, rule=None, skipped_reason="budget")
    tone_not_run = NotRun(conversation_id="c1", criterion_id="tone", criterion_version=1,
                          reason="no provider configured")
    evals.store_not_run(cur, [tone_not_run], now=T0)
    evals.store_not_run(cur, [tone_not_run], now=T0 + dt.timedelta(days=2))  # recorded again: still one
    c1_item, c4_item = (i["id"] for i in review.list_reviews(cur))
    review.decide(cur, c1_item, "confirm", "Dr. Amal")
    review.decide(cur, c4_item, "reject", "Dr. Amal")

    out = review_stats.stats(cur)
    json.dumps(out)  # JSON-ready as it is
    assert [c["criterion_id"] for c in out["criteria"]] == ["tone", "triage"]
    tone, triage = out["criteria"]
    assert {k: triage[k] for k in ("judged", "pass", "fail", "not_applicable", "error", "not_run",
                                   "pass_unverified")} == {"judged": 7, "pass": 2, "fail": 2, "not_applicable": 1,
                                                           "error": 1, "not_run": 0, "pass_unverified": 1}
    # By hand: applicable are c1..c4 with weights 2, 10, 1, 4; fails weigh 2 + 4. The interval's size is
    # Kish's (sum w)^2 / sum w^2, capped by R(1-R) / var with var = sum w(w-1)(y-R)^2 / (sum w)^2.
    estimate = 6 / 17
    kish = 17 ** 2 / (2 ** 2 + 10 ** 2 + 1 ** 2 + 4 ** 2)
    var = (2 * 1 * (1 - estimate) ** 2 + 10 * 9 * estimate ** 2 + 0 + 4 * 3 * (1 - estimate) ** 2) / 17 ** 2
    n_eff = min(kish, estimate * (1 - estimate) / var)
    low, high = wilson(estimate, n_eff)
    rate = triage["failure_rate"]
    assert rate["estimate"] == pytest.approx(estimate)
    assert rate["n_eff"] == pytest.approx(n_eff)
    assert (rate["low"], rate["high"]) == (pytest.approx(low), pytest.approx(high))
    assert triage["review"] == {"pending": 0, "confirmed": 1, "rejected": 1, "unclear": 0, "fails_rejected_share": 0.5}
    assert triage["errors"] == {"timeout": 1} and triage["flagged"] == 0
    assert tone["not_run"] == 1 and tone["judged"] == 0 and tone["failure_rate"] is None
    assert tone["not_run_reasons"] == {"no provider configured": 1}
    (group,) = out["groups"]
    assert (group["group"], group["fail"], group["not_run"]) == ("clinical", 2, 1)
    assert group["failure_rate"]["estimate"] == pytest.approx(estimate)
    assert out["conversations"] == {"ended": 0, "sampled": 7, "not_sampled": 1, "skipped": {"budget": 1},
                                    "judged": 7}
    assert out["tokens"] == {"input_tokens": 2800, "output_tokens": 280}
    assert [c["criterion_id"] for c in review_stats.stats(cur, criterion="tone")["criteria"]] == ["tone"]
    later = review_stats.stats(cur, since=T0 + dt.timedelta(days=1))  # verdicts were judged at T0; not run is newer
    assert [c["criterion_id"] for c in later["criteria"]] == ["tone"] and later["tokens"]["input_tokens"] == 0


def test_stats_with_equal_weights_is_the_plain_rate_and_zero_fails_use_rule_of_three(
        cur: duckdb.DuckDBPyConnection) -> None:
    for n in range(10):
        store(cur, [verdict(f"c{n}", "always-ok", "pass"),
                                   verdict(f"c{n}", "sometimes", "fail" if n < 3 else "pass")],
                             probability=1.0, rule=None)
    out = {c["criterion_id"]: c for c in review_stats.stats(cur)["criteria"]}
    ok = out["always-ok"]["failure_rate"]
    assert (ok["estimate"], ok["low"], ok["high"]) == (0.0, 0.0, pytest.approx(0.3))
    some = out["sometimes"]["failure_rate"]
    assert some["estimate"] == pytest.approx(0.3) and some["n_eff"] == pytest.approx(10)
    assert (some["low"], some["high"]) == (pytest.approx(wilson(0.3, 10)[0]), pytest.approx(wilson(0.3, 10)[1]))


def test_stats_failures_in_lightly_sampled_traffic_widen_the_interval(cur: duckdb.DuckDBPyConnection) -> None:
    # Two fails sampled at 10% (weight 10), fifty passes sampled with certainty (weight 1).
    for n in range(2):
        store(cur, [verdict(f"rare{n}", "k", "fail")], probability=0.1, rule="rare")
    for n in range(50):
        store(cur, [verdict(f"all{n}", "k", "pass")], probability=1.0, rule=None)
    rate = review_stats.stats(cur)["criteria"][0]["failure_rate"]
    estimate = 20 / 70
    kish = 70 ** 2 / (2 * 10 ** 2 + 50)
    capped = estimate * (1 - estimate) / (2 * 10 * 9 * (1 - estimate) ** 2 / 70 ** 2)
    assert capped < kish  # the cap binds here
    assert rate["estimate"] == pytest.approx(estimate) and rate["n_eff"] == pytest.approx(capped)
    assert (rate["low"], rate["high"]) == (pytest.approx(wilson(estimate, capped)[0]),
                                           pytest.approx(wilson(estimate, capped)[1]))


class WritesBetween:
    """A cursor that, once the verdict counts are read, lets another cursor store a conversation's verdicts."""

    def __init__(self, cur: duckdb.DuckDBPyConnection, other: duckdb.DuckDBPyConnection) -> None:
        self.cur, self.other, self.written = cur, other, False

    def execute(self, sql: str, params: Any = None) -> duckdb.DuckDBPyConnection:
        out = self.cur.execute(sql, params)
        if "GROUP BY v.criterion_id" in sql and not self.written:
            self.written = True
            store(self.other, [verdict("late", "k", "fail"), verdict("late", "j", "pass")], probability=1.0, rule=None)
        return out


def test_stats_count_conversations_and_verdicts_on_one_snapshot(cur: duckdb.DuckDBPyConnection) -> None:
    """Verdicts stored while the figures are read: every count is of the same moment (the demo's test saw four
    conversations judged beside the verdicts of two)."""
    store(cur, [verdict("first", "k", "pass"), verdict("first", "j", "pass")], probability=1.0, rule=None)
    other = cur.cursor()
    try:
        between = WritesBetween(cur, other)
        rows = review_stats.stats_rows(between)  # type: ignore[arg-type]
        assert between.written
        assert rows["judged"] == 1 and sum(r[-1] for r in rows["verdicts"]) == 2, rows
        out = review_stats.stats(cur)  # and afterwards, all of it
        assert out["conversations"]["judged"] == 2 and {c["criterion_id"]: c["fail"] for c in out["criteria"]} == {
            "j": 0, "k": 1}
    finally:
        other.close()


# --- review page ----------------------------------------------------------------------------------------

HOSTILE = 'Ignore that. <script>alert("x")</script><img src=x onerror=alert(1)> & "quotes"'


def page_detail(cur: duckdb.DuckDBPyConnection) -> dict[str, Any]:
    sha = add_conversation(cur, "conv-<b>", [
        {"role": "user", "content": HOSTILE},
        {"role": "user", "content": "عندي ألم في الصدر"},
        {"role": "assistant", "content": "Take an aspirin and rest.\nYou will   be fine."},
    ])
    evals.store_criteria(cur, [LLMCriterion(id="chest-pain", version=2, prompt="Ask about <arm> pain first.")])
    store(cur, [verdict("conv-<b>", "chest-pain", "fail", sha, version=2,
                                       reasoning="Advice </div><script>bad()</script> without questions.",
                                       evidence=["BOT: take an aspirin ... you will be fine",
                                                 "a quote nobody said"])],
                         probability=1.0, rule=None)
    (item,) = review.list_reviews(cur)
    return review.review_item(cur, item["id"])


def test_review_page_escapes_everything(cur: duckdb.DuckDBPyConnection) -> None:
    detail = page_detail(cur)
    page = render_item(detail, error="<script>x</script>")
    assert page.lower().count("<script") == 1 and '<script src="/review/static/review.js" defer>' in page
    assert "<img" not in page and "onerror=alert(1)&gt;" in page
    assert "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;" in page
    assert "Ask about &lt;arm&gt; pain first." in page
    assert "conv-&lt;b&gt;" in page
    listing = render_list(review.list_reviews(cur), filters={"criterion": '"><script>', "service": "<img>"},
                          criteria=["chest-pain"])
    assert listing.lower().count("<script") == 1 and "&#34;&gt;&lt;script&gt;" in listing and "<img" not in listing
    assert f'href="/review/{detail["item"]["id"]}"' in listing


def test_review_page_highlights_evidence_and_shows_rtl(cur: duckdb.DuckDBPyConnection) -> None:
    detail = page_detail(cur)
    page = render_item(detail)
    # The quote's two pieces (around the ellipsis) are marked, matching case and spacing loosely.
    assert "<mark>Take an aspirin</mark>" in page
    assert "<mark>You will   be fine</mark>" in page
    assert '<a class="quote text" href="#m' in page and "not found in the transcript" in page  # found: a link
    assert re.search(r'<div class="text" dir="auto">عندي ألم في الصدر</div>', page)
    assert 'action="/review/1/decision"' in page and 'name="reviewer"' in page and 'for="reviewer"' in page
    assert 'value="confirm"' in page and 'value="reject"' in page and 'name="force"' not in page
    assert 'name="viewport"' in page
    review.decide(cur, detail["item"]["id"], "confirm", "Dr. <Amal>")
    decided = render_item(review.review_item(cur, detail["item"]["id"]))
    assert 'name="force" value="1"' in decided and "Dr. &lt;Amal&gt;" in decided


def _highlighted(text: str, quotes: Sequence[str]) -> str:
    """``text`` as the page shows a user message of that text, with the quotes located by the judges."""
    _, marks = locate_quotes([{"role": "user", "content": text}], quotes)
    return highlight(text, marks.get((0, -1), ()))


def test_highlight_is_escaped_around_marks() -> None:
    assert _highlighted("a <b> c", ["<b>"]) == "a <mark>&lt;b&gt;</mark> c"
    assert _highlighted("It’s FINE, really", ["\"it's fine\""]) == "<mark>It’s FINE</mark>, really"
    assert _highlighted("nothing here", ["absent"]) == "nothing here"


def test_page_highlights_exactly_what_the_evidence_check_verified(cur: duckdb.DuckDBPyConnection) -> None:
    """The page's highlighting and evidence_verified come from one matcher (NFKC folding, pieces in order)."""
    msgs = [{"role": "user", "content": "my ﬁle is on the ＤＥＳＫ"},
            {"role": "assistant", "content": "Rest first. Then call us."}]
    sha = add_conversation(cur, "conv-q", msgs)
    record = conversation_record(cur, "conv-q")
    assert record is not None
    transcript = Conversation.model_validate(record).messages
    folded, disordered = "file is on the desk", "then call us ... rest first"
    assert verify_evidence([folded], transcript) and not verify_evidence([disordered], transcript)
    evals.store_criteria(cur, [LLMCriterion(id="c1", version=1, prompt="p")])
    for quote in (folded, disordered):
        cur.execute("DELETE FROM review_items")
        cur.execute("DELETE FROM verdicts")
        store(cur, [verdict("conv-q", "c1", "fail", sha, evidence=[quote],
                            verified=verify_evidence([quote], transcript))], probability=1.0, rule=None)
        (item,) = review.list_reviews(cur)
        page = render_item(review.review_item(cur, item["id"]))
        if quote == folded:
            assert "my <mark>ﬁle is on the ＤＥＳＫ</mark>" in page and '<a class="quote text" href="#m' in page
            assert "was not found in the transcript" not in page
        else:
            assert "<mark>" not in page and "not found in the transcript" in page
            assert "At least one quote the judge gave was not found" in page


def test_an_older_files_keyed_evals_tables_are_rebuilt_without_their_keys_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Keys on the evals tables filled DuckDB's memory as conversations were kept: a file that has them is
    rebuilt without, every row kept, and the rows written then are stored once as before."""
    from collector.evals.judging import PROGRESS_SCHEMA
    from collector.evals.judging import ensure_schema as judging_schema

    old = {  # the tables as they were made before
        "sampling_decisions": evals.UNKEYED["sampling_decisions"].replace(
            "conversation_id VARCHAR NOT NULL", "conversation_id VARCHAR PRIMARY KEY"),
        "verdicts": evals.UNKEYED["verdicts"].replace("id VARCHAR NOT NULL", "id VARCHAR PRIMARY KEY", 1),
        "not_run": evals.UNKEYED["not_run"].replace(
            '"at" TIMESTAMPTZ NOT NULL', '"at" TIMESTAMPTZ NOT NULL, PRIMARY KEY (conversation_id, criterion_id, '
            'criterion_version)'),
        "eval_progress": PROGRESS_SCHEMA.replace("conversation_id VARCHAR NOT NULL",
                                                 "conversation_id VARCHAR PRIMARY KEY"),
    }
    con = duckdb.connect(str(tmp_path / "old.duckdb"))
    c = con.cursor()
    c.execute(CONVERSATIONS_SCHEMA)
    c.execute("CREATE SEQUENCE verdict_seq")
    for table, ddl in old.items():
        c.execute(ddl.format(name=table))
    review.ensure_schema(c)
    add_conversation(c, "c", TOOL_TURNS[:2])
    c.execute("INSERT INTO sampling_decisions VALUES ('c', 1, NULL, true, 0.5, NULL, NULL, ?)", [T0])
    c.execute("INSERT INTO not_run VALUES ('c', 'tone', 1, 'no provider configured', ?)", [T0])
    c.execute("INSERT INTO eval_progress VALUES ('c', 1, ?, 1, 1, ?)", [T0, T0])
    stored = store(c, [verdict("c", "c1", "fail", "1" * 64)], probability=0.5, rule=None, now=T0)
    tables = ("sampling_decisions", "verdicts", "not_run", "eval_progress")

    def rows() -> dict[str, list[Any]]:
        return {t: c.execute(f"SELECT * FROM {t} ORDER BY ALL").fetchall() for t in tables}

    def keyed() -> list[str]:
        return [t for (t,) in c.execute("SELECT table_name FROM duckdb_constraints() WHERE constraint_type = "
                                        "'PRIMARY KEY' AND list_contains(?, table_name)", [list(tables)]).fetchall()]

    before = rows()
    assert sorted(keyed()) == sorted(tables)
    caplog.set_level(logging.WARNING, logger="tracejudge.store")
    judging_schema(c)
    assert keyed() == [] and rows() == before
    assert caplog.text.count("without its key, once") == 4
    judging_schema(c)  # once
    assert caplog.text.count("without its key, once") == 4

    # Written again: the first decision stands, the latest not-run reason, a verdict once.
    assert evals.record_sampling(c, "c", sampled=False, probability=0.1, rule="r")["probability"] == 0.5
    evals.store_not_run(c, [NotRun(conversation_id="c", criterion_id="tone", criterion_version=1, reason="budget")])
    assert store(c, [verdict("c", "c1", "fail", "1" * 64)], probability=0.5, rule=None) == []
    after = rows()
    assert after["sampling_decisions"] == before["sampling_decisions"] and after["verdicts"] == before["verdicts"]
    assert [r[3] for r in after["not_run"]] == ["budget"]
    assert stored and len(after["verdicts"]) == 1
    con.close()
