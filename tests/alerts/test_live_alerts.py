"""Live criteria over the wire: a conversation still open, sent turn by turn through the OpenTelemetry SDK's
exporter to the real daemon, fails a live criterion on its second turn: one signed alert arrives at a webhook
receiver on loopback, with the evidence and a link to the review item opened at once; the third failing turn
pages nobody again. Once with a code check, once with an LLM criterion judged by the real ``anthropic`` client
against a loopback server speaking the Messages API."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from collector.demo.traffic import Persona, Turn

from ..support.daemon import DaemonProcess, base_config, wait_until
from ..support.judge_server import FAIL_WORD, RuleJudge
from ..support.online import send
from ..support.webhooks import Receiver
from .test_alerts_delivery import documented_verify

pytestmark = pytest.mark.slow  # each test starts the daemon

SECRET = "whsec-live-2c91"
PROMISE = f"Don't worry, this is a {FAIL_WORD}: you get your money back whatever happens."
CONVERSATION = Persona("live", "en", "live-test", [
    Turn("Where is my order B-7?", "Order B-7 ships today."),
    Turn("It arrived broken.", PROMISE),
    Turn("So I keep the money?", f"Yes, it is a {FAIL_WORD}, as I said."),
], conversation_id="live-1")
CODE = f"""\
criteria:
  - id: no-refund-promises
    version: 1
    kind: code
    severity: high
    check: regex
    pattern: "[^.:]*{FAIL_WORD}[^.:]*"
    must: not_match
    live: true
"""
LLM = """\
criteria:
  - id: no-refund-promises
    version: 1
    kind: llm
    severity: high
    prompt: 'Criterion: the bot never promises a refund. "pass", "fail" or "not_applicable".'
    live: true
"""


@pytest.fixture
def hook() -> Iterator[Receiver]:
    receiver = Receiver()
    yield receiver
    receiver.close()


@pytest.fixture
def judge() -> Iterator[RuleJudge]:
    server = RuleJudge()
    yield server
    server.close()


def start(tmp_path: Path, criteria: str, hook: Receiver, **sections: Any) -> DaemonProcess:
    (tmp_path / "criteria.yaml").write_text(criteria, encoding="utf-8")
    config = base_config(tmp_path, conversations={"idle_timeout": "10m"}, sampling={"rate": 1.0},
                         alerts={"live_settle": "1s", "webhooks": [{"url": f"{hook.url}/hooks/live", "secret": SECRET,
                                                                   "events": ["live_failure"]}]},
                         **{"judges": {"criteria": [str(tmp_path / "criteria.yaml")], **sections.pop("judges", {})}},
                         **sections)
    return DaemonProcess(tmp_path, config).start()


def live_verdicts(daemon: DaemonProcess, result: str) -> float:
    return daemon.metric(f'tracejudge_live_verdicts_total{{result="{result}"}}')


def turn(daemon: DaemonProcess, n: int) -> None:
    """Send the conversation's turn ``n`` (from 1), the earlier ones being its history."""
    send(daemon.grpc, [Persona(CONVERSATION.name, "en", "live-test", CONVERSATION.turns[:n],
                               conversation_id=CONVERSATION.conversation_id)], service="live-test", start=n - 1)


def second_and_third_turns_page_once(daemon: DaemonProcess, hook: Receiver) -> dict[str, Any]:
    """Turn 1 passes; turn 2 fails and pages; turn 3 fails and pages nobody. The alert's body."""
    turn(daemon, 1)
    wait_until(lambda: live_verdicts(daemon, "pass") == 1, "turn 1 judged live")
    assert hook.received() == []
    turn(daemon, 2)
    (got,) = wait_until(lambda: hook.received() or None, lambda: f"the alert\n{daemon.output()[-3000:]}")
    assert documented_verify()(SECRET, got.body, got.headers["x-tracejudge-signature"])
    assert got.headers["x-tracejudge-event"] == "live_failure" and got.path == "/hooks/live"
    body = json.loads(got.body)
    assert got.headers["x-tracejudge-id"] == body["id"]
    assert {k: body[k] for k in ("type", "state", "service", "conversation_id", "criterion", "severity", "result",
                                 "turn")} == {
        "type": "live_failure", "state": "open", "service": "live-test", "conversation_id": "live-1",
        "criterion": "no-refund-promises", "severity": "high", "result": "fail", "turn": 2}
    # The review item was opened at once, live, first in the queue, and the alert links to it.
    url = urlsplit(body["review_url"])
    assert f"{url.scheme}://{url.netloc}" == daemon.api and url.path.startswith("/review/")
    item = daemon.get(f"/api{url.path}")[1]
    assert item["item"]["live"] and item["item"]["state"] == "pending"
    assert item["item"]["conversation_id"] == "live-1" and item["verdict"]["live"]
    assert daemon.get("/api/review")[1]["items"][0]["id"] == item["item"]["id"]
    assert daemon.get("/api/conversations/live-1")[1]["ended_by"] == "open"  # judged while still open

    turn(daemon, 3)
    wait_until(lambda: live_verdicts(daemon, "fail") == 2, "turn 3 judged live")
    assert daemon.metric('tracejudge_alerts_fired_total{type="live_failure"}') == 1  # no second alert queued
    assert len(daemon.get("/api/review?state=all")[1]["items"]) == 1
    wait_until(lambda: daemon.get("/api/status")[1]["alert_deliveries_pending"] == 0, "nothing left to deliver")
    assert len(hook.received()) == 1
    return body  # type: ignore[no-any-return]


def test_a_live_code_check_pages_once_with_its_evidence(tmp_path: Path, hook: Receiver) -> None:
    daemon = start(tmp_path, CODE, hook)
    body = second_and_third_turns_page_once(daemon, hook)
    assert body["evidence"] == ["Don't worry, this is a guaranteed-refund"]
    assert "must not appear" in body["reasoning"]


def test_a_live_llm_criterion_pages_once_judged_once_per_turn(tmp_path: Path, hook: Receiver,
                                                              judge: RuleJudge) -> None:
    daemon = start(tmp_path, LLM, hook, judges={"provider": {
        "type": "anthropic", "model": "judge-test", "base_url": judge.url, "api_key": "test-key"}})
    body = second_and_third_turns_page_once(daemon, hook)
    assert body["evidence"] == [PROMISE] and body["reasoning"] == "The bot promised a refund it cannot promise."
    assert len(judge.requests) == 3  # once per turn, each after the turn had settled
    assert daemon.metric("tracejudge_eval_judge_tokens_total") == 3 * 120  # spent against the budget's count
