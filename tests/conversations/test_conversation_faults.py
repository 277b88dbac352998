"""Faults in the conversation stage: bad content in a message, a reindex that fails, a stop while far behind.

Requests are built the way the OpenTelemetry SDK sends them (one trace per user
turn: the app's ``invoke_agent`` span with the conversation id and a ``chat``
span with the v1.37+ content attributes as JSON strings).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from collector.config import Conversations as Settings
from collector.conversations.duck import DuckData
from collector.conversations.stage import local_stage
from collector.conversations.archive import ArchiveFilter
from collector.conversations.reindex import Reindex
from collector.ingest.decode import parse_traces, span_batch
from collector.store import Store

from ..support.daemon import REPO, clean_env, run_cli, wait_conversations, wait_until
from ..support.wire import add_attributes, post

T0 = 1_764_478_800_000_000_000


def _text(role: str, text: str) -> dict[str, Any]:
    return {"role": role, "parts": [{"type": "text", "content": text}]}


def turn_request(turns: list[dict[str, Any]]) -> bytes:
    """One export request; each turn is ``{"conversation", "input", "output"}`` with the content
    attributes as JSON text (a turn may also give ``"system"``)."""
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    kv = rs.resource.attributes.add()
    kv.key, kv.value.string_value = "service.name", "shopbot"
    ss = rs.scope_spans.add()
    ss.scope.name = "opentelemetry.util.genai.handler"
    for i, turn in enumerate(turns):
        trace = (turn["trace"] if "trace" in turn else i + 1).to_bytes(16, "big")
        start = T0 + i * 1_000_000
        root = ss.spans.add()
        root.trace_id, root.span_id, root.name = trace, trace[8:], "invoke_agent ShopBot"
        root.start_time_unix_nano, root.end_time_unix_nano = start, start + 900_000
        chat = ss.spans.add()
        chat.trace_id, chat.span_id, chat.parent_span_id, chat.name = trace, (i + 1 << 32).to_bytes(8, "big"), \
            root.span_id, "chat gpt-4o-mini"
        chat.start_time_unix_nano, chat.end_time_unix_nano = start + 1000, start + 800_000
        attrs: dict[str, Any] = {"gen_ai.operation.name": "chat", "gen_ai.request.model": "gpt-4o-mini",
                                 "gen_ai.input.messages": turn["input"], "gen_ai.output.messages": turn["output"],
                                 "gen_ai.usage.input_tokens": 12, "gen_ai.usage.output_tokens": 5}
        if "system" in turn:
            attrs["gen_ai.system_instructions"] = turn["system"]
        add_attributes(root.attributes, {"gen_ai.operation.name": "invoke_agent",
                                         "gen_ai.conversation.id": turn["conversation"]})
        add_attributes(chat.attributes, attrs)
    return req.SerializeToString()


def plain_turn(conversation: str, user: str, answer: str, trace: int | None = None) -> dict[str, Any]:
    turn = {"conversation": conversation, "input": json.dumps([_text("user", user)]),
            "output": json.dumps([_text("assistant", answer)])}
    return turn if trace is None else {**turn, "trace": trace}


# Lone surrogates written as JSON escapes, as a JSON encoder does for text cut in the middle of a
# UTF-16 pair: in a message, in a tool call's arguments and in the system instructions.
BAD_TURN = {
    "conversation": "c-bad",
    "system": r'[{"type":"text","content":"Be kind \udfff"}]',
    "input": r'[{"role":"user","parts":[{"type":"text","content":"my order \ud800 is late"}]}]',
    "output": r'[{"role":"assistant","parts":[{"type":"text","content":"Let me check \udc00."},'
              r'{"type":"tool_call","id":"call_1","name":"lookup_order","arguments":{"order":"A-1\ud83d"}}],'
              r'"finish_reason":"tool_call"}]',
}
REPAIRED = [
    {"role": "user", "content": "my order \ufffd is late"},
    {"role": "assistant", "content": "Let me check \ufffd.",
     "tool_calls": [{"id": "call_1", "name": "lookup_order", "arguments": {"order": "A-1\ufffd"}}]},
]


def _record(daemon: Any, cid: str) -> tuple[int, Any]:
    return daemon.get("/api/conversations/" + urllib.parse.quote(cid, safe=""), check=False)


def _messages(record: dict[str, Any]) -> list[dict[str, Any]]:
    return [{k: v for k, v in m.items() if k in ("role", "content", "tool_calls")} for m in record["messages"]]


@pytest.mark.slow
def test_lone_surrogate_in_a_message_is_repaired_and_the_others_are_rebuilt_too(make_daemon: Any) -> None:
    daemon = make_daemon()
    body = turn_request([plain_turn("c-good", "hi there", "hello!"), BAD_TURN])
    status, _, _ = post(daemon.http, "/v1/traces", body)
    assert status == 200
    wait_conversations(daemon)
    status, record = _record(daemon, "c-bad")
    assert status == 200, record
    assert _messages(record) == REPAIRED
    assert record["system"] == "Be kind \ufffd"
    status, good = _record(daemon, "c-good")
    assert status == 200 and [m["content"] for m in good["messages"]] == ["hi there", "hello!"]
    assert "conversation update failed" not in daemon.output()


@pytest.mark.slow
def test_reindex_of_a_file_with_a_lone_surrogate_rebuilds_every_conversation(make_daemon: Any) -> None:
    daemon = make_daemon()
    turns = [plain_turn(f"c-{i}", f"question {i}", f"answer {i}") for i in range(3)] + [{**BAD_TURN, "trace": 9}]
    assert post(daemon.http, "/v1/traces", turn_request(turns))[0] == 200
    wait_conversations(daemon)
    assert daemon.stop() == 0
    res = run_cli("reindex", "--config", str(daemon.config_path))
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr and "reindexed: 4 conversations" in res.stdout
    assert daemon.query("SELECT count(*) FROM conversations") == [(4,)]
    daemon.start()
    status, record = _record(daemon, "c-bad")
    assert status == 200 and _messages(record) == REPAIRED
    assert all(_record(daemon, f"c-{i}")[0] == 200 for i in range(3))


# ---------------------------------------------------------------- reindex: nothing goes before the new is built


def _seed(path: Path, conversations: int, per_commit: int = 50, hours_apart: bool = False) -> None:
    """Store spans the way the daemon does, without its conversation stage (as if it was far behind); with
    ``hours_apart`` each commit comes an hour after the last, so that a rebuild ends the ones before it."""
    commits = iter(range(10**6))
    store = Store(path, clock=(lambda: 1_764_478_800.0 + 3600 * next(commits)) if hours_apart else time.time)
    store.open()
    try:
        for first in range(0, conversations, per_commit):
            turns = [plain_turn(f"c-{i}", f"question {i}", f"answer {i}", trace=i + 1)
                     for i in range(first, min(first + per_commit, conversations))]
            store.submit(spans=span_batch(parse_traces(turn_request(turns)))[0]).result(60)
    finally:
        store.close()


def _stored(store: Store, when: str = "updated_at") -> dict[str, list[tuple[Any, ...]]]:
    """What a reindex writes, but for when (``updated_at``: the swap's time)."""
    cur = store.cursor()
    try:
        return {table: cur.execute(f"SELECT * {f'EXCLUDE ({when}) ' if table == 'conversations' else ''}"
                                   f"FROM {table} ORDER BY ALL").fetchall()
                for table in ("conversations", "messages", "trace_conversations")}
    finally:
        cur.close()


def _reindex(store: Store, stop: threading.Event | None = None, **kw: Any) -> Reindex:
    job = Reindex(store, Settings(), **kw)
    job.prepare()
    if job.run(stop, on_progress=(lambda p: stop.set()) if stop is not None else None):
        cur = store.cursor()
        try:
            job.swap(cur)
        finally:
            cur.close()
    return job


def test_a_reindex_cut_off_midway_leaves_the_old_conversations_and_goes_on_from_there(tmp_path: Path) -> None:
    path = tmp_path / "t.duckdb"
    _seed(path, 6)
    store = Store(path)
    store.open()
    try:
        assert _reindex(store).progress.conversations == 6
        before = _stored(store)
        assert len(before["conversations"]) == 6 and len(before["messages"]) == 12

        cut = _reindex(store, threading.Event(), chunk=2)  # stopped after its first chunk
        assert (cut.progress.state, cut.progress.done, cut.progress.total) == ("stopped", 2, 6)
        assert _stored(store) == before

        resumed = _reindex(store, chunk=2)
        assert resumed.progress.resumed_from == 2 and resumed.progress.state == "finished"
        assert _stored(store) == before
        assert Reindex(store, Settings()).progress.resumed_from == 0  # nothing left to resume
    finally:
        store.close()


def test_a_reindex_that_archives_its_conversations_swaps_in_the_same_ones_with_their_filter(tmp_path: Path) -> None:
    """With no ended conversation kept keyed, the reindex's stage moves them to its archive, a chunk at a
    time, cut off and resumed too: the swap brings the archive and its filter, and the conversations are
    those of a reindex that keeps them all keyed."""
    path = tmp_path / "t.duckdb"
    _seed(path, 6, per_commit=1, hours_apart=True)
    store = Store(path)
    store.open()
    try:
        # In the same chunks (where messages are written follows them); the last conversation ends by the clock.
        _reindex(store, chunk=2)
        keyed = _stored(store, when="updated_at, closed_at")
        assert [r[5] for r in keyed["conversations"]] == ["ended"] * 6  # state
        assert _reindex(store, threading.Event(), chunk=2, conversations_kept=0).progress.state == "stopped"
        assert _reindex(store, chunk=2, conversations_kept=0).progress.resumed_from == 2
        assert _stored(store, when="updated_at, closed_at") == keyed
        cur = store.cursor()
        try:
            archived = [r[0] for r in cur.execute("SELECT conversation_id FROM archived_conversations").fetchall()]
            live = cur.execute("SELECT count(*) FROM live_conversations WHERE state = 'ended'").fetchall()
            assert sorted(ArchiveFilter(DuckData(cur).filter_layers()).maybe(archived)) == sorted(archived)
        finally:
            cur.close()
        assert len(archived) == 6 and live == [(0,)]
    finally:
        store.close()


@pytest.mark.slow
def test_reindex_interrupted_midway_keeps_the_old_conversations(make_daemon: Any) -> None:
    """Ctrl-C while the reindex rebuilds: one line, exit 1, the stored conversations as they were; run
    again, it goes on and ends with the same conversations."""
    daemon = make_daemon(start=False)
    _seed(daemon.duckdb, 6000, per_commit=200)
    assert run_cli("reindex", "--config", str(daemon.config_path)).returncode == 0
    same = "SELECT * EXCLUDE (updated_at) FROM conversations ORDER BY ALL"
    before = daemon.query(same)
    messages = daemon.query("SELECT count(*) FROM messages")
    assert len(before) == 6000

    proc = subprocess.Popen([sys.executable, "-m", "collector", "reindex", "--config", str(daemon.config_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(), cwd=REPO)
    assert proc.stderr is not None
    assert proc.stderr.read(len("rebuilding conversations")) == "rebuilding conversations"  # it has begun
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert "Traceback" not in err, err
    if proc.returncode != 0:  # it had not finished
        assert proc.returncode == 1 and "interrupted after" in err and len(err.strip().splitlines()) <= 2, err
        assert daemon.query(same) == before
        assert daemon.query("SELECT count(*) FROM messages") == messages
        again = run_cli("reindex", "--config", str(daemon.config_path))
        assert again.returncode == 0 and "resuming the reindex" in again.stderr, again.stderr
    assert daemon.query(same) == before


# ---------------------------------------------------------------- a stop while far behind


@pytest.mark.slow
def test_stop_while_far_behind_leaves_the_rest_to_the_next_start(make_daemon: Any) -> None:
    total = 12_000
    daemon = make_daemon(start=False)
    _seed(daemon.duckdb, total, per_commit=200)  # stored, and no conversation rebuilt yet
    daemon.start()
    status: dict[str, Any] = {}

    def first_part_written() -> bool:
        nonlocal status
        status = daemon.get("/api/status")[1]
        assert status["conversations_batch"] < status["committed_batch"], "caught up before the stop"
        return bool(status["conversations_batch"] > 0)

    wait_until(first_part_written, lambda: f"the catch-up to write its first part: {status}", timeout=120,
               interval=0.02)
    assert daemon.stop() == 0
    stopped = re.search(r"stopped before catching up: (\d+) traces left for the next start", daemon.output())
    assert stopped, daemon.output()[-3000:]
    left = int(stopped.group(1))
    # What was done is written whole and kept; the batch mark claims nothing that is not.
    done = daemon.query("SELECT count(*), count(*) FILTER (WHERE message_count = 2) FROM conversations")[0]
    assert done[0] == done[1] > 0 and 0 < left < total and done[0] + left >= total

    daemon.start()
    wait_conversations(daemon, timeout=300)
    assert re.findall(r"catching up on (\d+) traces", daemon.output())[-1] == str(left)
    assert daemon.stop() == 0
    assert daemon.query("SELECT count(*), sum(message_count) FROM conversations") == [(total, 2 * total)]
    assert daemon.query("SELECT content FROM messages WHERE conversation_id = 'c-7' ORDER BY seq") == [
        ("question 7",), ("answer 7",)]


def test_stop_leaves_commits_queued_behind_ingestion_to_the_next_start(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """The stage gives way to ingestion; commits it holds at stop are not worked off then, nor lost."""
    store = Store(tmp_path / "t.duckdb")
    store.open()
    try:
        # Ingestion always seems busy, so the stage holds every commit (as under a sustained load).
        stage = local_stage(store, Settings(), idle_gap=1e9, max_wait=1e9)
        stage.start()
        store.on_commit(stage.on_commit)
        for first in range(0, 300, 50):
            turns = [plain_turn(f"c-{i}", f"question {i}", f"answer {i}", trace=i + 1)
                     for i in range(first, first + 50)]
            store.submit(spans=span_batch(parse_traces(turn_request(turns)))[0]).result(60)
        with caplog.at_level("INFO", logger="tracejudge.conversations"):
            stage.stop()
        assert "stopped before catching up: 300 traces left for the next start" in caplog.text
        assert _stored(store)["conversations"] == []

        stage = local_stage(store, Settings())
        stage.start()
        assert stage.wait_idle(60)
        stage.stop()
        stored = _stored(store)
        assert len(stored["conversations"]) == 300 and len(stored["messages"]) == 600
    finally:
        store.close()


def test_a_conversation_that_cannot_be_rebuilt_costs_only_its_own_update(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A rebuild that raises (a bug meeting odd data): counted and logged, the others written all the same."""
    import collector.conversations.rebuild as stage_module

    real = stage_module.build_transcript
    broken = {"question 1"}

    def build(spans: list[dict[str, Any]], logs: list[dict[str, Any]], memo: Any = None) -> Any:
        if any(text in str(r.get("attributes")) for r in spans for text in broken):
            raise RuntimeError("odd data")
        return real(spans, logs, memo)

    monkeypatch.setattr(stage_module, "build_transcript", build)
    store = Store(tmp_path / "t.duckdb")
    store.open()
    try:
        stage = local_stage(store, Settings())
        stage.start()
        store.on_commit(stage.on_commit)
        assert stage.wait_idle(60)  # its catch-up done: each commit is rebuilt once
        turns = [plain_turn(f"c-{i}", f"question {i}", f"answer {i}", trace=i + 1) for i in range(3)]
        store.submit(spans=span_batch(parse_traces(turn_request(turns)))[0]).result(60)
        assert stage.wait_idle(60)
        cur = store.cursor()
        rows = dict(cur.execute("SELECT conversation_id, message_count FROM conversations").fetchall())
        assert rows == {"c-0": 2, "c-1": 0, "c-2": 2}  # c-1 listed, without messages
        reason = cur.execute("SELECT no_content_reason FROM conversations WHERE conversation_id = 'c-1'").fetchone()
        assert "could not be rebuilt (RuntimeError: odd data)" in reason[0]
        assert stage.status()["conversations_failed"] == 1

        # A later rebuild of a stored conversation that fails keeps the stored version.
        broken.add("question 0")
        more = [plain_turn("c-0", "question 0, again", "answer", trace=10), plain_turn("c-2", "more", "ok", trace=12)]
        store.submit(spans=span_batch(parse_traces(turn_request(more)))[0]).result(60)
        assert stage.wait_idle(60)
        rows = dict(cur.execute("SELECT conversation_id, message_count FROM conversations").fetchall())
        assert rows == {"c-0": 2, "c-1": 0, "c-2": 4}
        assert stage.status()["conversations_failed"] == 2
        cur.close()
        stage.stop()
    finally:
        store.close()


def test_a_write_that_fails_is_retried_from_the_stored_state(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A cycle whose write fails claims nothing: the stage starts again from what is stored."""
    store = Store(tmp_path / "t.duckdb")
    store.open()
    other = store.cursor()
    try:
        stage = local_stage(store, Settings())
        stage.start()
        store.on_commit(stage.on_commit)
        assert stage.wait_idle(60)
        other.execute("ALTER TABLE messages RENAME TO messages_away")  # every write of the stage fails
        with caplog.at_level("ERROR", logger="tracejudge.conversations"):
            turns = [plain_turn(f"c-{i}", f"question {i}", f"answer {i}", trace=i + 1) for i in range(3)]
            store.submit(spans=span_batch(parse_traces(turn_request(turns)))[0]).result(60)
            wait_until(lambda: "conversation update failed" in caplog.text, "the failed update logged", interval=0.02)
        other.execute("ALTER TABLE messages_away RENAME TO messages")
        assert stage.wait_idle(60)
        stage.stop()
        stored = _stored(store)
        assert [r[0] for r in stored["conversations"]] == ["c-0", "c-1", "c-2"] and len(stored["messages"]) == 6
        assert other.execute("SELECT value FROM tracejudge_state").fetchall() == [(str(store.batch_id),)]
    finally:
        other.close()
        store.close()
