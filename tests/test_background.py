"""Background stages that fail say so: a failed cycle is logged with its traceback, counted on
/metrics by stage, and the stage goes on; a stage that cannot go on is named by /readyz and
/api/status while the daemon keeps taking data."""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Any

import duckdb
import pytest
from aiohttp.test_utils import TestClient, TestServer

from collector.api.app import API
from collector.background import Stage
from collector.config import Config
from collector.metrics import Metrics
from collector.review import queue as review_queue
from collector.store import Store

from .support.daemon import wait_until
from .support.evaluator import Clock, add_conversation, make_evaluator, open_store, query, verdict


class Doomed(Stage):
    """A stage whose loop raises beyond one cycle (a bug outside the per-cycle handling)."""

    name = "doomed"

    def _run(self) -> None:
        raise RuntimeError("the loop itself broke")


class Flaky(Stage):
    """A stage whose first cycles raise, then succeed."""

    name = "flaky"

    def __init__(self, store: Store, metrics: Metrics, failures: int,
                 error: Exception = ValueError("a cycle met a bug")) -> None:
        super().__init__(store, metrics)
        self.failures = failures
        self.error = error
        self.cycles_ok = 0
        self.delays: list[float] = []

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                if self.failures:
                    self.failures -= 1
                    raise self.error
                self.cycles_ok += 1
                self.cycle_ok()
            except Exception:
                self.delays.append(self.cycle_failed("a cycle failed"))
                continue  # no wait: the test checks the delays it asks for
            self.stopping.wait(0.01)

    def _wake(self) -> None:
        pass


async def _ask(api: API, *paths: str) -> list[tuple[int, Any]]:
    """GET each path from the API app served on a loopback port: (status, JSON or text)."""
    client = TestClient(TestServer(api.app))
    await client.start_server()
    try:
        out: list[tuple[int, Any]] = []
        for path in paths:
            reply = await client.get(path)
            out.append((reply.status, await reply.json() if path != "/metrics" else await reply.text()))
        return out
    finally:
        await client.close()


@pytest.fixture
def store(tmp_path: Path) -> Any:
    s = Store(tmp_path / "t.duckdb")
    s.open()
    yield s
    s.close()


def test_a_failed_cycle_is_logged_counted_and_the_stage_goes_on(store: Store,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    metrics = Metrics()
    stage = Flaky(store, metrics, failures=3)
    with caplog.at_level(logging.ERROR, logger="tracejudge.stages"):
        stage.start()
        try:
            wait_until(lambda: stage.cycles_ok >= 2, "cycles after the failures")
            assert stage.state == "running" and stage.stopped is None
        finally:
            stage.stop()
    assert stage.delays == [1.0, 2.0, 4.0]  # doubling while cycles keep failing
    assert 'tracejudge_stage_errors_total{stage="flaky"} 3' in metrics.render()
    assert caplog.text.count("ValueError: a cycle met a bug") == 3  # each with its traceback
    assert stage.state == "not running"


def test_a_fatal_duckdb_error_in_a_cycle_stops_the_store(store: Store) -> None:
    """No retry can succeed on a file DuckDB invalidated: the store stops (the daemon exits for its supervisor
    to restart it), though nothing is being ingested for its writer to find out."""
    stopped = threading.Event()
    store.on_broken(lambda reason: stopped.set())
    stage = Flaky(store, Metrics(), failures=1, error=duckdb.FatalException("FATAL Error: out of memory"))
    stage.start()
    try:
        assert stopped.wait(30)
    finally:
        stage.stop()
    assert store.broken is not None and "FatalException: FATAL Error: out of memory" in store.broken


def test_a_stage_that_stopped_is_named_by_readyz_and_status(store: Store,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    metrics = Metrics()
    doomed, fine = Doomed(store, metrics), Flaky(store, metrics, failures=0)
    api = API(store, metrics, Config().api, stages=(doomed, fine))
    api.ready = True
    with caplog.at_level(logging.CRITICAL, logger="tracejudge.stages"):
        doomed.start()
        fine.start()
        wait_until(lambda: doomed.stopped is not None, "the doomed stage to stop")
    try:
        replies = asyncio.run(_ask(api, "/readyz", "/api/status", "/metrics"))
    finally:
        doomed.stop()
        fine.stop()
    (ready_status, ready), (_, status), (_, metrics_text) = replies
    assert ready_status == 503
    assert ready["error"]["code"] == "stage_stopped"
    assert "the doomed stage stopped (RuntimeError: the loop itself broke)" in ready["error"]["message"]
    assert status["stages"] == {"doomed": "stopped: RuntimeError: the loop itself broke", "flaky": "running"}
    assert 'tracejudge_stage_errors_total{stage="doomed"} 0' in metrics_text
    assert 'tracejudge_stage_running{stage="doomed"} 0' in metrics_text  # for an alert rule
    assert 'tracejudge_stage_running{stage="flaky"} 1' in metrics_text
    assert "the doomed stage stopped (RuntimeError: the loop itself broke)" in caplog.text
    assert "Traceback" in caplog.text


def test_the_evaluator_goes_on_after_a_cycle_that_raised_beyond_duckdb(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Once, storing a verdict raises a bug's error (not a DuckDB one): the evaluator used to end
    silently; now the cycle is logged and counted, and the verdict is stored on the next one."""
    s = open_store(tmp_path / "e.duckdb")
    clock = Clock()
    clock.now += 10
    opener = review_queue.item_opener(Config())
    raised: list[str] = []

    def on_stored(*args: Any) -> None:
        if not raised:
            raised.append("once")
            raise KeyError("a bug in what runs after storing")
        opener(*args)

    ev, _ = make_evaluator(s, tmp_path, clock, lambda request: verdict("pass", "Thank you kindly"),
                           on_stored=on_stored)
    add_conversation(s, "c1", "Thank you kindly")
    try:
        with caplog.at_level(logging.ERROR, logger="tracejudge.stages"):
            ev.start()
            wait_until(lambda: query(s, "SELECT count(*) FROM verdicts") == [(2,)], "the verdicts, stored on a retry")
            assert ev.state == "running"
        assert "evaluator stage: a cycle failed" in caplog.text and "KeyError" in caplog.text
        assert 'tracejudge_stage_errors_total{stage="evaluator"} 1' in ev.metrics.render()
    finally:
        ev.stop()
        s.close()


def test_what_each_stage_holds_in_memory_is_on_metrics(store: Store) -> None:
    """``tracejudge_stage_held{stage,what}``: the row cache, the trace map and the queues, read at scrape time."""
    from collector.config import Conversations as Settings
    from collector.conversations.stage import local_stage
    from collector.ingest.decode import parse_traces, span_batch

    from .support.wire import span_request_bytes

    metrics = Metrics()
    stage = local_stage(store, Settings(), metrics)
    stage.start()
    store.on_commit(stage.on_commit)
    try:
        assert stage.wait_idle(60)
        before = metrics.render()
        assert 'tracejudge_stage_held{stage="conversations",what="cached_rows"} 0' in before
        body, _ = span_request_bytes(3)
        store.submit(spans=span_batch(parse_traces(body))[0]).result(60)
        assert stage.wait_idle(60)
        after = metrics.render()
        assert 'tracejudge_stage_held{stage="conversations",what="cached_rows"} 3' in after
        assert after.count("# TYPE tracejudge_stage_held gauge") == 1
    finally:
        stage.stop()
