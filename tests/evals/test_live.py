"""Live criteria in the evaluator, on a real store with a clock of the test's: open conversations written as
the conversation stage writes them, turn by turn, and the daemon's own handling of a live fail (its review
item and its alert)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from collector.alerts import store as alerts_store
from collector.alerts.live import on_live_fail
from collector.config import Config
from collector.evals import live
from collector.evals.evaluator import Evaluator
from collector.metrics import Metrics
from collector.review import queue as review_queue
from collector.store import Store
from judges import JudgeRequest, ProviderReply, ScriptedProvider, Usage, load_criteria

from ..support.daemon import wait_until
from ..support.evaluator import T0, Clock, open_store, query, verdict

CRITERIA = """
criteria:
  - id: one-question
    version: 1
    kind: code
    severity: high
    check: max_user_turns
    max: 1
    live: true
  - id: polite
    version: 1
    kind: llm
    prompt: 'Criterion: the bot is polite. "pass", "fail" or "not_applicable".'
    live: true
  - id: short
    version: 1
    kind: code
    check: max_user_turns
    max: 5
"""
TURNS = [("Where is my order?", "It ships today."), ("And the invoice?", "It is attached."),
         ("Thanks!", "You are welcome.")]


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    monkeypatch.setattr(live, "POLL", 0.02)
    s = open_store(tmp_path / "t.duckdb")
    cur = s.cursor()
    alerts_store.ensure_schema(cur)
    cur.close()
    yield s
    s.close()


def write_turns(store: Store, cid: str, turns: int, clock: Clock, *, state: str = "open",
                service: str = "bot") -> None:
    """The conversation with its first ``turns`` turns, as the conversation stage writes it: the row replaced,
    the transcript written whole with the batch the stage had taken in, data arrived now."""
    at = dt.datetime.fromtimestamp(clock.now, dt.timezone.utc)
    batch = int(clock.now * 10)
    messages = [(role, text) for user, answer in TURNS[:turns] for role, text in (("user", user), ("assistant", answer))]
    cur = store.cursor()
    try:
        cur.execute("BEGIN")  # in one transaction, as the stage writes: a look sees the row with its messages
        cur.execute("DELETE FROM live_conversations WHERE conversation_id = ?", [cid])
        cur.execute("DELETE FROM messages WHERE conversation_id = ?", [cid])
        cur.execute("INSERT INTO live_conversations (conversation_id, service, state, ended_by, models, trace_ids, "
                    "content_captured, revision, user_turns, message_count, last_arrival_at, closed_at, updated_at, "
                    "messages_batch, first_batch) VALUES (?, ?, ?, ?, '[]', '[]', true, ?, ?, ?, ?, ?, ?, ?, 1)",
                    [cid, service, state, "idle" if state == "ended" else None, turns, turns, len(messages), at,
                     at if state == "ended" else None, at, batch])
        for seq, (role, text) in enumerate(messages):
            cur.execute("INSERT INTO messages (conversation_id, seq, role, content, first_batch) VALUES (?, ?, ?, ?, ?)",
                        [cid, seq, role, text, batch])
        cur.execute("COMMIT")
    finally:
        cur.close()


def make(store: Store, tmp_path: Path, clock: Clock, *, sampling: dict[str, Any] | None = None,
         tokens: int = 0) -> tuple[Evaluator, ScriptedProvider]:
    (tmp_path / "criteria.yaml").write_text(CRITERIA, encoding="utf-8")
    cfg = Config.model_validate({"sampling": sampling or {"rate": 1.0}, "judges": {"concurrency": 2},
                                 "alerts": {"live_settle": "2s"}})

    def polite(request: JudgeRequest) -> ProviderReply:
        return ProviderReply(text=verdict("pass", "It ships today."), usage=Usage(input_tokens=tokens))

    provider = ScriptedProvider(polite, model="scripted-judge")
    ev = Evaluator(store, cfg, Metrics(), criteria=load_criteria(tmp_path / "criteria.yaml"), provider=provider,
                   clock=clock, poll=0.05, on_stored=review_queue.item_opener(cfg))
    return ev, provider


def live_verdicts(store: Store, criterion: str = "one-question") -> list[tuple[Any, ...]]:
    return query(store, f"SELECT result, superseded FROM verdicts WHERE live AND criterion_id = '{criterion}' "
                        "ORDER BY seq")


def test_a_failing_turn_opens_its_item_and_fires_once_per_conversation_and_criterion(
        store: Store, tmp_path: Path) -> None:
    clock = Clock()
    ev, _ = make(store, tmp_path, clock)
    write_turns(store, "c1", 1, clock)
    ev.start()
    try:
        ev.go_live(on_live_fail("http://127.0.0.1:8318"))
        wait_until(lambda: live_verdicts(store) == [("pass", False)], "turn 1's live verdict")
        assert query(store, "SELECT count(*) FROM alerts") == [(0,)]
        clock.now += 1
        write_turns(store, "c1", 2, clock)
        wait_until(lambda: query(store, "SELECT count(*) FROM alerts") == [(1,)], "the alert of turn 2")
        [(body,)] = query(store, "SELECT body FROM alerts")
        [item] = review_queue.list_reviews(store.cursor())
        assert item["live"] and item["criterion_id"] == "one-question" and item["state"] == "pending"
        assert f'"review_url":"http://127.0.0.1:8318/review/{item["id"]}"' in body
        assert '"turn":2' in body and '"severity":"high"' in body and '"conversation_id":"c1"' in body
        clock.now += 1
        write_turns(store, "c1", 3, clock)
        wait_until(lambda: live_verdicts(store) == [("pass", True), ("fail", True), ("fail", False)],
                   "turn 3's live verdict")
        assert query(store, "SELECT count(*) FROM alerts") == [(1,)]  # turn 3 pages nobody again
        assert query(store, "SELECT count(*) FROM review_items") == [(1,)]
        # Nothing is judged again while nothing new comes.
        scans = ev.scans
        wait_until(lambda: ev.scans >= scans + 3, "more scans")
        assert len(live_verdicts(store)) == 3
        # The end verdict is still made, and it alone counts; its fail opens no second item.
        clock.now += 1
        write_turns(store, "c1", 3, clock, state="ended")
        clock.now += 10
        ev.wake()
        wait_until(lambda: query(store, "SELECT count(*) FROM verdicts WHERE NOT live AND criterion_id = "
                                        "'one-question'") == [(1,)], "the end verdict")
        assert query(store, "SELECT count(*) FROM review_items") == [(1,)]
    finally:
        ev.stop()


def test_an_llm_criterion_is_judged_once_a_turn_has_settled(store: Store, tmp_path: Path) -> None:
    clock = Clock()
    ev, provider = make(store, tmp_path, clock)
    write_turns(store, "c1", 1, clock)
    ev.start()
    try:
        ev.go_live(lambda cur, failures, now: None)
        wait_until(lambda: live_verdicts(store), "the code check, at once")
        scans = ev.scans
        wait_until(lambda: ev.scans >= scans + 3, "more scans")
        assert provider.requests == [] and live_verdicts(store, "polite") == []  # not settled yet
        clock.now += 2
        wait_until(lambda: live_verdicts(store, "polite") == [("pass", False)], "the LLM criterion, settled")
        scans = ev.scans
        wait_until(lambda: ev.scans >= scans + 3, "more scans")
        assert len(provider.requests) == 1  # once per turn
    finally:
        ev.stop()


def test_a_restart_neither_judges_a_turn_again_nor_skips_one(store: Store, tmp_path: Path) -> None:
    clock = Clock()
    ev, _ = make(store, tmp_path, clock)
    write_turns(store, "c1", 2, clock)
    ev.start()
    try:
        ev.go_live(lambda cur, failures, now: None)
        wait_until(lambda: live_verdicts(store) == [("fail", False)], "turn 2")
    finally:
        ev.stop()
    clock.now += 1
    write_turns(store, "c1", 3, clock)
    ev, _ = make(store, tmp_path, clock)
    ev.start()
    try:
        ev.go_live(lambda cur, failures, now: None)
        wait_until(lambda: len(live_verdicts(store)) == 2, "turn 3, written while it was stopped")
        scans = ev.scans
        wait_until(lambda: ev.scans >= scans + 3, "more scans")
        assert query(store, "SELECT count(*) FROM verdicts WHERE live AND criterion_id = 'one-question'") == [(2,)]
    finally:
        ev.stop()


def test_sampling_rules_read_on_the_open_conversation_decide_which_are_judged_live(
        store: Store, tmp_path: Path) -> None:
    clock = Clock()
    # A rule on ended_by matches no open conversation: the service rule decides "quiet" ones, the default the rest.
    ev, _ = make(store, tmp_path, clock, sampling={"rate": 1.0, "rules": [
        {"when": {"ended_by": "idle"}, "rate": 1.0}, {"when": {"service": "quiet"}, "rate": 0.0}]})
    write_turns(store, "c-quiet", 2, clock, service="quiet")
    write_turns(store, "c-loud", 2, clock, service="loud")
    ev.start()
    try:
        ev.go_live(lambda cur, failures, now: None)
        wait_until(lambda: query(store, "SELECT conversation_id FROM verdicts WHERE live AND criterion_id = "
                                        "'one-question'") == [("c-loud",)], "the loud one, live")
        scans = ev.scans
        wait_until(lambda: ev.scans >= scans + 3, "more scans")
        assert query(store, "SELECT count(*) FROM verdicts WHERE conversation_id = 'c-quiet'") == [(0,)]
    finally:
        ev.stop()


def test_live_llm_criteria_spend_the_token_budget_and_stop_when_it_is_spent(store: Store, tmp_path: Path) -> None:
    clock = Clock()
    ev, provider = make(store, tmp_path, clock, sampling={"rate": 1.0, "budget": {"judge_tokens_per_day": 150}},
                        tokens=100)
    write_turns(store, "c1", 1, clock)
    write_turns(store, "c2", 1, clock)
    clock.now += 2
    ev.start()
    try:
        ev.go_live(lambda cur, failures, now: None)
        # Both were admitted while tokens were left: calls admitted at once may overshoot the budget.
        wait_until(lambda: ev.sampler.usage().judge_tokens_today == 200, "both turns judged, their tokens counted")
        assert len(live_verdicts(store, "polite")) == 2
        clock.now += 1
        write_turns(store, "c1", 2, clock)
        clock.now += 2
        assert ev.live is not None
        passed_over = ev.live.m.not_run
        wait_until(lambda: len(live_verdicts(store)) == 3, "turn 2's code check: code checks go on")
        assert passed_over.value(reason="budget:judge_tokens_per_day") == 1 and len(provider.requests) == 2
    finally:
        ev.stop()
