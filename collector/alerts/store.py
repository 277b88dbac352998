"""The alert tables, and how any stage fires, resolves, lists and acknowledges alerts.

Three tables, written with the DuckDB commit of whoever fires, so an alert is
kept exactly when the finding that fired it is:

- ``alerts``: one row per alert (``key`` unique for ever: a finding fires once);
  its ``state`` goes open -> acknowledged (a person looks at it) -> resolved
  (its cause went away), or open -> resolved.
- ``alert_notices``: what receivers are told, each with the exact JSON body sent:
  ``open`` when it fired, ``resolved`` when it resolved (same ``id``).
- ``alert_deliveries``: one row per notice and webhook, made by the delivery stage
  (``delivery``) when it picks the notice up, with the webhooks configured then;
  ``pending`` until the webhook answers 2xx (``delivered``) or refuses it for good
  (``refused``), or ``dropped`` when its webhook left ``alerts.webhooks``.

Errors: ``AlertError`` and its kinds, each with the JSON API's status and code::

    AlertError            400 bad_request: no one named to acknowledge it
    ├── AlertNotFound     404 not_found
    └── AlertConflict     409 already_resolved: nothing left to acknowledge
"""

from __future__ import annotations

import datetime as dt
import json
import secrets
from typing import Any

import duckdb

from ..errors import UserError
from ..words import iso_utc
from ..names import clean_name
from ..store.transactions import Transaction, one, utc_now
from . import ALERT_STATES, ALERT_TYPES

__all__ = ["ALERT_STATES", "ALERT_TYPES", "AlertConflict", "AlertError", "AlertNotFound", "acknowledge", "alert",
           "check_state", "ensure_schema", "fire", "list_alerts", "resolve"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS alerts (
    id VARCHAR PRIMARY KEY,
    key VARCHAR NOT NULL UNIQUE,
    type VARCHAR NOT NULL,
    state VARCHAR NOT NULL,
    body VARCHAR NOT NULL,
    fired_at TIMESTAMPTZ NOT NULL,
    acknowledged_by VARCHAR,
    acknowledged_at TIMESTAMPTZ,
    resolved_at TIMESTAMPTZ
);
CREATE SEQUENCE IF NOT EXISTS alert_notice_seq;
CREATE TABLE IF NOT EXISTS alert_notices (
    seq BIGINT PRIMARY KEY,
    alert_id VARCHAR NOT NULL,
    state VARCHAR NOT NULL,
    body VARCHAR NOT NULL,
    made_at TIMESTAMPTZ NOT NULL,
    queued BOOLEAN NOT NULL DEFAULT false
);
CREATE TABLE IF NOT EXISTS alert_deliveries (
    notice_seq BIGINT NOT NULL,
    webhook VARCHAR NOT NULL,
    url VARCHAR NOT NULL,
    state VARCHAR NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_at TIMESTAMPTZ NOT NULL,
    last_status INTEGER,
    last_error VARCHAR,
    done_at TIMESTAMPTZ,
    PRIMARY KEY (notice_seq, webhook)
);
"""
# ``alert_notices.queued``: its deliveries are made. A flag, not a position: two stages firing at once may
# commit their sequence numbers out of order, and a position would pass over the one committed last.

RESERVED = ("id", "type", "at", "state")
"""Keys every body starts with, which a payload may not set."""


class AlertError(UserError):
    """A request on alerts that cannot be done; ``status`` and ``code`` are its JSON API answer."""

    status = 400
    code = "bad_request"


class AlertNotFound(AlertError):
    status = 404
    code = "not_found"


class AlertConflict(AlertError):
    status = 409
    code = "already_resolved"


def ensure_schema(cur: duckdb.DuckDBPyConnection) -> None:
    """Create the alert tables when they do not exist yet."""
    cur.execute(SCHEMA)


def fire(cur: duckdb.DuckDBPyConnection, *, type: str, key: str, payload: dict[str, Any],
         now: dt.datetime | None = None) -> str | None:
    """Open an alert unless one with ``key`` was ever opened, and queue its ``open`` notice for the webhooks.

    The delivery stage sends the notice to every webhook whose ``events`` include ``type`` (the webhooks
    configured when it picks the notice up, within a second or so of the commit).

    Args:
        type: one of ``ALERT_TYPES``.
        key: what makes the finding one (``live_failure:<conversation>:<criterion>``); an alert with this key,
            whatever its state, means this call does nothing.
        payload: merged into the body after ``id``, ``type``, ``at`` and ``state`` (live_failure's: service,
            conversation_id, criterion, severity, result, evidence, reasoning, review_url, turn); JSON values,
            datetimes as RFC 3339 UTC.
        now: the time of the alert (default: the wall clock).

    Returns:
        The new alert's id (the idempotency key receivers see), or None when one with ``key`` exists.

    Runs inside the caller's transaction if one is open on ``cur`` (``collector.store.Transaction`` nests).
    """
    if type not in ALERT_TYPES:
        raise ValueError(f"not an alert type: {type!r} (one of {', '.join(ALERT_TYPES)})")
    _check_payload(payload)
    at = utc_now(now)
    with Transaction(cur):
        if one(cur.execute("SELECT 1 FROM alerts WHERE key = ?", [key])) is not None:
            return None
        alert_id = secrets.token_hex(8)
        body = _json({"id": alert_id, "type": type, "at": iso_utc(at), "state": "open", **payload})
        cur.execute("INSERT INTO alerts (id, key, type, state, body, fired_at) VALUES (?, ?, ?, 'open', ?, ?)",
                    [alert_id, key, type, body, at])
        _notice(cur, alert_id, "open", body, at)
    return alert_id


def resolve(cur: duckdb.DuckDBPyConnection, *, key: str, payload: dict[str, Any] | None = None,
            now: dt.datetime | None = None) -> str | None:
    """Mark the alert with ``key`` resolved (if open or acknowledged) and queue its ``resolved`` notice: the body
    it opened with, ``payload`` merged in, ``"state": "resolved"`` and ``resolved_at``.

    Returns:
        Its id, or None when no alert with ``key`` was open or acknowledged.

    Runs inside the caller's transaction if one is open on ``cur``.
    """
    _check_payload(payload or {})
    at = utc_now(now)
    with Transaction(cur):
        row = one(cur.execute("SELECT id, body FROM alerts WHERE key = ? AND state IN ('open', 'acknowledged')",
                              [key]))
        if row is None:
            return None
        alert_id, opened = row
        body = {**json.loads(opened), **(payload or {}), "state": "resolved", "resolved_at": iso_utc(at)}
        cur.execute("UPDATE alerts SET state = 'resolved', resolved_at = ? WHERE id = ?", [at, alert_id])
        _notice(cur, alert_id, "resolved", _json(body), at)
    return str(alert_id)


def acknowledge(cur: duckdb.DuckDBPyConnection, alert_id: str, by: str, *,
                now: dt.datetime | None = None) -> dict[str, Any]:
    """Record that ``by`` looks at an open alert; one acknowledged already stays as its first acknowledgement
    left it. Receivers are not told.

    Returns:
        The alert (``alert``).

    Raises:
        AlertError: no name; AlertNotFound: no such alert; AlertConflict: it is resolved.
    """
    who = clean_name(by or "")
    if not who:
        raise AlertError("say who acknowledges the alert (a name, or a reviewer's token)")
    with Transaction(cur):
        row = one(cur.execute("SELECT state, resolved_at FROM alerts WHERE id = ?", [alert_id]))
        if row is None:
            raise AlertNotFound(f"no alert {alert_id!r}")
        if row[0] == "resolved":
            raise AlertConflict(f"alert {alert_id} was resolved at {iso_utc(row[1])}: nothing to acknowledge")
        if row[0] == "open":
            cur.execute("UPDATE alerts SET state = 'acknowledged', acknowledged_by = ?, acknowledged_at = ? "
                        "WHERE id = ?", [who, utc_now(now), alert_id])
    found = alert(cur, alert_id)
    assert found is not None
    return found


_COLUMNS = "id, key, type, state, body, fired_at, acknowledged_by, acknowledged_at, resolved_at"


def list_alerts(cur: duckdb.DuckDBPyConnection, *, state: str = "open", limit: int = 100) -> list[dict[str, Any]]:
    """Alerts in ``state`` (or ``all``), the newest first, each with its deliveries.

    Raises:
        AlertError: an unknown state.
    """
    check_state(state)
    where = "" if state == "all" else "WHERE state = ?"
    rows = cur.execute(f"SELECT {_COLUMNS} FROM alerts {where} ORDER BY fired_at DESC, id LIMIT ?",
                       [*([] if state == "all" else [state]), limit]).fetchall()
    return _with_deliveries(cur, rows)


def check_state(state: str) -> None:
    """Raises AlertError unless ``state`` is one of ``ALERT_STATES`` or ``all``."""
    if state not in (*ALERT_STATES, "all"):
        raise AlertError(f"state must be {', '.join(ALERT_STATES)} or all, not {state!r}")


def alert(cur: duckdb.DuckDBPyConnection, alert_id: str) -> dict[str, Any] | None:
    """One alert with its deliveries, or None."""
    return next(iter(_with_deliveries(cur, cur.execute(f"SELECT {_COLUMNS} FROM alerts WHERE id = ?",
                                                        [alert_id]).fetchall())), None)


def _with_deliveries(cur: duckdb.DuckDBPyConnection, rows: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    out = [{"id": r[0], "key": r[1], "type": r[2], "state": r[3], "at": iso_utc(r[5]), "acknowledged_by": r[6],
            "acknowledged_at": iso_utc(r[7]), "resolved_at": iso_utc(r[8]), "body": json.loads(r[4]),
            "deliveries": []} for r in rows]
    if not out:
        return out
    by_id = {a["id"]: a for a in out}
    for aid, notice, url, state, attempts, status, error, next_at, done_at in cur.execute(
            "SELECT n.alert_id, n.state, d.url, d.state, d.attempts, d.last_status, d.last_error, d.next_at, "
            "d.done_at FROM alert_deliveries d JOIN alert_notices n ON n.seq = d.notice_seq "
            "WHERE list_contains(?, n.alert_id) ORDER BY d.notice_seq, d.url", [list(by_id)]).fetchall():
        by_id[aid]["deliveries"].append({
            "notice": notice, "webhook": url, "state": state, "attempts": attempts, "last_status": status,
            "last_error": error, "next_attempt_at": iso_utc(next_at) if state == "pending" else None,
            "done_at": iso_utc(done_at)})
    return out


def _notice(cur: duckdb.DuckDBPyConnection, alert_id: str, state: str, body: str, at: dt.datetime) -> None:
    cur.execute("INSERT INTO alert_notices (seq, alert_id, state, body, made_at) "
                "VALUES (nextval('alert_notice_seq'), ?, ?, ?, ?)", [alert_id, state, body, at])


def _check_payload(payload: dict[str, Any]) -> None:
    taken = sorted(set(RESERVED) & set(payload))
    if taken:
        raise ValueError(f"a payload may not set {', '.join(taken)}: every body starts with them")


def _json(body: dict[str, Any]) -> str:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), default=_jsonable)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return iso_utc(value)
    raise TypeError(f"an alert's payload holds JSON values and datetimes, not {type(value).__name__}")
