"""Resolving each touched trace to its conversation: ``Resolve``, a job of the conversation stage.

A trace goes to the conversation its id attributes name (``keys``), else to the one whose response its
model call continues (``tracemap.TraceMap.chained``), else to the recent conversation without an id whose
history its call resends (``stitch``), else to ``trace:<trace id>``; one with nothing conversational yet
waits (``TraceMap.pending``). A trace whose id arrives after its children moves with its rows. Each
conversation touched is marked for a rebuild (``rebuild``) ``rebuild_settle`` after the first touch since
its last rebuild, and at most once per ``rebuild_interval``: what arrives meanwhile joins that rebuild.
"""

from __future__ import annotations

import logging
from typing import Callable, Mapping

from ..store.transactions import Batches
from .assemble import NO_CONTENT_REASON, build_transcript
from .keys import conversation_key, has_messages
from .rows import TraceRows
from .state import StageState
from .stitch import Opening, opening
from .tracemap import is_genai

log = logging.getLogger("tracejudge.conversations")


class Resolve(StageState):
    """Traces to conversations (see the module docstring)."""

    def _touch(self, arrived: dict[str, float], current: dict[str, str | None] | None = None,
               since: Mapping[str, int] | int = 0, taken: Mapping[str, Batches] | None = None,
               complete: bool = True) -> set[str]:
        """Resolve each touched trace to its conversation and mark those conversations for a rebuild.

        ``arrived``: when each trace's rows last arrived; ``current`` the trace map for these
        traces when the caller has read it already; ``since`` the first commit with a trace's
        new rows (for the batch mark), per trace or for all; ``taken`` the first and last commits
        with the rows of each trace the caller took in, where it knows them. ``complete``: a trace
        in no conversation and not pending has no other rows (its first rows are among these); else
        such a trace is read from the whole table.
        """
        if not arrived:
            return set()
        traces = list(arrived)
        if current is None:
            current = self.map.of(self.data, traces)
        # Their conversations' first commits bound the reads of these traces' older rows.
        self.map.load(self.data, [c for c in current.values() if c is not None])

        def unstored(tid: str) -> Batches:
            cid = current.get(tid)
            if cid is not None:
                return self.map.convs[cid].first_batch, None
            pending = self.map.pending.get(tid)
            if pending is not None:
                return pending[1], None
            return taken[tid] if complete and taken is not None and tid in taken else (None, None)

        keys: dict[str, str] = {}
        how: dict[str, str] = {}  # trace -> how it joined a conversation without an id, if not alone
        stitching: list[tuple[int, str, Opening | None]] = []  # traces to stitch by history, once all are read
        trace_batches: dict[str, Batches] = {}
        for i in range(0, len(traces), 500):  # bounded memory: rows of at most 500 traces at once
            chunk = traces[i:i + 500]
            rows = self.rows.get(self.data, chunk, where=self._batches(unstored, taken))
            for tid in chunk:
                self._check_stop()
                self._give_way()
                key = conversation_key(rows[tid].spans, self.settings.id_attributes)
                if key is None and current.get(tid) is None and not has_messages(rows[tid].spans, rows[tid].logs):
                    # Neither an id nor a message (yet: content may come in later rows): no conversation.
                    self._no_content(tid, rows[tid])
                    self.map.pending[tid] = (arrived[tid], rows[tid].first_batch)
                    continue
                trace_batches[tid] = rows[tid].batches()
                self._newest_batch = max(self._newest_batch, trace_batches[tid][1] or 0)
                self.map.pending.pop(tid, None)
                self._counted_no_content.discard(tid)
                if key is None:
                    key = self.map.chained(tid, rows[tid])
                    if key is not None:
                        how[tid] = "response"
                    else:
                        key = self._unkeyed(tid, rows[tid], current.get(tid), stitching)
                if key is not None:
                    keys[tid] = key
            del rows
        # In the order they started: a turn after the one it continues, whatever order they came in.
        for _, tid, op in sorted(stitching, key=lambda s: (s[0], s[1])):
            own = f"trace:{tid}"
            found = self.stitcher.find(op, arrived[tid], exclude=own) if op is not None else None
            keys[tid] = found or own
            if found is not None:
                how[tid] = "history"
                self.stitcher.drop(own)
            # The conversation's transcript is now the trace's own: alone, or the one it continues extended.
            if op is not None and op.digest is not None:
                self.stitcher.put(keys[tid], op.service, op.digest, op.started, arrived[tid])
            else:
                self.stitcher.drop(keys[tid])
        self.map.load(self.data, [*keys.values(), *(c for c in current.values() if c is not None)])
        now = self.clock()
        for tid, cid in keys.items():
            conv = self.map.convs[cid]
            old = current.get(tid)
            first = since if isinstance(since, int) else since[tid]
            if tid in how:
                conv.grouped(how[tid])
                if how[tid] == "response":  # its transcript is known again once rebuilt
                    self.stitcher.drop(cid)
            if old != cid:
                if old is not None:  # the span carrying the id arrived after its children
                    self.stitcher.drop(old)
                    prev = self.map.convs[old]
                    if tid in prev.traces:
                        prev.traces.remove(tid)
                    self._dirty.setdefault(old, now)
                    self._since.setdefault(old, first)
                self.map.move(tid, cid)
            if old is None and tid in conv.traces:
                # Back after the trace map forgot it (``archive_traces``): its older rows are in its
                # conversation's commits, and the cache holds only the new ones.
                self.rows.drop([tid])
                trace_batches[tid] = (conv.first_batch, trace_batches[tid][1])
            # Each touched trace's commits, as they are now (``_batches`` reads them back).
            self._writes.traces[tid] = (cid, *trace_batches[tid])
            if old is None:  # not keyed: neither memory nor the table knew it (``DuckData.write``)
                self._writes.new_traces.add(tid)
            b = trace_batches[tid][0]
            if b is not None and (conv.first_batch is not None or not conv.traces):  # None with traces: unknown
                conv.first_batch = b if conv.first_batch is None else min(conv.first_batch, b)
            # Also when the map has it already: a stop can come between writing the map and the
            # conversation (its rebuild waits for the next interval), and the catch-up mends it.
            if tid not in conv.traces:
                conv.traces.append(tid)
                if conv.state == "ended":  # a new trace reopens an ended conversation
                    conv.reopen()
                    self.metrics.conversations_reopened.inc()
            if not conv.first_arrival:
                conv.first_arrival = arrived[tid]
            conv.last_arrival = max(conv.last_arrival, arrived[tid])
            # What comes with the first touch joins its rebuild (``stage.REBUILD_SETTLE`` says why);
            # at most one rebuild per interval while data streams in.
            self._dirty.setdefault(cid, max(now + self.rebuild_settle, conv.rebuilt_at + self.rebuild_interval))
            self._since.setdefault(cid, first)
        return set(keys.values())

    def _unkeyed(self, tid: str, rows: TraceRows, current: str | None,
                 stitching: list[tuple[int, str, Opening | None]]) -> str | None:
        """The conversation of a trace with no id nor previous response: the one it is in already, or None
        with the trace added to ``stitching`` (its conversation is decided once every trace is read)."""
        service = next((s for r in rows.spans if (s := r.get("service"))), None)
        if service not in self._warned_no_id:
            self._warned_no_id.add(service)
            log.warning("service %s sends traces with no conversation id: each is a conversation of its own, but "
                        "for one whose model call resends a recent conversation of the service whole, which "
                        "continues it (grouped_by: history). Set gen_ai.conversation.id on a span around each turn; "
                        "README.md, 'Point your bot at it', shows how with opentelemetry-instrumentation-openai-v2",
                        service or "(unnamed)")
        own = f"trace:{tid}"
        alone = current == own and self.map.convs[own].traces in ([], [tid])
        if current is not None and not alone:
            self.stitcher.drop(current)  # new rows: its transcript is known again once rebuilt
            return current
        # Still alone: with more of its rows it may turn out to continue another conversation.
        op = opening(build_transcript(rows.spans, rows.logs)) if self.stitcher.enabled else None
        stitching.append((op.started if op is not None else rows.start(), tid, op))
        return None

    def _no_content(self, tid: str, rows: TraceRows) -> None:
        """A trace with LLM calls but neither an id nor content makes no conversation: counted once, and
        the first of each service says why and how to turn capture on (as a conversation without content
        does)."""
        if tid in self._counted_no_content or not is_genai(rows, kinds=("llm",)):
            return
        self._counted_no_content.add(tid)
        self.metrics.genai_traces_without_content.inc()
        service = next((s for r in rows.spans if isinstance(s := r.get("service"), str) and s), "")
        if service not in self._warned_no_content:
            self._warned_no_content.add(service)
            log.warning("trace %s of service %s has LLM calls but neither a conversation id nor message content: "
                        "its spans are stored, it makes no conversation and cannot be judged: %s",
                        tid, service or "(unknown)", NO_CONTENT_REASON)

    def _batches(self, unstored: Callable[[str], Batches], taken: Mapping[str, Batches] | None = None
                 ) -> Callable[[list[str]], dict[str, Batches]]:
        """For ``RowCache.get``: the commits that can hold each trace's rows. Those this stage wrote for
        it (in this cycle's writes, else in ``trace_conversations``), with ``taken`` (commits just taken
        in for it); a trace with none stored from ``unstored(trace)`` (a trace in no conversation yet,
        or one an older version stored: its conversation's first commit on, learnt by its rebuild)."""

        def where(traces: list[str]) -> dict[str, Batches]:
            written = self._writes.traces
            stored = {t: (p.first_batch, p.last_batch)
                      for t, p in self.data.trace_map([t for t in traces if t not in written]).items()}
            out: dict[str, Batches] = {}
            for t in traces:
                first, last = written[t][1:] if t in written else stored.get(t, (None, None))
                if first is None or last is None:
                    self._unranged.add(t)
                    first, last = unstored(t)
                elif taken is not None and t in taken:
                    new_first, new_last = taken[t]
                    first = first if new_first is None else min(first, new_first)
                    last = last if new_last is None else max(last, new_last)
                out[t] = first, last
            return out

        return where
