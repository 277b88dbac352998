"""Slow code checks against the real daemon: they record ``error`` and never stop ingestion or a SIGTERM.

A regex that backtracks for hours over a long user message (the patterns are
ones a team writes: ``(?i)refund.*guarantee``, ``(?s).*(<script|...).*``), or a
``python`` check that never returns, runs in a worker process of the daemon
under its criterion's ``timeout``. While one runs, ``/healthz``, OTLP/HTTP and
OTLP/gRPC answer; when it runs out of time its verdict is ``error``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from collector.demo.traffic import Persona, Turn

from ..support.daemon import wait_until
from ..support.online import send, wait_status
from ..support.wire import grpc_export, post, span_request_bytes

pytestmark = pytest.mark.slow  # each test waits for checks to run out of time in the daemon

NEVER_ENDS = """
criteria:
  - id: no-script-tags
    version: 1
    kind: code
    check: regex
    role: user
    pattern: "(?s).*(<script|javascript:).*"
    must: not_match
    timeout: 1h
"""

TIMED_OUT = """
criteria:
  - id: no-script-tags
    version: 1
    kind: code
    check: regex
    role: user
    pattern: "(?s).*(<script|javascript:).*"
    must: not_match
    timeout: 1s
  - id: refunds-short
    version: 1
    kind: code
    check: max_user_turns
    max: 3
    applies_if: {user_matches: "(?i)refund.*guarantee"}
    timeout: 1s
  - id: endless
    version: 1
    kind: code
    check: python
    function: endless_checks_for_tests:spin
    timeout: 1s
"""

CHECKS_PY = """
def spin(conversation):
    while True:
        pass
"""


def config(tmp_path: Path, criteria: str) -> dict[str, Any]:
    (tmp_path / "criteria.yaml").write_text(criteria, encoding="utf-8")
    (tmp_path / "endless_checks_for_tests.py").write_text(CHECKS_PY, encoding="utf-8")
    return {"conversations": {"idle_timeout": "1s"}, "sampling": {"rate": 1.0},
            "judges": {"criteria": [str(tmp_path / "criteria.yaml")]}}


def refund_storm(cid: str) -> Persona:
    """One turn whose user message (300 KiB) makes both regexes above backtrack for hours."""
    return Persona("storm", "en", "shop-test", [Turn("refund " * 43_000, "Let me look into it.")],
                   conversation_id=cid)


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def check_workers(parent: int) -> list[int]:
    """The daemon's check worker processes still running."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
            cmdline = (status.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if f"\nPPid:\t{parent}\n" in text and b"judges._check_process" in cmdline and alive(int(status.parent.name)):
            found.append(int(status.parent.name))
    return found


def test_while_a_check_runs_on_the_daemon_answers_and_stops_on_sigterm(make_daemon: Any, tmp_path: Path) -> None:
    daemon = make_daemon(**config(tmp_path, NEVER_ENDS))
    assert daemon.proc is not None
    send(daemon.grpc, [refund_storm("conv-storm")])
    wait_status(daemon, lambda s: s["evals_in_flight"] >= 1, what="the check under way")
    [worker] = wait_until(lambda: check_workers(daemon.proc.pid), "the check's worker process", interval=0.05)

    assert daemon.get("/healthz")[0] == 200
    status, _, body = post(daemon.http, "/v1/traces", span_request_bytes(4, trace_seed=71)[0])
    assert status == 200, body
    grpc_export(daemon.grpc, "traces", span_request_bytes(4, trace_seed=72)[0])
    # All along the check was running (its limit is an hour away).
    assert worker in check_workers(daemon.proc.pid)
    assert daemon.get("/api/status")[1]["evals_in_flight"] >= 1

    assert daemon.stop() == 0
    assert not alive(worker)
    assert "stopped cleanly" in daemon.output()


def test_checks_that_run_out_of_time_store_error_with_the_reason(make_daemon: Any, tmp_path: Path) -> None:
    daemon = make_daemon(**config(tmp_path, TIMED_OUT))
    send(daemon.grpc, [refund_storm("conv-storm")])
    wait_status(daemon, lambda s: s["evals_judged"] >= 1, what="the conversation judged")
    verdicts = daemon.get("/api/verdicts")[1]["verdicts"]
    assert sorted((v["criterion_id"], v["result"], v["error_reason"]) for v in verdicts) == [
        ("endless", "error", "timeout: check ran longer than 1s"),
        ("no-script-tags", "error", "timeout: check ran longer than 1s"),
        ("refunds-short", "error", "timeout: check ran longer than 1s"),
    ]
    stats = {c["criterion_id"]: c for c in daemon.get("/api/stats")[1]["criteria"]}
    assert {cid: (c["error"], c["pass"], c["errors"]) for cid, c in stats.items()} == {
        cid: (1, 0, {"timeout": 1}) for cid in ("endless", "no-script-tags", "refunds-short")}
    assert daemon.get("/healthz")[0] == 200
    assert daemon.stop() == 0
