"""The conversation stage in its own process: killed, it starts again and catches up; it ends with the daemon.

The daemon runs its conversation stage in a child process whose statements it serves on its own
cursor. These tests go through the real daemon and the real OpenTelemetry SDK: the child is killed
with SIGKILL while conversations arrive, and every conversation must still be rebuilt, once.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest

from collector.cli.status import render
from collector.config import Conversations as Settings
from collector.conversations.process import Arrivals, StageProcess, Stall
from collector.metrics import Metrics

from ..support.daemon import run_cli, wait_conversations, wait_until
from ..support.online import persona, send, wait_status


def _gone(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.slow
def test_a_killed_stage_process_starts_again_and_catches_up(make_daemon: Any) -> None:
    daemon = make_daemon(conversations={"idle_timeout": "1h"})
    send(daemon.grpc, [persona(i) for i in range(3)])
    first = wait_conversations(daemon)["conversations_process"]
    assert first["pid"] and first["restarts"] == 0
    # The child leaves Arrow to the daemon, which builds the tables of its inserts: code it never loads.
    maps = Path(f"/proc/{first['pid']}/maps").read_text()
    assert "_duckdb" in maps and "nanoarrow" not in maps and "pyarrow" not in maps

    os.kill(first["pid"], signal.SIGKILL)
    send(daemon.grpc, [persona(i) for i in range(3, 6)])  # while it is down, or just back
    status = wait_status(daemon, lambda s: s["conversations_process"]["restarts"] == 1
                         and s["conversations_process"]["pid"] not in (0, first["pid"]), what="a new stage process")
    daemon.wait_output("the conversation stage's process ended (exit code -9)")
    wait_conversations(daemon)

    listed = daemon.get("/api/conversations?limit=100")[1]["conversations"]
    assert sorted(c["conversation_id"] for c in listed) == [f"conv-{i:03d}" for i in range(6)]
    for c in listed:
        record = daemon.get(f"/api/conversations/{c['conversation_id']}")[1]
        assert [m["role"] for m in record["messages"]].count("user") == 2, record
    assert daemon.metric("tracejudge_conversations_process_restarts_total") == 1
    assert daemon.metric("tracejudge_conversations_process_resident_memory_bytes") > 0

    pid = status["conversations_process"]["pid"]
    assert daemon.stop() == 0
    assert _gone(pid), "the stage's process outlived the daemon"
    assert "stopped cleanly" in daemon.output()


@pytest.mark.slow
def test_a_stage_that_falls_behind_shows_its_lag_and_the_log_warns_until_it_catches_up(make_daemon: Any) -> None:
    """Data arriving faster than the stage rebuilds it (here: its process stopped) must be visible to the
    operator: conversations end and are judged late. /api/status, /metrics and `tracejudge status` say
    how far behind they are, and the log warns once past conversations.lag_warning, then says when
    they caught up."""
    # Frozen here only to fall behind: not for long enough to count as stalled.
    daemon = make_daemon(conversations={"idle_timeout": "1h", "lag_warning": "1s", "stall_timeout": "1h"})
    send(daemon.grpc, [persona(0)])
    pid = wait_conversations(daemon)["conversations_process"]["pid"]
    assert daemon.metric("tracejudge_conversations_lag_commits") == 0
    assert daemon.metric("tracejudge_conversations_lag_seconds") == 0
    # A slow machine may have logged a short lag already: only what the log says from here on counts.
    start = len(daemon.output())

    def logged(text: str) -> int:
        return daemon.output()[start:].count(text)

    os.kill(pid, signal.SIGSTOP)  # it takes nothing in, while the daemon goes on storing
    try:
        send(daemon.grpc, [persona(i) for i in range(1, 4)])
        status = wait_status(daemon, lambda s: s["conversations_lag_seconds"] >= 1, what="a lag of a second")
        assert status["conversations_lag_commits"] >= 1
        assert "behind; the oldest arrived" in run_cli("status", "--config", str(daemon.config_path)).stdout
        wait_until(lambda: logged("behind ingestion ("), "the lag warning")
        assert daemon.metric("tracejudge_conversations_lag_commits") >= 1
        assert daemon.metric("tracejudge_conversations_lag_seconds") >= 1
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_conversations(daemon)
    wait_until(lambda: logged("conversations caught up with ingestion"), "the caught-up line")
    status = daemon.get("/api/status")[1]
    assert (status["conversations_lag_commits"], status["conversations_lag_seconds"]) == (0, 0)
    assert len(daemon.get("/api/conversations?limit=10")[1]["conversations"]) == 4
    assert logged("behind ingestion (") == 1  # once, not at every check


def _said(daemon: Any, cid: str) -> list[str]:
    record = daemon.get(f"/api/conversations/{cid}")[1]
    return [m["content"] for m in record["messages"] if m["role"] == "user"]


@pytest.mark.slow
def test_a_frozen_stage_process_is_found_stalled_restarted_and_catches_up(make_daemon: Any) -> None:
    """The stage's process frozen (SIGSTOP) while data arrives: the lag, from the daemon's own marks,
    grows on /metrics and /api/status; after conversations.stall_timeout /readyz answers 503 naming the
    stage, the log says so once, and the process is killed and started again; it catches up from its
    stored mark, with every conversation sent rebuilt, and /readyz is 200 again."""
    daemon = make_daemon(conversations={"idle_timeout": "1h", "stall_timeout": "2s"})
    sent = [persona(i) for i in range(6)]
    send(daemon.grpc, sent[:2])
    first = wait_conversations(daemon)["conversations_process"]
    assert first["restarts"] == 0 and daemon.get("/readyz")[0] == 200
    start = len(daemon.output())

    def logged(text: str) -> int:
        return daemon.output()[start:].count(text)

    os.kill(first["pid"], signal.SIGSTOP)
    try:
        send(daemon.grpc, sent[2:4])  # stored and acknowledged while the stage takes nothing in
        status = wait_status(daemon, lambda s: s["conversations_lag_commits"] >= 1
                             and s["conversations_lag_seconds"] > 0, what="a lag")
        lag = status["conversations_lag_seconds"]
        wait_until(lambda: daemon.metric("tracejudge_conversations_lag_seconds") > lag, "the lag to grow on /metrics")
        wait_status(daemon, lambda s: s["conversations_lag_seconds"] > lag, what="the lag to grow on /api/status")
        assert daemon.metric("tracejudge_conversations_lag_commits") >= 1

        # Each seen once while the stall lasts (until the new process has caught up), in either order.
        seen: dict[str, Any] = {}

        def stalled() -> bool:
            code, body = daemon.get("/readyz", check=False)
            if code == 503:
                seen["readyz"] = body
            status = daemon.get("/api/status")[1]
            if status["stages"]["conversations"].startswith("stalled: "):
                seen["status"] = status
                seen["metrics"] = daemon.get("/metrics")[1]
            return len(seen) == 3

        wait_until(stalled, lambda: f"the stall to show on /readyz and /api/status: {seen}\n{daemon.output()[-3000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):  # killed by the daemon, as it should be
            os.kill(first["pid"], signal.SIGCONT)
    error = seen["readyz"]["error"]
    assert error["code"] == "stage_stalled"
    assert error["message"].startswith("the conversations stage stalled (no progress for "), error
    assert " waiting; its process was killed and starts again)" in error["message"], error
    # `tracejudge status` says it too (its API client adds where the daemon listens).
    assert "conversations stalled: no progress for " in render({**seen["status"], "daemon": daemon.api})

    status = wait_status(daemon, lambda s: s["conversations_process"]["restarts"] == 1
                         and s["conversations_process"]["pid"] not in (0, first["pid"]), what="a new stage process")
    daemon.wait_output("the conversation stage's process ended (exit code -9)")
    send(daemon.grpc, sent[4:])  # to the new process
    wait_conversations(daemon)
    wait_until(lambda: daemon.get("/readyz", check=False)[0] == 200, "/readyz to answer 200 again")
    assert daemon.get("/api/status")[1]["stages"]["conversations"] == "running"

    listed = daemon.get("/api/conversations?limit=100")[1]["conversations"]
    assert sorted(c["conversation_id"] for c in listed) == [p.conversation_id for p in sent]
    for p in sent:
        assert _said(daemon, p.conversation_id) == [t.user for t in p.turns], p.conversation_id
    # Logged once, with the lag.
    assert logged("the conversation stage's process is stalled: it took in nothing for ") == 1
    assert re.search(r"is stalled: .* waited \(conversations.stall_timeout; conversations are .+ behind ingestion\)",
                     daemon.output()[start:])
    assert daemon.metric("tracejudge_conversations_process_restarts_total") == 1
    assert status["conversations_process"]["restarts"] == 1
    assert 'tracejudge_stage_running{stage="conversations"} 1' in seen["metrics"]  # stalled is not stopped


def test_the_stall_rule_counts_only_while_work_waits_and_nothing_is_taken_in() -> None:
    stall = Stall(timeout=30.0)
    stall.restart(now=1000.0)
    assert stall.check(waiting=0, behind=0.0, now=5000.0) is None  # idle: never stalled
    # Work waiting since the process started, none taken in: stalled once the timeout has passed.
    assert stall.check(waiting=3, behind=29.0, now=1029.0) is None
    assert stall.check(waiting=3, behind=31.0, now=1031.0) == 31.0
    # Work that starts waiting after a quiet spell counts from its arrival, not from the last progress.
    stall.reported(mark=7, now=1031.0)
    assert stall.check(waiting=1, behind=10.0, now=2000.0) is None
    assert stall.check(waiting=1, behind=30.0, now=2020.0) == 30.0
    # Reports that show the same mark are no progress; a mark that moves is.
    stall.reported(mark=7, now=2025.0)
    assert stall.check(waiting=2, behind=40.0, now=2030.0) == 40.0
    stall.reported(mark=8, now=2030.0)
    assert stall.check(waiting=2, behind=40.0, now=2059.0) is None
    assert stall.check(waiting=2, behind=70.0, now=2060.0) == 30.0
    # A new process has the whole timeout again, even behind a backlog.
    stall.restart(now=3000.0)
    assert stall.check(waiting=50, behind=900.0, now=3029.0) is None
    assert stall.check(waiting=50, behind=930.0, now=3030.0) == 30.0


class _Store:
    """What the daemon's side of the stage asks of its store, on a clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.batch_id = 0
        self.failure: str | None = None

    def clock(self) -> float:
        return self.now


class _Child:
    pid = 4242
    killed = 0

    def kill(self) -> None:
        self.killed += 1


def test_a_stalled_child_is_killed_once_and_readiness_named_until_the_stage_catches_up() -> None:
    store = _Store()
    stage = StageProcess(store, Settings(stall_timeout="30s"), Metrics())  # type: ignore[arg-type]
    child = _Child()
    stage._proc = child
    stage._stall.restart(store.now)

    def report(mark: int) -> None:  # as the reader does with the child's status
        stage._status["conversations_batch"] = mark
        stage._stall.reported(mark, store.now)
        stage._check_lag()

    report(0)
    store.now += 3600  # idle: nothing waits
    report(0)
    assert stage.stalled is None and child.killed == 0
    store.batch_id = 5
    stage._arrivals.add(1, store.now)
    store.now += 10
    report(2)  # progress
    store.now += 29
    stage._check_lag()
    assert stage.stalled is None
    # Waiting on a store that cannot commit, or on this side's answer, is not a stall.
    store.failure = "disk full"
    store.now += 60
    stage._check_lag()
    store.failure = None
    stage._answering = True
    store.now += 60
    stage._check_lag()
    stage._answering = False
    assert stage.stalled is None and child.killed == 0
    store.now += 31
    stage._check_lag()
    assert child.killed == 1
    assert stage.stalled == "no progress for 31 s with 3 commits waiting; its process was killed and starts again"
    assert stage.state == f"stalled: {stage.stalled}"
    stage._check_lag()
    assert child.killed == 1  # once per process
    # A new process: what was stored at the stall (commit 5) must be taken in before it is ready.
    store.batch_id = 7
    stage._proc = _Child()
    stage._stall.restart(store.now)
    report(4)
    assert stage.stalled is not None
    report(5)
    assert stage.stalled is None and stage.state == "not running"  # its thread was never started here


def test_arrivals_give_when_the_oldest_commit_not_taken_in_arrived_in_bounded_memory() -> None:
    arrivals = Arrivals(most=8, width=1.0)
    for batch in range(1, 5):  # four commits within a second: the first stands for them
        arrivals.add(batch, 100.0 + batch / 10)
    assert len(arrivals) == 1
    assert arrivals.arrival(3) == 100.1  # at most a width early
    assert arrivals.arrival(0) is None  # stored before any kept (before the daemon started)
    for batch in range(5, 105):  # a backlog: one commit a second
        arrivals.add(batch, 100.0 + batch)
        assert len(arrivals) <= 8
    arrival = arrivals.arrival(60)
    assert arrival is not None and 160.0 - 2 * 16 <= arrival <= 160.0  # early by at most the gap now kept
    last = arrivals.arrival(104)
    assert last is not None and 204.0 - 2 * 16 <= last <= 204.0
    # Caught up: one commit kept, and the width back to a second.
    arrivals.add(105, 300.0)
    arrivals.add(106, 300.5)
    assert arrivals.arrival(106) == 300.0
    arrivals.add(107, 302.0)
    assert arrivals.arrival(107) == 302.0
