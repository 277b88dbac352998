"""When a conversation ends: an end rule on its newest trace, or ``idle_timeout`` without data.

Time is the daemon's clock at commit, never span timestamps. The stage applies
these; a conversation that ended is reopened only by a trace it did not have.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from ..config import EndRule
from .keys import StoredRow, json_column
from .tracemap import Tracked


def _matches(rule: EndRule, value: Any) -> bool:
    if value is None:
        return False
    if value == rule.equals and type(value) is type(rule.equals):
        return True
    # "true" set as a string, 1 for True: compare as text, booleans case-insensitively.
    return str(value).lower() == str(rule.equals).lower()


def ended_by_rule(rules: Sequence[EndRule], spans: Iterable[StoredRow]) -> str | None:
    """The ``ended_by`` of the first rule that a span's attributes or resource match, if any."""
    if not rules:
        return None
    for span in spans:
        try:
            attrs = json_column(span, "attributes") or {}
            resource = json_column(span, "resource") or {}
        except (ValueError, RecursionError):  # a row that does not parse ends nothing
            continue
        if not isinstance(attrs, dict) or not isinstance(resource, dict):
            continue
        for rule in rules:
            if _matches(rule, attrs.get(rule.attribute)) or _matches(rule, resource.get(rule.attribute)):
                return rule.ended_by
    return None


def idle(convs: Iterable[Tracked], now: float, timeout: float) -> list[Tracked]:
    """The open conversations with no data for ``timeout`` seconds."""
    return [c for c in convs if c.state == "open" and now - c.last_arrival >= timeout]
