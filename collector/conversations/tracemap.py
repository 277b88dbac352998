"""Which conversation each trace belongs to, and the conversations the stage holds in memory.

A trace goes to the conversation its id attributes name (``keys``), else to the
one whose response its model call continues (``previous_response.id``), else to
``trace:<trace id>``; a trace with nothing conversational in it yet (no id and
no message content, ``keys.has_messages``) waits in ``pending`` until it has,
and is dropped from it, a conversation never made, after ``idle_timeout``.

Memory holds the open conversations and the ended ones touched recently, with
their traces; anything else is read back (``StageData.trace_map``,
``StageData.conversations``, the archive's among them when its filter may have
them, ``archive``) when a trace of it comes back.

Lifecycle: one per stage, used by its thread only; ``clear()`` after a failed
cycle, then ``load_open`` again.
"""

from __future__ import annotations

import datetime as dt
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Mapping

from ..normalize import Attrs, span_kind
from .archive import ConversationArchive
from .data import StageData, StoredConversation
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

    def load_open(self, stored: Iterable[StoredConversation]) -> None:
        """Bring every open conversation into memory (at start: ``Resume.conversations``)."""
        for conv in stored:
            self.keep(tracked(conv))

    def of(self, data: StageData, trace_ids: list[str],
           read: Mapping[str, str | None] | None = None) -> dict[str, str | None]:
        """The conversation of each of these traces (memory, else the trace map), None for a new trace.

        ``read``: the trace map's answer, read already, for some of them (``Taken.mapped``).
        """
        read = read or {}
        out: dict[str, str | None] = {t: self._traces.get(t) or read.get(t) for t in trace_ids}
        unknown = [t for t, c in out.items() if c is None and t not in read]
        if unknown:
            for t, place in data.trace_map(unknown).items():
                out[t] = place.conversation_id
        return out

    def load(self, data: StageData, cids: Iterable[str]) -> None:
        """Bring these conversations into memory (the live ones, and those the archive's filter may have);
        new ones start empty."""
        missing = sorted({c for c in cids if c not in self.convs})
        if not missing:
            return
        found = {c.conversation_id: tracked(c) for c in data.conversations(missing, self.archive.filter.maybe(missing))}
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


def tracked(c: StoredConversation) -> Tracked:
    """A stored conversation as the stage tracks it."""
    conv = Tracked(c.conversation_id, list(c.trace_ids), c.state, c.ended_by, c.first_arrival, c.last_arrival,
                   c.closed_at, c.newest_trace_id, c.transcript_hash, c.revision, stored=True,
                   archived=c.archived, first_batch=c.first_batch)
    if c.grouped_by and conv.grouped_by != "id":  # None in rows older than the column
        conv.grouped_by = c.grouped_by
    return conv
