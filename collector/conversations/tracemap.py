"""Which conversation each trace belongs to, and the conversations the stage holds in memory.

A trace goes to the conversation its id attributes name (``keys``), else to the
one whose response its model call continues (``previous_response.id``), else to
``trace:<trace id>``; a trace with nothing conversational in it yet (no id and
no message content, ``keys.has_messages``) waits in ``pending`` until it has,
and is dropped from it, a conversation never made, after ``idle_timeout``.

Memory holds the open conversations and the ended ones touched recently, with
their traces; anything else is read from ``live_conversations`` (or the archive,
``archive``) and ``trace_conversations`` when a trace of it comes back.

Lifecycle: one per stage, used by its thread only; ``clear()`` after a failed
cycle, then ``load_open`` again.
"""

from __future__ import annotations

import datetime as dt
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import duckdb
import orjson

from ..normalize import Attrs, span_kind
from ..store.transactions import by_keys
from .archive import ConversationArchive
from .keys import json_column, response_links
from .rows import TraceRows

MAX_RESPONSES = 100_000  # response ids kept for chaining: chains are continued within minutes


@dataclass
class Tracked:
    """A conversation as the stage tracks it between rebuilds."""

    id: str
    traces: list[str]
    state: str = "open"
    ended_by: str | None = None
    first_arrival: float = 0.0
    last_arrival: float = 0.0
    closed_at: float | None = None
    newest_trace: str | None = None
    hash: str | None = None
    revision: int = 0
    stored: bool = False  # has rows in the conversations/messages tables
    archived: bool = False  # its stored row is in archived_conversations (read back by ``TraceMap.load``)
    last_span_end: dt.datetime | None = None
    rebuilt_at: float = 0.0
    # The first commit holding rows of its traces, so that reading them skips older commits; None when
    # unknown (stored before it was kept: read whole once, and its rebuild learns it).
    first_batch: int | None = None
    grouped_by: str = "trace"  # ``stitch.GROUPED_BY``

    def __post_init__(self) -> None:
        if not self.id.startswith("trace:"):
            self.grouped_by = "id"

    def grouped(self, how: str) -> None:
        """One of its traces joined it ``how`` (``response`` or ``history``): the weakest link is the one
        it reports."""
        if _WEAKNESS[how] > _WEAKNESS[self.grouped_by]:
            self.grouped_by = how

    def end(self, ended_by: str, at: float) -> None:
        self.state, self.ended_by, self.closed_at = "ended", ended_by, at

    def reopen(self) -> None:
        self.state, self.ended_by, self.closed_at = "open", None, None


def is_genai(rows: TraceRows, kinds: tuple[str, ...] = ("llm", "agent")) -> bool:
    """Whether the normalizer finds a span of these kinds (an LLM call or agent span) in a trace, or a
    GenAI event; any other trace (health checks, plain HTTP) has none."""
    if any((r.get("event_name") or "").startswith("gen_ai") for r in rows.logs):
        return True
    for r in rows.spans:
        try:
            attrs = json_column(r, "attributes")
        except (ValueError, RecursionError):
            continue
        if isinstance(attrs, dict) and span_kind(Attrs(attrs), str(r.get("name") or "")) in kinds:
            return True
    return False


class TraceMap:
    """Traces to conversations, and the conversations in memory (see the module docstring)."""

    def __init__(self, archive: ConversationArchive | None = None) -> None:
        self.archive = archive or ConversationArchive()
        self.convs: dict[str, Tracked] = {}  # open conversations, and ended ones touched recently
        # traces with no conversation yet -> (when they last arrived, the first commit with their rows)
        self.pending: dict[str, tuple[float, int | None]] = {}
        self._traces: dict[str, str] = {}  # trace -> conversation, for the traces of ``convs``
        self._responses: OrderedDict[str, str] = OrderedDict()  # response id -> conversation

    def clear(self) -> None:
        self.convs.clear()
        self._traces.clear()

    def held(self) -> dict[str, int]:
        """Conversations in memory, the traces mapped for them, traces waiting, response ids for chaining, and
        the bytes of the archive's filter (2 an archived conversation)."""
        return {"conversations": len(self.convs), "mapped_traces": len(self._traces),
                "pending_traces": len(self.pending), "response_ids": len(self._responses),
                "archive_filter_bytes": self.archive.filter.nbytes()}

    def load_open(self, cur: duckdb.DuckDBPyConnection) -> None:
        """Bring every open conversation into memory (at start)."""
        for conv in _read(cur, "state = 'open'"):
            self.keep(conv)

    def of(self, cur: duckdb.DuckDBPyConnection, trace_ids: list[str],
           read: Mapping[str, str | None] | None = None) -> dict[str, str | None]:
        """The conversation of each of these traces (memory, else the table), None for a new trace.

        ``read``: the table's answer, read already, for some of them (``Taken.mapped``).
        """
        read = read or {}
        out: dict[str, str | None] = {t: self._traces.get(t) or read.get(t) for t in trace_ids}
        unknown = [t for t, c in out.items() if c is None and t not in read]
        if unknown:
            for t, c in by_keys(cur, "SELECT trace_id, conversation_id FROM trace_conversations WHERE trace_id IN {keys}",
                                unknown):
                out[t] = c
        return out

    def load(self, cur: duckdb.DuckDBPyConnection, cids: Iterable[str]) -> None:
        """Bring these conversations into memory (one read of the live ones for those not there yet, then of
        the archive for those its filter may have); new ones start empty."""
        missing = sorted({c for c in cids if c not in self.convs})
        if not missing:
            return
        found = {c.id: c for c in _read(cur, "conversation_id IN {keys}", missing)}
        for conv in _tracked(self.archive.find(cur, [c for c in missing if c not in found], _COLUMNS)):
            conv.archived = True
            found[conv.id] = conv
        for cid in missing:
            self.keep(found.get(cid) or Tracked(cid, []))

    def keep(self, conv: Tracked) -> None:
        self.convs[conv.id] = conv
        for t in conv.traces:
            self._traces[t] = conv.id

    def move(self, tid: str, cid: str) -> None:
        """The trace now belongs to this conversation (in memory)."""
        self._traces[tid] = cid

    def forget(self, conv: Tracked) -> None:
        """An ended conversation leaves memory; late data reads it back from DuckDB."""
        self.convs.pop(conv.id, None)
        for t in conv.traces:
            self._traces.pop(t, None)

    def chained(self, tid: str, rows: TraceRows) -> str | None:
        """A trace with no id continues the conversation whose response its call names as previous
        (``gen_ai.request.previous_response.id``); its own responses can be continued in turn."""
        ids, previous = response_links(rows.spans)
        cid = next((self._responses[p] for p in sorted(previous) if p in self._responses), None)
        for rid in ids:
            self._responses[rid] = cid or f"trace:{tid}"
            self._responses.move_to_end(rid)
        while len(self._responses) > MAX_RESPONSES:
            self._responses.popitem(last=False)
        return cid


_WEAKNESS = {"id": 0, "trace": 0, "response": 1, "history": 2}
_COLUMNS = ("conversation_id, state, ended_by, trace_ids, newest_trace_id, transcript_hash, revision, "
            "epoch(first_arrival_at), epoch(last_arrival_at), epoch(closed_at), first_batch, grouped_by")


def _read(cur: duckdb.DuckDBPyConnection, where: str, keys: list[str] | None = None) -> list[Tracked]:
    """Live conversations as the stage tracks them: ``where``, or with ``keys`` those ids (``{keys}`` in it)."""
    sql = f"SELECT {_COLUMNS} FROM live_conversations WHERE {where}"
    return _tracked(by_keys(cur, sql, keys) if keys is not None else cur.execute(sql).fetchall())


def _tracked(rows: list[tuple[Any, ...]]) -> list[Tracked]:
    out = [Tracked(rec[0], list(orjson.loads(rec[3] or "[]")), rec[1], rec[2], rec[7] or 0.0, rec[8] or 0.0,
                   rec[9], rec[4], rec[5], rec[6] or 0, stored=True, first_batch=rec[10]) for rec in rows]
    for conv, rec in zip(out, rows):
        if rec[11] and conv.grouped_by != "id":  # NULL in rows older than the column
            conv.grouped_by = rec[11]
    return out
