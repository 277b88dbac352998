"""``tracejudge alerts list|ack``: what the daemon paged about, and saying someone looks at it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from ..alerts import ALERT_STATES
from ..words import MAX_LIMIT
from .common import ask, config_option, json_option, reviewer_token_option, table


@click.group()
def alerts() -> None:
    """Alerts: live failures and monitors past their thresholds, as sent to alerts.webhooks.

    Works through the running daemon's API, or on the DuckDB file when no daemon
    runs. The review page at <api>/review shows the open ones on top.
    """


def _what(a: dict[str, Any]) -> str:
    """What the alert is about: its criterion and conversation, else its key."""
    body = a["body"]
    parts = [str(body[k]) for k in ("criterion", "conversation_id") if body.get(k)]
    return " on ".join(parts) if parts else a["key"]


def _deliveries(a: dict[str, Any]) -> str:
    states = [d["state"] for d in a["deliveries"]]
    return ", ".join(f"{states.count(s)} {s}" for s in dict.fromkeys(states)) or "no webhook"


@alerts.command("list")
@config_option
@json_option
@click.option("--state", type=click.Choice([*ALERT_STATES, "all"]), default="open", show_default=True,
              help="Which alerts: open (nobody has acknowledged them), acknowledged, resolved, or all.")
@click.option("--limit", type=click.IntRange(1, MAX_LIMIT), default=100, show_default=True)
def list_cmd(config_path: Path | None, as_json: bool, state: str, limit: int) -> None:
    """Alerts, the newest first, with how their deliveries went."""
    found = ask(config_path, lambda c: c.alerts(state=state, limit=limit))
    if as_json:
        click.echo(json.dumps(found, ensure_ascii=False, indent=2))
        return
    if not found:
        click.echo(f"no {'' if state == 'all' else state + ' '}alerts")
        return
    rows = [["alert", "type", "state", "fired", "deliveries", "about"]]
    for a in found:
        state_text = a["state"] + (f" by {a['acknowledged_by']}" if a.get("acknowledged_by") else "")
        rows.append([a["id"], a["type"], state_text, a["at"].split(".")[0].removesuffix("Z") + "Z", _deliveries(a),
                     _what(a)])
    click.echo(table(rows, align="lllll"))


@alerts.command("ack")
@click.argument("alert_id")
@config_option
@json_option
@click.option("--by", envvar="TRACEJUDGE_REVIEWER", show_envvar=True,
              help="Who looks at it (kept with the alert); with review.reviewers, --token names them instead "
                   "(a --by given must be the token's).")
@reviewer_token_option
def ack_cmd(alert_id: str, config_path: Path | None, as_json: bool, by: str | None,
            reviewer_token: str | None) -> None:
    """Acknowledge an alert: someone looks at it (it leaves the open ones; receivers are not told)."""
    found = ask(config_path, lambda c: c.ack_alert(alert_id, by), reviewer_token=reviewer_token, records=True)
    if as_json:
        click.echo(json.dumps(found, ensure_ascii=False, indent=2))
    else:
        click.echo(f"alert {found['id']} ({found['type']}, {_what(found)}): {found['state']} by "
                   f"{found['acknowledged_by']}")
