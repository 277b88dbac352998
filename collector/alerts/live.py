"""What a live fail does, in the transaction that stores it: the conversation's live review item, and its alert.

The evaluator judges live criteria on open conversations (``evals.live``) and
hands each live fail to ``on_live_fail``'s function as it stores it: the fail
opens its review item at once (``review.queue.open_live_item``; a later fail of
the same conversation and criterion finds the same item) and fires one
``live_failure`` alert per conversation and criterion (``store.fire``: the next
failing turn pages nobody again). Item, alert and verdict commit together.
"""

from __future__ import annotations

import datetime as dt

import duckdb

from ..evals.live import LiveFailure, OnLiveFail
from ..review import queue as review_queue
from . import store


def on_live_fail(api_url: str) -> OnLiveFail:
    """What the evaluator calls with live fails (``Evaluator.go_live``); ``api_url``: where the review page is."""

    def failed(cur: duckdb.DuckDBPyConnection, failures: list[LiveFailure], now: dt.datetime) -> None:
        for f in failures:
            v = f.verdict
            item = review_queue.open_live_item(cur, f.verdict_id, now=now)
            store.fire(cur, type="live_failure", key=f"live:{v.conversation_id}:{v.criterion_id}", now=now, payload={
                "service": f.service, "conversation_id": v.conversation_id, "criterion": v.criterion_id,
                "severity": f.severity, "result": v.result, "evidence": v.evidence, "reasoning": v.reasoning,
                "review_url": f"{api_url}/review/{item}", "turn": f.turn})

    return failed
