"""Keyed writes: how the conversation stage replaces rows, against DuckDB's INSERT OR REPLACE.

Writes in the stage's own tables (``trace_conversations``, ``live_conversations``) the way one of
its cycles does, in transactions of ``--rows`` rows built as Arrow tables (``insert_rows``):

  trace map      new traces into a map already holding ``--keys`` (most traces the stage writes
                 are new): INSERT OR REPLACE (the baseline), INSERT OR IGNORE, plain INSERT
  conversations  a third of each write stored before, the rest new: INSERT OR REPLACE (the
                 baseline), and what ``Writes.flush`` does: delete the stored ones by key
                 (``by_keys``), then insert every row

Methods alternate round by round, so the machine's noise hits them alike; it prints microseconds
a row (statement only, and the whole transaction) and each method as a ratio of the baseline.
Run by hand:

    .venv/bin/python bench/keyed_writes.py [--keys 200000] [--rows 512] [--writes 150] [--rounds 3]
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import duckdb

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from collector.conversations.tables import CONVERSATION_COLUMNS, SCHEMA, TRACE_MAP_COLUMNS  # noqa: E402
from collector.store.schema import TRACE_MAP  # noqa: E402
from collector.store.transactions import by_keys, insert_rows  # noqa: E402

NOW = dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc)


def _id(*parts: Any) -> str:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).hexdigest()


def _conversation(cid: str, n: int) -> tuple[Any, ...]:
    values = {c: None for c in CONVERSATION_COLUMNS}
    values.update(conversation_id=cid, service="shopbot", started_at=NOW, ended_at=NOW, state="open", user_turns=4,
                  input_tokens=480, output_tokens=160, llm_calls=12, message_count=9, models='["gpt-4o-mini"]',
                  system="You are ShopBot, the support assistant of an online bookshop." * 5, content_captured=True,
                  transcript_hash=_id(cid, n), revision=n, trace_ids='["a", "b", "c", "d"]', newest_trace_id="d",
                  first_arrival_at=NOW, last_arrival_at=NOW, updated_at=NOW, unparsed_spans=0, unparsed_logs=0,
                  sources='["otel_genai/span"]', first_batch=n, messages_batch=n)
    return tuple(values[c] for c in CONVERSATION_COLUMNS)


def timed_write(cur: duckdb.DuckDBPyConnection, statements: Callable[[], None]) -> tuple[float, float]:
    """(seconds in ``statements``, seconds of the whole transaction)."""
    began = time.perf_counter()
    cur.execute("BEGIN TRANSACTION")
    t = time.perf_counter()
    statements()
    stmt = time.perf_counter() - t
    cur.execute("COMMIT")
    return stmt, time.perf_counter() - began


def trace_map(cur: duckdb.DuckDBPyConnection, how: str, rows: list[tuple[Any, ...]]) -> tuple[float, float]:
    statement = {"replace": "INSERT OR REPLACE INTO", "ignore": "INSERT OR IGNORE INTO", "insert": "INSERT INTO"}[how]
    return timed_write(cur, lambda: insert_rows(cur, f"{statement} trace_conversations", TRACE_MAP_COLUMNS, rows))


def conversations(cur: duckdb.DuckDBPyConnection, how: str, rows: list[tuple[Any, ...]], stored: list[str]
                  ) -> tuple[float, float]:
    def write() -> None:
        if how == "replace":
            insert_rows(cur, "INSERT OR REPLACE INTO live_conversations", CONVERSATION_COLUMNS, rows)
        else:
            by_keys(cur, "DELETE FROM live_conversations WHERE conversation_id IN {keys}", stored)
            insert_rows(cur, "INSERT INTO live_conversations", CONVERSATION_COLUMNS, rows)
    return timed_write(cur, write)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=200_000, help="rows in each table before the writes")
    ap.add_argument("--rows", type=int, default=512, help="rows in each write")
    ap.add_argument("--writes", type=int, default=150, help="writes per method and round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        con = duckdb.connect(str(Path(tmp) / "bench.duckdb"))
        con.execute("SET memory_limit = '128MB'")
        con.execute(TRACE_MAP)
        con.execute(SCHEMA)
        con.execute("INSERT INTO trace_conversations SELECT md5(i::VARCHAR), 'c', i, i FROM range(?) r(i)", [args.keys])
        insert_rows(con, "INSERT INTO live_conversations", CONVERSATION_COLUMNS,
                    [_conversation(f"old-{i}", 0) for i in range(args.keys // 4)])
        con.execute("CHECKPOINT")
        print(f"{args.keys:,} traces and {args.keys // 4:,} conversations stored; writes of {args.rows} rows, "
              f"{args.writes} per method and round, {args.rounds} rounds")

        results: dict[str, list[tuple[float, float]]] = {}
        written: list[str] = [f"old-{i}" for i in range(args.keys // 4)]
        n = 0
        for rnd in range(args.rounds):
            for how in ("replace", "ignore", "insert"):
                per = []
                for w in range(args.writes):
                    n += 1
                    per.append(trace_map(con, how, [(_id(n, i), f"c-{n}", n, n) for i in range(args.rows)]))
                results.setdefault(f"trace map: {how}", []).append(_per_row(per, args.rows))
            for how in ("replace", "delete+insert"):
                per = []
                for w in range(args.writes):
                    n += 1
                    stored = [written[(n * 7919 + i * 104729) % len(written)] for i in range(args.rows // 3)]
                    stored = list(dict.fromkeys(stored))
                    new = [f"conv-{n}-{i}" for i in range(args.rows - len(stored))]
                    written += new
                    rows = [_conversation(cid, n) for cid in stored + new]
                    per.append(conversations(con, how, rows, stored))
                results.setdefault(f"conversations: {how}", []).append(_per_row(per, args.rows))

        baselines = {"trace map": "trace map: replace", "conversations": "conversations: replace"}
        print(f"{'method':<32}{'statements us/row':>18}{'transaction us/row':>20}{'vs baseline':>13}")
        for name, rounds in results.items():
            stmt = statistics.median(r[0] for r in rounds)
            whole = statistics.median(r[1] for r in rounds)
            base = statistics.median(r[1] for r in results[baselines[name.split(":")[0]]])
            print(f"{name:<32}{stmt:>18.1f}{whole:>20.1f}{whole / base:>12.2f}x")


def _per_row(per: list[tuple[float, float]], rows: int) -> tuple[float, float]:
    return (sum(s for s, _ in per) / len(per) / rows * 1e6, sum(w for _, w in per) / len(per) / rows * 1e6)


if __name__ == "__main__":
    main()
