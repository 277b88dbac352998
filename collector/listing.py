"""What listings share in the API and the CLI: ``since`` and ``limit`` as they read them, times as they print them."""

from __future__ import annotations

import datetime as dt
from typing import Any

from .words import parse_duration

MAX_LIMIT = 100_000
"""The most rows a listing returns at once (``limit``), in the API and the CLI."""


def iso_utc(value: Any) -> Any:
    """A datetime (naive ones are UTC, as DuckDB returns them) as RFC 3339 UTC text; anything else as is."""
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.timezone.utc)
        elif value.tzinfo is not dt.timezone.utc:
            value = value.astimezone(dt.timezone.utc)
        return value.isoformat().replace("+00:00", "Z")
    return value


def parse_since(text: str, now: dt.datetime | None = None) -> dt.datetime:
    """``15m`` / ``2h`` / ``7d`` ago, or an ISO 8601 time (UTC when it has no zone)."""
    now = now or dt.datetime.now(dt.timezone.utc)
    try:
        seconds = parse_duration(text)
    except ValueError:
        seconds = None
    try:
        if seconds is not None:
            return now - dt.timedelta(seconds=seconds)
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
        return (when if when.tzinfo else when.replace(tzinfo=dt.timezone.utc)).astimezone(dt.timezone.utc)
    except OverflowError:
        raise ValueError(f"since: {text!r} is before the year 1") from None
    except ValueError:
        raise ValueError(f"since: {text!r} is neither a duration (15m, 2h, 7d) nor an ISO 8601 time") from None
