"""Alerts over the wire: the real daemon POSTs them to webhook receivers on loopback.

The alerts are fired into the DuckDB file while no daemon runs (as a stage would, on its cursor), then
the daemon starts and delivers them: what arrives, how it is signed, and how delivery outlives a
receiver that fails, goes down, and a daemon killed with ``kill -9``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import duckdb
import pytest

from collector.alerts.store import ensure_schema, fire

from ..support.daemon import REPO, DaemonProcess, base_config, wait_until
from ..support.webhooks import Receiver

pytestmark = pytest.mark.slow  # each test starts the daemon

SECRET = "whsec-7f3a91"
LIVE = {"service": "triage-bot", "conversation_id": "c-1042", "criterion": "red-flags", "severity": "high",
        "result": "fail", "evidence": ["It can probably wait <until> tomorrow & see."],
        "reasoning": "Chest pain was reported and the bot advised waiting.",
        "review_url": "http://127.0.0.1:8318/review/17", "turn": 3}


@pytest.fixture
def receivers() -> Iterator[list[Receiver]]:
    made: list[Receiver] = []
    yield made
    for r in made:
        r.close()


def receiver(receivers: list[Receiver], **kwargs: Any) -> Receiver:
    r = Receiver(**kwargs)
    receivers.append(r)
    return r


def fire_into(path: Path, *alerts: tuple[str, str, dict[str, Any]]) -> list[str]:
    """Fire ``(type, key, payload)`` alerts into the DuckDB file (no daemon runs on it); their ids."""
    con = duckdb.connect(str(path))
    try:
        ensure_schema(con)
        ids = [fire(con, type=kind, key=key, payload=payload) for kind, key, payload in alerts]
    finally:
        con.close()
    assert all(ids)
    return [str(i) for i in ids]


def documented_verify() -> Callable[[str, bytes, str | None], bool]:
    """The receiver's check as docs/alerts.md and the README show it (the same), run as written."""
    snippets = []
    for page, heading in (("docs/alerts.md", "### Verifying the signature"), ("README.md", "## Alerts")):
        text = (REPO / page).read_text(encoding="utf-8")
        code = re.search(r"```python\n(.*?)```", text[text.index(heading):], re.S)
        assert code is not None, page
        snippets.append(code.group(1))
    assert snippets[0] == snippets[1]
    scope: dict[str, Any] = {}
    exec(snippets[0], scope)  # noqa: S102 - the documentation's own snippet
    return scope["verify"]  # type: ignore[no-any-return]


def sample(daemon: DaemonProcess, series: str) -> float:
    """The value of one series (name and labels) on /metrics."""
    for line in daemon.get("/metrics")[1].splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{series} not on /metrics")


def arrived(r: Receiver, n: int = 1) -> list[Any]:
    return wait_until(lambda: r.received() if len(r.received()) >= n else None, f"{n} POSTs to {r.url}")


def test_an_alert_arrives_signed_in_json_and_in_slack_and_only_where_its_type_is_wanted(
        tmp_path: Path, receivers: list[Receiver]) -> None:
    plain, slack, other = receiver(receivers), receiver(receivers), receiver(receivers)
    config = base_config(tmp_path, alerts={"webhooks": [
        {"url": f"{plain.url}/hooks/tracejudge?token=t0ps3cret", "secret": SECRET},
        {"url": f"{slack.url}/services/T0/B0/XyZ", "format": "slack", "events": ["live_failure"]},
        {"url": other.url, "events": ["failure_rate"]},
    ]})
    daemon = DaemonProcess(tmp_path, config)
    (alert_id,) = fire_into(daemon.duckdb, ("live_failure", "live_failure:c-1042:red-flags", LIVE))
    daemon.start()
    (got,) = arrived(plain)
    assert got.path == "/hooks/tracejudge?token=t0ps3cret"
    assert got.headers["x-tracejudge-event"] == "live_failure" and got.headers["x-tracejudge-id"] == alert_id
    assert got.headers["content-type"] == "application/json"
    verify = documented_verify()
    assert verify(SECRET, got.body, got.headers["x-tracejudge-signature"])
    assert not verify("another secret", got.body, got.headers["x-tracejudge-signature"])
    assert not verify(SECRET, got.body + b" ", got.headers["x-tracejudge-signature"])
    body = json.loads(got.body)
    assert body == {"id": alert_id, "type": "live_failure", "at": body["at"], "state": "open", **LIVE}

    (message,) = arrived(slack)
    assert "x-tracejudge-signature" not in message.headers  # no secret: unsigned
    said = json.loads(message.body)
    assert said["text"].startswith("tracejudge: Live failure: red-flags (high) in conversation c-1042")
    assert said["text"].endswith(" <http://127.0.0.1:8318/review/17|review>")
    blocks = {b["type"]: b for b in said["blocks"]}
    assert blocks["header"]["text"]["text"] == "Live failure: red-flags (high)"
    sections = [b["text"]["text"] for b in said["blocks"] if b["type"] == "section" and "text" in b]
    assert "*evidence*\n> It can probably wait &lt;until&gt; tomorrow &amp; see." in sections  # escaped, quoted
    assert f"*reasoning*\n{LIVE['reasoning']}" in sections
    assert blocks["actions"]["elements"][0]["url"] == LIVE["review_url"]
    assert alert_id in blocks["context"]["elements"][0]["text"]

    wait_until(lambda: daemon.metric("tracejudge_alert_deliveries_total") == 2, "two deliveries counted")
    assert other.received() == []  # it takes failure_rate alerts only
    text = daemon.get("/metrics")[1]
    assert 'tracejudge_alert_deliveries_total{outcome="delivered"} 2' in text
    assert 'tracejudge_alerts_fired_total{type="live_failure"} 1' in text
    assert 'tracejudge_alerts_fired_total{type="judge_errors"} 0' in text
    assert 'tracejudge_alerts_open{type="live_failure"} 1' in text
    assert "tracejudge_alerts_undelivered_oldest_seconds 0.000" in text
    status = daemon.get("/api/status")[1]
    assert status["alert_deliveries_pending"] == 0 and status["stages"]["alerts"] == "running"
    assert [w["url"] for w in status["alert_webhooks"]] == [
        f"{plain.url}/hooks/tracejudge?token=***", f"{slack.url}/services/T0/B0/XyZ", other.url]
    assert "t0ps3cret" not in daemon.output() and "token=***" in daemon.output()  # the banner masks it


def test_a_receiver_failing_then_down_across_a_kill_gets_the_alert_once_back_with_the_same_id_and_bytes(
        tmp_path: Path, receivers: list[Receiver]) -> None:
    failing = receiver(receivers, default=500)
    config = base_config(tmp_path, alerts={"webhooks": [{"url": failing.url, "secret": SECRET}]})
    daemon = DaemonProcess(tmp_path, config)
    first, second = fire_into(daemon.duckdb, ("judge_errors", "judge_errors:1", {"value": 0.4, "above": 0.2}),
                              ("live_failure", "live_failure:c-1:red-flags", LIVE))
    daemon.start()
    tries = arrived(failing, 2)
    assert {t.headers["x-tracejudge-id"] for t in tries} == {first}  # the second waits behind the first
    assert len({t.body for t in tries}) == 1 and json.loads(tries[0].body)["id"] == first
    wait_until(lambda: sample(daemon, 'tracejudge_alert_deliveries_total{outcome="retried"}') >= 2,
               "the retries counted")
    port = failing.port
    failing.close()  # down
    daemon.kill9()
    daemon.start()

    def refused() -> str | None:
        (hook,) = daemon.get("/api/status")[1]["alert_webhooks"]
        return hook["last_error"] if hook["last_error"] and "Connection" in hook["last_error"] else None

    wait_until(refused, "a try while the receiver is down")
    assert daemon.metric("tracejudge_alerts_undelivered_oldest_seconds") > 0
    back = receiver(receivers, port=port)  # up again, answering 200
    got = arrived(back, 2)
    assert [g.headers["x-tracejudge-id"] for g in got] == [first, second]  # in the order they fired
    assert got[0].body == tries[0].body  # the same bytes, the same signature
    assert got[0].headers["x-tracejudge-signature"] == tries[0].headers["x-tracejudge-signature"]
    wait_until(lambda: daemon.get("/api/status")[1]["alert_deliveries_pending"] == 0, "nothing pending")
    assert len(back.received()) == 2  # each once, now that it is delivered
    assert daemon.metric("tracejudge_alerts_undelivered_oldest_seconds") == 0
    daemon.stop()
    rows = daemon.query("SELECT state, count(*) FROM alert_deliveries GROUP BY state")
    assert rows == [("delivered", 2)]


def test_a_refusal_is_kept_visible_and_not_retried_and_the_next_alert_goes_on(
        tmp_path: Path, receivers: list[Receiver]) -> None:
    strict = receiver(receivers, answers=[(401, {})])
    config = base_config(tmp_path, alerts={"webhooks": [{"url": strict.url}]})
    daemon = DaemonProcess(tmp_path, config)
    refused, taken = fire_into(daemon.duckdb, ("failure_rate", "failure_rate:a", {"value": 0.1}),
                               ("failure_rate", "failure_rate:b", {"value": 0.2}))
    daemon.start()
    got = arrived(strict, 2)
    assert [g.headers["x-tracejudge-id"] for g in got] == [refused, taken]
    wait_until(lambda: daemon.get("/api/status")[1]["alert_deliveries_pending"] == 0, "nothing pending")
    text = daemon.get("/metrics")[1]
    assert 'tracejudge_alert_deliveries_total{outcome="refused"} 1' in text
    assert 'tracejudge_alert_deliveries_total{outcome="delivered"} 1' in text
    assert 'tracejudge_alert_deliveries_total{outcome="retried"} 0' in text
    daemon.wait_output("answered 401: a permanent refusal, not retried")
    assert len(strict.received()) == 2
    daemon.stop()
    assert daemon.query("SELECT d.state, d.last_status FROM alert_deliveries d JOIN alert_notices n "
                        "ON n.seq = d.notice_seq ORDER BY n.seq") == [("refused", 401), ("delivered", 200)]
