"""Retention: what storage.retention lets go is deleted, and nothing else.

The data is real: conversations sent through the OpenTelemetry SDK to a real
daemon, judged on a code criterion (a failure opens a review item). The
sweeps then run on that file with a clock of the test's (in process), or in
the daemon on rows whose arrival times were moved back (a kill -9 among them).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import duckdb
import pytest
import yaml

from collector.cli.status import render
from collector.config import Config, ConfigError, Retention as Settings, load_config
from collector.conversations.archive import ConversationArchive
from collector.conversations.tables import SCHEMA as CONVERSATION_TABLES
from collector.conversations.duck import DuckData, archive_traces
from collector.evals.judging import PROGRESS_SCHEMA as PROGRESS_TABLE, utc
from collector.evals.verdicts import SCHEMA as VERDICT_TABLES
from collector.system.memory import INDEX_WARNING
from collector.metrics import Metrics
from collector.retention import (GATHER, IDLE_GAP, INTERVAL, RESCAN, ROWS, SETTLE, SHARE, SHARE_BEHIND, SOON,
                                 WAITING_AGAIN, Retention)
from collector.review.queue import SCHEMA as REVIEW_TABLES
from collector.store import Pacing, Store, Transaction

from ..forward.test_forward import forwarded, sink, traces
from ..forward.test_forward import send as forward_send
from ..support.daemon import DaemonProcess, base_config, run_cli, wait_conversations, wait_until
from ..support.online import persona, send

DAY = 86400.0
CRITERIA = """
criteria:
  - id: looks-orders-up
    version: 1
    kind: code
    check: tool_called
    name: lookup_order
"""
MEMORY = "24MB"  # DuckDB's limit in the test of a sweep's memory: it fails at 32MB when all are joined at once
# Rows of one conversation in every table it has rows in.
PER_CONVERSATION = ("conversations", "messages", "sampling_decisions", "verdicts", "eval_progress", "trace_map")


def sections(tmp_path: Path, **retention: Any) -> dict[str, Any]:
    (tmp_path / "criteria.yaml").write_text(CRITERIA, encoding="utf-8")
    out: dict[str, Any] = {"conversations": {"idle_timeout": "1s"}, "sampling": {"rate": 1.0},
                           "judges": {"criteria": [str(tmp_path / "criteria.yaml")]}}
    if retention:
        out["storage"] = {"retention": retention}
    return out


def judged(daemon: DaemonProcess, n: int) -> None:
    def done() -> bool:
        stats = daemon.get("/api/stats")[1]
        return bool(stats["criteria"]) and stats["criteria"][0]["judged"] >= n

    wait_until(done, f"{n} conversations judged", timeout=90)


def recorded(daemon: DaemonProcess, people: list[Any]) -> DaemonProcess:
    """Send ``people`` (lookup=False fails the criterion: a review item), wait until all are judged, stop."""
    send(daemon.grpc, people)
    judged(daemon, len(people))
    assert daemon.stop() == 0
    return daemon


def rows_of(daemon_or_store: Any, cid: str) -> dict[str, int]:
    sql = {t: f"SELECT count(*) FROM {t} WHERE conversation_id = ?" for t in PER_CONVERSATION}
    sql["spans"] = ("SELECT count(*) FROM span_records WHERE trace_id IN "
                    "(SELECT trace_id FROM trace_map WHERE conversation_id = ?)")
    if isinstance(daemon_or_store, Store):
        cur = daemon_or_store.cursor()
        try:
            return {t: cur.execute(q, [cid]).fetchone()[0] for t, q in sql.items()}
        finally:
            cur.close()
    return {t: daemon_or_store.query(q, [cid])[0][0] for t, q in sql.items()}


def one(store: Store, sql: str, params: list[Any] | None = None) -> Any:
    cur = store.cursor()
    try:
        return cur.execute(sql, params or []).fetchone()[0]
    finally:
        cur.close()


def open_retention(path: Path, clock: list[float], rows: int = ROWS, settle: float = SETTLE,
                   **settings: Any) -> tuple[Store, Retention]:
    store = Store(path)
    store.open()
    stage = Retention(store, Settings(**settings), Metrics(), clock=lambda: clock[0], max_wait=0, rows=rows,
                      settle=settle)
    stage.open()
    return store, stage


def scraped_behind(stage: Retention) -> float:
    """``tracejudge_retention_conversations_behind_seconds`` as /metrics renders it."""
    lines = [line for line in stage.metrics.render().splitlines()
             if line.startswith("tracejudge_retention_conversations_behind_seconds ")]
    assert len(lines) == 1, lines
    return float(lines[0].split()[1])


@pytest.mark.slow
@pytest.mark.parametrize("archived", [False, True])
def test_expired_spans_go_and_their_conversations_stay_until_they_expire_too(make_daemon: Any, tmp_path: Path,
                                                                             archived: bool) -> None:
    """With ``archived``, every trace has left the keyed trace map for ``trace_archive`` (as traces do
    after 200,000 newer ones), and every conversation the live table for ``archived_conversations`` (as
    ended ones do after 100,000 newer ones): retention finds and deletes them there alike."""
    daemon = recorded(make_daemon(**sections(tmp_path)), [persona(1, lookup=False), persona(2), persona(3)])
    ids = ["conv-001", "conv-002", "conv-003"]
    if archived:
        con = duckdb.connect(str(daemon.duckdb))
        try:
            with Transaction(con):
                archive_traces(con, 0)
            assert ConversationArchive(0).move(DuckData(con), held=()) == 3
            assert con.execute("SELECT count(*) FROM trace_conversations").fetchall() == [(0,)]
        finally:
            con.close()
    before = {cid: rows_of(daemon, cid) for cid in ids}
    assert all(b["spans"] > 0 and b["verdicts"] == 1 for b in before.values()), before
    assert daemon.query("SELECT conversation_id FROM review_items") == [("conv-001",)]
    # A conversation the evaluator has still to decide (as if it had stopped before it came to it):
    # its sampling rules may read its spans, and it must be judged.
    # settle=0: the range holds conv-003 at once (the next test waits for it to settle).
    store, stage = open_retention(daemon.duckdb, clock := [time.time() + 13 * DAY], settle=0, spans="14d",
                                  conversations="90d")
    try:
        cur = store.cursor()
        for table in ("eval_progress", "sampling_decisions", "verdicts"):
            cur.execute(f"DELETE FROM {table} WHERE conversation_id = 'conv-003'")
        cur.close()
        undecided = {**before["conv-003"], "eval_progress": 0, "sampling_decisions": 0, "verdicts": 0}
        assert stage.sweep() == {"spans": 0, "log_records": 0, "conversations": 0}  # nothing is 14 days old yet
        clock[0] += 2 * DAY
        deleted = stage.sweep()
        assert deleted["spans"] == before["conv-001"]["spans"] + before["conv-002"]["spans"]
        assert deleted["conversations"] == 0
        for cid in ids[:2]:  # transcripts, verdicts and review items stay
            assert rows_of(store, cid) == {**before[cid], "spans": 0}
        assert rows_of(store, "conv-003") == undecided  # its spans too
        assert stage.oldest["spans"] is not None and stage.oldest["conversations"] is not None

        clock[0] += 80 * DAY  # 95 days on
        assert stage.sweep()["conversations"] == 1  # only conv-002: conv-001 is reviewed, conv-003 undecided
        assert rows_of(store, "conv-002") == dict.fromkeys(before["conv-002"], 0)
        assert rows_of(store, "conv-001") == {**before["conv-001"], "spans": 0}
        assert rows_of(store, "conv-003") == undecided
    finally:
        stage.stop()
        store.close()

    # Without keep_reviewed the reviewed one goes too, its review item with it.
    store, stage = open_retention(daemon.duckdb, clock, spans="14d", conversations="90d", keep_reviewed=False)
    try:
        assert stage.sweep()["conversations"] == 1
        assert one(store, "SELECT count(*) FROM review_items") == 0
        assert one(store, "SELECT count(*) FROM conversations") == 1  # conv-003, still undecided
    finally:
        stage.stop()
        store.close()


@pytest.mark.slow
def test_a_conversation_whose_spans_expired_keeps_its_transcript_on_late_data_and_through_reindex(
        make_daemon: Any, tmp_path: Path) -> None:
    daemon = recorded(make_daemon(**sections(tmp_path)), [persona(1), persona(2)])
    shown = ["conversations", "show", "conv-001", "--config", str(daemon.config_path), "--json"]
    before = json.loads(run_cli(*shown).stdout)
    store, stage = open_retention(daemon.duckdb, [time.time() + 15 * DAY], spans="14d")
    try:
        assert stage.sweep()["spans"] > 0
    finally:
        stage.stop()
        store.close()

    # A new trace of conv-001 arrives: rebuilt from what is left, it would lose its first turns.
    daemon.start()
    send(daemon.grpc, [persona(1)])
    daemon.wait_output("the spans of its older traces were deleted")
    wait_conversations(daemon)
    assert daemon.stop() == 0
    after = json.loads(run_cli(*shown).stdout)
    assert after["messages"] == before["messages"]
    assert len(after["trace_ids"]) > len(before["trace_ids"])

    out = run_cli("reindex", "--config", str(daemon.config_path))
    assert out.returncode == 0, out.stderr
    assert "2 conversations kept as stored" in out.stdout, out.stdout
    assert json.loads(run_cli(*shown).stdout)["messages"] == before["messages"]


@pytest.mark.slow
def test_a_kill_during_deletion_loses_nothing_unexpired_and_leaves_no_half_deleted_conversation(
        make_daemon: Any, tmp_path: Path) -> None:
    old = [persona(i, lookup=i % 5 != 0) for i in range(1, 25)]
    daemon = recorded(make_daemon(**sections(tmp_path)), old)
    # Move every stored arrival 100 days back: to a daemon keeping 14 days of spans and 30 of
    # conversations, all of it has expired.
    back = "- INTERVAL 100 DAY"
    con = duckdb.connect(str(daemon.duckdb))
    for table in ("span_records", "log_records"):
        con.execute(f"UPDATE {table} SET received_at = received_at {back}")
    con.execute(f"UPDATE live_conversations SET last_arrival_at = last_arrival_at {back}, "
                f"first_arrival_at = first_arrival_at {back}")
    traces = dict(con.execute("SELECT trace_id, count(*) FROM span_records GROUP BY trace_id").fetchall())
    con.close()
    daemon.config["storage"]["retention"] = {"spans": "14d", "conversations": "30d"}
    daemon.config_path.write_text(yaml.safe_dump(daemon.config), encoding="utf-8")
    daemon.start()
    fresh = [persona(i) for i in range(100, 104)]
    send(daemon.grpc, fresh)
    wait_until(lambda: daemon.metric("tracejudge_retention_deleted_total") > 0, "retention to delete")
    daemon.kill9()

    def whole_or_gone(d: DaemonProcess) -> None:
        for cid in [p.conversation_id for p in old]:
            rows = rows_of(d, cid)
            if rows["conversations"]:
                assert all(rows[t] > 0 for t in ("messages", "sampling_decisions", "trace_map")), rows
            else:
                assert all(n == 0 for n in rows.values()), (cid, rows)
        orphans = d.query("SELECT count(*) FROM messages WHERE conversation_id NOT IN "
                          "(SELECT conversation_id FROM conversations)")
        assert orphans == [(0,)]
        left = dict(d.query("SELECT trace_id, count(*) FROM span_records GROUP BY trace_id"))
        assert all(left.get(t, 0) in (0, n) for t, n in traces.items()), "a trace's rows go together"

    whole_or_gone(daemon)
    daemon.start()  # the sweeps go on from where the kill left them
    wait_until(lambda: daemon.get("/api/status")[1]["storage"]["retention"]["sweeps"] > 0, "a whole sweep")
    judged(daemon, 4 + len(fresh))  # what is left: the four reviewed, and the fresh ones once judged
    status = daemon.get("/api/status")[1]["storage"]
    assert status["file_bytes"] > 0 and status["retention"]["spans"]["keep_seconds"] == 14 * DAY
    memory = daemon.get("/api/status")[1]["duckdb_memory"]
    assert memory["limit_bytes"] == 128_000_000 and memory["used_bytes"] >= memory["index_bytes"] > 0, memory
    assert daemon.metric('tracejudge_duckdb_memory_bytes{tag="ART_INDEX"}') > 0
    in_use = daemon.metric('tracejudge_allocator_bytes{kind="duckdb_allocated"}')
    assert 0 < in_use <= daemon.metric('tracejudge_allocator_bytes{kind="duckdb_resident"}')
    text = run_cli("status", "--config", str(daemon.config_path))
    assert text.returncode == 0, text.stderr
    assert "spans" in text.stdout and "kept 14d" in text.stdout and "running at" in text.stdout, text.stdout
    assert "of 128.0 MB (storage.memory_limit); key indexes" in text.stdout, text.stdout
    assert "deletion caught up" in text.stdout, text.stdout
    assert "deletion of ended conversations caught up" in text.stdout, text.stdout
    assert status["retention"]["behind_seconds"] == 0 and daemon.metric("tracejudge_retention_behind_seconds") == 0
    assert daemon.metric("tracejudge_retention_conversations_behind_seconds") == 0
    assert daemon.stop() == 0
    whole_or_gone(daemon)
    assert daemon.query("SELECT count(*) FROM span_records WHERE received_at < now() - INTERVAL 14 DAY") == [(0,)]
    reviewed = {r[0] for r in daemon.query("SELECT DISTINCT conversation_id FROM review_items")}
    assert reviewed == {p.conversation_id for p in old if p.conversation_id[-1] in "05"}
    kept = {r[0] for r in daemon.query("SELECT conversation_id FROM conversations")}
    assert kept == reviewed | {p.conversation_id for p in fresh}
    for p in fresh:  # nothing unexpired is touched
        rows = rows_of(daemon, p.conversation_id)
        assert all(n > 0 for n in rows.values()), rows
    text = run_cli("status", "--config", str(daemon.config_path))  # from the file, the daemon stopped
    assert "not running" in text.stdout and "kept 30d" in text.stdout, text.stdout
    assert "deletion caught up" in text.stdout, text.stdout
    as_json = json.loads(run_cli("status", "--config", str(daemon.config_path), "--json").stdout)
    assert as_json["storage"]["retention"]["behind_seconds"] == 0


def test_retention_settings_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "otel-config.yaml"
    path.write_text("storage:\n  retention:\n    spans: 14\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"storage\.retention\.spans.*no unit"):
        load_config(path)
    path.write_text("storage:\n  retention:\n    span: 14d\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="span"):
        load_config(path)
    path.write_text("conversations: {idle_timeout: 1h}\nstorage:\n  retention: {conversations: 30m}\n",
                    encoding="utf-8")
    with pytest.raises(ConfigError, match="must be at least conversations.idle_timeout"):
        load_config(path)
    cfg = Config.model_validate({"storage": {"retention": {"spans": "14d"}}})
    assert cfg.storage.retention.spans == 14 * DAY and cfg.storage.retention.conversations is None


def test_without_retention_the_daemon_says_the_file_grows(make_daemon: Any) -> None:
    daemon = make_daemon()
    daemon.wait_output("storage.retention is not set: nothing is ever deleted")
    assert daemon.get("/api/status")[1]["storage"]["retention"]["spans"]["keep_seconds"] is None
    assert daemon.metric("tracejudge_retention_deleted_total") == 0


@pytest.mark.slow
def test_spans_queued_for_an_exporter_are_forwarded_after_retention_deleted_them(tmp_path: Path) -> None:
    """The forward queue keeps its own copy of each request: retention may delete the spans' rows while a
    backend is down, and the backend still gets every request once it is back."""
    with sink() as backend:
        down = True
        backend.answer = lambda r: (503, {"Retry-After": "1"}) if down else (200, {})
        cfg = base_config(tmp_path, exporters={"raw": {"type": "otlphttp", "endpoint": f"{backend.base}/v1/traces"}},
                          conversations={"idle_timeout": "1s"})
        daemon = DaemonProcess(tmp_path, cfg).start()
        try:
            # Three traces with content and no id: three conversations of their own, which end at once.
            sent = [traces(seed, conversation=None) for seed in (1, 2, 3)]
            for body in sent:
                assert forward_send(daemon, body) == 200
            wait_until(lambda: forwarded(daemon, "raw")["retried"] >= 1, "the sender retrying")
            wait_conversations(daemon)  # retention deletes only what the conversation stage has taken in
            # ... and the spans of conversations ended and decided on by the evaluator.
            wait_until(lambda: daemon.metric("tracejudge_eval_sampling_decisions_total") == 3, "3 decisions")
            assert daemon.stop() == 0
            store, stage = open_retention(daemon.duckdb, [time.time() + 2 * DAY], spans="1d")
            try:
                assert stage.sweep()["spans"] == 12
                assert one(store, "SELECT count(*) FROM span_records") == 0
            finally:
                stage.stop()
                store.close()
            daemon.start()
            assert forwarded(daemon, "raw")["queued_requests"] >= 1
            down = False
            wait_until(lambda: forwarded(daemon, "raw")["queued_requests"] == 0, "the queue emptied")
            assert b"".join(backend.delivered()) == b"".join(sent), "every request once, in order"
            assert daemon.stop() == 0
        finally:
            daemon.end()


@pytest.mark.slow
def test_a_sweep_passes_over_expired_conversations_still_due_in_bounded_duckdb_memory(make_daemon: Any,
                                                                                       tmp_path: Path) -> None:
    """After a backlog, many expired conversations wait for the evaluator while DuckDB works at its memory
    limit beside the stages catching up. A sweep passes over them to the ones it may delete, with memory
    for a window of them: joined whole, 300,000 of them took more DuckDB memory than this limit."""
    daemon = recorded(make_daemon(**sections(tmp_path)), [persona(1), persona(2)])
    clock = [time.time() + 95 * DAY]
    con = duckdb.connect(str(daemon.duckdb))
    # Older than both, expired, ended and sampled, not judged yet.
    con.execute("INSERT INTO live_conversations (conversation_id, state, revision, last_arrival_at) "
                "SELECT 'waiting-' || md5(i::VARCHAR), 'ended', 1, now() - INTERVAL 1 DAY FROM range(300000) t(i)")
    con.execute("INSERT INTO sampling_decisions (conversation_id, revision, sampled, probability, decided_at) "
                "SELECT conversation_id, 1, true, 1.0, now() FROM conversations WHERE conversation_id LIKE 'waiting-%'")
    con.close()
    store = Store(daemon.duckdb, memory_limit=MEMORY)
    store.open()
    stage = Retention(store, Settings(conversations="90d"), Metrics(), clock=lambda: clock[0], max_wait=0)
    stage.open()
    try:
        assert stage.sweep()["conversations"] == 2
        assert one(store, "SELECT count(*) FROM conversations") == 300_000
        assert one(store, "SELECT count(*) FROM span_records") == 0
    finally:
        stage.stop()
        store.close()


@pytest.mark.slow
def test_under_ingestion_that_never_pauses_each_sweep_waits_for_its_share_only(make_daemon: Any,
                                                                             tmp_path: Path) -> None:
    """Above a few thousand spans/s ingestion never pauses, and retention runs on its share of the time
    alone. A sweep's last piece must end with it: counted until the next sweep began, it took in the
    minute between them, and that sweep waited nine minutes (so under a steady load nothing was deleted).
    A sweep more than BEHIND seconds behind its horizon takes a larger share, and gives it back once caught up."""
    daemon = recorded(make_daemon(**sections(tmp_path)), [persona(1)])
    clock = [time.time() + 15 * DAY]
    store, stage = open_retention(daemon.duckdb, clock, spans="14d")
    # Always busy, by the same clock as the sweeps: a turn comes at once, or never on this frozen clock.
    stage.pacing = Pacing(lambda: 0.0, idle_gap=IDLE_GAP, share=SHARE, max_wait=0, poll=0.01,
                          clock=lambda: clock[0])
    try:
        assert stage.behind_seconds() > DAY - 60  # everything expired a day ago
        assert stage.sweep()["spans"] > 0
        assert stage.pacing.share == SHARE_BEHIND  # it was a day behind
        assert stage.behind_seconds() == 0
        clock[0] += INTERVAL  # the wait between two sweeps
        second = threading.Thread(target=stage.sweep, daemon=True)
        second.start()
        wait_until(lambda: not second.is_alive(), "the second sweep", timeout=30)
        assert stage.sweeps == 2
        assert stage.pacing.share == SHARE  # caught up
    finally:
        stage.stop()
        store.close()


def test_status_warns_when_key_indexes_hold_over_half_of_duckdbs_memory() -> None:
    kept = {"keep_seconds": None, "horizon": None, "oldest": None}
    body = {"daemon": "http://127.0.0.1:8318", "stages": {}, "queue_depth": 0, "committed_batch": 9,
            "conversations_batch": 9,
            "storage": {"path": "t.duckdb", "file_bytes": 10**9, "wal_bytes": 0,
                        "retention": {"spans": kept, "log_records": kept, "conversations": kept,
                                      "keep_reviewed": True}}}
    calm = render({**body, "duckdb_memory": {"used_bytes": 90 * 10**6, "index_bytes": 40 * 10**6,
                                             "limit_bytes": 128 * 10**6}})
    assert "90.0 MB of 128.0 MB (storage.memory_limit); key indexes 40.0 MB" in calm
    assert INDEX_WARNING not in calm
    full = render({**body, "duckdb_memory": {"used_bytes": 120 * 10**6, "index_bytes": 70 * 10**6,
                                             "limit_bytes": 128 * 10**6}})
    assert INDEX_WARNING in full
    assert "DuckDB memory" not in render(body)  # read from the file: no daemon, no memory to show


def test_a_sweep_warns_once_the_key_indexes_pass_half_of_duckdbs_memory(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """The conversations' key indexes grow with the conversations kept: the sweep (every minute, with or
    without retention) says so at half of storage.memory_limit, and again only at each further eighth."""
    caplog.set_level(logging.WARNING, logger="tracejudge.retention")
    store = Store(tmp_path / "t.duckdb", memory_limit="24MB")
    store.open()
    cur = store.cursor()
    try:  # the other stages' tables, as the daemon's start makes them
        for schema in (CONVERSATION_TABLES, VERDICT_TABLES, PROGRESS_TABLE.format(name="eval_progress")):
            cur.execute(schema)
    finally:
        cur.close()
    stage = Retention(store, Settings(), Metrics(), max_wait=0)
    stage.open()
    try:
        stage.sweep()
        assert INDEX_WARNING not in caplog.text
        cur = store.cursor()
        try:  # about 70 bytes of index each: 17 MB of the 24
            for lo in range(0, 250_000, 10_000):
                cur.execute("INSERT INTO live_conversations (conversation_id, state) "
                            "SELECT md5(i::VARCHAR), 'ended' FROM range(?, ?) t(i)", [lo, lo + 10_000])
        finally:
            cur.close()
        stage.sweep()
        assert caplog.text.count(INDEX_WARNING) == 1, caplog.text
        stage.sweep()
        assert caplog.text.count(INDEX_WARNING) == 1  # nothing grew: said once
    finally:
        stage.stop()
        store.close()


class CheckedPacing(Pacing):
    """Ingestion always idle; ``check`` runs before each of retention's transactions (between two commits)."""

    def __init__(self, check: Any) -> None:
        super().__init__(lambda: 10.0, idle_gap=IDLE_GAP, share=SHARE, max_wait=0, poll=0.01)
        self.check = check
        self.turns = 0

    def wait(self, stop: threading.Event | None = None) -> bool:
        self.turns += 1
        self.check()
        return super().wait(stop)


def span_counts(store: Store) -> dict[str, int]:
    """Span rows per trace (every trace of the map, 0 for one without rows)."""
    cur = store.cursor()
    try:
        return dict(cur.execute("SELECT m.trace_id, count(s.trace_id) FROM trace_map m LEFT JOIN span_records s "
                                "USING (trace_id) GROUP BY m.trace_id").fetchall())
    finally:
        cur.close()


@pytest.mark.slow
def test_a_burst_is_swept_by_the_sweep_due_at_its_expiry_a_range_at_a_time_each_trace_whole(
        make_daemon: Any, tmp_path: Path) -> None:
    """The sweep after data expires is due when it expires (not a minute later), and deletes all of it however
    many ranges of commits it takes. One trace's rows are split over two commits here, the second one
    range later: it is held until both are swept, then goes whole. Between any two transactions every
    trace has all its rows or none."""
    daemon = recorded(make_daemon(**sections(tmp_path)), [persona(i) for i in range(1, 7)])
    con = duckdb.connect(str(daemon.duckdb))
    try:  # the last span of conv-001's first trace arrives in a commit of its own, after all the others
        [(split, last)] = con.execute(
            "SELECT trace_id, max(span_id) FROM span_records WHERE trace_id = (SELECT min(trace_id) FROM trace_map "
            "WHERE conversation_id = 'conv-001') GROUP BY trace_id").fetchall()
        [(top, newest)] = con.execute("SELECT max(batch_id), max(received_at) FROM span_records").fetchall()
        con.execute("UPDATE span_records SET batch_id = ?, received_at = ? WHERE span_id = ?", [top + 1, newest, last])
        con.execute("UPDATE trace_conversations SET last_batch = ? WHERE trace_id = ?", [top + 1, split])
        con.execute("UPDATE tracejudge_state SET value = ? WHERE key = 'conversations.batch'", [str(top + 1)])
        [(first,)] = con.execute("SELECT epoch(min(received_at)) FROM span_records").fetchall()
    finally:
        con.close()
    clock = [first + 14 * DAY - 10]
    store, stage = open_retention(daemon.duckdb, clock, spans="14d", rows=1)  # a commit per range
    before = span_counts(store)
    assert before[split] >= 2 and all(before.values()), before

    def whole_or_gone() -> None:
        now = span_counts(store)
        assert all(now[t] in (0, n) for t, n in before.items()), {t: n for t, n in now.items() if n != before[t]}

    stage.pacing = pacing = CheckedPacing(whole_or_gone)
    try:
        assert stage.sweep()["spans"] == 0  # 10 s before the first expires
        assert SOON <= stage.next_sweep() <= 10 + 1e-6  # due when it expires (arrival times are kept to the µs)
        assert stage.behind_seconds() == 0
        clock[0] += 11 + INTERVAL  # all expired; one sweep, a range of one commit at a time
        assert stage.behind_seconds() > INTERVAL - 1
        assert stage.sweep()["spans"] == sum(before.values())
        whole_or_gone()
        assert pacing.turns >= top + 1  # a transaction per commit, the split trace's held in between
        assert stage.behind_seconds() == 0 and stage.status()["storage"]["retention"]["held_traces"] == 0
        assert stage.next_sweep() == INTERVAL  # nothing stored is left to expire
        for cid in (f"conv-{i:03d}" for i in range(1, 7)):  # transcripts stay
            assert rows_of(store, cid)["messages"] > 0
    finally:
        stage.stop()
        store.close()


@pytest.mark.slow
def test_spans_of_a_conversation_open_unsampled_or_due_for_judgement_are_held_until_it_may_go(
        make_daemon: Any, tmp_path: Path) -> None:
    """conv-001 is still open, conv-002 has no sampling decision yet, conv-003 is due for judgement (its
    judgement lost, as if the evaluator had stopped before it). Most of the range waits for them: the sweep
    waits SETTLE seconds for them to end and be judged, then deletes the rest and holds their spans whole;
    once each has ended, been sampled and been judged, the next sweep deletes them."""
    daemon = recorded(make_daemon(**sections(tmp_path)), [persona(i) for i in range(1, 5)])
    clock = [time.time() + 15 * DAY]
    store, stage = open_retention(daemon.duckdb, clock, spans="14d")
    before = {f"conv-{i:03d}": rows_of(store, f"conv-{i:03d}") for i in range(1, 5)}
    cur = store.cursor()
    try:
        cur.execute("CREATE TEMP TABLE saved_decisions AS SELECT * FROM sampling_decisions "
                    "WHERE conversation_id = 'conv-002'")
        cur.execute("CREATE TEMP TABLE saved_progress AS SELECT * FROM eval_progress WHERE conversation_id = 'conv-003'")
        cur.execute("UPDATE live_conversations SET state = 'open' WHERE conversation_id = 'conv-001'")
        cur.execute("DELETE FROM sampling_decisions WHERE conversation_id = 'conv-002'")
        cur.execute("DELETE FROM eval_progress WHERE conversation_id = 'conv-003'")
        assert stage.sweep()["spans"] == 0  # three quarters of the range would be held: it waits for them
        assert stage.next_sweep() == WAITING_AGAIN
        clock[0] += SETTLE
        assert stage.sweep()["spans"] == before["conv-004"]["spans"]
        assert rows_of(store, "conv-004")["spans"] == 0
        for cid in ("conv-001", "conv-002", "conv-003"):
            assert rows_of(store, cid)["spans"] == before[cid]["spans"], cid
        traces = sum(before[c]["trace_map"] for c in ("conv-001", "conv-002", "conv-003"))
        assert stage.status()["storage"]["retention"]["held_traces"] == traces
        assert stage.behind_seconds() == 0  # held on purpose, not behind
        clock[0] += 60
        assert stage.sweep()["spans"] == 0  # nothing has changed for them

        cur.execute("UPDATE live_conversations SET state = 'ended' WHERE conversation_id = 'conv-001'")
        cur.execute("INSERT INTO sampling_decisions SELECT * FROM saved_decisions")
        cur.execute("INSERT INTO eval_progress SELECT * FROM saved_progress")
        assert stage.sweep()["spans"] == sum(before[c]["spans"] for c in ("conv-001", "conv-002", "conv-003"))
        assert one(store, "SELECT count(*) FROM span_records") == 0
        assert one(store, "SELECT count(*) FROM retention_held") == 0
    finally:
        cur.close()
        stage.stop()
        store.close()


# ------------------------------------------------------------ step 3 on a file made here: many conversations

T0 = 1_790_000_000.0  # the first conversation's last arrival (unix seconds)
OLD = 6_000  # conversations that arrive in the first minute, 100 a second, a commit per 100
NEW = 400  # conversations that arrive an hour later
# Expired ones each kept for a reason: still open, no sampling decision yet, due for judgement, due for a
# retry, reviewed (keep_reviewed).
KEPT = {"c-000100": "open", "c-000200": "unsampled", "c-000300": "due", "c-000400": "retry", "c-000500": "reviewed"}


def made_file(path: Path) -> None:
    """OLD + NEW ended conversations, as the stages leave them: a row, two messages, a sampling decision (a
    tenth sampled, judged, with a verdict), a trace of two spans and a log record in the conversation's
    commit; and a few of KEPT's kinds among the old ones."""
    store = Store(path)
    store.open()
    cur = store.cursor()
    try:
        for schema in (CONVERSATION_TABLES, VERDICT_TABLES, PROGRESS_TABLE.format(name="eval_progress"), REVIEW_TABLES):
            cur.execute(schema)
        cur.execute(f"CREATE TEMP TABLE made AS SELECT i, printf('c-%06d', i) AS cid, printf('t-%06d', i) AS tid, "
                    f"(i // 100 + 1)::UBIGINT AS batch, to_timestamp({T0} + CASE WHEN i < {OLD} THEN i / 100 "
                    f"ELSE 3600 + (i - {OLD}) / 100 END) AS arrived FROM range({OLD + NEW}) t(i)")
        cur.execute("INSERT INTO live_conversations (conversation_id, state, revision, first_arrival_at, "
                    "last_arrival_at, first_batch, messages_batch, content_captured) "
                    "SELECT cid, 'ended', 1, arrived, arrived, batch, batch, true FROM made")
        cur.execute("INSERT INTO messages (conversation_id, seq, role, content, first_batch) "
                    "SELECT cid, s, CASE s WHEN 0 THEN 'user' ELSE 'assistant' END, 'hi', batch FROM made, range(2) r(s)")
        cur.execute("INSERT INTO sampling_decisions (conversation_id, revision, sampled, probability, decided_at) "
                    "SELECT cid, 1, i % 10 = 0, 0.1, arrived FROM made")
        cur.execute("INSERT INTO eval_progress (conversation_id, revision, judged_at, errors, attempts) "
                    "SELECT cid, 1, arrived, 0, 1 FROM made WHERE i % 10 = 0")
        cur.execute("INSERT INTO verdicts (id, seq, conversation_id, criterion_id, criterion_version, judge_provider, "
                    "judge_model, transcript_sha256, result, evidence_verified, flagged, input_tokens, output_tokens, "
                    "inclusion_probability, judged_at, superseded) SELECT 'v-' || cid, i, cid, 'c', 1, 'code', 'code', "
                    "'x', 'fail', false, false, 0, 0, 0.1, arrived, false FROM made WHERE i % 10 = 0")
        cur.execute("INSERT INTO trace_conversations SELECT tid, cid, batch, batch FROM made")
        cur.execute("INSERT INTO span_records (trace_id, span_id, received_at, batch_id) "
                    "SELECT tid, tid || '-' || s, arrived, batch FROM made, range(2) r(s)")
        cur.execute("INSERT INTO log_records (log_id, trace_id, received_at, batch_id) "
                    "SELECT 'l-' || tid, tid, arrived, batch FROM made")
        cur.execute("INSERT OR REPLACE INTO tracejudge_state VALUES ('conversations.batch', "
                    "(SELECT max(batch)::VARCHAR FROM made))")
        kept = {why: cid for cid, why in KEPT.items()}
        cur.execute("UPDATE live_conversations SET state = 'open' WHERE conversation_id = ?", [kept["open"]])
        cur.execute("DELETE FROM sampling_decisions WHERE conversation_id = ?", [kept["unsampled"]])
        cur.execute("DELETE FROM eval_progress WHERE conversation_id = ?", [kept["due"]])
        cur.execute("UPDATE eval_progress SET retry_at = ?::TIMESTAMPTZ + INTERVAL 1 DAY, errors = 1 "
                    "WHERE conversation_id = ?", [utc(T0), kept["retry"]])
        cur.execute("INSERT INTO review_items (id, verdict_id, conversation_id, criterion_id, state, created_at) "
                    "VALUES (1, ?, ?, 'c', 'open', ?)", ["v-" + kept["reviewed"], kept["reviewed"], utc(T0)])
    finally:
        cur.close()
        store.close()


def conversation_rows(store: Store) -> dict[str, dict[str, int]]:
    """Each conversation's rows in every table that holds some (a conversation with none is left out)."""
    tables = {"conversations": "conversations", "messages": "messages", "decisions": "sampling_decisions",
              "progress": "eval_progress", "verdicts": "verdicts", "trace_map": "trace_map",
              "spans": "span_records JOIN trace_map USING (trace_id)",
              "logs": "log_records JOIN trace_map USING (trace_id)"}
    out: dict[str, dict[str, int]] = {}
    cur = store.cursor()
    try:
        for name, source in tables.items():
            for cid, n in cur.execute(f"SELECT conversation_id, count(*) FROM {source} GROUP BY ALL").fetchall():
                out.setdefault(cid, dict.fromkeys(tables, 0))[name] = n
    finally:
        cur.close()
    return out


def whole_rows(rows: dict[str, int], i: int) -> bool:
    """A made conversation's rows, all of them."""
    judged = int(i % 10 == 0)
    return rows == {"conversations": 1, "messages": 2, "decisions": 1, "progress": judged, "verdicts": judged,
                    "trace_map": 1, "spans": 2, "logs": 1}


def check_whole_or_gone(store: Store) -> dict[str, dict[str, int]]:
    """Every made conversation has all its rows or none, and every new one (unexpired) all of them;
    the spans and logs of no conversation are left behind either. Each one's rows, by conversation."""
    rows = conversation_rows(store)
    for i in range(OLD + NEW):
        cid = f"c-{i:06d}"
        if cid in KEPT:
            continue
        assert cid in rows or i < OLD, f"{cid}: unexpired, deleted"
        assert cid not in rows or whole_rows(rows[cid], i), (cid, rows[cid])
    assert one(store, "SELECT count(*) FROM span_records WHERE trace_id NOT IN (SELECT trace_id FROM trace_map)") == 0
    return rows


@pytest.mark.slow
def test_a_burst_of_expired_conversations_goes_in_one_sweep_of_bounded_transactions_and_what_is_kept_stays(
        tmp_path: Path) -> None:
    """6,000 conversations expire within a minute of each other (an hour after a burst of them): the sweep due
    when they expire deletes them all, a chunk a transaction, each conversation whole between any two;
    the expired ones still open, not sampled, due for judgement or a retry, or reviewed, stay whole, as do
    the unexpired ones. Once the first four may go, the next pass from the oldest deletes them."""
    made_file(path := tmp_path / "t.duckdb")
    clock = [T0 + 3600 - 10]  # 10 s before the first expires
    chunk = 1000
    store, stage = open_retention(path, clock, conversations="1h")
    stage.chunk, stage.window = chunk, 2 * chunk
    stage.pacing = pacing = CheckedPacing(lambda: check_whole_or_gone(store))
    try:
        assert stage.sweep()["conversations"] == 0
        assert stage.conversations_behind_seconds() == 0
        assert SOON <= stage.next_sweep() <= GATHER  # due when the first expires, GATHER apart at most
        clock[0] += 10 + 60 + GATHER  # all OLD expired, none of NEW
        assert stage.conversations_behind_seconds() > 60
        assert scraped_behind(stage) > 60
        pacing.turns = 0
        deleted = stage.sweep()
        assert deleted == {"spans": 2 * (OLD - len(KEPT)), "log_records": OLD - len(KEPT),
                           "conversations": OLD - len(KEPT)}
        # A transaction a chunk, and a read past the last: bounded by the chunk, not a conversation's rows.
        assert pacing.turns <= -(-(OLD - len(KEPT)) // chunk) + 2, pacing.turns
        rows = check_whole_or_gone(store)
        assert set(rows) == set(KEPT) | {f"c-{i:06d}" for i in range(OLD, OLD + NEW)}
        assert stage.conversations_behind_seconds() == 0  # the kept ones are passed over on purpose
        assert stage.status()["storage"]["retention"]["conversations"]["behind_seconds"] == 0
        assert scraped_behind(stage) == 0
        assert one(store, "SELECT count(*) FROM review_items") == 1

        # Each one kept may go now, but the reviewed: the pass that finds them is the next from the oldest.
        cur = store.cursor()
        try:
            cur.execute("UPDATE live_conversations SET state = 'ended' WHERE conversation_id = 'c-000100'")
            cur.execute("INSERT INTO sampling_decisions (conversation_id, revision, sampled, probability, decided_at) "
                        "VALUES ('c-000200', 1, false, 0.1, now())")
            cur.execute("INSERT INTO eval_progress (conversation_id, revision, judged_at, errors, attempts) "
                        "VALUES ('c-000300', 1, now(), 0, 1)")
            cur.execute("UPDATE eval_progress SET retry_at = NULL WHERE conversation_id = 'c-000400'")
        finally:
            cur.close()
        clock[0] += GATHER
        assert stage.sweep()["conversations"] == 0  # after the last one passed: nothing new has expired
        clock[0] += RESCAN
        assert stage.sweep()["conversations"] == 4
        assert set(conversation_rows(store)) - {f"c-{i:06d}" for i in range(OLD, OLD + NEW)} == {"c-000500"}
    finally:
        stage.stop()
        store.close()


@pytest.mark.slow
def test_a_sweep_that_meets_the_stage_moving_the_same_traces_goes_again_without_an_error(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The conversation stage moves the oldest traces of its trace map to the archive (``archive_traces``) while
    retention deletes the oldest conversations with their traces: DuckDB's "Conflict on tuple deletion!"
    rolls the sweep's transaction back whole. That is no error (before, one with its traceback in every
    10-minute soak): a line at info, not counted, and the next sweep a second later deletes what is due."""
    made_file(path := tmp_path / "t.duckdb")
    clock = [T0 + 3600 + 60 + GATHER]  # all OLD expired
    store, stage = open_retention(path, clock, conversations="1h")
    stage.chunk, stage.window = 1000, 2000
    stage_cur = store.cursor()
    try:
        stage_cur.execute("BEGIN")  # the stage's move of one old trace, not committed yet
        stage_cur.execute("INSERT INTO trace_archive SELECT * FROM trace_conversations WHERE trace_id = 't-000001'")
        stage_cur.execute("DELETE FROM trace_conversations WHERE trace_id = 't-000001'")
        caplog.set_level(logging.INFO, logger="tracejudge")
        with pytest.raises(duckdb.TransactionException, match="Conflict") as raised:
            stage.sweep()
        try:
            raise raised.value
        except duckdb.TransactionException as exc:
            assert stage.sweep_failed(exc) == SOON
        assert [r.levelno for r in caplog.records if r.name.startswith("tracejudge")] == [logging.INFO]
        assert "rolled back" in caplog.records[-1].getMessage()
        assert 'tracejudge_stage_errors_total{stage="retention"} 0' in stage.metrics.render()
        assert len(conversation_rows(store)) == OLD + NEW  # nothing of the rolled-back chunk went
        stage_cur.execute("COMMIT")
        assert stage.sweep()["conversations"] == OLD - len(KEPT)
        check_whole_or_gone(store)
    finally:
        stage_cur.close()
        stage.stop()
        store.close()


CHILD = """
import sys, time
from pathlib import Path
from collector.config import Retention as Settings
from collector.metrics import Metrics
from collector.retention import Retention
from collector.store import Pacing, Store

class Told(Pacing):
    def wait(self, stop=None):
        print("turn", flush=True)
        return super().wait(stop)

store = Store(Path(sys.argv[1]))
store.open()
stage = Retention(store, Settings(conversations="1h"), Metrics(), clock=lambda: float(sys.argv[2]), chunk=50,
                  window=100)
stage.open()
stage.pacing = Told(lambda: 10.0, idle_gap=0.1, share=1.0, max_wait=0, poll=0.01)
stage.sweep()
print("swept", flush=True)
time.sleep(60)
"""


@pytest.mark.slow
@pytest.mark.parametrize("turns", [3, 40])
def test_a_kill_during_a_conversation_delete_loses_nothing_unexpired_and_leaves_each_conversation_whole_or_gone(
        tmp_path: Path, turns: int) -> None:
    """A process sweeping expired conversations 50 a transaction is killed (SIGKILL) after ``turns`` of its
    transactions have begun, wherever it is: every conversation has all its rows or none, nothing unexpired
    has gone, and the next sweep deletes the rest."""
    made_file(path := tmp_path / "t.duckdb")
    now = T0 + 3600 + 70
    with subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(now)], stdout=subprocess.PIPE, text=True,
                          cwd=Path(__file__).resolve().parents[2]) as child:
        try:
            assert child.stdout is not None
            seen = 0
            for line in child.stdout:
                seen += line.startswith("turn")
                assert not line.startswith("swept"), "the sweep ended before the kill"
                if seen >= turns:
                    break
            time.sleep(0.05 * (turns % 7))  # somewhere in a transaction, or between two
        finally:
            child.kill()  # SIGKILL
            child.wait()
    clock = [now]
    store, stage = open_retention(path, clock, conversations="1h")
    try:
        rows = check_whole_or_gone(store)
        assert len(rows) > len(KEPT) + NEW, "the kill came before any was deleted"
        assert OLD - len(KEPT) - (len(rows) - len(KEPT) - NEW) >= 50 * (turns - 2)  # those deleted are gone
        assert stage.sweep()["conversations"] == len(rows) - len(KEPT) - NEW
        assert set(check_whole_or_gone(store)) == set(KEPT) | {f"c-{i:06d}" for i in range(OLD, OLD + NEW)}
    finally:
        stage.stop()
        store.close()
