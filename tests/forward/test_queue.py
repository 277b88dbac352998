"""The forward queue on its own: one write per request whatever the number of exporters, a cursor each,
nothing deleted that an exporter still needs, and what a crash leaves cleaned up at the start."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from collector.forward import queue as queue_module
from collector.forward.queue import ForwardStore

BOTH = ("traces", "logs")


def put(store: ForwardStore, signal: str, body: bytes) -> None:
    store.put(signal, body).result(timeout=30)


def drain(store: ForwardStore, name: str) -> list[bytes]:
    q = store.queues[name]
    out: list[bytes] = []
    while items := q.peek(1 << 20):
        out += [i.body for i in items]
        q.remove(items)
    return out


def segment_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in (folder / "bodies").glob("*.seg"))


def test_a_request_is_written_once_and_read_by_each_exporter_from_its_cursor(tmp_path: Path) -> None:
    store = ForwardStore(tmp_path, [("a", BOTH, 1 << 30), ("b", BOTH, 1 << 30)])
    try:
        bodies = [bytes([n]) * 1000 for n in range(5)]
        for b in bodies:
            put(store, "traces", b)
        assert segment_bytes(tmp_path) == 5000  # once, not once per exporter
        assert drain(store, "a") == bodies
        assert store.queues["a"].requests == 0 and store.queues["b"].requests == 5
        assert store.queues["b"].bytes == 5000
        assert drain(store, "b") == bodies  # a's progress took nothing from b
        assert not store._con.execute("SELECT count(*) FROM queue").fetchone()[0]
    finally:
        store.close()


def test_a_restart_resumes_each_cursor_and_numbers_on_after_an_empty_queue(tmp_path: Path) -> None:
    store = ForwardStore(tmp_path, [("a", BOTH, 1 << 30), ("b", BOTH, 1 << 30)])
    put(store, "traces", b"one")
    put(store, "traces", b"two")
    assert drain(store, "a") == [b"one", b"two"]
    items = store.queues["b"].peek(1 << 20)[:1]
    store.queues["b"].attempted(items)
    store.queues["b"].remove(items)
    store.close()

    store = ForwardStore(tmp_path, [("a", BOTH, 1 << 30), ("b", BOTH, 1 << 30)])
    try:
        assert store.queues["a"].requests == 0 and store.queues["b"].requests == 1
        put(store, "traces", b"three")  # a has delivered all: the new request still comes after its cursor
        assert drain(store, "a") == [b"three"]
        front = store.queues["b"].peek(1 << 20)
        assert [i.body for i in front] == [b"two", b"three"] and [i.attempts for i in front] == [0, 0]
    finally:
        store.close()


def test_a_send_tried_before_a_crash_is_marked_when_read_again(tmp_path: Path) -> None:
    store = ForwardStore(tmp_path, [("a", BOTH, 1 << 30)])
    put(store, "traces", b"x")
    store.queues["a"].attempted(store.queues["a"].peek(1 << 20))
    store.close()
    store = ForwardStore(tmp_path, [("a", BOTH, 1 << 30)])
    try:
        assert [i.attempts for i in store.queues["a"].peek(1 << 20)] == [1]
    finally:
        store.close()


def test_each_exporter_sees_only_its_signals_and_a_request_goes_when_the_last_that_needs_it_is_past(
        tmp_path: Path) -> None:
    store = ForwardStore(tmp_path, [("traces_only", ("traces",), 1 << 30), ("both", BOTH, 1 << 30)])
    try:
        put(store, "logs", b"L1")
        put(store, "traces", b"T1")
        assert store.queues["traces_only"].requests == 1 and store.queues["both"].requests == 2
        assert drain(store, "traces_only") == [b"T1"]
        assert store._con.execute("SELECT count(*) FROM queue").fetchone()[0] == 2
        front = store.queues["both"].peek(1 << 20)
        assert [i.body for i in front] == [b"L1"]  # one signal per send
        store.queues["both"].remove(front)
        assert store._con.execute("SELECT count(*) FROM queue").fetchone()[0] == 1
        assert drain(store, "both") == [b"T1"]
        assert store._con.execute("SELECT count(*) FROM queue").fetchone()[0] == 0
    finally:
        store.close()


def test_segments_are_deleted_once_every_exporter_is_past_them(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(queue_module, "SEGMENT_BYTES", 2500)
    store = ForwardStore(tmp_path, [("a", BOTH, 1 << 30), ("b", BOTH, 1 << 30)])
    try:
        for n in range(9):
            put(store, "traces", bytes([n]) * 1000)
        assert len(list((tmp_path / "bodies").glob("*.seg"))) == 3
        drain(store, "a")
        assert len(list((tmp_path / "bodies").glob("*.seg"))) == 3  # b still needs them all
        q = store.queues["b"]
        first = q.peek(3000)
        assert len(first) == 3
        q.remove(first)
        assert len(list((tmp_path / "bodies").glob("*.seg"))) == 2
        drain(store, "b")
        assert len(list((tmp_path / "bodies").glob("*.seg"))) == 1  # the one being appended to stays
    finally:
        store.close()


def test_what_a_crash_left_unreferenced_is_deleted_and_never_appended_to(tmp_path: Path) -> None:
    store = ForwardStore(tmp_path, [("a", BOTH, 1 << 30)])
    put(store, "traces", b"kept")
    store.close()
    # A crash between the fsync of the bodies and the commit of their index rows: bytes nothing points at.
    (tmp_path / "bodies" / "000000000002.seg").write_bytes(b"half a request")
    store = ForwardStore(tmp_path, [("a", BOTH, 1 << 30)])
    try:
        assert sorted(p.name for p in (tmp_path / "bodies").glob("*.seg")) == ["000000000001.seg"]
        put(store, "traces", b"next")
        assert drain(store, "a") == [b"kept", b"next"]
        assert (tmp_path / "bodies" / "000000000002.seg").read_bytes() == b"next"
    finally:
        store.close()


def test_an_exporter_no_longer_configured_lets_its_requests_go_and_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = ForwardStore(tmp_path, [("a", BOTH, 1 << 30), ("gone", BOTH, 1 << 30)])
    put(store, "traces", b"x")
    drain(store, "a")
    store.close()
    with caplog.at_level(logging.WARNING, "tracejudge.forward"):
        store = ForwardStore(tmp_path, [("a", BOTH, 1 << 30), ("new", BOTH, 1 << 30)])
    try:
        assert "exporter gone is no longer configured: the 1 requests it had queued are not sent to it" in caplog.text
        assert store._con.execute("SELECT count(*) FROM queue").fetchone()[0] == 0
        assert store.queues["new"].requests == 0  # a new exporter starts at the next request
        put(store, "traces", b"y")
        assert drain(store, "new") == [b"y"]
    finally:
        store.close()


def test_drop_oldest_skips_the_front_until_the_new_request_fits(tmp_path: Path) -> None:
    store = ForwardStore(tmp_path, [("small", BOTH, 2500), ("big", BOTH, 1 << 30)])
    try:
        for n in range(3):
            put(store, "traces", bytes([n]) * 1000)
        q = store.queues["small"]
        assert q.full(1000)
        assert q.drop_oldest(1000) == 2  # 3000 + 1000 over 2500: two of 1000 go
        assert q.requests == 1 and q.bytes == 1000
        assert drain(store, "small") == [bytes([2]) * 1000]
        assert store.queues["big"].requests == 3  # the other exporter loses nothing
    finally:
        store.close()
