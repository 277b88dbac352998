"""Reads and deletes by key as the conversation stage makes them, against the forms they replaced.

The stage asks which conversation each of a commit's traces belongs to (``trace_conversations``, primary
key ``trace_id``), a few hundred traces at a time. Without retention that table only grows, so a read
whose cost follows the table's size slows the stage down for good. This fills a fresh DuckDB file with
trace-map rows in steps (ids as the daemon makes them: 32 hex characters), and at each size times both
forms of the same read of 200 recent traces (``collector.store.by_keys`` makes the first), each best of 7:

  unnest     ``WHERE trace_id IN (SELECT unnest(?))``: a join, which reads the whole column
  by_keys    ``WHERE trace_id IN (?, ?, ...)``: looked up in the primary key's index

Then the same for replacing transcripts: a ``messages`` table of N rows (nine per conversation, written
in order, as the stage appends them), and the delete of 60 recent conversations' messages (rolled back):

  by id      ``DELETE FROM messages WHERE conversation_id IN (SELECT unnest(?))``: reads the whole table
  bounded    ``collector.conversations.writes.delete_messages``: from the smallest stored ``first_batch``

It prints milliseconds per read or delete, the new form as a ratio of the old at the same size. Run by hand:

    .venv/bin/python bench/lookups.py [--steps 100000,300000,1000000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import duckdb

from collector.conversations.tables import SCHEMA
from collector.conversations.writes import delete_messages
from collector.store.transactions import by_keys

INSERT_ROWS = 50_000  # rows per insert while filling: one bulk insert of millions would build the index in memory
LOOKUP = 200


def best(fn: object, repeat: int = 7) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t)
    return min(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", default="100000,300000,1000000")
    args = ap.parse_args()
    steps = [int(s) for s in args.steps.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        con = duckdb.connect(str(Path(tmp) / "lookups.duckdb"), config={"memory_limit": "256MB"})
        con.execute("CREATE TABLE trace_conversations (trace_id VARCHAR PRIMARY KEY, conversation_id VARCHAR NOT NULL)")
        filled = 0
        print(f"{'rows':>10} {'unnest ms':>10} {'by_keys ms':>11} {'by_keys / unnest':>17}")
        for size in steps:
            for lo in range(filled, size, INSERT_ROWS):
                con.execute("INSERT INTO trace_conversations SELECT md5('t' || i::VARCHAR), md5('c' || (i // 4)::VARCHAR) "
                            "FROM range(?, ?) t(i)", [lo, min(size, lo + INSERT_ROWS)])
            filled = size
            con.execute("CHECKPOINT")
            recent = [r[0] for r in con.execute("SELECT md5('t' || i::VARCHAR) FROM range(?, ?) t(i)",
                                                [size - LOOKUP, size]).fetchall()]
            sql = "SELECT trace_id, conversation_id FROM trace_conversations WHERE trace_id IN "
            unnest = best(lambda: con.execute(sql + "(SELECT unnest(?))", [recent]).fetchall())
            keyed = best(lambda: by_keys(con, sql + "{keys}", recent))
            assert len(by_keys(con, sql + "{keys}", recent)) == LOOKUP
            print(f"{size:>10,} {unnest:>10.1f} {keyed:>11.1f} {keyed / unnest:>17.2f}", flush=True)
        messages(con, steps)


MESSAGES_PER_CONVERSATION = 9
REPLACED = 60


def messages(con: duckdb.DuckDBPyConnection, steps: list[int]) -> None:
    con.execute(SCHEMA)
    filled = 0
    print(f"\n{'messages':>10} {'by id ms':>10} {'bounded ms':>11} {'bounded / by id':>16}")
    for size in steps:
        for lo in range(filled, size, INSERT_ROWS):  # conversation i // 9, its first commit i // 900
            con.execute("INSERT INTO messages (conversation_id, seq, role, content, first_batch) "
                        "SELECT md5((i // 9)::VARCHAR), i % 9, 'user', repeat('x', 100), i // 900 FROM range(?, ?) t(i)",
                        [lo, min(size, lo + INSERT_ROWS)])
            con.execute("INSERT INTO conversations (conversation_id, state, first_batch) "
                        "SELECT md5(c::VARCHAR), 'ended', c // 100 FROM range(?, ?) t(c)",
                        [lo // MESSAGES_PER_CONVERSATION, min(size, lo + INSERT_ROWS) // MESSAGES_PER_CONVERSATION])
        filled = size
        con.execute("CHECKPOINT")
        last = size // MESSAGES_PER_CONVERSATION
        ids = [r[0] for r in con.execute("SELECT md5(c::VARCHAR) FROM range(?, ?) t(c)", [last - REPLACED, last]).fetchall()]

        def rolled_back(delete: object) -> None:
            con.execute("BEGIN")
            delete()  # type: ignore[operator]
            con.execute("ROLLBACK")

        by_id = best(lambda: rolled_back(lambda: con.execute(
            "DELETE FROM messages WHERE conversation_id IN (SELECT unnest(?))", [ids])))
        bounded = best(lambda: rolled_back(lambda: delete_messages(con, ids)))
        print(f"{size:>10,} {by_id:>10.1f} {bounded:>11.1f} {bounded / by_id:>16.2f}", flush=True)


if __name__ == "__main__":
    main()
