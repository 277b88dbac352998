"""The evaluator stage on a real store with a clock of the test's: error retries, no-content conversations.

Conversations are written as the conversations stage writes them; the judge is
``judges.ScriptedProvider`` (a real provider answering from a script), so the
hours between retries pass on the injected clock instead of the wall's.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest

from collector.config import Config
from collector.evals.evaluator import Evaluator
from collector.evals.judging import RETRIES, RETRY
from collector.metrics import Metrics
from collector.store import Store
from judges import JudgeRequest, ProviderReply, ScriptedProvider, load_criteria

from ..support.daemon import wait_until
from ..support.evaluator import CRITERIA, T0, Clock, add_conversation, make_evaluator, open_store, query, verdict


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = open_store(tmp_path / "t.duckdb")
    yield s
    s.close()



def test_judge_errors_are_retried_after_1_10_and_60_minutes() -> None:
    assert [RETRY.delay(n) for n in range(1, RETRIES + 1)] == [60.0, 600.0, 3600.0]

def test_errors_are_retried_later_on_the_criteria_that_errored(store: Store, tmp_path: Path) -> None:
    clock = Clock()
    clock.now = T0 + 10
    replies = iter(["not json at all", verdict("pass", "Thank you kindly")])
    ev, provider = make_evaluator(store, tmp_path, clock, lambda request: next(replies))
    add_conversation(store, "c1", "Thank you kindly")
    ev.start()
    try:
        wait_until(lambda: ev.judged == 1, "the first attempt")
        rows = query(store, "SELECT criterion_id, result, error_reason FROM verdicts ORDER BY criterion_id")
        assert [(c, r) for c, r, _ in rows] == [("polite", "error"), ("short", "pass")]
        assert rows[0][2].startswith("junk_reply")
        assert query(store, "SELECT attempts, epoch(retry_at) FROM eval_progress") == [(1, T0 + 10 + RETRY.delay(1))]
        assert query(store, "SELECT count(*) FROM review_items") == [(0,)]  # an error is never queued
        scans = ev.scans
        wait_until(lambda: ev.scans >= scans + 2, "a whole scan for retries before their time")
        assert len(provider.requests) == 1  # not before its time
        clock.now += RETRY.delay(1) + 1
        ev.wake()
        wait_until(lambda: ev.judged == 2, "the retry")
        rows = query(store, "SELECT criterion_id, result FROM verdicts ORDER BY criterion_id")
        assert rows == [("polite", "pass"), ("short", "pass")]  # the error replaced, the code check not re-run
        assert len(provider.requests) == 2
        assert query(store, "SELECT attempts, retry_at FROM eval_progress") == [(2, None)]
    finally:
        ev.stop()


def test_conversations_judged_while_another_is_in_flight_are_stored_with_it(store: Store, tmp_path: Path) -> None:
    """A store is a transaction of about ten statements, whatever it holds: outcomes wait for others
    (up to ``store_wait``), and hold no judging slot while they wait."""
    clock = Clock()
    clock.now = T0 + 10
    release = threading.Event()

    class Held(ScriptedProvider):
        async def send(self, request: JudgeRequest) -> ProviderReply:
            while "slow reply" in request.prompt and not release.is_set():
                await asyncio.sleep(0.01)
            return await super().send(request)

    stored: list[int] = []

    def on_stored(cur: duckdb.DuckDBPyConnection, verdict_ids: list[str], now: object) -> int:
        stored.append(len(verdict_ids))
        return 0

    (tmp_path / "criteria.yaml").write_text(CRITERIA, encoding="utf-8")
    cfg = Config.model_validate({"sampling": {"rate": 1.0}, "judges": {"concurrency": 2}})  # 4 in flight at most
    ev = Evaluator(store, cfg, Metrics(), criteria=load_criteria(tmp_path / "criteria.yaml"),
                   provider=Held(lambda request: verdict("pass", "reply"), model="scripted-judge"), clock=clock,
                   poll=0.05, on_stored=on_stored)
    ev.store_wait = 3600.0  # stored once nothing else is being judged, then
    add_conversation(store, "a-slow", "slow reply")
    for i in range(5):
        add_conversation(store, f"fast-{i}", "fast reply")
    ev.start()
    try:
        # More than the 3 slots left beside the slow one: each judged conversation gave its slot back.
        wait_until(lambda: ev.held()["judged_unstored"] == 5, "the fast ones judged, waiting to be stored")
        assert stored == [] and ev.judged == 0
        release.set()
        wait_until(lambda: ev.judged == 6, "all six stored")
        assert stored == [12]  # two verdicts each, in one transaction
    finally:
        ev.stop()


def test_a_conversation_without_content_is_never_judged(store: Store, tmp_path: Path) -> None:
    clock = Clock()
    clock.now = T0 + 10
    ev, provider = make_evaluator(store, tmp_path, clock, lambda request: verdict("pass", "x"))
    add_conversation(store, "dark", "", captured=False)
    ev.start()
    try:
        wait_until(lambda: ev.judged == 1, "the conversation's turn")
        assert provider.requests == [] and query(store, "SELECT count(*) FROM verdicts") == [(0,)]
        assert sorted(query(store, "SELECT criterion_id, reason FROM not_run")) == [
            ("polite", "no content captured"), ("short", "no content captured")]
    finally:
        ev.stop()


def test_a_conversation_written_moments_ago_waits_for_late_rows(store: Store, tmp_path: Path) -> None:
    clock = Clock()
    clock.now = T0 + 0.5  # written half a second ago: its last trace may still be arriving
    ev, provider = make_evaluator(store, tmp_path, clock, lambda request: verdict("pass", "fine"))
    add_conversation(store, "fresh", "fine")
    ev.start()
    try:
        wait_until(lambda: ev.scans >= 2, "scans that see it")
        assert query(store, "SELECT count(*) FROM sampling_decisions") == [(0,)]
        clock.now = T0 + 10
        ev.wake()
        wait_until(lambda: ev.judged == 1, "judging once settled")
        assert query(store, "SELECT sampled, probability, rule FROM sampling_decisions") == [(True, 1.0, "default")]
    finally:
        ev.stop()


def test_criteria_not_run_for_want_of_a_provider_are_judged_when_one_comes(store: Store, tmp_path: Path) -> None:
    clock = Clock()
    clock.now = T0 + 10
    add_conversation(store, "c1", "Thank you kindly")
    ev, _ = make_evaluator(store, tmp_path, clock, lambda request: "unused", no_provider="no API key: set it")
    ev.start()
    try:
        wait_until(lambda: ev.judged == 1, "judging without a provider")
    finally:
        ev.stop()
    assert query(store, "SELECT criterion_id, reason FROM not_run") == [("polite", "no API key: set it")]
    assert query(store, "SELECT criterion_id, result FROM verdicts") == [("short", "pass")]

    ev, provider = make_evaluator(store, tmp_path, clock, lambda request: verdict("pass", "Thank you kindly"))
    ev.start()
    try:
        wait_until(lambda: ev.judged == 1, "judging with the provider")
    finally:
        ev.stop()
    assert len(provider.requests) == 1
    assert query(store, "SELECT criterion_id, result FROM verdicts ORDER BY 1") == [
        ("polite", "pass"), ("short", "pass")]
    assert query(store, "SELECT count(*) FROM not_run") == [(0,)]


@pytest.mark.slow
@pytest.mark.parametrize("env, judged", [
    ({}, False),
    ({"ANTHROPIC_API_KEY": "k"}, True),
    ({"ANTHROPIC_BASE_URL": "http://127.0.0.1:9/gateway"}, True),  # a gateway may need no key
])
def test_the_daemon_judges_with_anthropic_given_a_key_or_a_url(monkeypatch: pytest.MonkeyPatch,
                                                              env: dict[str, str], judged: bool) -> None:
    from collector.evals.setup import daemon_provider

    for name in ("ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL", "ANTHROPIC_MODEL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cfg = Config.model_validate({"judges": {"provider": {"type": "anthropic", "model": "claude-test"}}})
    provider, why = daemon_provider(cfg)
    assert (provider is not None) == judged and (why is None) == judged
    assert judged or why is not None and "ANTHROPIC_API_KEY" in why
