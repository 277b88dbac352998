"""Alerts through the JSON API, the review page's form and ``tracejudge alerts list|ack``, with and without the
daemon, and who an acknowledgement records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import duckdb
import pytest

from collector.alerts.store import ensure_schema, fire, resolve

from ..support.api_http import assert_error, call, origin, post_form, post_json
from ..support.daemon import DaemonProcess, base_config, clean_env, run_cli

pytestmark = pytest.mark.slow  # each test starts the daemon

LIVE = {"service": "triage-bot", "conversation_id": "c-1", "criterion": "red-flags", "severity": "high",
        "result": "fail", "evidence": ["wait until tomorrow"], "reasoning": "r", "turn": 2}
ANA, BO = "ana-token-4d1c", "bo-token-9e2f"
API_TOKEN = "api-token-77aa"


def seeded(tmp_path: Path, **sections: Any) -> tuple[DaemonProcess, dict[str, str]]:
    """A daemon (not started) whose file holds an open live failure, an open failure-rate alert and a resolved one."""
    daemon = DaemonProcess(tmp_path, base_config(tmp_path, **sections))
    con = duckdb.connect(str(daemon.duckdb))
    try:
        ensure_schema(con)
        ids = {"live": fire(con, type="live_failure", key="live_failure:c-1:red-flags", payload=LIVE),
               "rate": fire(con, type="failure_rate", key="failure_rate:red-flags:1", payload={"value": 0.1}),
               "gone": fire(con, type="judge_errors", key="judge_errors:1", payload={"value": 0.5})}
        resolve(con, key="judge_errors:1", payload={"value": 0.1})
    finally:
        con.close()
    return daemon, {k: str(v) for k, v in ids.items()}


def cli(daemon: DaemonProcess, *args: str, **env: str) -> Any:
    return run_cli("alerts", *args, "--config", str(daemon.config_path), env=clean_env(**env))


def test_list_and_acknowledge_through_the_api_the_cli_and_the_file(tmp_path: Path) -> None:
    daemon, ids = seeded(tmp_path)
    daemon.start()
    api = daemon.api
    listed = daemon.get("/api/alerts")[1]["alerts"]
    assert {a["id"] for a in listed} == {ids["live"], ids["rate"]}  # open ones by default
    live = next(a for a in listed if a["id"] == ids["live"])
    assert live["type"] == "live_failure" and live["state"] == "open" and live["body"]["criterion"] == "red-flags"
    assert live["deliveries"] == []  # no webhook configured
    (gone,) = daemon.get("/api/alerts?state=resolved")[1]["alerts"]
    assert gone["id"] == ids["gone"] and gone["resolved_at"] and gone["body"]["state"] == "open"
    assert len(daemon.get("/api/alerts?state=all")[1]["alerts"]) == 3
    assert_error(call(api, "GET", "/api/alerts?state=closed"), 400, "bad_request", "state must be")

    path = f"/api/alerts/{ids['live']}/ack"
    assert_error(post_json(api, path, {}), 400, "bad_request", "who acknowledges")
    assert_error(post_json(api, "/api/alerts/nope/ack", {"by": "Ana"}), 404, "not_found", "nope")
    assert_error(post_json(api, f"/api/alerts/{ids['gone']}/ack", {"by": "Ana"}), 409, "already_resolved")
    assert_error(post_json(api, path, {"by": "Ana", "who": "x"}), 400, "bad_request", "unknown field")
    assert_error(post_json(api, path, {"by": "Ana"}, {"Origin": "http://evil.example"}), 403, "cross_origin")
    done = post_json(api, path, {"by": "Ana"})
    assert done.status == 200 and done.json()["state"] == "acknowledged" and done.json()["acknowledged_by"] == "Ana"
    assert post_json(api, path, {"by": "Bo"}).json()["acknowledged_by"] == "Ana"  # the first stays
    assert [a["id"] for a in daemon.get("/api/alerts?state=acknowledged")[1]["alerts"]] == [ids["live"]]
    assert 'tracejudge_alerts_open{type="live_failure"} 0' in daemon.get("/metrics")[1]

    shown = cli(daemon, "list")
    assert shown.returncode == 0, shown.stderr
    assert ids["rate"] in shown.stdout and ids["live"] not in shown.stdout and "failure_rate:red-flags:1" in shown.stdout
    wrong = cli(daemon, "ack", ids["gone"], "--by", "Bo")
    assert wrong.returncode == 2 and "was resolved at" in wrong.stderr and "Traceback" not in wrong.stderr

    daemon.stop()  # now the file itself
    acked = cli(daemon, "ack", ids["rate"], TRACEJUDGE_REVIEWER="Bo")
    assert acked.returncode == 0, acked.stderr
    assert acked.stdout.strip() == f"alert {ids['rate']} (failure_rate, failure_rate:red-flags:1): acknowledged by Bo"
    assert cli(daemon, "list").stdout.strip() == "no open alerts"
    every = cli(daemon, "list", "--state", "all", "--json")
    assert every.returncode == 0, every.stderr
    assert {(a["id"], a["state"], a["acknowledged_by"]) for a in json.loads(every.stdout)} == {
        (ids["live"], "acknowledged", "Ana"), (ids["rate"], "acknowledged", "Bo"), (ids["gone"], "resolved", None)}
    missing = cli(daemon, "ack", "nope", "--by", "Bo")
    assert missing.returncode == 2 and "no alert 'nope'" in missing.stderr


def test_with_reviewer_tokens_the_token_names_who_acknowledges(tmp_path: Path) -> None:
    daemon, ids = seeded(tmp_path, api={"auth": {"bearer_token": API_TOKEN}},
                         review={"reviewers": [{"name": "Ana Ruiz", "token": ANA}, {"name": "Bo", "token": BO}]})
    daemon.start()
    api = daemon.api
    ana = {"Authorization": f"Bearer {ANA}"}
    assert call(api, "GET", "/api/alerts", headers=ana).status == 200  # a reviewer's token opens it
    assert_error(post_json(api, f"/api/alerts/{ids['live']}/ack", {"by": "Ana Ruiz"},
                           {"Authorization": f"Bearer {API_TOKEN}"}), 403, "reviewer_token_required")
    assert_error(post_json(api, f"/api/alerts/{ids['live']}/ack", {"by": "Bo"}, ana), 403, "wrong_reviewer")
    done = post_json(api, f"/api/alerts/{ids['live']}/ack", {}, ana)
    assert done.status == 200 and done.json()["acknowledged_by"] == "Ana Ruiz"

    # The page's form, signed in with Bo's token: no name typed, the token names him.
    page = call(api, "GET", "/review", headers={"Authorization": f"Bearer {BO}"})
    assert page.status == 200 and f'action="/review/alerts/{ids["rate"]}/ack"' in page.body
    assert 'name="reviewer"' not in page.body.split('id="alerts"')[1].split("</section>")[0]
    sent = post_form(api, f"/review/alerts/{ids['rate']}/ack", {},
                     {"Authorization": f"Bearer {BO}", "Origin": origin(api)})
    assert sent.status == 303 and sent.header("Location") == f"/review?acknowledged={ids['rate']}"
    refused = post_form(api, f"/review/alerts/{ids['rate']}/ack", {},
                        {"Authorization": f"Bearer {BO}", "Origin": "http://evil.example"})
    assert refused.status == 403 and "text/html" in str(refused.header("Content-Type"))
    rows = call(api, "GET", "/api/alerts?state=acknowledged", headers=ana).json()["alerts"]
    assert {(a["id"], a["acknowledged_by"]) for a in rows} == {(ids["live"], "Ana Ruiz"), (ids["rate"], "Bo")}

    no_token = cli(daemon, "ack", ids["live"], "--by", "Ana Ruiz")
    assert no_token.returncode == 2 and "--token" in no_token.stderr
    with_token = cli(daemon, "ack", ids["live"], "--token", ANA)
    assert with_token.returncode == 0 and with_token.stdout.rstrip().endswith("acknowledged by Ana Ruiz")
