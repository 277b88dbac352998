"""``StageData`` in memory: the conversation stage's unit tests run it with no DuckDB and no child process.

Each operation is checked as the daemon's side of the stage process checks it (a name and plain
arguments). ``MemoryData()`` holds what ``DuckData`` keeps in tables (rows, conversations, messages, the trace map
and its archive, the archive's filter, the batch mark) in dicts and lists. ``commit(spans=..., logs=...)``
stores a commit as the store does and returns the ``Committed`` handed to the stage. ``fail_writes``
makes the next writes raise, each leaving nothing of itself, as a rolled-back transaction does.
"""

from __future__ import annotations

import copy
import pickle
import dataclasses
import datetime as dt
from collections.abc import KeysView, Mapping, Sequence
from typing import Any

import orjson

from collector.conversations.archive import Layer
from collector.conversations.process import plain_request
from collector.conversations.data import (LOG_COLUMNS, SPAN_COLUMNS, CommitRows, EndedToArchive, Ending, Later,
                                          LogRow, RecentTranscript, Resume, SpanRow, StoredConversation,
                                          StoredRows, TracePlace, TraceSince)
from collector.conversations.record import STORED_COLUMNS, stored_conversation, stored_message
from collector.conversations.transcript import Transcript, from_unix_nano
from collector.conversations.data import ConversationRow, Writes
from collector.ingest.batches import LogBatch, SpanBatch
from collector.store import Committed
from collector.store.transactions import Batches


def _epoch(at: dt.datetime | None) -> float | None:
    return at.timestamp() if at is not None else None


class MemoryData:
    """The stage's data in memory (see the module docstring)."""

    def __init__(self) -> None:
        self.spans: list[SpanRow] = []
        self.logs: list[LogRow] = []
        self.arrived: dict[int, float] = {}  # commit -> when it arrived
        self.batch_id = 0
        self.opened = 0
        self.mark = 0
        self.live: dict[str, ConversationRow] = {}
        self.archived: dict[str, ConversationRow] = {}
        self.messages: dict[str, list[tuple[Any, ...]]] = {}
        self.traces: dict[str, tuple[str, int | None, int | None]] = {}  # the keyed trace map
        self.trace_archive: dict[str, tuple[str, int | None, int | None]] = {}
        self.layers: dict[int, Layer] = {}
        self.calls: list[str] = []  # the operations asked for, in order
        self.fail_writes = 0
        self.swapped: list[dt.datetime] = []

    # ------------------------------------------------------------ the store's side

    def commit(self, spans: SpanBatch | None = None, logs: LogBatch | None = None,
               received_at: float = 0.0) -> Committed:
        """Store a commit as the store does; what the store hands the stage."""
        spans, logs = spans or SpanBatch(), logs or LogBatch()
        self.batch_id += 1
        self.arrived[self.batch_id] = received_at
        for row in spans.rows():
            self.spans.append((*(row[c] for c in SPAN_COLUMNS), self.batch_id))
        for seq, row in enumerate(logs.rows()):
            self.logs.append((*(row[c] for c in LOG_COLUMNS), self.batch_id, seq))
        return Committed(self.batch_id, received_at, spans, logs, len(spans), len(logs))

    def conversation(self, cid: str) -> ConversationRow | None:
        return self.live.get(cid) or self.archived.get(cid)

    def said(self, cid: str) -> list[tuple[str, str]]:
        """A stored transcript's (role, content), in order."""
        return [(m[2], m[3]) for m in self.messages.get(cid, [])]

    # ------------------------------------------------------------ StageData

    def resume(self, stitch_since: float, stitch_kept: int) -> Resume:
        self._called("resume", stitch_since, stitch_kept)
        recent = sorted((r for r in self.live.values() if r.conversation_id.startswith("trace:") and r.content_captured
                         and (_epoch(r.last_arrival_at) or 0.0) >= stitch_since),
                        key=lambda r: (_epoch(r.last_arrival_at) or 0.0, r.conversation_id), reverse=True)[:stitch_kept]
        return Resume(self.mark, self.batch_id, self.opened,
                      [self._stored(r, False) for r in self.live.values() if r.state == "open"],
                      copy.deepcopy(self.layers),
                      [RecentTranscript(r.conversation_id, self._transcript(r), _epoch(r.last_arrival_at) or 0.0)
                       for r in reversed(recent)])

    def trace_map(self, trace_ids: Sequence[str]) -> dict[str, TracePlace]:
        self._called("trace_map", trace_ids)
        return {t: TracePlace(*self.traces[t]) for t in trace_ids if t in self.traces}

    def conversations(self, ids: Sequence[str], maybe_archived: Sequence[str]) -> list[StoredConversation]:
        self._called("conversations", ids, maybe_archived)
        found = [self._stored(self.live[c], False) for c in ids if c in self.live]
        found += [self._stored(self.archived[c], True) for c in maybe_archived
                  if c not in self.live and c in self.archived]
        return found

    def trace_rows(self, trace_ids: Sequence[str], batches: Sequence[Batches]) -> StoredRows:
        self._called("trace_rows", trace_ids, batches)
        wanted = set(trace_ids)
        every = any(first is None for first, _ in batches)

        def within(batch: int) -> bool:
            return every or any(first is not None and first <= batch and (last is None or batch <= last)
                                for first, last in batches)

        n = len(SPAN_COLUMNS)
        return StoredRows([r for r in self.spans if r[0] in wanted and within(r[n])],
                          [r for r in self.logs if r[1] in wanted and within(r[len(LOG_COLUMNS)])])

    def commit_rows(self, first: int, last: int) -> Later[CommitRows]:
        self._called("commit_rows", first, last)

        def read() -> CommitRows:
            spans = [r for r in self.spans if first <= r[len(SPAN_COLUMNS)] <= last and r[0] is not None]
            logs = [r for r in self.logs if first <= r[len(LOG_COLUMNS)] <= last and r[1] is not None]
            traces = {r[0] for r in spans} | {r[1] for r in logs}
            return CommitRows(spans, logs, {t: self.traces[t][0] for t in traces if t in self.traces})

        return Later(read)

    def traces_since(self, after: int, upto: int | None) -> list[TraceSince]:
        self._called("traces_since", after, upto)
        last = upto if upto is not None else 2**63
        seen: dict[str, list[Any]] = {}  # trace -> [arrived, first, last, start]
        rows = [(r[0], r[len(SPAN_COLUMNS)], r[4]) for r in self.spans]
        rows += [(r[1], r[len(LOG_COLUMNS)], r[3]) for r in self.logs if r[1] is not None]
        for tid, batch, start in rows:
            if not after < batch <= last:
                continue
            got = seen.setdefault(tid, [0.0, batch, batch, start])
            got[0] = max(got[0], self.arrived[batch])
            got[1], got[2] = min(got[1], batch), max(got[2], batch)
            got[3] = min(got[3], start) if start is not None and got[3] is not None else got[3] or start
        order = sorted(seen.items(), key=lambda kv: (kv[1][2], kv[1][0], kv[1][3] or 0, kv[0]))
        return [TraceSince(t, at, first, last_) for t, (at, first, last_, _) in order]

    def stored_transcript(self, conversation_id: str) -> Transcript | None:
        self._called("stored_transcript", conversation_id)
        row = self.conversation(conversation_id)
        return None if row is None else self._transcript(row)

    def write(self, writes: Writes, mark: int) -> None:
        self._called("write", writes, mark)
        if self.fail_writes:
            self.fail_writes -= 1
            raise RuntimeError("the write failed")
        w = copy.deepcopy(writes)  # a write sent is the data's, as over the pipe
        for cid in w.deleted:
            self.live.pop(cid, None)
            self.messages.pop(cid, None)
        for cid in w.unarchive:
            self.archived.pop(cid, None)
        for cid in w.replace:
            self.messages.pop(cid, None)
        for t, where in w.traces.items():
            self.traces[t] = where
        while len(self.traces) > w.traces_kept + w.traces_kept // 4:  # the oldest last commits first
            t = min(self.traces, key=lambda t: (self.traces[t][2] or 0, t))
            self.trace_archive[t] = self.traces.pop(t)
        for cid, msgs in w.messages.items():
            if cid not in w.deleted:
                self.messages[cid] = list(msgs)
        for cid, row in w.conversations.items():
            if cid not in w.deleted:
                self.live[cid] = row
        self.mark = mark

    def end_stored(self, endings: Sequence[Ending], first_batch: int, updated_at: dt.datetime) -> None:
        self._called("end_stored", endings, first_batch, updated_at)
        for e in endings:
            traces = {t for t, where in (*self.traces.items(), *self.trace_archive.items())
                      if where[0] == e.conversation_id}
            ends = [r[5] for r in self.spans if r[0] in traces and r[5] and r[len(SPAN_COLUMNS)] >= first_batch]
            self.live[e.conversation_id] = dataclasses.replace(
                self.live[e.conversation_id], state="ended", ended_at=from_unix_nano(max(ends, default=None)),
                ended_by=e.ended_by, closed_at=e.closed_at, updated_at=updated_at)

    def ended_to_archive(self, over: int, keep: int, most: int, held: Sequence[str]) -> EndedToArchive:
        self._called("ended_to_archive", over, keep, most, held)
        ended = [r for r in self.live.values() if r.state == "ended"]
        if len(ended) <= over:
            return EndedToArchive(len(ended), [])
        oldest = sorted((r for r in ended if r.conversation_id not in held),
                        key=lambda r: (r.last_arrival_at is not None, r.last_arrival_at, r.conversation_id))
        return EndedToArchive(len(ended), [(r.conversation_id, r.last_arrival_at)
                                           for r in oldest[:min(len(ended) - keep, most)]])

    def archived_by(self, last_arrival: dt.datetime | None, limit: int) -> list[str]:
        self._called("archived_by", last_arrival, limit)
        return [c for c, r in self.archived.items()
                if r.last_arrival_at is None or (last_arrival is not None and r.last_arrival_at <= last_arrival)][:limit]

    def archive(self, ids: Sequence[str], layers: Mapping[int, Layer | None]) -> None:
        self._called("archive", ids, layers)
        for cid in ids:
            self.archived[cid] = self.live.pop(cid)
        for n, layer in layers.items():
            if layer is None:
                self.layers.pop(n, None)
            else:
                self.layers[n] = copy.deepcopy(layer)

    def swap(self, now: dt.datetime) -> int:
        self._called("swap", now)
        self.swapped.append(now)
        return len(self.live) + len(self.archived)

    def sync(self) -> None:
        """Every operation has answered already."""

    @property
    def in_flight(self) -> int:
        return 0

    def close(self) -> None:
        """Nothing is held."""

    # ------------------------------------------------------------ the operations as they cross

    def _called(self, name: str, *args: Any) -> None:
        """Each operation as the stage process would send it: the daemon's side refuses anything but a
        named operation of plain data (``process.plain_request``)."""
        plain_request(pickle.dumps((name, *(list(a) if isinstance(a, KeysView) else a for a in args))))
        self.calls.append(name)

    # ------------------------------------------------------------ rows as the stage reads them back

    @staticmethod
    def _stored(r: ConversationRow, archived: bool) -> StoredConversation:
        return StoredConversation(r.conversation_id, r.state, r.ended_by, list(orjson.loads(r.trace_ids or "[]")),
                                  r.newest_trace_id, r.transcript_hash, r.revision or 0,
                                  _epoch(r.first_arrival_at) or 0.0, _epoch(r.last_arrival_at) or 0.0,
                                  _epoch(r.closed_at), r.first_batch, r.grouped_by, archived)

    def _transcript(self, r: ConversationRow) -> Transcript:
        row = tuple(getattr(r, c) for c in STORED_COLUMNS)
        messages = [stored_message((m[0], *m[2:11])) for m in self.messages.get(r.conversation_id, [])]
        return stored_conversation(row, messages)[0]
