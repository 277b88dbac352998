"""DuckDB's memory for the trace map as it grows: every trace keyed, against the newest ones keyed.

The conversation stage writes, for each commit, which conversation each of its traces belongs to, and
looks up the traces of the next commit first. Trace ids are random (as tracers make them), so every
write touches the whole of a key's index, which DuckDB then keeps in memory. This drives two fresh
DuckDB files, each under the same ``memory_limit``, with the same commits, one after the other:

  keyed      every trace keyed in ``trace_conversations`` (the layout before ``trace_archive``)
  archived   the daemon's layout: ``collector.conversations.duck.archive_traces`` after each write,
             the newest ``--kept`` traces keyed and the older ones in ``trace_archive``

Each commit looks up its traces (``collector.store.by_keys``, as ``TraceMap.of`` does), then writes them
with ``INSERT OR REPLACE``. At each step it prints, for both, DuckDB's index memory (``ART_INDEX`` in
``duckdb_memory()``), all of DuckDB's memory, and the milliseconds per commit, the archived layout as a
ratio of the keyed one; a layout whose commit fails (out of memory) stops there, and the step says so.
Run by hand:

    .venv/bin/python bench/trace_map.py [--traces 3000000] [--per-commit 300] [--memory-limit 128MB]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from hashlib import blake2b
from pathlib import Path

import duckdb

from collector.conversations.tables import TRACES_KEPT
from collector.conversations.duck import archive_traces
from collector.store.schema import SCHEMA
from collector.store.transactions import by_keys

KEYED = "CREATE TABLE trace_conversations (trace_id VARCHAR PRIMARY KEY, conversation_id VARCHAR NOT NULL, " \
        "first_batch UBIGINT, last_batch UBIGINT)"


def trace_ids(start: int, n: int) -> list[str]:
    """Random-looking trace ids, the same in every run: 32 hex characters of a digest of the number."""
    return [blake2b(i.to_bytes(8, "little"), digest_size=16).hexdigest() for i in range(start, start + n)]


class Layout:
    def __init__(self, name: str, path: Path, memory_limit: str, kept: int | None) -> None:
        self.name, self.kept = name, kept
        self.con = duckdb.connect(str(path), config={"memory_limit": memory_limit})
        self.con.execute(SCHEMA if kept is not None else KEYED)
        self.seconds = 0.0
        self.commits = 0
        self.failed: str | None = None

    def commit(self, batch: int, ids: list[str]) -> None:
        if self.failed:
            return
        started = time.perf_counter()
        try:
            self.con.execute("BEGIN")
            by_keys(self.con, "SELECT trace_id, conversation_id FROM trace_conversations WHERE trace_id IN {keys}",
                    ids)
            self.con.execute("INSERT OR REPLACE INTO trace_conversations SELECT unnest(?::VARCHAR[]), "
                             "'c' || left(unnest(?::VARCHAR[]), 12), ?, ?", [ids, ids, batch, batch])
            if self.kept is not None:
                archive_traces(self.con, self.kept)
            self.con.execute("COMMIT")
        except duckdb.Error as exc:
            self.con.execute("ROLLBACK")
            self.failed = f"failed at commit {batch}: {type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
            print(f"[{self.name} {self.failed}]", flush=True)
            return
        self.seconds += time.perf_counter() - started
        self.commits += 1

    def memory(self) -> tuple[float, float]:
        """DuckDB's index memory and all of its memory, in MB."""
        rows = dict(self.con.execute("SELECT tag, memory_usage_bytes FROM duckdb_memory()").fetchall())
        return rows.get("ART_INDEX", 0) / 2**20, sum(rows.values()) / 2**20

    def ms_per_commit(self) -> float | None:
        """Milliseconds per commit since the last call; None when none committed."""
        ms = 1000 * self.seconds / self.commits if self.commits else None
        self.seconds, self.commits = 0.0, 0
        return ms


def _ms(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", type=int, default=3_000_000, help="traces written in all (default 3,000,000)")
    ap.add_argument("--per-commit", type=int, default=300, help="traces per commit (default 300)")
    ap.add_argument("--step", type=int, default=300_000, help="traces between two printed rows")
    ap.add_argument("--kept", type=int, default=TRACES_KEPT, help=f"traces kept keyed (default {TRACES_KEPT:,})")
    ap.add_argument("--memory-limit", default="128MB", help="DuckDB's memory_limit for each file (the daemon's)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        layouts = [Layout("keyed", Path(tmp) / "keyed.duckdb", args.memory_limit, None),
                   Layout("archived", Path(tmp) / "archived.duckdb", args.memory_limit, args.kept)]
        print(f"{args.per_commit} random trace ids a commit, memory_limit {args.memory_limit}, "
              f"{args.kept:,} kept keyed in the archived layout")
        print(f"{'traces':>10} | {'index MB keyed':>14} {'archived':>9} | {'DuckDB MB keyed':>15} {'archived':>9} | "
              f"{'ms/commit keyed':>15} {'archived':>9} {'ratio':>6}")
        batch, written = 0, 0
        while written < args.traces:
            batch += 1
            ids = trace_ids(written, args.per_commit)
            for layout in layouts:
                layout.commit(batch, ids)
            written += args.per_commit
            if written % args.step == 0 or written >= args.traces:
                (ki, km), (ai, am) = layouts[0].memory(), layouts[1].memory()
                kms, ams = layouts[0].ms_per_commit(), layouts[1].ms_per_commit()
                ratio = f"{ams / kms:5.2f}x" if kms and ams else "-"
                row = (f"{written:>10,} | {ki:>14.1f} {ai:>9.1f} | {km:>15.1f} {am:>9.1f} | "
                       f"{_ms(kms):>15} {_ms(ams):>9} {ratio:>6}")
                print(row, flush=True)
                if all(x.failed for x in layouts):
                    break
        for layout in layouts:
            layout.con.close()


if __name__ == "__main__":
    main()
