"""When a conversation ends: an end rule on its newest trace, or ``idle_timeout`` without data.

Time is the daemon's clock at commit, never span timestamps. ``Ending`` is the
stage's job that applies them: idle conversations end with their stored rows
(rebuilt if new data came), conversations loaded at start end as stored, and
an ended conversation leaves memory once its write is sent. A conversation that
ended is reopened only by a trace it did not have (``resolve``).
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Iterable, Sequence

from ..config import EndRule
from .data import Ending as Ended, timestamp
from .keys import StoredRow, json_column
from .state import StageState
from .tracemap import Tracked

END_CHUNK = 2000  # conversations ended as stored per transaction (a restart after downtime)


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


class Ending(StageState):
    """Conversations ended, and out of memory (see the module docstring)."""

    def _end(self, conv: Tracked, ended_by: str) -> None:
        conv.end(ended_by, self.clock())
        self.metrics.conversations_ended.inc(ended_by=ended_by)

    def _end_stored(self, convs: list[Tracked], now: float) -> None:
        """End conversations whose stored transcripts are current (open at the last stop, nothing new
        since) as they are stored, ``END_CHUNK`` per transaction: a restart after downtime ends them
        all without rebuilding each, and a stop in between leaves the rest open for the next start."""
        stamp = dt.datetime.fromtimestamp(now, dt.timezone.utc)
        convs = sorted(convs, key=lambda c: c.first_batch or 0)  # each part reads from its first commit on
        for i in range(0, len(convs), END_CHUNK):
            self._check_stop()
            self._give_way()
            part = convs[i:i + END_CHUNK]
            self.data.end_stored([Ended(c.id, c.ended_by, dt.datetime.fromtimestamp(c.closed_at or now, dt.timezone.utc))
                                  for c in part], part[0].first_batch or 0, stamp)
            for conv in part:
                self._done(conv.id)
                self._forget(conv)

    def _forget(self, conv: Tracked) -> None:
        """An ended conversation leaves memory; late data reads it back from DuckDB."""
        self.map.forget(conv)
        self._rows_written.pop(conv.id, None)
        self._drop_memo(conv.id)
        self.rows.drop(conv.traces)

    def _sweep_idle(self, upto: float | None = None) -> None:
        """End the conversations idle for ``idle_timeout``: by now, or with commits held back for the next
        cycle by when the first of them arrived (time is the clock at commit, as if the stage had kept up)."""
        now = self.clock() if upto is None else min(self.clock(), upto)
        limit = self.settings.idle_timeout
        as_stored = []
        for conv in idle(list(self.map.convs.values()), now, limit):
            self._end(conv, "idle")
            row = self._rows_written.get(conv.id)
            if conv.id in self._dirty:  # new rows: rebuild
                self._rebuild_one(conv)
            elif row is None:  # loaded at start, and nothing new: what is stored is current
                as_stored.append(conv)
            else:
                self._done(conv.id)
                self._writes.conversations[conv.id] = row.ended(conv.last_span_end, conv.ended_by, conv.state,
                                                                timestamp(conv.closed_at), timestamp(now))
                self._forget(conv)
        self._end_stored(as_stored, now)
        for tid in [t for t, (at, _) in self.map.pending.items() if now - at >= limit]:
            del self.map.pending[tid]
            self._counted_no_content.discard(tid)
