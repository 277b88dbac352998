"""DuckDB's memory during a checkpoint after retention's deletes, by how many row-group merges it runs.

A checkpoint merges row groups that have deleted rows (DuckDB's vacuum tasks, ``max_vacuum_tasks``,
100 by default): each merge reads them back into memory and writes them again, fewer. Retention
deletes a conversation's spans wherever they are, so after a sweep many row groups hold deleted rows.

This stores 300,000 spans of ``bench/ingest.py``'s workload in a file (8192-row groups, as the daemon
writes), then three times: deletes a third of the oldest rows, adds about 15,000 spans in small
commits, and checkpoints while another cursor polls ``duckdb_memory()``. It prints the uncommitted
table memory (``IN_MEMORY_TABLE``) before each checkpoint, its peak during it, and the checkpoint's
seconds, for a run without deletes (the baseline) and for each ``--tasks``, with the peak as a ratio
of the baseline's. The daemon runs ``collector.store.files.VACUUM_TASKS``. Run by hand:

    .venv/bin/python bench/checkpoint_memory.py [--tasks 100 1 0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import duckdb

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ingest  # noqa: E402  (the workload)

from collector.ingest.batches import SpanBatch  # noqa: E402
from collector.ingest.decode import parse_traces, span_batch  # noqa: E402
from collector.store.arrow import Table  # noqa: E402
from collector.store.files import ROW_GROUP_SIZE, connect  # noqa: E402
from collector.store.schema import SPAN_ARROW, create_schema  # noqa: E402

MB = 1_000_000
REQUESTS = [span_batch(parse_traces(ingest.make_requests(512, first=i)[0]))[0] for i in range(8)]


def append(con: duckdb.DuckDBPyConnection, requests: int, first_batch: int) -> None:
    """``requests`` commits of 512 spans, commits numbered from ``first_batch``."""
    for i in range(requests):
        batch: SpanBatch = REQUESTS[i % len(REQUESTS)]
        con.register("incoming", Table(dict(zip(SPAN_ARROW, batch.columns)), SPAN_ARROW))
        con.execute("INSERT INTO span_records BY NAME SELECT *, now()::TIMESTAMPTZ AS received_at, "
                    f"{first_batch + i} AS batch_id FROM incoming")
        con.unregister("incoming")


def checkpoint(con: duckdb.DuckDBPyConnection) -> tuple[float, float, float]:
    """(uncommitted table MB before, its peak during the checkpoint, seconds)."""
    poll, peak, done = con.cursor(), [0.0], threading.Event()

    def table_memory(cur: duckdb.DuckDBPyConnection) -> float:
        rows = dict(cur.execute("SELECT tag, memory_usage_bytes FROM duckdb_memory()").fetchall())
        return rows.get("IN_MEMORY_TABLE", 0) / MB

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], table_memory(poll))

    before = table_memory(con)
    t = threading.Thread(target=watch)
    t.start()
    start = time.perf_counter()
    con.execute("CHECKPOINT")
    took = time.perf_counter() - start
    done.set()
    t.join()
    return before, peak[0], took


def run(tasks: int, deletes: bool) -> list[tuple[float, float, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        con = connect(Path(tmp) / "bench.duckdb", memory_limit="1GB", row_group_size=ROW_GROUP_SIZE)
        con.execute("SET checkpoint_threshold = '1GB'")  # only the checkpoints below
        con.execute(f"SET max_vacuum_tasks = {tasks}")
        create_schema(con)
        append(con, 600, 0)
        con.execute("CHECKPOINT")
        out = []
        for r in range(3):
            if deletes:
                con.execute(f"DELETE FROM span_records WHERE batch_id < {200 * (r + 1)} AND hash(span_id) % 3 = 0")
            append(con, 30, 1000 + 30 * r)
            out.append(checkpoint(con))
        con.close()
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, nargs="+", default=[100, 1, 0])
    args = ap.parse_args()
    base = run(100, deletes=False)
    base_peak = statistics.median(p for _, p, _ in base)
    print(f"{'run':28}{'before MB':>11}{'peak MB':>10}{'vs baseline':>13}{'seconds':>9}")
    for name, rows in [("no deletes (baseline)", base),
                       *((f"deletes, {n} vacuum tasks", run(n, deletes=True)) for n in args.tasks)]:
        for before, peak, took in rows:
            print(f"{name:28}{before:11.1f}{peak:10.1f}{peak / base_peak:13.2f}{took:9.2f}")


if __name__ == "__main__":
    main()
