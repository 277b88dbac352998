"""Conversations stitched from their history when the bot sends no id (``collector.conversations.stitch``).

The captures of bots with their ids removed (``tests/fixtures/frameworks/cases/*-noid``) go through a
real store and the real conversation stage: in one commit, a commit per trace (in the order they
started, and with the turns of the two users who typed the same first message swapped), through the
stage process's pipe, across a restart of the stage, and by a reindex. The time window runs on
injected clocks.
"""

from __future__ import annotations

import gzip
import json
import logging
import urllib.parse
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from collector.config import Conversations as Settings
from collector.conversations import Conversations, conversation_record
from collector.conversations.stage import local_stage
from collector.conversations.reindex import Reindex
from collector.conversations.stitch import Opening, Stitcher, opening
from collector.conversations.transcript import Transcript, TranscriptMessage
from collector.ingest.batches import LogBatch, SpanBatch
from collector.ingest.decode import log_batch, parse_logs, parse_traces, span_batch
from collector.store import Store

from ..support.conversations import comparable_messages
from ..normalize.test_framework_captures import GAPS
from ..support.daemon import wait_conversations
from ..support.genai_fixtures import case_names
from ..support.served import Served, stage_on
from ..support.wire import replay

CASES = Path(__file__).resolve().parents[1] / "fixtures" / "frameworks" / "cases"


def _framework_sets_id(case: str) -> bool:
    """A noid capture whose framework gave each conversation an id of its own (pydantic-ai 2.x): nothing to
    stitch, its conversations are grouped by that id (``test_framework_captures``)."""
    conversations = json.loads((CASES / f"{case}.expected.json").read_text())["conversations"]
    return any(c["conversation_key"] for c in conversations)


# The noid captures whose every conversation the normalizer rebuilds exactly today (the others wait for
# their dialect: GAPS says what is missing); the first is the one the tests of one capture use.
EXACT = sorted((c for c in case_names(CASES) if c.endswith("-noid") and c not in GAPS and not _framework_sets_id(c)),
               key=lambda c: c != "openai-v2-chat-nowrapper-grpc-noid")
T0 = 1_764_478_800.0


def _records(case: str) -> tuple[SpanBatch, LogBatch]:
    """The capture's spans and log records (some instrumentations put the messages in logs)."""
    meta = json.loads((CASES / f"{case}.meta.json").read_text())
    spans, logs = SpanBatch(), LogBatch()
    for req in meta["export_requests"]:
        body = (CASES / req["file"]).read_bytes()
        if req.get("stored_gzip_compressed") or req["file"].endswith(".gz"):
            body = gzip.decompress(body)
        json_body = "json" in req["content_type"]
        if req["signal"] == "traces":
            batch, rejected, _ = span_batch(parse_traces(body, json_body))
            spans.extend(batch)
        else:
            assert req["signal"] == "logs"
            records, rejected, _ = log_batch(parse_logs(body, json_body))
            logs.extend(records)
        assert rejected == 0
    return spans, logs


def _by_trace(batch: SpanBatch, logs: LogBatch | None = None) -> dict[str, tuple[SpanBatch, LogBatch]]:
    """The batch (and the log records of each trace) cut into one per trace, in the order the traces started."""
    rows = batch.rows()
    starts: dict[str, int] = {}
    for r in rows:
        starts[r["trace_id"]] = min(starts.get(r["trace_id"], r["start_time_unix_nano"]), r["start_time_unix_nano"])
    log_rows = logs.rows() if logs else []
    out: dict[str, tuple[SpanBatch, LogBatch]] = {}
    for t in sorted(starts, key=lambda t: (starts[t], t)):
        idx = [i for i, r in enumerate(rows) if r["trace_id"] == t]
        lidx = [i for i, r in enumerate(log_rows) if r["trace_id"] == t]
        out[t] = (SpanBatch([[column[i] for i in idx] for column in batch.columns]),
                  LogBatch([[column[i] for i in lidx] for column in logs.columns]) if logs else LogBatch())
    return out


def _expected(case: str) -> list[dict[str, Any]]:
    return json.loads((CASES / f"{case}.expected.json").read_text())["conversations"]  # type: ignore[no-any-return]


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def _stage(store: Any, clock: Callable[[], float], **stitch: Any) -> Conversations:
    settings = Settings.model_validate({"stitch": stitch}) if stitch else Settings()
    stage = local_stage(store, settings, clock=clock)
    stage.start()
    return stage


def _stored(store: Store) -> dict[str, dict[str, Any]]:
    cur = store.cursor()
    try:
        ids = [r[0] for r in cur.execute("SELECT conversation_id FROM conversations ORDER BY 1").fetchall()]
        return {cid: record for cid in ids if (record := conversation_record(cur, cid)) is not None}
    finally:
        cur.close()


def _assert_as_expected(stored: dict[str, dict[str, Any]], case: str) -> None:
    expected = {f"trace:{c['trace_ids'][0]}": c for c in _expected(case)}
    assert {cid: sorted(r["trace_ids"]) for cid, r in stored.items()} == \
        {cid: sorted(c["trace_ids"]) for cid, c in expected.items()}
    for cid, conv in expected.items():
        record = stored[cid]
        assert record["grouped_by"] == "history", cid
        got, exp = comparable_messages(record["messages"], conv["messages"])
        assert got == exp, cid


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    clock = Clock()
    s = Store(tmp_path / "t.duckdb", clock=clock)
    s.open()
    s.test_clock = clock  # type: ignore[attr-defined]
    yield s
    s.close()


def _send(store: Store, stage: Conversations, batches: list[tuple[SpanBatch, LogBatch]], each: bool) -> None:
    if each:  # a cycle each: they arrive in this order
        for spans, logs in batches:
            store.submit(spans=spans, logs=logs).result(30)
            assert stage.wait_idle(60)
    else:
        whole, whole_logs = SpanBatch(), LogBatch()
        for spans, logs in batches:
            whole.extend(spans)
            whole_logs.extend(logs)
        store.submit(spans=whole, logs=whole_logs).result(30)
    assert stage.wait_idle(60)


@pytest.mark.parametrize("each", [False, True], ids=["one-commit", "a-commit-per-trace"])
@pytest.mark.parametrize("case", EXACT)
def test_noid_capture_is_stitched_into_one_conversation_per_user(store: Store, case: str, each: bool) -> None:
    clock = store.test_clock  # type: ignore[attr-defined]
    stage = _stage(store, clock)
    store.on_commit(stage.on_commit)
    try:
        _send(store, stage, list(_by_trace(*_records(case)).values()), each)
    finally:
        stage.stop()
    _assert_as_expected(_stored(store), case)


def test_stitched_through_the_stage_process_pipe(store: Store) -> None:
    """As in the daemon: the stage's statements run on the other side of a pipe, a commit per trace."""
    case = EXACT[0]
    served = Served(store, Settings())
    stage = stage_on(store, Settings(), served, clock=store.test_clock, cache_spans=8)
    stage.start()
    store.on_commit(stage.on_commit)
    try:
        _send(store, stage, list(_by_trace(*_records(case)).values()), each=True)
    finally:
        stage.stop()
        served.close()
    _assert_as_expected(_stored(store), case)


def _users(record: dict[str, Any]) -> list[str]:
    return [m["content"] for m in record["messages"] if m["role"] == "user"]


def test_two_users_who_typed_the_same_first_message_are_never_merged(store: Store) -> None:
    """carol and dave both open with "Hello, I need help with an order." and get the same answer; here
    dave's second turn comes before carol's. Each conversation holds one user's messages, once each."""
    case = EXACT[0]
    expected = {c["scenario"]: c for c in _expected(case)}
    traces = _by_trace(*_records(case))
    carol, dave = expected["carol"]["trace_ids"], expected["dave"]["trace_ids"]
    order = [carol[0], dave[0], *dave[1:], *carol[1:]]
    stage = _stage(store, store.test_clock)  # type: ignore[attr-defined]
    store.on_commit(stage.on_commit)
    try:
        _send(store, stage, [traces[t] for t in order], each=True)
    finally:
        stage.stop()
    stored = _stored(store)
    want = {tuple(m["content"] for m in c["messages"] if m["role"] == "user") for c in (expected["carol"],
                                                                                       expected["dave"])}
    got = {tuple(_users(r)) for r in stored.values() if set(r["trace_ids"]) & set(carol + dave)}
    assert got == want  # two conversations, each one user's whole
    for record in stored.values():
        mine = set(record["trace_ids"])
        # Their first turns are the same two messages: the one that started first is continued by the first
        # second turn to come (dave's here). Every later trace stays with its own user.
        assert not (mine & set(carol[1:]) and mine & set(dave[1:])), record["trace_ids"]


def test_no_stitch_beyond_the_window_nor_across_services(store: Store) -> None:
    """A turn that arrives more than stitch.window after its conversation's last data starts a conversation
    of its own (arrival times: the store's clock, never the spans')."""
    case = EXACT[0]
    expected = {c["scenario"]: c for c in _expected(case)}
    traces = _by_trace(*_records(case))
    bob = expected["bob"]["trace_ids"]
    clock = store.test_clock  # type: ignore[attr-defined]
    stage = _stage(store, clock, window="10m")
    store.on_commit(stage.on_commit)
    try:
        _send(store, stage, [traces[bob[0]]], each=True)
        clock.now += 599
        _send(store, stage, [traces[bob[1]]], each=True)  # within 10 minutes: stitched
        clock.now += 601
        _send(store, stage, [traces[bob[2]]], each=True)  # past it: alone
    finally:
        stage.stop()
    stored = _stored(store)
    assert sorted(r["trace_ids"] for r in stored.values()) == sorted([sorted(bob[:2]), [bob[2]]])
    assert stored[f"trace:{bob[2]}"]["grouped_by"] == "trace"

    # Across services: the same history from another service is not the same conversation.
    stitcher = Stitcher(window=60, kept=10)
    tr = _transcript("u1", "a1")
    op = opening(_transcript("u1", "a1", "u2", "a2"))
    assert op is not None
    stitcher.put("trace:a", "shop", _digest(tr), 1, 0.0)
    assert stitcher.find(op, 1.0) is None  # the opening's service is None
    stitcher.put("trace:b", None, _digest(tr), 1, 0.0)
    assert stitcher.find(op, 1.0) == "trace:b"
    assert stitcher.find(op, 61.0) is None


def _transcript(*texts: str, opening: int | None = None) -> Transcript:
    roles = ["user", "assistant"]
    messages = tuple(TranscriptMessage(role=roles[i % 2], content=t) for i, t in enumerate(texts))
    return Transcript(messages=messages, opening=len(texts) - 1 if opening is None else opening)


def _digest(tr: Transcript) -> bytes:
    from collector.conversations.stitch import answered

    digest = answered(tr.messages)
    assert digest is not None
    return digest


def test_the_rule() -> None:
    """Exact prefix of the first call's input, and more; the candidate answered; longest wins; equal ones go to
    the one that started first; a capacity of recent conversations."""
    stitcher = Stitcher(window=60, kept=2)
    stitcher.put("trace:hello", None, _digest(_transcript("hi", "hello")), 5, 0.0)
    stitcher.put("trace:twin", None, _digest(_transcript("hi", "hello")), 3, 0.0)
    op: Opening | None = opening(_transcript("hi", "hello", "order 7?", "shipped"))
    assert op is not None and stitcher.find(op, 0.0) == "trace:twin"  # equal: the one that started first
    assert stitcher.find(op, 0.0, exclude="trace:twin") == "trace:hello"
    # Another user's first turn resends only its own first message: never a continuation.
    first = opening(_transcript("hi", "hello"))
    assert first is not None and stitcher.find(first, 0.0) is None
    # Sent exactly the candidate's transcript, nothing more: not a continuation either.
    assert stitcher.find(opening(_transcript("hi", "hello", "again", opening=2)), 0.0) is None  # type: ignore[arg-type]
    # A different word anywhere in the history: no match.
    other = opening(_transcript("hi!", "hello", "order 7?", "shipped"))
    assert other is not None and stitcher.find(other, 0.0) is None
    # The longest match wins.
    stitcher.put("trace:long", None, _digest(_transcript("hi", "hello", "order 7?", "shipped")), 9, 0.0)
    longer = opening(_transcript("hi", "hello", "order 7?", "shipped", "thanks", "bye"))
    assert longer is not None and stitcher.find(longer, 0.0) == "trace:long"
    assert len(stitcher) == 2  # kept=2: the least recently put went
    # A conversation whose last message is the user's (its answer lost) is no candidate.
    from collector.conversations.stitch import answered

    assert answered(_transcript("hi").messages) is None


def test_stitching_survives_a_restart_and_a_reindex(store: Store, caplog: pytest.LogCaptureFixture) -> None:
    """The stage's memory of recent conversations is rebuilt from DuckDB at start; a reindex stitches the same.
    The log says once per service that traces come without an id, and how to set one."""
    caplog.set_level(logging.WARNING, logger="tracejudge.conversations")
    case = EXACT[0]
    traces = list(_by_trace(*_records(case)).values())
    clock = store.test_clock  # type: ignore[attr-defined]
    half = len(traces) // 2
    for part in (traces[:half], traces[half:]):  # the second half arrives after a restart of the stage
        stage = _stage(store, clock)
        store.on_commit(stage.on_commit)
        try:
            _send(store, stage, part, each=True)
        finally:
            stage.stop()
        clock.now += 30
    stored = _stored(store)
    _assert_as_expected(stored, case)
    warned = [r.getMessage() for r in caplog.records if "with no conversation id" in r.getMessage()]
    assert len(warned) == 2 and "shopbot-support" in warned[0] and "README.md" in warned[0]  # once per stage run

    job = Reindex(store, Settings(), clock=clock)
    job.prepare()
    assert job.run()
    cur = store.cursor()
    try:
        job.swap(cur)
    finally:
        cur.close()
    assert _stored(store) == stored


def _requests(case: str) -> list[dict[str, Any]]:
    """The capture's export requests as sent on the wire (``support.wire.replay`` takes them)."""
    meta = json.loads((CASES / f"{case}.meta.json").read_text())
    out = []
    for req in meta["export_requests"]:
        body = (CASES / req["file"]).read_bytes()
        if req.get("stored_gzip_compressed") and req.get("content_encoding") != "gzip":
            body = gzip.decompress(body)  # stored compressed, sent plain
        out.append({**req, "body": body})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", EXACT)
def test_the_daemon_stitches_a_noid_capture_over_the_wire(make_daemon: Any, case: str) -> None:
    """The real daemon on ephemeral ports, sent the capture as the bot sent it: the API lists one conversation
    per user, each record ``grouped_by: history``, and the log said once how to set an id."""
    daemon = make_daemon()
    for req in _requests(case):
        replay(req, daemon.grpc, daemon.http)
    wait_conversations(daemon)
    listed = daemon.get("/api/conversations?limit=100")[1]["conversations"]
    expected = {f"trace:{c['trace_ids'][0]}": c for c in _expected(case)}
    assert {c["conversation_id"]: c["grouped_by"] for c in listed} == {cid: "history" for cid in expected}
    stored = {cid: daemon.get("/api/conversations/" + urllib.parse.quote(cid, safe=""))[1] for cid in expected}
    _assert_as_expected(stored, case)
    assert daemon.output().count("with no conversation id") == 1


def test_an_id_written_as_the_text_of_nothing_is_no_id() -> None:
    """Logfire writes the Agents SDK's group_id=None as "null": taken as an id, it made every conversation one."""
    from collector.conversations.keys import conversation_key

    rows = [{"trace_id": "t", "span_id": "s", "attributes": json.dumps({"group_id": "null", "session.id": "None"}),
             "resource": "{}"}]
    assert conversation_key(rows, ["group_id", "session.id"]) is None
    rows[0]["attributes"] = json.dumps({"group_id": "null", "session.id": "s-1"})
    assert conversation_key(rows, ["group_id", "session.id"]) == "s-1"
