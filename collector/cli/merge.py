"""Reads of several stores as one (``--db FILE`` given more than once).

Behind the OpenTelemetry Collector's ``load_balancing`` exporter each daemon
keeps its own DuckDB file with whole conversations. Lists are put together in
the order and with the limit one store gives them; ``stats`` is computed once
over the rows of all of them (``review.stats.stats_of``), never from the
figures of each; an export writes every store's conversations.
"""

from __future__ import annotations

import datetime as dt
import heapq
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..api.export import Export


def _time(text: str | None) -> dt.datetime:
    # The API's and the file's times are the same RFC 3339 text, but not of one width (no fraction when it is 0).
    return dt.datetime.fromisoformat(text) if text else dt.datetime.min.replace(tzinfo=dt.timezone.utc)


def conversations(lists: list[list[dict[str, Any]]], limit: int) -> list[dict[str, Any]]:
    """The most recently active first, then by id (``conversations.tables.list_conversations``), at most ``limit``.

    Each list is the first ``limit`` of its store, so the first ``limit`` of all are among them.
    """
    rows = sorted((r for rows in lists for r in rows), key=lambda r: r["conversation_id"])
    rows.sort(key=lambda r: _time(r["last_arrival_at"]), reverse=True)  # stable: ties stay in id order
    return rows[:limit]


def verdicts(lists: list[list[dict[str, Any]]], limit: int) -> list[dict[str, Any]]:
    """The newest first, at most ``limit``.

    One store orders by the sequence it stored them in, which no other store shares: across stores the
    time each was judged (the daemon's clock) orders them, each store's own order kept, ties going to the
    store named first.
    """
    merged = heapq.merge(*lists, key=lambda v: _time(v["judged_at"]), reverse=True)
    return [v for _, v in zip(range(limit), merged)]


class MergedExport:
    """The exports of several stores, one after the other, noting ids that more than one store holds (the caller
    closes the exports)."""

    def __init__(self, exports: list["Export"]) -> None:
        self.exports = exports
        self.total = sum(e.total for e in exports)
        self.duplicates: set[str] = set()
        """Conversation ids found in more than one store (each copy is written); known once the lines are read."""
        self.lines = self._lines()

    def _lines(self) -> Iterator[bytes]:
        import orjson  # here: every subcommand's help loads this module, and orjson takes 25 ms to load

        seen: set[str] = set()  # the ids of the stores read so far
        for e in self.exports:
            ids: set[str] = set()
            for line in e.lines:
                cid = orjson.loads(line)["id"]
                if cid in seen:
                    self.duplicates.add(cid)
                ids.add(cid)
                yield line
            seen |= ids
