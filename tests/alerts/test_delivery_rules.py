"""The delivery stage's rules, cycle by cycle on an injected clock: Retry-After and the backoff, the order
behind a delivery that waits, redirects, and deliveries to a webhook that left the config."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from collector.alerts.delivery import AlertDelivery
from collector.alerts.store import alert, fire, resolve
from collector.config import Webhook
from collector.metrics import Metrics
from collector.store import Store
from judges import Backoff

from ..support.webhooks import Receiver

T0 = dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.timezone.utc)


class World:
    """A store, a clock and a delivery stage worked one cycle at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.now = T0
        self.store = Store(path)
        self.store.open()
        self.stages: list[AlertDelivery] = []

    def stage(self, *webhooks: Webhook) -> AlertDelivery:
        stage = AlertDelivery(self.store, Metrics(), webhooks, clock=lambda: self.now, backoff=Backoff(1.0, 300.0))
        stage.open()
        self.stages.append(stage)
        return stage

    def fire(self, key: str, kind: str = "failure_rate") -> str:
        cur = self.store.cursor()
        try:
            alert_id = fire(cur, type=kind, key=key, payload={"value": 0.5}, now=self.now)
        finally:
            cur.close()
        assert alert_id is not None
        return alert_id

    def alert(self, alert_id: str) -> dict[str, Any]:
        cur = self.store.cursor()
        try:
            found = alert(cur, alert_id)
        finally:
            cur.close()
        assert found is not None
        return found

    def later(self, seconds: float) -> None:
        self.now += dt.timedelta(seconds=seconds)

    def close(self) -> None:
        for s in self.stages:
            s.stop()
        self.store.close()


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    w = World(tmp_path / "t.duckdb")
    yield w
    w.close()


@pytest.fixture
def receivers() -> Iterator[list[Receiver]]:
    made: list[Receiver] = []
    yield made
    for r in made:
        r.close()


def ids(r: Receiver) -> list[str]:
    return [g.headers["x-tracejudge-id"] for g in r.received()]


def test_retry_after_is_kept_to_and_the_alerts_behind_wait_in_order(world: World, receivers: list[Receiver]) -> None:
    busy = Receiver(answers=[(429, {"Retry-After": "120"}), (503, {})])
    receivers.append(busy)
    stage = world.stage(Webhook(url=busy.url))
    first, second = world.fire("a"), world.fire("b")
    stage.cycle()
    assert ids(busy) == [first]  # 429: the second waits behind it
    world.later(119)
    stage.cycle()
    assert ids(busy) == [first]
    world.later(1)
    stage.cycle()  # Retry-After is over: 503, no Retry-After, so the backoff (1 s doubling: 2 s after two failures)
    assert ids(busy) == [first, first]
    (d,) = world.alert(first)["deliveries"]
    assert (d["state"], d["attempts"], d["last_status"], d["last_error"]) == ("pending", 2, 503, "answered 503")
    assert d["next_attempt_at"] == "2026-03-01T12:02:02Z"
    world.later(1.9)
    stage.cycle()
    assert len(busy.received()) == 2
    world.later(0.1)
    stage.cycle()
    assert ids(busy) == [first, first, first, second]
    assert [d["state"] for a in (first, second) for d in world.alert(a)["deliveries"]] == ["delivered", "delivered"]
    assert (stage.outcomes.value(outcome="retried"), stage.outcomes.value(outcome="delivered")) == (2, 2)
    assert world.alert(first)["deliveries"][0]["next_attempt_at"] is None


def test_redirects_are_followed_within_the_origin_only(world: World, receivers: list[Receiver]) -> None:
    elsewhere = Receiver()
    moved = Receiver(answers=[(307, {"Location": "/v2/hook"}), (308, {"Location": f"{elsewhere.url}/hook"})])
    receivers += [elsewhere, moved]
    stage = world.stage(Webhook(url=f"{moved.url}/hook"))
    alert_id = world.fire("a")
    stage.cycle()
    assert [g.path for g in moved.received()] == ["/hook", "/v2/hook"]  # the same POST, followed
    assert elsewhere.received() == []  # another origin: never
    (d,) = world.alert(alert_id)["deliveries"]
    assert d["state"] == "pending" and d["last_error"] == f"answered 308 redirecting to {elsewhere.url}/hook, not followed"
    assert moved.received()[0].body == moved.received()[1].body
    world.later(1)
    stage.cycle()
    assert [d["state"] for d in world.alert(alert_id)["deliveries"]] == ["delivered"]


def test_each_webhook_gets_the_types_it_takes_and_one_that_left_the_config_is_dropped(
        world: World, receivers: list[Receiver]) -> None:
    rates, down = Receiver(), Receiver(default=503)
    receivers += [rates, down]
    stage = world.stage(Webhook(url=rates.url, events=["failure_rate"]), Webhook(url=down.url))
    live, rate = world.fire("l", kind="live_failure"), world.fire("r")
    stage.cycle()
    assert ids(rates) == [rate] and ids(down) == [live]
    stage.stop()
    later = world.stage(Webhook(url=rates.url, events=["failure_rate"]))  # the next start, without the second
    deliveries = world.alert(live)["deliveries"]
    assert [(d["webhook"], d["state"], d["last_error"]) for d in deliveries] == [
        (down.url, "dropped", "its webhook is no longer in alerts.webhooks")]
    later.cycle()
    assert json.loads(rates.received()[0].body)["id"] == rate and len(rates.received()) == 1


def test_a_resolved_alert_is_told_with_the_same_id_after_its_opening(world: World, receivers: list[Receiver]) -> None:
    hook = Receiver()
    receivers.append(hook)
    stage = world.stage(Webhook(url=hook.url, secret="s"))
    alert_id = world.fire("rate")
    cur = world.store.cursor()
    try:
        assert resolve(cur, key="rate", payload={"value": 0.01}, now=world.now) == alert_id
    finally:
        cur.close()
    stage.cycle()
    opened, resolved = (json.loads(g.body) for g in hook.received())
    assert (opened["id"], opened["state"], opened["value"]) == (alert_id, "open", 0.5)
    assert (resolved["id"], resolved["state"], resolved["value"]) == (alert_id, "resolved", 0.01)
    assert [g.headers["x-tracejudge-event"] for g in hook.received()] == ["failure_rate", "failure_rate"]
    assert [d["notice"] for d in world.alert(alert_id)["deliveries"]] == ["open", "resolved"]
