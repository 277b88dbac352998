"""Alerts: what the daemon pages people about, kept in DuckDB and delivered to webhooks.

Whoever sees something page-worthy (the evaluator's live criteria, the
monitors) calls ``store.fire`` on its own cursor, in its own transaction; the
``delivery`` stage sends each alert to every webhook of ``alerts.webhooks``
whose ``events`` include its type (``webhooks``: the bodies, Slack's included,
and their signature). The API and the review page list and acknowledge them.

This module loads nothing: the config and the command line read the names below.
"""

from typing import Literal, get_args

AlertType = Literal["live_failure", "failure_rate", "judge_agreement", "judge_errors"]
ALERT_TYPES: tuple[AlertType, ...] = get_args(AlertType)
AlertState = Literal["open", "acknowledged", "resolved"]
ALERT_STATES: tuple[AlertState, ...] = get_args(AlertState)
"""open (nobody has acknowledged it), acknowledged (someone looks at it), resolved (its cause went away)."""
TITLES: dict[str, str] = {
    "live_failure": "Live failure", "failure_rate": "Failure rate above its threshold",
    "judge_agreement": "Judge disagrees with people", "judge_errors": "Judge errors above their threshold"}
"""Each type as people read it (Slack messages, the review page)."""
