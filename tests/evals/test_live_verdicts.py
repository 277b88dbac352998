"""Live verdicts in the store: kept apart from the verdicts made at the end, never counted in stats, and a
live fail's review item standing for its conversation and criterion."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest

from collector.conversations.tables import SCHEMA as CONVERSATIONS_SCHEMA
from collector.evals import verdicts
from collector.evals.judging import ensure_schema
from collector.review import queue
from collector.review.stats import stats
from collector.store import Store
from judges import Verdict

from ..support.evaluator import add_conversation, open_store


@pytest.fixture
def cur(tmp_path: Path) -> Iterator[duckdb.DuckDBPyConnection]:
    store: Store = open_store(tmp_path / "t.duckdb")
    add_conversation(store, "c1", "We refund you in full.")
    c = store.cursor()
    ensure_schema(c)
    yield c
    c.close()
    store.close()


def verdict(result: str, sha: str = "s1", criterion: str = "no-refunds") -> Verdict:
    return Verdict(conversation_id="c1", criterion_id=criterion, criterion_version=1, result=result,
                   evidence=["We refund you in full."] if result == "fail" else [],
                   judge={"provider": "code", "model": "regex"}, transcript_sha256=sha)


def store(cur: duckdb.DuckDBPyConnection, v: Verdict, *, live: bool) -> list[str]:
    return verdicts.store_verdicts(cur, [v], probability=1.0, rule="default", current={"c1": v.transcript_sha256},
                                   live=live)


def test_a_live_verdict_and_the_end_verdict_on_one_transcript_are_two(cur: duckdb.DuckDBPyConnection) -> None:
    [live] = store(cur, verdict("fail"), live=True)
    [end] = store(cur, verdict("fail"), live=False)
    assert live != end
    rows = cur.execute("SELECT id, live, superseded FROM verdicts ORDER BY seq").fetchall()
    assert rows == [(live, True, False), (end, False, False)]
    assert [v["live"] for v in verdicts.list_verdicts(cur)] == [False, True]


def test_live_verdicts_supersede_only_live_ones(cur: duckdb.DuckDBPyConnection) -> None:
    [end] = store(cur, verdict("pass", "s0"), live=False)
    [turn2] = store(cur, verdict("fail", "s1"), live=True)
    [turn3] = store(cur, verdict("fail", "s2"), live=True)
    superseded = dict(cur.execute("SELECT id, superseded FROM verdicts").fetchall())
    assert superseded == {end: False, turn2: True, turn3: False}


def test_stats_count_the_end_verdict_alone(cur: duckdb.DuckDBPyConnection) -> None:
    store(cur, verdict("fail", "s1"), live=True)
    store(cur, verdict("fail", "s2"), live=True)
    assert stats(cur)["criteria"] == []
    store(cur, verdict("pass", "s2"), live=False)
    [entry] = stats(cur)["criteria"]
    assert (entry["judged"], entry["pass"], entry["fail"]) == (1, 1, 0)


def test_a_live_item_stands_for_its_conversation_and_criterion(cur: duckdb.DuckDBPyConnection) -> None:
    [first] = store(cur, verdict("fail", "s1"), live=True)
    item = queue.open_live_item(cur, first)
    [again] = store(cur, verdict("fail", "s2"), live=True)
    assert queue.open_live_item(cur, again) == item
    [end] = store(cur, verdict("fail", "s2"), live=False)
    assert queue.open_items(cur, [end], ["fail"]) == 0  # the live item is its review
    [other] = store(cur, verdict("fail", "s2", criterion="other"), live=False)
    assert queue.open_items(cur, [other], ["fail"]) == 1
    items = queue.list_reviews(cur)
    assert [(i["criterion_id"], i["live"]) for i in items] == [("no-refunds", True), ("other", False)]
    [entry] = [c for c in stats(cur)["criteria"] if c["criterion_id"] == "no-refunds"]
    assert entry["review"]["pending"] == 1 and entry["fail"] == 1


def test_pending_live_items_come_first_whatever_their_severity(cur: duckdb.DuckDBPyConnection) -> None:
    cur.execute("INSERT INTO criteria VALUES ('high-one', 1, 'code', 'high', NULL, 't', now()), "
                "('no-refunds', 1, 'code', 'low', NULL, 't', now())")
    [high] = store(cur, verdict("fail", criterion="high-one"), live=False)
    queue.open_items(cur, [high], ["fail"])
    [live] = store(cur, verdict("fail"), live=True)
    queue.open_live_item(cur, live)
    for order in ("severity", "age"):
        assert [i["criterion_id"] for i in queue.list_reviews(cur, order=order)] == ["no-refunds", "high-one"]


def test_a_file_older_than_live_criteria_gets_its_verdicts_and_items_marked_not_live(tmp_path: Path) -> None:
    con = duckdb.connect(str(tmp_path / "old.duckdb"))
    con.execute(CONVERSATIONS_SCHEMA)
    ddl = verdicts.UNKEYED["verdicts"].format(name="verdicts").replace(",\n    live BOOLEAN NOT NULL DEFAULT false", "")
    con.execute(ddl)
    con.execute(queue.SCHEMA.split("-- Opened by a live fail")[0])
    con.execute("INSERT INTO verdicts VALUES ('v1', 1, 'c1', 'k', 1, 'code', 'regex', 's', 'fail', NULL, '', '[]', "
                "true, false, 0, 0, '', 1.0, 'default', now(), false)")
    con.execute("INSERT INTO review_items (id, verdict_id, conversation_id, criterion_id, state, created_at) "
                "VALUES (1, 'v1', 'c1', 'k', 'pending', now())")
    ensure_schema(con)
    queue.ensure_schema(con)
    assert con.execute("SELECT live FROM verdicts").fetchall() == [(False,)]
    assert [i["live"] for i in queue.list_reviews(con)] == [False]
    con.close()
