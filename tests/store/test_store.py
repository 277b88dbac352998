"""The store's writer: callers that give up, and a writer that stops for good (unit tests of the module)."""

from __future__ import annotations

import ast
import random
import threading
from pathlib import Path
from typing import Iterator

import duckdb
import pytest

from collector.errors import StoreUnavailable
from collector.evals.verdicts import UNKEYED
from collector.ingest.batches import LOG_COLUMNS, SPAN_COLUMNS, LogBatch, SpanBatch
from collector.ingest.decode import parse_traces, span_batch
from collector.store import ATTACHED, Committed, Store
from collector.store.schema import LOG_TABLE, SPAN_TABLE
from collector.store.transactions import one

from ..support.daemon import REPO, DaemonProcess, base_config, wait_until
from ..support.wire import span_request_bytes


def spans(n: int, seed: int) -> SpanBatch:
    body, _ = span_request_bytes(n, trace_seed=seed, attr_bytes=300)
    return span_batch(parse_traces(body, False))[0]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(tmp_path / "t.duckdb")
    s.open()
    yield s
    s.close()


def stored(store: Store) -> int:
    cur = store.cursor()
    try:
        row = cur.execute("SELECT count(*) FROM span_records").fetchone()
        return int(row[0]) if row else 0
    finally:
        cur.close()


def test_callers_that_give_up_leave_the_writer_running(store: Store) -> None:
    """What a gRPC deadline does: the receiver's awaited future is cancelled, queued or being committed."""
    big, *small = [spans(n, seed) for seed, n in enumerate((20_000, 64, 64, 64), start=1)]
    taken = store.submit(big)
    wait_until(taken.running, "the writer to take the request")  # the writer has taken it: cancelling can no longer pull it from under the writer
    behind = [store.submit(b) for b in small]
    assert not taken.cancel()
    assert all(f.cancel() for f in behind)  # still queued: their callers may go, their data is still committed
    assert taken.result(timeout=60) == (20_000, 0)
    assert store.submit(spans(8, 9)).result(timeout=60) == (8, 0)
    assert store.failure is None and store.broken is None
    assert stored(store) == 20_000 + 3 * 64 + 8


class Crash(BaseException):
    """Not one bad batch: something that ends the writer thread."""


def test_a_writer_that_stops_refuses_everything_and_says_why(store: Store) -> None:
    in_listener = threading.Event()
    release = threading.Event()
    reasons: list[str] = []

    def crash(c: Committed) -> None:
        in_listener.set()
        release.wait(30)
        raise Crash("listener bug")

    store.on_commit(crash)
    store.on_broken(reasons.append)
    first = store.submit(spans(8, 1))
    assert in_listener.wait(30)
    assert first.result(timeout=30) == (8, 0)  # committed, then answered: acknowledged data stays stored
    queued = store.submit(spans(8, 2))  # waits behind the writer, which is about to stop
    release.set()
    with pytest.raises(StoreUnavailable) as refused:
        queued.result(timeout=30)
    assert refused.value.reason == "storage_error" and "writer stopped" in str(refused.value)
    assert reasons and "Crash: listener bug" in reasons[0]
    assert store.broken == store.failure == reasons[0]
    with pytest.raises(StoreUnavailable, match="writer stopped"):
        store.submit(spans(8, 3))
    assert store.queue_depth == 0
    store.drain()  # returns: nothing waits on a writer that is gone
    assert stored(store) == 8


@pytest.mark.parametrize("let_go", [False, True])
def test_a_file_a_read_still_holds_is_attached_again_once_it_lets_go_else_the_writer_stops(
        tmp_path: Path, let_go: bool) -> None:
    """The file is gone from under the writer (detached here; in a soak, DuckDB invalidated it when a
    commit ran out of memory) while a read holds it open: attaching it again fails for as long as the
    read holds it. Once it lets go, the writer attaches the file again and commits; if it never does,
    the writer stops after ``pinned_give_up`` seconds (the daemon exits for its supervisor), rather than
    refusing data for ever. Nothing committed is lost."""
    store = Store(tmp_path / "t.duckdb", retry_after=0.05, pinned_give_up=0.5 if not let_go else 3600)
    store.open()
    broken = threading.Event()
    store.on_broken(lambda reason: broken.set())
    try:
        assert store.submit(spans(8, 1)).result(timeout=60) == (8, 0)
        reader = store.cursor()
        reader.execute("SELECT * FROM span_records")
        assert len(reader.fetchmany(1)) == 1  # the rest unread: the result holds the file
        other = store.cursor()
        other.execute("USE memory")
        other.execute(f"DETACH DATABASE {ATTACHED}")
        with pytest.raises(StoreUnavailable, match="storage commit failed"):
            store.submit(spans(8, 2)).result(timeout=60)
        if let_go:
            reader.close()
            assert store.submit(spans(8, 3)).result(timeout=60) == (8, 0)
            assert store.broken is None
        else:
            assert broken.wait(60)
            assert store.broken is not None and "only a restart frees it" in store.broken
            reader.close()
    finally:
        store.close()
    store = Store(tmp_path / "t.duckdb")
    store.open()  # the restart
    try:
        assert stored(store) == (16 if let_go else 8)
    finally:
        store.close()


def test_a_fatal_error_met_by_a_reader_stops_the_idle_writer(store: Store) -> None:
    """DuckDB invalidates the file for every cursor after a fatal error (out of memory in a stage's commit):
    told of one, the store stops as if its writer had met it, with nothing to ingest; other errors are
    the reader's own."""
    reasons: list[str] = []
    broken = threading.Event()
    store.on_broken(lambda reason: (reasons.append(reason), broken.set()))
    assert store.submit(spans(8, 1)).result(timeout=60) == (8, 0)
    assert not store.fatal(duckdb.OutOfMemoryException("Out of Memory Error: could not allocate block"))
    assert store.submit(spans(8, 2)).result(timeout=60) == (8, 0)
    assert store.broken is None
    assert store.fatal(duckdb.FatalException("FATAL Error: Failed: database has been invalidated"))
    assert broken.wait(30)
    assert "FatalException: FATAL Error: Failed: database has been invalidated" in reasons[0]
    assert store.broken == reasons[0]
    with pytest.raises(StoreUnavailable, match="writer stopped"):
        store.submit(spans(8, 3))
    assert store.fatal(duckdb.FatalException("again"))  # said once: the writer is gone already
    assert len(reasons) == 1
    store.drain()
    assert stored(store) == 16


def test_the_views_read_every_row_whatever_its_time(store: Store) -> None:
    """2^64-1 ns is a valid OTLP time past what a timestamp holds: its row reads with no time, the others too."""
    batch = spans(2, seed=12)
    times = batch.columns[SPAN_COLUMNS.index("start_time_unix_nano")]
    times[0] = 2**64 - 1
    assert store.submit(batch).result(timeout=60) == (2, 0)
    cur = store.cursor()
    try:
        rows = cur.execute("SELECT start_time_unix_nano, start_time FROM spans ORDER BY 1").fetchall()
    finally:
        cur.close()
    assert rows[1] == (2**64 - 1, None) and rows[0][1] is not None


def test_the_file_checkpoints_after_a_schema_is_created(store: Store) -> None:
    """A reindex creates its schema beside the live tables; DuckDB must still checkpoint after that, or the
    WAL and its memory grow until the process ends (a result left unread at start-up held a transaction)."""
    cur, other = store.cursor(), store.cursor()
    try:
        cur.execute("CREATE SCHEMA rebuilt")
        other.execute("CHECKPOINT").fetchall()
    finally:
        cur.close()
        other.close()


def test_a_row_read_with_one_lets_the_file_checkpoint(store: Store) -> None:
    """``fetchone`` leaves its result open, and then, once the catalog changed, no checkpoint can run."""
    cur, other = store.cursor(), store.cursor()
    try:
        assert one(cur.execute("SELECT count(*) FROM span_records")) == (0,)
        other.execute("CREATE SCHEMA rebuilt")
        other.execute("CHECKPOINT").fetchall()
        cur.execute("SELECT count(*) FROM span_records").fetchone()
        other.execute("CREATE SCHEMA again")
        with pytest.raises(duckdb.TransactionException, match="CHECKPOINT"):
            other.execute("CHECKPOINT")
    finally:
        cur.close()
        other.close()


def test_no_module_leaves_a_duckdb_result_open_with_fetchone() -> None:
    """The rule the test above gives the reason for: every first row is read with ``one``."""
    found = []
    for path in (REPO / "collector").rglob("*.py"):
        source = path.read_text(encoding="utf-8")
        if "import sqlite3" in source:  # SQLite's cursors hold no DuckDB transaction
            continue
        found += [f"{path.relative_to(REPO)}:{node.lineno}" for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr == "fetchone"]
    assert not found, found


def logs(n: int, seed: int) -> LogBatch:
    batch = LogBatch()
    for i in range(n):
        row = {c: None for c in LOG_COLUMNS}
        row.update(log_id=f"log-{seed}-{i}", trace_id=f"{seed:032x}", body='"hello"', attributes="{}")
        for column, value in zip(batch.columns, (row[c] for c in LOG_COLUMNS)):
            column.append(value)
    return batch


def count(store: Store, sql: str) -> int:
    cur = store.cursor()
    try:
        row = one(cur.execute(sql))
        return int(row[0]) if row else 0
    finally:
        cur.close()


def test_retries_of_recent_records_store_nothing_and_of_older_ones_store_them_again(tmp_path: Path) -> None:
    """Only the newest ``keys_kept`` records are recognised: a retry from before them is stored a second time
    (the transcript still has each message once: a rebuild takes one copy of a span)."""
    store = Store(tmp_path / "t.duckdb", keys_kept=1000)
    store.open()

    def send(span_rows: SpanBatch | None, log_rows: LogBatch | None = None) -> tuple[int, int]:
        """What the commit stored."""
        before = (count(store, "SELECT count(*) FROM span_records"), count(store, "SELECT count(*) FROM log_records"))
        store.submit(span_rows, log_rows).result(timeout=60)
        return (count(store, "SELECT count(*) FROM span_records") - before[0],
                count(store, "SELECT count(*) FROM log_records") - before[1])

    try:
        first, first_logs = spans(64, 1), logs(16, 1)
        assert send(first, first_logs) == (64, 16)
        assert send(first, first_logs) == (0, 0)  # an OTLP retry
        twice = spans(32, 2)
        twice.extend(spans(32, 2))  # one span twice in a commit: the first is stored
        assert send(twice) == (32, 0)
        for seed in range(3, 40):  # 1,184 newer spans: the first request's keys are deleted
            assert send(spans(32, seed)) == (32, 0)
        assert count(store, "SELECT count(*) FROM recent_keys") <= 1000 + 100
        assert send(first, first_logs) == (64, 16)  # spans and logs: their commit's keys went at once
    finally:
        store.close()


def random_spans(n: int, rnd: random.Random) -> SpanBatch:
    """Spans with random ids, as real tracers make them (an index on them is touched all over by each commit)."""
    batch = SpanBatch()
    made = {"trace_id": lambda: f"{rnd.getrandbits(128):032x}", "span_id": lambda: f"{rnd.getrandbits(64):016x}",
            "name": lambda: "chat", "attributes": lambda: "{}", "kind": lambda: 1}
    for column, name in zip(batch.columns, SPAN_COLUMNS):
        make = made.get(name)
        column.extend(make() if make else None for _ in range(n))
    return batch


@pytest.mark.slow
def test_a_store_of_many_spans_holds_no_index_of_them_in_duckdbs_memory(tmp_path: Path) -> None:
    """A primary key on the spans held its whole index in DuckDB's memory while rows went in: at 16 MB
    commits failed from 20,000 spans on (at 32 MB from 150,000). Only the newest records' keys are held now."""
    store = Store(tmp_path / "t.duckdb", memory_limit="16MB", keys_kept=20_000)
    store.open()
    rnd = random.Random(1)
    try:
        for _ in range(80):
            store.submit(random_spans(5000, rnd)).result(timeout=120)
        assert store.failure is None
        assert stored(store) == 400_000
        assert count(store, "SELECT count(*) FROM recent_keys") <= 22_000
    finally:
        store.close()


def test_a_file_whose_span_and_log_tables_have_keys_is_rebuilt_without_them(tmp_path: Path) -> None:
    """Files written before ``recent_keys``: the tables are rebuilt once, in the order stored, and a
    retry of their newest records still stores nothing."""
    path = tmp_path / "t.duckdb"
    store = Store(path)
    store.open()
    batches = [(spans(40, seed), logs(8, seed)) for seed in range(1, 6)]
    for span_rows, log_rows in batches:
        store.submit(span_rows, log_rows).result(timeout=60)
    before = {t: store.cursor().execute(f"SELECT * FROM {t} ORDER BY batch_id").fetchall()
              for t in ("span_records", "log_records")}
    store.close()
    con = duckdb.connect(str(path))  # as an older version made them: keyed, and no recent_keys
    for table, ddl, key in (("span_records", SPAN_TABLE, "trace_id, span_id"), ("log_records", LOG_TABLE, "log_id")):
        con.execute(ddl.format(name="keyed").removesuffix(")") + f", PRIMARY KEY ({key}))")
        con.execute(f"INSERT INTO keyed BY NAME SELECT * FROM {table}")
        con.execute(f"DROP TABLE {table}")
        con.execute(f"ALTER TABLE keyed RENAME TO {table}")
    con.execute("DROP TABLE recent_keys")
    assert con.execute("SELECT count(*) FROM duckdb_constraints() WHERE constraint_type = 'PRIMARY KEY' "
                       "AND table_name IN ('span_records', 'log_records')").fetchall() == [(2,)]
    con.close()

    store = Store(path)
    store.open()
    try:
        cur = store.cursor()
        assert cur.execute("SELECT count(*) FROM duckdb_constraints() WHERE constraint_type = 'PRIMARY KEY' "
                           "AND table_name IN ('span_records', 'log_records')").fetchall() == [(0,)]
        for table, rows in before.items():
            assert cur.execute(f"SELECT * FROM {table} ORDER BY batch_id").fetchall() == rows
        cur.close()
        span_rows, log_rows = batches[-1]
        store.submit(span_rows, log_rows).result(timeout=60)
        store.submit(spans(8, 99)).result(timeout=60)
        assert count(store, "SELECT count(*) FROM span_records") == len(before["span_records"]) + 8
        assert count(store, "SELECT count(*) FROM log_records") == len(before["log_records"])
    finally:
        store.close()


# A keyed table of an older file, as it was made, and how to fill it with a million rows.
_OLDER = {
    "span_records": (SPAN_TABLE.format(name="span_records").removesuffix(")") + ", PRIMARY KEY (trace_id, span_id))",
                     "INSERT INTO span_records (trace_id, span_id, name, attributes, received_at, batch_id) "
                     "SELECT md5((i // 4)::VARCHAR), left(md5(i::VARCHAR), 16), 'chat', '{\"k\": \"v\"}', now(), "
                     "i // 512 FROM range(?) t(i)"),
    "sampling_decisions": (UNKEYED["sampling_decisions"].format(name="sampling_decisions").replace(
                               "conversation_id VARCHAR NOT NULL", "conversation_id VARCHAR PRIMARY KEY"),
                           "INSERT INTO sampling_decisions SELECT md5(i::VARCHAR), 1, NULL, i % 10 = 0, 0.1, NULL, "
                           "NULL, now() FROM range(?) t(i)"),
}


@pytest.mark.slow
@pytest.mark.parametrize("table", list(_OLDER))
def test_a_stop_during_the_rebuild_of_an_older_file_leaves_it_whole_and_the_next_start_rebuilds_it(
        tmp_path: Path, table: str) -> None:
    """The rebuild of a keyed table (the span table's, the evals tables') is one transaction in the
    daemon's start: SIGTERM interrupts it (the daemon exits at once, the file as it was) or, had it
    finished first, finds it rebuilt. Either way no row is lost, and the next start rebuilds what is left."""
    rows = 1_000_000
    daemon = DaemonProcess(tmp_path, base_config(tmp_path))
    store = Store(daemon.duckdb)
    store.open()
    store.close()
    con = duckdb.connect(str(daemon.duckdb))
    ddl, fill = _OLDER[table]
    con.execute(f"DROP TABLE IF EXISTS {table}")
    con.execute(ddl)
    con.execute(fill, [rows])
    con.close()

    def layout() -> tuple[int, int]:
        c = duckdb.connect(str(daemon.duckdb), read_only=True)
        try:
            return c.execute(f"SELECT (SELECT count(*) FROM {table}), (SELECT count(*) FROM duckdb_constraints() "
                             "WHERE table_name = ? AND constraint_type = 'PRIMARY KEY')", [table]).fetchall()[0]
        finally:
            c.close()

    try:
        daemon.start(ready=False)
        daemon.wait_output(f"rebuilding {table}")
        assert daemon.stop() == 0
        rebuilt = f"{table} rebuilt in" in daemon.output()  # logged once its transaction committed
        assert rebuilt or "interrupting it" in daemon.output()
        assert layout() == (rows, 0 if rebuilt else 1), daemon.output()
        daemon.start(timeout=120)
        assert daemon.stop() == 0
        assert layout() == (rows, 0)
    finally:
        daemon.end()


def test_span_and_log_text_is_compressed_with_zstd(store: Store) -> None:
    """Checkpointed, every text column of the span and log tables is stored with zstd (the writer's
    cheaper, smaller choice: ``SPAN_TABLE``), not by DuckDB's choice among its methods."""
    n = 3000
    logs = LogBatch()
    for column, values in zip(LOG_COLUMNS, logs.columns):
        values.extend([f"l{i}" if column == "log_id" else f"log {i} " * 20 if column == "body" else None
                       for i in range(n)])
    assert store.submit(spans(n, 7), logs).result(timeout=60) == (n, n)
    cur = store.cursor()
    try:
        cur.execute("CHECKPOINT")
        found = {(t, c): k for t, c, k in cur.execute(
            "SELECT 'span_records', column_name, compression FROM pragma_storage_info('span_records') "
            "WHERE segment_type = 'VARCHAR' UNION ALL "
            "SELECT 'log_records', column_name, compression FROM pragma_storage_info('log_records') "
            "WHERE segment_type = 'VARCHAR'").fetchall()}
    finally:
        cur.close()
    assert ("span_records", "attributes") in found and ("log_records", "body") in found, found
    assert set(found.values()) == {"ZSTD"}, found
