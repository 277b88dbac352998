"""Rebuilding the transcripts of touched conversations: ``Rebuild``, a job of the conversation stage.

Each conversation due is rebuilt from every row of its traces (``rows``, read back within their commits
where not cached) with ``assemble``, parsing only rows its memo has not seen; a changed transcript gets
the next revision (to be judged again). The end rules run on its newest trace (``endings``), and its
rows are added to the cycle's ``Writes``. A conversation that cannot be rebuilt keeps its stored version
and is counted; one whose older spans retention deleted keeps its stored transcript.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import orjson

from .assemble import ParseMemo, build_transcript
from .data import ConversationRow, timestamp
from .endings import ended_by_rule
from .rows import TraceRows
from .state import StageState
from .stitch import answered, started
from .tracemap import Tracked
from .transcript import Transcript

log = logging.getLogger("tracejudge.conversations")


class Rebuild(StageState):
    """Transcripts (see the module docstring)."""

    _processed_batch: int  # the stage's: messages are written with it

    def _rebuild_due(self, force: bool = False, only: set[str] | None = None) -> None:
        now = self.clock()
        due = sorted(c for c, at in self._dirty.items() if (force or at <= now) and (only is None or c in only))
        convs = self.map.convs
        for i in range(0, len(due), 200):  # bounded memory: rows of at most 200 conversations at once
            part = [convs[c] for c in due[i:i + 200] if c in convs]
            firsts = {t: conv.first_batch for conv in part for t in conv.traces}
            rows = self.rows.get(self.data, firsts, where=self._batches(lambda t: (firsts[t], None)))
            for conv in part:
                self._check_stop()
                self._rebuild_one(conv, rows)
                self._give_way()
            del rows
            if i + 200 < len(due):
                self._flush()  # bounded memory: transcripts of at most 200 conversations wait to be written
        for cid in due:
            self._done(cid)

    def _rebuild_one(self, conv: Tracked, rows: dict[str, TraceRows] | None = None) -> None:
        """``_rebuild``, where a failure costs this conversation its update, never the others theirs.

        The conversation keeps its stored version; one never stored is stored
        without messages, with the reason, so that it is listed and counted.
        """
        try:
            self._rebuild(conv, rows)
        except Exception as exc:  # noqa: BLE001 - odd data meeting a bug: counted, logged, the rest goes on
            self.failed += 1
            log.warning("conversation %s could not be rebuilt (%s: %s); %s", conv.id, type(exc).__name__, exc,
                        "its stored version is kept" if conv.stored else "it is stored without messages",
                        exc_info=log.isEnabledFor(logging.DEBUG))
            if not conv.stored:
                self._write(conv, Transcript(trace_ids=tuple(conv.traces), no_content_reason=(
                    f"could not be rebuilt ({type(exc).__name__}: {exc}); the log has the details")))
        self._done(conv.id)

    def _rebuild(self, conv: Tracked, rows: dict[str, TraceRows] | None = None) -> None:
        conv.rebuilt_at = self.clock()
        if not conv.traces:  # every trace moved to a keyed conversation
            self.stitcher.drop(conv.id)
            self._writes.delete(conv.id)
            if conv.archived:
                self._writes.unarchive.add(conv.id)
            self.map.convs.pop(conv.id, None)
            self._rows_written.pop(conv.id, None)
            return
        if rows is None or any(t not in rows for t in conv.traces):
            rows = self.rows.get(self.data, conv.traces, where=self._batches(lambda _: (conv.first_batch, None)))
        # Now that every row of its traces is at hand, their first commit is known exactly.
        conv.first_batch = min((b for t in conv.traces if (b := rows[t].first_batch) is not None),
                               default=conv.first_batch)
        for t in self._unranged.intersection(conv.traces):  # stored by an older version: now they are known
            self._writes.traces[t] = (conv.id, *rows[t].batches())
        # Oldest first, as trace_ids promises: the same order live and in a reindex, whatever order
        # the traces' commits came in.
        conv.traces.sort(key=lambda t: (rows[t].start(), t))
        expired = conv.stored and any(not rows[t] for t in conv.traces)
        tr = self._stored(conv) if expired else None
        if tr is None:
            spans = [r for t in conv.traces for r in rows[t].spans]
            logs = [r for t in conv.traces for r in rows[t].logs]
            memo = self._drop_memo(conv.id) or ParseMemo()
            tr = build_transcript(spans, logs, memo)
            self._memos[conv.id] = (memo, len(spans) + len(logs))  # most recently rebuilt last
            self._memo_rows += len(spans) + len(logs)
            if self._memo_rows > self.memo_rows:
                self._trim_memos()
            digest = tr.content_hash(memo.digest)
            if digest != conv.hash:
                conv.revision += 1
                conv.hash = digest
        if conv.grouped_by != "id":  # what a trace with no id may continue now
            history = answered(tr.messages) if self.stitcher.enabled else None
            if history is None:
                self.stitcher.drop(conv.id)
            else:
                self.stitcher.put(conv.id, tr.service, history, started(tr), conv.last_arrival)
        conv.newest_trace = max(conv.traces, key=lambda t: (rows[t].start(), t))
        if conv.state == "open" and conv.newest_trace in rows:
            ended_by = ended_by_rule(self.settings.end_rules, rows[conv.newest_trace].spans)
            if ended_by is not None:
                self._end(conv, ended_by)
        self._write(conv, tr)

    def _stored(self, conv: Tracked) -> Transcript | None:
        """The stored transcript of a conversation whose older spans retention deleted: rebuilt from
        what is left it would lose their messages, so it stays as stored (with its new traces listed)."""
        stored = self.data.stored_transcript(conv.id)
        if stored is None:
            return None
        log.warning("conversation %s has new data, but the spans of its older traces were deleted "
                    "(storage.retention.spans): its stored transcript is kept as it was", conv.id)
        return dataclasses.replace(stored, trace_ids=tuple(conv.traces))

    def _trim_memos(self) -> None:
        """Down to three quarters of ``memo_rows`` (so that a trim, which walks the memos, comes once in
        many rebuilds): first the memos of conversations with no rebuild due, the least recently rebuilt
        first (a deferred rebuild keeps its memo), then the oldest; the newest stays, however long."""
        target = self.memo_rows * 3 // 4
        for cid in [c for c in self._memos if c not in self._dirty]:
            if self._memo_rows <= target:
                return
            self._drop_memo(cid)
        while self._memo_rows > target and len(self._memos) > 1:
            self._drop_memo(next(iter(self._memos)))

    def _drop_memo(self, cid: str) -> ParseMemo | None:
        memo, rows = self._memos.pop(cid, (None, 0))
        self._memo_rows -= rows
        return memo

    def _write(self, conv: Tracked, tr: Transcript) -> None:
        conv.last_span_end = tr.ended_at
        if not tr.content_captured and tr.llm_calls and (tr.service or "") not in self._warned_no_content:
            self._warned_no_content.add(tr.service or "")
            log.warning("conversation %s of service %s carries no message content, so it cannot be judged: %s",
                        conv.id, tr.service or "(unknown)", tr.no_content_reason)
        row = conversation_row(conv, tr, self.clock(), max(self._processed_batch, self._newest_batch))
        self._rows_written[conv.id] = row
        self._writes.conversations[conv.id] = row
        self._writes.messages[conv.id] = message_rows(conv.id, tr, row.messages_batch)
        if conv.stored:
            self._writes.replace.add(conv.id)
        else:
            self._writes.new.add(conv.id)
        if conv.archived:  # back in live_conversations with this write, out of the archive with the same flush
            self._writes.unarchive.add(conv.id)
            conv.archived = False
        conv.stored = True
        if conv.state == "ended":
            # It leaves memory once this write is sent: until then the trace map and its row in DuckDB
            # may not say it ended, and reads of its traces must find it here (``_cycle`` sends a group's
            # writes after the next group's reads).
            self._leaving.append(conv)



def _json_text(value: Any) -> str:
    """JSON text of a column (orjson; json where orjson refuses, e.g. integers past 64 bits)."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return json.dumps(value, ensure_ascii=False, default=str)


def conversation_row(conv: Tracked, tr: Transcript, now: float, written: int) -> ConversationRow:
    """``written``: the batch the stage has taken in, which its messages rows carry."""
    usage = tr.usage
    return ConversationRow(
        conversation_id=conv.id, service=tr.service, started_at=tr.started_at,
        ended_at=tr.ended_at if conv.state == "ended" else None, ended_by=conv.ended_by, state=conv.state,
        user_turns=tr.user_turns, input_tokens=usage.input_tokens if usage else None,
        output_tokens=usage.output_tokens if usage else None, llm_calls=tr.llm_calls,
        message_count=len(tr.messages), models=orjson.dumps(list(tr.models)).decode(), system=tr.system,
        content_captured=tr.content_captured, no_content_reason=tr.no_content_reason,
        transcript_hash=conv.hash, revision=conv.revision, trace_ids=orjson.dumps(conv.traces).decode(),
        newest_trace_id=conv.newest_trace, first_arrival_at=timestamp(conv.first_arrival),
        last_arrival_at=timestamp(conv.last_arrival), closed_at=timestamp(conv.closed_at), updated_at=timestamp(now),
        unparsed_spans=tr.unparsed_spans, unparsed_logs=tr.unparsed_logs,
        sources=orjson.dumps(list(tr.sources)).decode(), first_batch=conv.first_batch,
        messages_batch=written, grouped_by=conv.grouped_by)


def message_rows(cid: str, tr: Transcript, written: int | None) -> list[tuple[Any, ...]]:
    """The ``messages`` rows of a transcript, with the ``messages_batch`` its conversations row is written with."""
    return [(cid, i, m.role, m.content, _json_text(m.to_dict()["tool_calls"]) if m.tool_calls else None,
             m.tool_call_id, m.name, m.at, m.span_id, m.source, m.truncated, written)
            for i, m in enumerate(tr.messages)]
