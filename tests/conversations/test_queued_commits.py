"""Commits queued as trace ids only (the stage behind ingestion) rebuild the same conversations.

While ingestion is busy the conversation stage keeps only which traces each
commit touched and reads their rows back from DuckDB later, by commit range.
Every fixture case goes through a real store twice, once with every commit
handed over whole and once with every commit queued as ids only; the stored
conversations, messages and trace map must be identical. So must they with no row
cache at all and a cycle per request, where every read of a trace stays within
the commits the trace map stored for it, joined with those of its new rows.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import duckdb
import pytest

from collector.config import Conversations as Settings
from collector.conversations import Conversations
from collector.conversations.duck import DuckData
from collector.conversations.stage import local_stage
from collector.conversations.archive import BITS_PER_ID, FIRST_CAPACITY
from collector.ingest.decode import log_batch, parse_logs, parse_traces, span_batch
from collector.store import Store

from ..support.conversations import one_timestamp_per_call
from ..support.daemon import FIXTURES
from ..support.served import Served, stage_on
from ..support.wire import fixture_requests, wire_body

CASES = sorted(p.name.removesuffix(".meta.json") for p in FIXTURES.glob("*.meta.json"))
SETTINGS = Settings.model_validate({"end_rules": [{"attribute": "app.handover", "equals": True,
                                                   "ended_by": "handover"}]})


def rebuilt(tmp: Path, requests: list[dict[str, Any]], queued_only: bool, cache_spans: int = 10_000,
            each: bool = False, remote: bool = False, each_row: bool = False,
            traces_kept: int = 200_000, conversations_kept: int = 100_000) -> dict[str, list[tuple[Any, ...]]]:
    """What the stage stored; with ``each`` it catches up after every request, not once at the end; with
    ``each_row`` every row is a commit of its own; with ``remote`` its statements go through a pipe to the daemon's side of the stage process, which runs
    them on the store (reads ahead, writes behind), as in the daemon."""
    store = Store(tmp / f"{queued_only}-{cache_spans}-{remote}-{each_row}-{traces_kept}-{conversations_kept}.duckdb")
    store.open()
    served = Served(store, SETTINGS) if remote else None
    stage = stage_on(store, SETTINGS, served, max_queued_commits=0 if queued_only else 1_000_000,
                     cache_spans=cache_spans, traces_kept=traces_kept, conversations_kept=conversations_kept)
    stage.start()
    store.on_commit(stage.on_commit)
    try:
        if served is not None:
            served.server.gate.clear()  # the commits queue up meanwhile: the next cycle takes them all
        for req in requests:
            json_body = "json" in req.get("content_type", "")
            if req["signal"] == "traces":
                for spans in _commits(span_batch(parse_traces(wire_body(req), json_body))[0], each_row):
                    store.submit(spans=spans).result(30)
            elif req["signal"] == "logs":
                for logs in _commits(log_batch(parse_logs(wire_body(req), json_body))[0], each_row):
                    store.submit(logs=logs).result(30)
            if each:
                assert stage.wait_idle(60)
        if served is not None:
            served.server.gate.set()
        assert stage.wait_idle(60)
        cur = store.cursor()
        try:
            return {
                # trace_ids as a set: the stage lists them in the order it met them.
                "conversations": [(*row[:-1], sorted(json.loads(row[-1]))) for row in cur.execute(
                    "SELECT conversation_id, state, ended_by, user_turns, message_count, transcript_hash, "
                    "input_tokens, output_tokens, trace_ids FROM conversations ORDER BY ALL").fetchall()],
                # first_batch: where the rows were written, which follows the cycles
                "messages": cur.execute("SELECT * EXCLUDE (\"at\", first_batch) FROM messages ORDER BY ALL").fetchall(),
                "traces": cur.execute("SELECT * FROM trace_map ORDER BY ALL").fetchall(),
            }
        finally:
            cur.close()
    finally:
        stage.stop()
        if served is not None:
            assert served.data.read_ahead, "no group of commits was read ahead"
            served.close()
        store.close()


def _commits(batch: Any, each_row: bool) -> list[Any]:
    """The batch as one commit, or with ``each_row`` a commit per row (so that a cycle has several groups)."""
    if not each_row:
        return [batch]
    return [type(batch)([[column[i]] for column in batch.columns]) for i in range(len(batch))]


@pytest.mark.parametrize("case", CASES)
def test_queued_commits_rebuild_the_same_conversations(tmp_path: Path, case: str) -> None:
    requests = list(fixture_requests(case))
    whole = rebuilt(tmp_path, requests, queued_only=False)
    assert whole["conversations"]
    assert rebuilt(tmp_path, requests, queued_only=True) == whole


@pytest.mark.parametrize("case", CASES)
def test_rows_read_back_within_their_commits_rebuild_the_same_conversations(tmp_path: Path, case: str) -> None:
    requests = list(fixture_requests(case))
    whole = rebuilt(tmp_path, requests, queued_only=False)
    assert rebuilt(tmp_path, requests, queued_only=False, cache_spans=0, each=True) == whole


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_commits_read_ahead_and_written_behind_rebuild_the_same_conversations(tmp_path: Path, case: str) -> None:
    """As in the stage process: each group's rows are read while the group before is rebuilt, and written
    while the next is taken in. Each row is a commit of its own there, and a cache of 8 rows cuts a cycle
    into groups of two."""
    requests = list(fixture_requests(case))
    whole = rebuilt(tmp_path, requests, queued_only=False, each_row=True)
    assert rebuilt(tmp_path, requests, queued_only=True, cache_spans=8, remote=True, each_row=True) == whole


@pytest.mark.parametrize("case", CASES)
def test_a_trace_map_keyed_for_no_trace_rebuilds_the_same_conversations(tmp_path: Path, case: str) -> None:
    """With no trace kept keyed, every cycle moves the traces it wrote to the archive: the open
    conversations the stage holds still find their traces, and the map (``trace_map``) is the same."""
    requests = list(fixture_requests(case))
    whole = rebuilt(tmp_path, requests, queued_only=False)
    assert rebuilt(tmp_path, requests, queued_only=False, cache_spans=0, each=True, traces_kept=0) == whole
    con = duckdb.connect(str(tmp_path / "False-0-False-False-0-100000.duckdb"), read_only=True)
    try:
        keyed, archived = con.execute("SELECT (SELECT count(*) FROM trace_conversations), "
                                      "(SELECT count(*) FROM trace_archive)").fetchall()[0]
    finally:
        con.close()
    assert keyed == 0 and archived == len(whole["traces"]) > 0


def test_log_records_sharing_a_timestamp_read_back_in_request_order(tmp_path: Path) -> None:
    """Rows read back from DuckDB keep the order their request gave them, as rows handed over do."""
    case = "openai-v2-2.3b0-legacy-log-events-http"
    requests = one_timestamp_per_call(list(fixture_requests(case)))
    queued = rebuilt(tmp_path, requests, queued_only=True)
    got: dict[str, list[tuple[str, str]]] = {}
    for row in queued["messages"]:  # (conversation_id, seq, role, content, ...), in seq order
        got.setdefault(row[0], []).append((row[2], row[3] or ""))
    expected = json.loads((FIXTURES / f"{case}.expected.json").read_text())["conversations"]
    assert got == {c["conversation_key"] or f"trace:{c['trace_ids'][0]}":
                   [(m["role"], m.get("content") or "") for m in c["messages"]] for c in expected}
    assert rebuilt(tmp_path, requests, queued_only=False) == queued


def test_commits_made_after_the_stage_opened_are_not_caught_up_again(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """The catch-up at start covers commits made before the stage opened; a burst that arrives before
    its first cycle reaches it through on_commit only (reading it back as well rebuilt it twice)."""
    caplog.set_level(logging.INFO, logger="tracejudge.conversations")
    store = Store(tmp_path / "burst.duckdb")
    store.open()
    # Ingestion looks busy for the first 2 s (idle_gap), so the first cycle, catch-up included,
    # runs after the burst below is committed.
    stage = local_stage(store, SETTINGS, idle_gap=3600.0, max_wait=2.0)
    stage.start()
    store.on_commit(stage.on_commit)
    try:
        for req in fixture_requests("openai-v2-latest-span-only-grpc"):
            if req["signal"] == "traces":
                store.submit(spans=span_batch(parse_traces(wire_body(req), False))[0]).result(30)
        assert stage.wait_idle(60)
        assert stage.status()["conversations_batch"] == store.batch_id
    finally:
        stage.stop()
        store.close()
    assert "catching up" not in caplog.text


@pytest.mark.parametrize("remote", [False, True])
def test_only_commits_of_an_earlier_run_are_caught_up_as_such(tmp_path: Path, remote: bool,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A first start that answers traffic before its stage opens catches nothing up from "before the last
    stop"; a restart counts only the traces committed before it, not those committed since it opened."""
    caplog.set_level(logging.INFO, logger="tracejudge.conversations")
    path = tmp_path / f"restart-{remote}.duckdb"

    def run(traces: range) -> None:
        store = Store(path)
        store.open()
        for trace in traces:  # committed before the stage opens, as a bot sends at once on a start
            store.submit(spans=_chat_commit(f"c{trace}", trace, "Where is my order?", "On its way.")).result(30)
        served = Served(store, SETTINGS) if remote else None
        stage = stage_on(store, SETTINGS, served)
        stage.start()
        store.on_commit(stage.on_commit)
        try:
            assert stage.wait_idle(60)
            assert stage.status()["conversations_batch"] == store.batch_id
        finally:
            stage.stop()
            if served is not None:
                served.close()
            store.close()

    run(range(1, 4))  # a fresh file
    assert "catching up" not in caplog.text
    # Three traces an earlier run committed and its stage never took in (a crash between the two):
    con = duckdb.connect(str(path))
    con.execute("UPDATE tracejudge_state SET value = '0' WHERE key = 'conversations.batch'")
    con.close()
    run(range(4, 6))
    assert "catching up on 3 traces committed before the last stop" in caplog.text


def _chat_commit(conversation: str | None, trace: int, user: str, answer: str, span_id: int = 0,
                 handover: bool = False) -> Any:
    """One chat span of a conversation (None: a span without the id), as a commit of its own."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    req = ExportTraceServiceRequest()
    span = req.resource_spans.add().scope_spans.add().spans.add()
    span.name, span.kind = "chat gpt-4o-mini", 3
    span.trace_id, span.span_id = trace.to_bytes(16, "big"), (span_id or trace).to_bytes(8, "big")
    span.start_time_unix_nano = 1_764_478_800_000_000_000 + trace * 10**9 + span_id * 10**8
    span.end_time_unix_nano = span.start_time_unix_nano + 10**7
    attrs = [("gen_ai.operation.name", "chat"),
             ("gen_ai.input.messages", json.dumps([{"role": "user", "parts": [{"type": "text", "content": user}]}])),
             ("gen_ai.output.messages", json.dumps([{"role": "assistant", "parts": [
                 {"type": "text", "content": answer}]}]))]
    if conversation is not None:
        attrs.append(("gen_ai.conversation.id", conversation))
    for key, value in attrs:
        kv = span.attributes.add()
        kv.key, kv.value.string_value = key, value
    if handover:
        kv = span.attributes.add()
        kv.key, kv.value.bool_value = "app.handover", True
    return span_batch(parse_traces(req.SerializeToString(), False))[0]


@pytest.mark.parametrize("remote", [False, True])
def test_late_rows_of_a_conversation_ended_in_a_backlog_join_it(tmp_path: Path, remote: bool) -> None:
    """In a backlog a group's writes go after the next group's reads (with ``remote``, the trace map of
    the next group is read ahead, before them): a conversation ended by the writes not stored yet stays
    in memory until they are, so a late span of its trace, in the next group, finds it there and joins it."""
    store = Store(tmp_path / "late.duckdb")
    store.open()
    served = Served(store, SETTINGS) if remote else None
    # The commits queue up (ingestion never looks paused; with ``remote`` the daemon's side does not
    # answer) until a waiter (wait_idle) comes; a cache of 8 rows makes groups of two commits.
    stage = stage_on(store, SETTINGS, served,
                          cache_spans=8, idle_gap=3600.0, max_wait=3600.0, max_queued_commits=0)
    stage.start()
    store.on_commit(stage.on_commit)
    if served is not None:
        served.server.gate.clear()
    commits = [_chat_commit("a", 1, "where is my parcel?", "a person will help you", handover=True),
               _chat_commit("b", 2, "hello", "hi"), _chat_commit("c", 3, "hello", "hi"),
               _chat_commit("d", 4, "hello", "hi"),
               _chat_commit(None, 1, "are you there?", "yes, here", span_id=99),  # late, in a's trace
               _chat_commit("e", 5, "hello", "hi")]
    try:
        for batch in commits:
            store.submit(spans=batch).result(30)
        if served is not None:
            served.server.gate.set()
        assert stage.wait_idle(60)
    finally:
        stage.stop()
        if served is not None:
            assert served.data.read_ahead, "no group of commits was read ahead"
            served.close()
    cur = store.cursor()
    try:
        stored = cur.execute("SELECT conversation_id, state, ended_by, user_turns, trace_ids FROM conversations "
                             "ORDER BY 1").fetchall()
        traces = cur.execute("SELECT trace_id, conversation_id FROM trace_conversations ORDER BY 1").fetchall()
    finally:
        cur.close()
        store.close()
    t1 = (1).to_bytes(16, "big").hex()
    assert stored[0][:4] == ("a", "ended", "handover", 2) and json.loads(stored[0][4]) == [t1], stored
    assert [row[0] for row in stored] == ["a", "b", "c", "d", "e"]
    assert (t1, "a") in traces
    # found in memory, ended once: read back from DuckDB before its end was stored, it began again, empty
    assert stage.metrics.conversations_ended.value(ended_by="handover") == 1


@pytest.mark.parametrize("traces_kept", [0, 200_000])
def test_a_trace_back_after_the_map_archived_it_keeps_its_older_messages(tmp_path: Path, traces_kept: int) -> None:
    """A conversation ended and left memory, and its trace left the keyed map (``traces_kept=0``): a late
    span of that trace with the conversation's id joins it, and the rebuild reads the trace's older rows
    too, as it does while the map still has the trace. Every span is in ``spans`` once."""
    store = Store(tmp_path / "back.duckdb")
    store.open()
    stage = _started(store, traces_kept=traces_kept)
    try:
        _taken(store, stage, _chat_commit("a", 1, "where is my parcel?", "a person will help you", handover=True))
        _taken(store, stage, _chat_commit("b", 2, "hello", "hi"))
        _taken(store, stage, _chat_commit("a", 1, "are you there?", "yes, here", span_id=99))
    finally:
        stage.stop()
    stored, said, spans, archived = _read(
        store, "SELECT conversation_id, state, user_turns FROM conversations ORDER BY 1",
        "SELECT content FROM messages WHERE conversation_id = 'a' AND role = 'user' ORDER BY seq",
        "SELECT span_id, conversation_id FROM spans ORDER BY 1", "SELECT count(*) FROM trace_archive")
    store.close()
    assert stored[0] == ("a", "ended", 2), stored
    assert said == [("where is my parcel?",), ("are you there?",)]
    assert [c for _, c in spans] == ["a", "b", "a"], spans
    assert (archived[0][0] > 0) == (traces_kept == 0)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("remote", [False, True])
def test_conversations_archived_at_every_flush_rebuild_the_same_conversations(tmp_path: Path, case: str,
                                                                               remote: bool) -> None:
    """With no ended conversation kept keyed, every flush moves those that left memory to the archive: a
    conversation the fixture continues after its end is read back from there (its id in the filter), and
    the conversations, their messages and the trace map are the same as with every one keyed."""
    requests = list(fixture_requests(case))
    whole = rebuilt(tmp_path, requests, queued_only=False, each_row=remote)
    assert rebuilt(tmp_path, requests, queued_only=remote, cache_spans=8 if remote else 0, each=not remote,
                   remote=remote, each_row=remote, conversations_kept=0) == whole


@pytest.mark.parametrize("restart", [False, True])
def test_a_conversation_back_from_the_archive_keeps_its_older_messages_and_is_stored_once(
        tmp_path: Path, restart: bool) -> None:
    """Conversation a ended and was archived (no ended conversation kept keyed); a new trace with its id
    comes, after a restart too (the filter read back from the file): the stage reads it back from the
    archive, its transcript has both turns, and its row is in the live table only."""
    store = Store(tmp_path / "back.duckdb")
    store.open()
    stage = _started(store, conversations_kept=0)
    try:
        _taken(store, stage, _chat_commit("a", 1, "where is my parcel?", "a person will help you", handover=True))
        _taken(store, stage, _chat_commit("b", 2, "hello", "hi", handover=True))
        assert _read(store, "SELECT conversation_id FROM archived_conversations ORDER BY 1")[0] == [("a",), ("b",)]
        if restart:
            stage.stop()
            stage = _started(store, conversations_kept=0)
        _taken(store, stage, _chat_commit("a", 3, "are you there?", "yes, here"))
        assert stage.map.archive.filter.maybe(["a", "b"]) == ["a", "b"]
        assert stage.held()["archive_filter_bytes"] == FIRST_CAPACITY * BITS_PER_ID // 8  # one layer, in memory
    finally:
        stage.stop()
    stored, said, live, archived = _read(
        store, "SELECT conversation_id, state, user_turns FROM conversations ORDER BY 1",
        "SELECT content FROM messages WHERE conversation_id = 'a' AND role = 'user' ORDER BY seq",
        "SELECT conversation_id FROM live_conversations ORDER BY 1",
        "SELECT conversation_id FROM archived_conversations ORDER BY 1")
    store.close()
    assert stored == [("a", "open", 2), ("b", "ended", 1)], stored
    assert said == [("where is my parcel?",), ("are you there?",)]
    assert (live, archived) == ([("a",)], [("b",)])


def _started(store: Store, **kw: Any) -> Conversations:
    """A conversation stage over ``store``, started, taking its commits."""
    stage = local_stage(store, SETTINGS, **kw)
    stage.start()
    store.on_commit(stage.on_commit)
    return stage


def _taken(store: Store, stage: Conversations, batch: Any) -> None:
    """Commit ``batch``, and wait until the stage has taken it in."""
    store.submit(spans=batch).result(30)
    assert stage.wait_idle(60)


def _read(store: Store, *queries: str) -> list[list[tuple[Any, ...]]]:
    cur = store.cursor()
    try:
        return [cur.execute(sql).fetchall() for sql in queries]
    finally:
        cur.close()


def test_a_backlog_goes_in_bounded_cycles_and_idle_conversations_end_between_them(tmp_path: Path) -> None:
    """A cycle takes at most CYCLE_GROUPS groups of commits: the conversations idle by the time the first
    commit held back arrived end before the next cycle, so a backlog does not hold all of its conversations
    in memory; and one whose next trace is among the held-back commits, within idle_timeout, stays open."""
    now = [1000.0]
    store = Store(tmp_path / "backlog.duckdb", clock=lambda: now[0])
    store.open()
    held: list[int] = []  # conversations in memory at each idle sweep

    class Watched(Conversations):
        def _sweep_idle(self, upto: float | None = None) -> None:
            held.append(len(self.map.convs))
            super()._sweep_idle(upto)

    settings = Settings.model_validate({"idle_timeout": "10s"})
    # Ingestion never looks paused: the commits queue up until a waiter (wait_idle) comes.
    stage = Watched(DuckData(store.cursor(), store), settings, clock=lambda: now[0], cache_spans=8,
                    pacing=store.pacing(idle_gap=3600.0, share=0.25, max_wait=3600.0, poll=0.02))
    stage.start()
    store.on_commit(stage.on_commit)
    try:
        for i in range(40):  # a conversation every 100 s, each idle before the next begins
            store.submit(spans=_chat_commit(f"c{i:02d}", i + 1, f"question {i}", f"answer {i}")).result(30)
            if i == 15:  # c15 goes on 5 s later, in the first commit the first cycle holds back
                now[0] += 5
                store.submit(spans=_chat_commit("c15", 1000, "and then?", "then this")).result(30)
            now[0] += 100
        now[0] += 1000
        assert stage.wait_idle(60)
    finally:
        stage.stop()
    cur = store.cursor()
    try:
        stored = cur.execute("SELECT conversation_id, state, ended_by, user_turns FROM conversations "
                             "ORDER BY 1").fetchall()
    finally:
        cur.close()
        store.close()
    assert stored == [(f"c{i:02d}", "ended", "idle", 2 if i == 15 else 1) for i in range(40)]
    assert stage.metrics.conversations_reopened.value() == 0
    # cache of 8 rows: groups of 2, cycles of at most 16 commits (one span each), each ending the
    # conversations of the cycle before
    assert len(held) >= 3 and max(held) <= 17, held
