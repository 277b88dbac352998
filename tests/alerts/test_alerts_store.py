"""The alert tables: a finding fires once, resolves once, and is acknowledged by someone; all in the caller's
transaction."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator

import duckdb
import pytest

from collector.alerts import ALERT_TYPES
from collector.alerts.store import (AlertConflict, AlertError, AlertNotFound, acknowledge, alert, ensure_schema, fire,
                                    list_alerts, resolve)
from collector.store import Transaction

T0 = dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.timezone.utc)
LIVE = {"service": "triage-bot", "conversation_id": "c-1", "criterion": "red-flags", "severity": "high",
        "result": "fail", "evidence": ["chest pain can wait"], "reasoning": "it told the user to wait",
        "review_url": "http://127.0.0.1:8318/review/17", "turn": 3}


@pytest.fixture
def cur() -> Iterator[duckdb.DuckDBPyConnection]:
    con = duckdb.connect()
    ensure_schema(con)
    ensure_schema(con)  # again: a restart
    yield con
    con.close()


def notices(cur: duckdb.DuckDBPyConnection) -> list[tuple[str, str, dict]]:  # type: ignore[type-arg]
    return [(a, s, json.loads(b)) for a, s, b in
            cur.execute("SELECT alert_id, state, body FROM alert_notices ORDER BY seq").fetchall()]


def test_a_finding_fires_once_with_the_body_receivers_get(cur: duckdb.DuckDBPyConnection) -> None:
    key = "live_failure:c-1:red-flags"
    alert_id = fire(cur, type="live_failure", key=key, payload=LIVE, now=T0)
    assert alert_id is not None
    assert fire(cur, type="live_failure", key=key, payload={**LIVE, "turn": 4}, now=T0) is None  # the next turn
    ((aid, state, body),) = notices(cur)
    assert (aid, state) == (alert_id, "open")
    assert list(body)[:4] == ["id", "type", "at", "state"]
    assert body == {"id": alert_id, "type": "live_failure", "at": "2026-03-01T12:00:00Z", "state": "open", **LIVE}
    (listed,) = list_alerts(cur)
    assert listed["id"] == alert_id and listed["key"] == key and listed["state"] == "open"
    assert listed["body"] == body and listed["deliveries"] == []


def test_fire_joins_the_callers_transaction(cur: duckdb.DuckDBPyConnection) -> None:
    with pytest.raises(RuntimeError):
        with Transaction(cur):
            assert fire(cur, type="judge_errors", key="k", payload={}) is not None
            raise RuntimeError("the finding was not stored")
    assert list_alerts(cur, state="all") == [] and notices(cur) == []
    assert fire(cur, type="judge_errors", key="k", payload={}) is not None  # never opened: it fires now


def test_resolve_sends_the_same_id_resolved_and_a_key_fires_never_again(cur: duckdb.DuckDBPyConnection) -> None:
    alert_id = fire(cur, type="failure_rate", key="failure_rate:red-flags:1", payload={"value": 0.05}, now=T0)
    later = T0 + dt.timedelta(hours=1)
    assert resolve(cur, key="failure_rate:red-flags:1", payload={"value": 0.01}, now=later) == alert_id
    assert resolve(cur, key="failure_rate:red-flags:1") is None  # once
    assert resolve(cur, key="never-fired") is None
    (_, (aid, state, body)) = notices(cur)
    assert (aid, state) == (alert_id, "resolved")
    assert body == {"id": alert_id, "type": "failure_rate", "at": "2026-03-01T12:00:00Z", "state": "resolved",
                    "value": 0.01, "resolved_at": "2026-03-01T13:00:00Z"}
    assert fire(cur, type="failure_rate", key="failure_rate:red-flags:1", payload={}) is None
    assert [a["state"] for a in list_alerts(cur, state="all")] == ["resolved"]
    assert list_alerts(cur) == []


def test_acknowledge_records_who_and_keeps_the_first(cur: duckdb.DuckDBPyConnection) -> None:
    alert_id = fire(cur, type="live_failure", key="a", payload=LIVE, now=T0)
    assert alert_id is not None
    with pytest.raises(AlertError, match="who acknowledges"):
        acknowledge(cur, alert_id, "  ")
    done = acknowledge(cur, alert_id, " Dr.  Ana Ruiz ", now=T0 + dt.timedelta(minutes=5))
    assert (done["state"], done["acknowledged_by"], done["acknowledged_at"]) == (
        "acknowledged", "Dr. Ana Ruiz", "2026-03-01T12:05:00Z")
    assert acknowledge(cur, alert_id, "Bo")["acknowledged_by"] == "Dr. Ana Ruiz"
    assert [a["id"] for a in list_alerts(cur, state="acknowledged")] == [alert_id] and list_alerts(cur) == []
    assert resolve(cur, key="a") == alert_id  # acknowledged alerts resolve too
    with pytest.raises(AlertConflict, match="resolved"):
        acknowledge(cur, alert_id, "Bo")
    with pytest.raises(AlertNotFound):
        acknowledge(cur, "nope", "Bo")
    assert alert(cur, "nope") is None


def test_bad_calls_are_refused(cur: duckdb.DuckDBPyConnection) -> None:
    with pytest.raises(ValueError, match="not an alert type"):
        fire(cur, type="paging", key="k", payload={})
    with pytest.raises(ValueError, match="may not set id, state"):
        fire(cur, type="live_failure", key="k", payload={"id": "x", "state": "y"})
    with pytest.raises(TypeError, match="not set"):
        fire(cur, type="live_failure", key="k", payload={"labels": {1, 2}})
    with pytest.raises(AlertError, match="state must be"):
        list_alerts(cur, state="closed")
    assert ALERT_TYPES == ("live_failure", "failure_rate", "judge_agreement", "judge_errors")
