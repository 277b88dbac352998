"""The conversation stage in its own process: killed, it starts again and catches up; it ends with the daemon.

The daemon runs its conversation stage in a child process whose statements it serves on its own
cursor. These tests go through the real daemon and the real OpenTelemetry SDK: the child is killed
with SIGKILL while conversations arrive, and every conversation must still be rebuilt, once.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from ..support.daemon import wait_conversations
from ..support.online import persona, send, wait_status


def _gone(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


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
