"""Compression: the writer's CPU, reads back and the file's size, by how the span table's text is compressed.

Stores ``--spans`` spans of ``bench/ingest.py``'s workload through the daemon's own writer
(``collector.store.Store``, 512 spans a request, four requests in flight), checkpoints, then reads
every row's ``trace_id``, ``attributes`` and ``resource`` back by commit range, ten commits at a time,
as the conversation stage does. Each method runs in a process of its own, and the methods alternate
round by round, so the machine's noise hits them alike. It prints, per method, the median over rounds
of the writer's CPU a span (decode excluded: the batches are decoded before the clock starts), the
reads' CPU a span and the file's size, each as a ratio of DuckDB's own choice (``auto``, the baseline).
A method is a value of DuckDB's ``force_compression``; ``table`` is the span table as the daemon creates
it (``collector.store.schema.SPAN_TABLE``: zstd for its text). Run by hand:

    .venv/bin/python bench/compression.py [--spans 150000] [--rounds 3] [--methods auto table fsst]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))


def one(method: str, spans: int) -> dict[str, float]:
    """In this process: store and read back with ``method``; CPU seconds a span, and the file's bytes."""
    import ingest  # the workload, in the child only

    from collector.ingest.decode import parse_traces, span_batch
    from collector.store import schema
    from collector.store.writer import Store

    if method != "table":  # the columns as DuckDB chooses, or as forced
        schema.SCHEMA = schema.SCHEMA.replace(" USING COMPRESSION zstd", "")
    batches = [span_batch(parse_traces(body))[0] for body in ingest.make_requests(spans)]
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "bench.duckdb")
        store.open(prepare=None if method == "table" else
                   lambda con: con.execute(f"SET force_compression = '{method}'"))
        start = time.process_time()
        waiting = []
        for batch in batches:
            waiting.append(store.submit(batch))
            if len(waiting) >= 4:
                waiting.pop(0).result()
        for future in waiting:
            future.result()
        cur = store.cursor()
        cur.execute("CHECKPOINT")
        write = time.process_time() - start
        (last,) = cur.execute("SELECT max(batch_id) FROM span_records").fetchall()[0]
        start = time.process_time()
        for low in range(0, last + 1, 10):
            cur.execute("SELECT trace_id, attributes, resource FROM span_records WHERE batch_id BETWEEN ? AND ?",
                        [low, low + 9]).fetchall()
        read = time.process_time() - start
        cur.close()
        store.close()
        size = sum(p.stat().st_size for p in Path(tmp).glob("bench.duckdb*"))
    return {"write_us": write / spans * 1e6, "read_us": read / spans * 1e6, "file_mb": size / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spans", type=int, default=150_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--methods", nargs="+", default=["auto", "table", "fsst"],
                    help="values of DuckDB's force_compression, or table; the first is the baseline")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.spans)))
        return
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in args.methods}
    for r in range(args.rounds):
        for method in args.methods:
            out = subprocess.run([sys.executable, __file__, "--one", method, "--spans", str(args.spans)],
                                 check=True, capture_output=True, text=True).stdout
            runs[method].append(json.loads(out.splitlines()[-1]))
            m = runs[method][-1]
            print(f"round {r + 1} {method:>10}: write {m['write_us']:5.1f} µs a span, read {m['read_us']:5.2f} µs "
                  f"a span, file {m['file_mb']:6.1f} MB", flush=True)
    base = {k: statistics.median(x[k] for x in runs[args.methods[0]]) for k in ("write_us", "read_us", "file_mb")}
    print(f"\n{args.spans:,} spans, median of {args.rounds} rounds, each as a ratio of {args.methods[0]}:")
    for method, results in runs.items():
        med = {k: statistics.median(x[k] for x in results) for k in base}
        print(f"  {method:>10}: write {med['write_us']:5.1f} µs a span ({med['write_us'] / base['write_us']:.2f}x), "
              f"read {med['read_us']:5.2f} µs ({med['read_us'] / base['read_us']:.2f}x), "
              f"file {med['file_mb']:6.1f} MB ({med['file_mb'] / base['file_mb']:.2f}x)")


if __name__ == "__main__":
    main()
