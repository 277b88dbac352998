"""The conversation stage's rebuild logic, in this process, against its data in memory (``support.memory``).

No DuckDB and no child process: commits go to a ``MemoryData`` as the store would make them, the stage
takes them in (``on_commit``), and what it wrote is read back from the double: rebuilt transcripts,
endings (rules, idle, reopening), traces whose id comes late, stitching by history, revisions, the batch
mark, a failed write and a reindex's swap.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from typing import Any, Iterator

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from collector.config import Conversations as Settings
from collector.conversations.rows import Light
from collector.conversations.stage import REBUILD_SETTLE, Conversations
from collector.ingest.batches import LogBatch, SpanBatch
from collector.ingest.decode import parse_traces, span_batch
from collector.store import Committed

from ..support.memory import MemoryData
from ..support.daemon import wait_until

T0 = 1_764_478_800  # unix seconds: the stage's clock starts here
SETTINGS = Settings.model_validate({"idle_timeout": "60s", "end_rules": [
    {"attribute": "app.handover", "equals": True, "ended_by": "handover"}]})


def chat(trace: int, user: str, answer: str, conversation: str | None = None, *, span: int = 0,
         history: list[tuple[str, str]] = (), handover: bool = False) -> SpanBatch:  # type: ignore[assignment]
    """One chat span of trace ``trace`` (its model call resends ``history`` before ``user``), as a request."""
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    kv = rs.resource.attributes.add()
    kv.key, kv.value.string_value = "service.name", "shopbot"
    sp = rs.scope_spans.add().spans.add()
    sp.name, sp.kind = "chat gpt-4o-mini", 3
    sp.trace_id, sp.span_id = trace.to_bytes(16, "big"), (span or trace).to_bytes(8, "big")
    sp.start_time_unix_nano = (T0 + trace) * 10**9 + span * 10**6
    sp.end_time_unix_nano = sp.start_time_unix_nano + 10**7
    text = lambda role, content: {"role": role, "parts": [{"type": "text", "content": content}]}  # noqa: E731
    sent = [text(role, content) for role, content in history] + [text("user", user)]
    attrs: list[tuple[str, Any]] = [("gen_ai.operation.name", "chat"),
                                    ("gen_ai.input.messages", json.dumps(sent)),
                                    ("gen_ai.output.messages", json.dumps([text("assistant", answer)]))]
    if conversation is not None:
        attrs.append(("gen_ai.conversation.id", conversation))
    for key, value in attrs:
        kv = sp.attributes.add()
        kv.key, kv.value.string_value = key, value
    if handover:
        kv = sp.attributes.add()
        kv.key, kv.value.bool_value = "app.handover", True
    return span_batch(parse_traces(req.SerializeToString(), False))[0]


def root(trace: int, conversation: str) -> SpanBatch:
    """The agent span around a turn, carrying the conversation id (no content)."""
    req = ExportTraceServiceRequest()
    sp = req.resource_spans.add().scope_spans.add().spans.add()
    sp.name = "invoke_agent ShopBot"
    sp.trace_id, sp.span_id = trace.to_bytes(16, "big"), (1000 + trace).to_bytes(8, "big")
    sp.start_time_unix_nano = (T0 + trace) * 10**9 - 10**6
    sp.end_time_unix_nano = sp.start_time_unix_nano + 10**8
    for key, value in (("gen_ai.operation.name", "invoke_agent"), ("gen_ai.conversation.id", conversation)):
        kv = sp.attributes.add()
        kv.key, kv.value.string_value = key, value
    return span_batch(parse_traces(req.SerializeToString(), False))[0]


def tid(trace: int) -> str:
    return trace.to_bytes(16, "big").hex()


class Harness:
    """A stage over ``MemoryData`` with a clock of its own; ``send`` commits and waits until it is taken in."""

    def __init__(self, settings: Settings = SETTINGS, data: MemoryData | None = None, **kw: Any) -> None:
        self.now = float(T0)
        self.data = data or MemoryData()
        self.stage = Conversations(self.data, settings, clock=lambda: self.now, **kw)

    def start(self) -> "Harness":
        self.stage.start()
        return self

    def send(self, *batches: SpanBatch, light: bool = False) -> None:
        for batch in batches:
            committed = self.data.commit(spans=batch, received_at=self.now)
            self.stage.on_commit(Light.of(committed) if light else committed)
        assert self.stage.wait_idle(30)

    def later(self, seconds: float) -> None:
        self.now += seconds
        assert self.stage.wait_idle(30)

    def restart(self) -> None:
        """Stop the stage (if it runs) and start a new one on the same data, as after a restart."""
        self.stage.stop()
        self.data.opened = self.data.batch_id
        self.stage = Conversations(self.data, self.stage.settings, clock=lambda: self.now)
        self.stage.start()


@pytest.fixture
def h() -> Iterator[Harness]:
    harness = Harness().start()
    try:
        yield harness
    finally:
        harness.stage.stop()


def test_a_commit_rebuilds_its_conversation_and_moves_the_batch_mark(h: Harness) -> None:
    h.send(chat(1, "where is my order?", "on its way", "c-1"))
    row = h.data.conversation("c-1")
    assert row is not None and (row.state, row.user_turns, row.revision) == ("open", 1, 1)
    assert h.data.said("c-1") == [("user", "where is my order?"), ("assistant", "on its way")]
    assert h.data.traces[tid(1)] == ("c-1", 1, 1)
    assert h.data.mark == h.data.batch_id == h.stage.status()["conversations_batch"] == 1
    h.send(chat(2, "thanks", "you're welcome", "c-1", history=[("user", "where is my order?"),
                                                               ("assistant", "on its way")]))
    assert h.data.said("c-1")[2:] == [("user", "thanks"), ("assistant", "you're welcome")]
    assert h.data.conversation("c-1").revision == 2  # type: ignore[union-attr]
    assert "trace_rows" not in h.data.calls, "rows handed over with their commits are not read back"


def test_commits_queued_without_their_rows_are_read_back_by_commit_range_to_the_same_conversations() -> None:
    batches = [chat(1, "hello", "hi", "c-1"), chat(2, "and?", "done", "c-1", history=[("user", "hello"),
                                                                                     ("assistant", "hi")]),
               chat(3, "other", "yes", "c-2", handover=True)]
    got = []
    for light in (False, True):
        harness = Harness(max_queued_commits=1_000).start()
        try:
            harness.send(*batches, light=light)
        finally:
            harness.stage.stop()
        got.append(({c: (r.state, r.ended_by, r.transcript_hash, r.trace_ids) for c, r in harness.data.live.items()},
                    harness.data.messages, harness.data.traces))
        assert ("commit_rows" in harness.data.calls) == light
    assert got[0] == got[1]


def test_an_end_rule_ends_the_conversation_and_a_new_trace_reopens_it(h: Harness) -> None:
    h.send(chat(1, "I want a person", "a person will help you", "c-1", handover=True))
    row = h.data.conversation("c-1")
    assert row is not None and (row.state, row.ended_by) == ("ended", "handover")
    assert row.ended_at is not None
    assert h.stage.metrics.conversations_ended.value(ended_by="handover") == 1
    h.send(chat(1, "are you there?", "yes", "c-1", span=7))  # a late span of a trace it has: no reopening
    assert h.data.conversation("c-1").state == "ended"  # type: ignore[union-attr]
    assert h.data.said("c-1")[-2:] == [("user", "are you there?"), ("assistant", "yes")]
    h.send(chat(2, "hello again", "hi", "c-1"))  # a new trace does
    assert h.data.conversation("c-1").state == "open"  # type: ignore[union-attr]
    assert h.stage.metrics.conversations_reopened.value() == 1


def test_a_conversation_idle_for_the_timeout_ends_by_the_stages_clock(h: Harness) -> None:
    h.send(chat(1, "hello", "hi", "c-1"))
    h.later(30)
    assert h.data.conversation("c-1").state == "open"  # type: ignore[union-attr]
    h.later(31)
    row = h.data.conversation("c-1")
    assert row is not None and (row.state, row.ended_by) == ("ended", "idle")
    assert row.closed_at == dt.datetime.fromtimestamp(h.now, dt.timezone.utc)
    assert "c-1" not in h.stage.map.convs, "an ended conversation leaves memory"


def test_an_open_conversation_stored_before_a_restart_ends_idle_as_stored() -> None:
    harness = Harness().start()
    try:
        harness.send(chat(1, "hello", "hi", "c-1"))
        harness.restart()  # nothing new for it: ended as stored, not rebuilt
        harness.later(61)
        row = harness.data.conversation("c-1")
        assert row is not None and (row.state, row.ended_by) == ("ended", "idle")
        assert row.ended_at == dt.datetime.fromtimestamp(T0 + 1 + 0.01, dt.timezone.utc)  # its last span's end
        assert "end_stored" in harness.data.calls
    finally:
        harness.stage.stop()


def test_spans_before_the_one_carrying_the_id_move_with_their_trace(h: Harness) -> None:
    h.send(chat(1, "hello", "hi"))  # no id yet: a conversation of its own trace
    assert list(h.data.live) == [f"trace:{tid(1)}"]
    h.send(root(1, "c-1"))
    assert list(h.data.live) == ["c-1"], "the trace's own conversation goes once the id comes"
    assert h.data.said("c-1") == [("user", "hello"), ("assistant", "hi")]
    assert h.data.traces[tid(1)][0] == "c-1"


def test_a_trace_without_an_id_resending_a_recent_history_continues_that_conversation(h: Harness) -> None:
    h.send(chat(1, "hello", "hi"))
    h.send(chat(2, "and then?", "then this", history=[("user", "hello"), ("assistant", "hi")]))
    own = f"trace:{tid(1)}"
    assert list(h.data.live) == [own]
    row = h.data.live[own]
    assert row.grouped_by == "history" and json.loads(row.trace_ids) == [tid(1), tid(2)]
    assert [m for _, m in h.data.said(own)] == ["hello", "hi", "and then?", "then this"]


def test_the_same_transcript_rebuilt_again_keeps_its_revision(h: Harness) -> None:
    h.send(chat(1, "hello", "hi", "c-1"))
    h.send(chat(1, "hello", "hi", "c-1", span=9))  # the same call twice (a retried export)
    row = h.data.conversation("c-1")
    assert row is not None and row.revision == 1 and len(h.data.said("c-1")) == 2


def test_the_batch_mark_stays_before_a_commit_whose_conversation_is_not_written_yet() -> None:
    """A rebuild put off (``rebuild_interval``) keeps the mark before its commit; a stop then leaves that commit
    to the next start, which catches up from the mark and writes it."""
    harness = Harness(rebuild_interval=3600.0).start()
    try:
        harness.send(chat(1, "hello", "hi", "c-1"))  # a waiter: rebuilt at once
        # With no waiter, the second turn's rebuild is due in an hour.
        harness.stage.on_commit(harness.data.commit(spans=chat(2, "more", "ok", "c-1"), received_at=harness.now))
        wait_until(lambda: harness.stage.processed_batch >= 2, "the stage to take in commit 2", timeout=30)
        assert harness.stage.processed_batch == 2
    finally:
        harness.stage.stop()
    assert harness.data.mark == 1 and len(harness.data.said("c-1")) == 2, "the mark claims only what is written"
    harness.restart()
    try:
        assert harness.stage.wait_idle(30)
        assert harness.data.mark == 2 and len(harness.data.said("c-1")) == 4
    finally:
        harness.stage.stop()


def test_turns_arriving_while_the_first_settles_are_rebuilt_and_written_once() -> None:
    """A conversation is rebuilt ``rebuild_settle`` after its first new data, with what arrived meanwhile:
    turns (or a turn's spans, exported as each ends) a fraction of a second apart are written once, not
    at the first and again an interval later."""
    written: list[int] = []  # the messages of c-1 in each write that had them

    class Counting(MemoryData):
        def write(self, writes: Any, mark: int) -> None:
            if "c-1" in writes.messages:
                written.append(len(writes.messages["c-1"]))
            super().write(writes, mark)

    harness = Harness(data=Counting()).start()
    try:
        turns = [chat(1, "hello", "hi", "c-1"), chat(2, "more", "ok", "c-1", history=[("user", "hello"),
                                                                                    ("assistant", "hi")])]
        for n, batch in enumerate(turns, 1):
            harness.stage.on_commit(harness.data.commit(spans=batch, received_at=harness.now))
            wait_until(lambda n=n: harness.stage.processed_batch >= n, f"the stage to take in commit {n}", timeout=30)
            harness.now += 0.2
        harness.now = T0 + REBUILD_SETTLE
        wait_until(lambda: written, "the rebuild once the first turn has settled", timeout=30)
        assert written[0] == 4, "both turns in the first write"
        assert harness.data.mark == 2
    finally:
        harness.stage.stop()


def test_a_write_that_fails_claims_nothing_and_the_stage_starts_again_from_what_is_stored(h: Harness) -> None:
    h.send(chat(1, "hello", "hi", "c-1"))
    h.data.fail_writes = 1
    h.stage.on_commit(h.data.commit(spans=chat(2, "other", "yes", "c-2"), received_at=h.now))
    assert h.stage.wait_idle(30)
    assert h.data.mark == 2 and set(h.data.live) == {"c-1", "c-2"}
    assert h.data.calls.count("resume") == 2, "read the stored state again after the failure"
    assert h.stage.metrics.stage_errors.value(stage="conversations") == 1


def test_a_swap_runs_between_cycles_then_the_stage_starts_again_from_what_is_stored(h: Harness) -> None:
    h.send(chat(1, "hello", "hi", "c-1"))
    now = dt.datetime.fromtimestamp(h.now, dt.timezone.utc)
    assert h.stage.swap(now).result(30) == 1
    assert h.data.swapped == [now]
    calls = h.data.calls
    assert calls[calls.index("swap") - 1] == "write" and "resume" in calls[calls.index("swap"):]


def test_a_stage_with_commits_queued_takes_the_next_without_its_rows() -> None:
    """What ``takes_rows`` says is what ``on_commit`` does: the daemon sends the stage's process rows
    only while it takes them, since it would drop them."""
    stage = Conversations(MemoryData(), SETTINGS, max_queued_commits=2)  # not started
    takes = []
    for batch_id in (1, 2, 3):
        takes.append(stage.takes_rows())
        stage.on_commit(Committed(batch_id, 0.0, SpanBatch(), LogBatch(), 0, 0))
    queued = [stage._queue.get_nowait() for _ in range(3)]
    assert takes == [True, True, False]
    assert [type(c) for c in queued] == [Committed, Committed, Light]
    assert [c.batch_id for c in queued] == [1, 2, 3]
