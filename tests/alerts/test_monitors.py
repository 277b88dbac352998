"""Monitors on a real store with a clock of the test's: a failure rate that fires once per episode and resolves,
hysteresis between the interval's ends, too few verdicts deciding nothing, judge errors, judge agreement on the
newest blind labels, and episodes that outlive a restart; then a daemon whose monitor's alert reaches a webhook."""

from __future__ import annotations

import datetime as dt
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import pytest

from collector.alerts import store as alerts
from collector.alerts.monitors import Monitors
from collector.config import Monitor
from collector.metrics import Metrics
from collector.store import Store
from judges import weighted_proportion

from ..support.daemon import DaemonProcess, base_config, wait_until
from ..support.stored import T0, add_verdicts, create_store, label
from ..support.webhooks import Receiver

HOUR = dt.timedelta(hours=1)
RATE = Monitor(kind="failure_rate", criterion="red-flags", window="1h", above=0.05)
_IDS = itertools.count()


class Clock:
    """The daemon's clock, as the test sets it."""

    def __init__(self, at: dt.datetime) -> None:
        self.at = at

    def __call__(self) -> float:
        return self.at.timestamp()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    create_store(tmp_path / "t.duckdb")
    s = Store(tmp_path / "t.duckdb")
    s.open()
    try:
        yield s
    finally:
        s.close()


def stage(store: Store, clock: Clock, *monitors: Monitor) -> Monitors:
    s = Monitors(store, monitors, Metrics(), clock=clock)
    s.open()
    return s


def judged(store: Store, hour: int, results: dict[str, int], criterion: str = "red-flags",
           **columns: Any) -> None:
    """Verdicts judged in the ``hour``-th hour after T0, spread over it: ``results`` counts each result."""
    rows = [result for result, count in results.items() for _ in range(count)]
    cur = store.cursor()
    try:
        add_verdicts(cur, [
            {"conversation_id": f"h{hour}-{result}-{next(_IDS)}", "criterion_id": criterion, "result": result,
             "judged_at": T0 + hour * HOUR + (k + 1) * HOUR / (len(rows) + 1), **columns}
            for k, result in enumerate(rows)])
    finally:
        cur.close()


def all_alerts(store: Store) -> list[dict[str, Any]]:
    cur = store.cursor()
    try:
        return list(reversed(alerts.list_alerts(cur, state="all")))  # oldest first
    finally:
        cur.close()


def notices(store: Store) -> list[tuple[str, dict[str, Any]]]:
    cur = store.cursor()
    try:
        return [(state, json.loads(body)) for state, body in
                cur.execute("SELECT state, body FROM alert_notices ORDER BY seq").fetchall()]
    finally:
        cur.close()


def metric_lines(s: Monitors, name: str) -> list[str]:
    return [line for line in s.metrics.render().splitlines() if line.startswith(name + "{")]


def test_a_failure_rate_fires_once_per_episode_holds_between_the_bounds_and_resolves(store: Store) -> None:
    clock = Clock(T0 + HOUR)
    s = stage(store, clock, RATE)
    judged(store, 0, {"fail": 20, "pass": 80})  # 20% (13% to 29%): the low end is above 5%
    reading = s.evaluate()["failure_rate:red-flags"]
    assert reading.decision == "fire"
    (alert,) = all_alerts(store)
    assert (alert["type"], alert["state"], alert["key"]) == (
        "failure_rate", "open", f"monitor:failure_rate:red-flags:{(T0 + HOUR).isoformat().replace('+00:00', 'Z')}")
    body = alert["body"]
    rate = weighted_proportion([(True, 1.0)] * 20 + [(False, 1.0)] * 80)
    assert rate is not None
    assert body["measures"] == {"failure_rate": {"estimate": 0.2, "low": rate.low, "high": rate.high,
                                                 "threshold": 0.05}}
    assert (body["monitor"], body["kind"], body["criterion"], body["window_seconds"]) == (
        "failure_rate:red-flags", "failure_rate", "red-flags", 3600)
    assert body["counts"] == {"judged": 100, "applicable": 100, "fail": 20, "n_eff": pytest.approx(100)}
    assert body["summary"] == ("failure_rate:red-flags: red-flags over 1h: failure rate 20.0% (13.3% to 28.9%), "
                               "threshold 5%")
    assert 'tracejudge_monitor_firing{monitor="failure_rate:red-flags"} 1' in s.metrics.render()

    s.evaluate()  # still out of bounds, the same episode: no second alert
    clock.at += HOUR
    judged(store, 1, {"fail": 5, "pass": 95})  # 5% (2.2% to 11.2%): between the bounds, it stays firing
    assert s.evaluate()["failure_rate:red-flags"].decision is None
    assert [a["state"] for a in all_alerts(store)] == ["open"]

    clock.at += HOUR
    judged(store, 2, {"pass": 200})  # 0%, at most 1.5% by the rule of three: below 5%
    assert s.evaluate()["failure_rate:red-flags"].decision == "resolve"
    assert [a["state"] for a in all_alerts(store)] == ["resolved"]
    (_, opened), (_, resolved) = notices(store)
    assert resolved["id"] == opened["id"] and resolved["state"] == "resolved"
    assert resolved["measures"]["failure_rate"]["high"] == pytest.approx(3 / 200)
    assert 'tracejudge_monitor_firing{monitor="failure_rate:red-flags"} 0' in s.metrics.render()
    s.evaluate()  # quiet stays quiet
    assert len(notices(store)) == 2

    clock.at += HOUR
    judged(store, 3, {"fail": 30, "pass": 70})
    s.evaluate()  # a new episode, a new alert
    assert [a["state"] for a in all_alerts(store)] == ["resolved", "open"]
    assert len({a["key"] for a in all_alerts(store)}) == 2


def test_the_rate_is_weighted_by_inclusion_probability_over_the_window_only(store: Store) -> None:
    s = stage(store, Clock(T0 + 2 * HOUR), RATE)
    judged(store, 0, {"fail": 50})  # an hour before the window
    judged(store, 1, {"pass": 50})
    judged(store, 1, {"fail": 3}, inclusion_probability=0.1)  # each stands for ten conversations
    measure = s.evaluate()["failure_rate:red-flags"].measures["failure_rate"]
    expected = weighted_proportion([(False, 1.0)] * 50 + [(True, 10.0)] * 3)
    assert expected is not None and measure.estimate == pytest.approx(expected.estimate)  # 30 of 80, not 3 of 53


def test_too_few_verdicts_report_their_value_and_decide_nothing(store: Store) -> None:
    s = stage(store, Clock(T0 + HOUR), RATE)
    judged(store, 0, {"fail": 9})  # every one a fail, but 9 tell nothing
    reading = s.evaluate()["failure_rate:red-flags"]
    assert reading.decision is None and not all_alerts(store)
    assert reading.measures["failure_rate"].text == "too few to tell (9 of 9)"
    values = metric_lines(s, "tracejudge_monitor_value")
    assert 'tracejudge_monitor_value{bound="estimate",measure="failure_rate",monitor="failure_rate:red-flags"} 1' \
        in values
    assert 'tracejudge_monitor_threshold{measure="failure_rate",monitor="failure_rate:red-flags"} 0.05' \
        in s.metrics.render()

    s.clock = Clock(T0 + 3 * HOUR)  # the window has nothing: no value at all, never a stale one
    assert s.evaluate()["failure_rate:red-flags"].measures == {}
    assert metric_lines(s, "tracejudge_monitor_value") == []


def test_judge_errors_fire_above_their_share_and_resolve_at_or_below_it(store: Store) -> None:
    errors = Monitor(kind="judge_errors", window="1h", above=0.2)
    clock = Clock(T0 + HOUR)
    s = stage(store, clock, errors)
    judged(store, 0, {"error": 6, "pass": 14})
    judged(store, 0, {"error": 4, "pass": 6}, criterion="polite")  # every criterion: 10 of 30
    reading = s.evaluate()["judge_errors"]
    assert reading.decision == "fire" and reading.measures["error_share"].estimate == pytest.approx(1 / 3)
    (alert,) = all_alerts(store)
    assert alert["type"] == "judge_errors" and alert["body"]["counts"] == {"judged": 30, "error": 10}
    clock.at += HOUR
    judged(store, 1, {"error": 2, "pass": 8})  # 20%: not above
    assert s.evaluate()["judge_errors"].decision == "resolve"
    assert [a["state"] for a in all_alerts(store)] == ["resolved"]


def test_an_open_episode_outlives_a_restart_and_a_removed_monitor_has_it_resolved(store: Store) -> None:
    clock = Clock(T0 + HOUR)
    judged(store, 0, {"fail": 20, "pass": 80})
    first = stage(store, clock, RATE)
    first.evaluate()
    first.stop()

    again = stage(store, clock, RATE)  # the daemon started again, the rate still high
    assert 'tracejudge_monitor_firing{monitor="failure_rate:red-flags"} 1' in again.metrics.render()
    again.evaluate()
    assert [a["state"] for a in all_alerts(store)] == ["open"]  # not fired a second time
    again.stop()

    stage(store, clock).stop()  # started with the failure_rate monitor gone from the config, and none left
    (alert,) = all_alerts(store)
    assert alert["state"] == "resolved"
    assert notices(store)[-1][1]["summary"] == "failure_rate:red-flags: the monitor was removed from alerts.monitors"


def test_judge_agreement_fires_when_the_newest_blind_labels_start_disagreeing(store: Store) -> None:
    agreement = Monitor(kind="judge_agreement", criterion="red-flags", max_false_pass=0.2, min_kappa=0.5)
    clock = Clock(T0 + HOUR)
    s = stage(store, clock, agreement)

    def labelled(prefix: str, n: int, human: str, judge: str, start: dt.datetime) -> None:
        cur = store.cursor()
        try:
            add_verdicts(cur, [{"conversation_id": f"{prefix}{k}", "criterion_id": "red-flags", "result": judge}
                               for k in range(n)])
            for k in range(n):
                label(cur, f"{prefix}{k}", "red-flags", human, start + k * dt.timedelta(seconds=1))
        finally:
            cur.close()

    # A judge that agrees with people: no false pass among 50 fails (at most 6% by the rule of three), kappa 1.
    labelled("agree-fail-", 50, "fail", "fail", T0)
    labelled("agree-pass-", 50, "pass", "pass", T0 + dt.timedelta(minutes=5))
    reading = s.evaluate()["judge_agreement:red-flags"]
    assert reading.decision == "resolve" and not all_alerts(store)
    assert reading.measures["kappa"].low == 1.0

    # Then it passes what people fail: the newest hundred tasks hold 40 of those, 20 agreeing passes and
    # the 40 newest agreeing passes before them.
    labelled("missed-", 40, "fail", "pass", T0 + 2 * HOUR)
    labelled("new-pass-", 20, "pass", "pass", T0 + 3 * HOUR)
    clock.at = T0 + 4 * HOUR
    reading = s.evaluate()["judge_agreement:red-flags"]
    assert reading.decision == "fire"
    (alert,) = all_alerts(store)
    assert alert["type"] == "judge_agreement"
    measures = alert["body"]["measures"]
    assert measures["false_pass"]["estimate"] == 1.0 and measures["false_pass"]["threshold"] == 0.2
    assert measures["kappa"]["high"] < 0.5 and measures["kappa"]["threshold"] == 0.5
    assert alert["body"]["counts"] == {"items": 100, "compared": 100, "human_fails": 40, "false_passes": 40}
    lines = metric_lines(s, "tracejudge_monitor_value")
    assert {line.split("}")[0] + "}" for line in lines} == {
        f'tracejudge_monitor_value{{bound="{b}",measure="{m}",monitor="judge_agreement:red-flags"}}'
        for b in ("estimate", "low", "high") for m in ("false_pass", "kappa")}
    assert s.evaluate()["judge_agreement:red-flags"].measures["kappa"] == reading.measures["kappa"]  # seeded


@pytest.mark.slow
def test_a_daemon_s_monitor_fires_to_the_webhooks_and_shows_on_metrics(tmp_path: Path) -> None:
    db = tmp_path / "tracejudge.duckdb"
    create_store(db)
    recently = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=10)
    with duckdb.connect(str(db)) as cur:
        add_verdicts(cur, [{"conversation_id": f"c{n}", "criterion_id": "red-flags", "result": result,
                            "judged_at": recently} for n, result in enumerate(["fail"] * 30 + ["pass"] * 70)])
    receiver = Receiver()
    try:
        daemon = DaemonProcess(tmp_path, base_config(tmp_path, alerts={
            "webhooks": [{"url": receiver.url, "events": ["failure_rate"]}],
            "monitors": [{"kind": "failure_rate", "criterion": "red-flags", "window": "1h", "above": 0.05}]})).start()
        (posted,) = wait_until(receiver.received, "the monitor's alert at the webhook")
        assert posted.headers["x-tracejudge-event"] == "failure_rate"
        body = json.loads(posted.body)
        assert body["state"] == "open" and body["monitor"] == "failure_rate:red-flags"
        assert body["measures"]["failure_rate"]["estimate"] == pytest.approx(0.3)
        assert daemon.metric('tracejudge_monitor_firing{monitor="failure_rate:red-flags"}') == 1
        assert daemon.metric('tracejudge_monitor_value{bound="estimate",measure="failure_rate",'
                             'monitor="failure_rate:red-flags"}') == pytest.approx(0.3)
        daemon.stop()
    finally:
        receiver.close()
