"""Reads and deletes by key as the conversation stage makes them, against the forms they replaced.

The stage asks which conversation each of a commit's traces belongs to (``trace_conversations``, primary
key ``trace_id``), a few hundred traces at a time. Without retention that table only grows, so a read
whose cost follows the table's size slows the stage down for good. This fills a fresh DuckDB file with
trace-map rows in steps (ids as the daemon makes them: 32 hex characters), and at each size times both
forms of the same read of 200 recent traces (``collector.store.by_keys`` makes the first), each best of 7:

  unnest     ``WHERE trace_id IN (SELECT unnest(?))``: a join, which reads the whole column
  by_keys    ``WHERE trace_id IN (?, ?, ...)``: looked up in the primary key's index

Then the same for replacing transcripts: a ``messages`` table of N rows (nine per conversation, written
in order, as the stage appends them), and the delete of 60 recent conversations' messages (rolled back),
one of which has been open since the first commit (its messages were written last, with the others):

  by id      ``DELETE FROM messages WHERE conversation_id IN (SELECT unnest(?))``: reads the whole table
  first      from the smallest ``first_batch`` of their conversations, as the delete was bounded before
             ``messages_batch``: the conversation open since the first commit makes it read everything
  written    ``collector.conversations.duck.delete_messages``: from the smallest ``messages_batch``,
             where their messages were last written

and of the 60 oldest conversations' messages, as retention deletes them: by id, and written (bounded
above by the largest ``messages_batch`` too).

Then the stage's read of traces that left its row cache: ``span_records`` of N spans in commit order (512
a commit, 8 a trace), and 200 recent traces of conversations, one of which has been open since the first
commit (its first trace is among the 200), read by ``RowCache.get``:

  from first   every trace from the earliest first commit among them on, as before each trace's commits
               were kept
  within       each trace within its own first and last commits (``trace_conversations``), the ranges
               merged down to ``MAX_RANGES``

the API's read of one recent trace (``/api/traces/{id}``):

  api view     ``SELECT * FROM spans WHERE trace_id = ?``: every commit, as it read once spans lost their key
  api placed   the trace's conversation and first commit from the keyed map
               (``collector.store.transactions.trace_place``), then the view's rows from that commit on

and the evaluator's read of one conversation's spans (its four most recent traces) for sampling rules that
look at attributes or status, ``collector.evals.evaluator.conversation_facts``:

  facts whole  with no range in the trace map for its traces: the whole table, as every read did before
  facts within with them: within each trace's commits

It prints milliseconds per read or delete, the new form as a ratio of the old at the same size. Run by hand:

    .venv/bin/python bench/lookups.py [--steps 100000,300000,1000000]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import duckdb

from collector.conversations.duck import DuckData
from collector.conversations.rows import RowCache
from collector.conversations.tables import SCHEMA
from collector.conversations.duck import delete_messages
from collector.evals.evaluator import conversation_facts
from collector.store.schema import SCHEMA as STORE_SCHEMA
from collector.store.schema import SPANS
from collector.store.transactions import by_keys, trace_place

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
        con.close()
        con = duckdb.connect(str(Path(tmp) / "reads.duckdb"), config={"memory_limit": "256MB"})
        trace_reads(con, steps)


MESSAGES_PER_CONVERSATION = 9
REPLACED = 60


def messages(con: duckdb.DuckDBPyConnection, steps: list[int]) -> None:
    con.execute(SCHEMA)
    filled = 0
    print(f"\n{'messages':>10} {'by id ms':>10} {'first ms':>9} {'written ms':>11} {'written / by id':>16} "
          f"{'written / first':>16} {'oldest by id':>13} {'oldest written':>15} {'ratio':>6}")
    for size in steps:
        for lo in range(filled, size, INSERT_ROWS):  # conversation i // 9, its first commit and messages i // 900
            con.execute("INSERT INTO messages (conversation_id, seq, role, content, first_batch) "
                        "SELECT md5((i // 9)::VARCHAR), i % 9, 'user', repeat('x', 100), i // 900 FROM range(?, ?) t(i)",
                        [lo, min(size, lo + INSERT_ROWS)])
            con.execute("INSERT INTO live_conversations (conversation_id, state, first_batch, messages_batch) "
                        "SELECT md5(c::VARCHAR), 'ended', c // 100, c // 100 FROM range(?, ?) t(c)",
                        [lo // MESSAGES_PER_CONVERSATION, min(size, lo + INSERT_ROWS) // MESSAGES_PER_CONVERSATION])
        filled = size
        con.execute("CHECKPOINT")
        last = size // MESSAGES_PER_CONVERSATION
        ids = [r[0] for r in con.execute("SELECT md5(c::VARCHAR) FROM range(?, ?) t(c)", [last - REPLACED, last]).fetchall()]
        con.execute("UPDATE live_conversations SET first_batch = 0 WHERE conversation_id = ?", [ids[-1]])  # open since the start
        con.execute("CHECKPOINT")

        def rolled_back(delete: object) -> None:
            con.execute("BEGIN")
            delete()  # type: ignore[operator]
            con.execute("ROLLBACK")

        by_id = best(lambda: rolled_back(lambda: con.execute(
            "DELETE FROM messages WHERE conversation_id IN (SELECT unnest(?))", [ids])))
        low = min(r[0] for r in by_keys(con, "SELECT first_batch FROM conversations WHERE conversation_id IN {keys}", ids))
        first = best(lambda: rolled_back(lambda: con.execute(
            "DELETE FROM messages WHERE first_batch >= ? AND conversation_id IN (SELECT unnest(?))", [low, ids])))
        written = best(lambda: rolled_back(lambda: delete_messages(con, ids)))
        oldest = [r[0] for r in con.execute("SELECT md5(c::VARCHAR) FROM range(?) t(c)", [REPLACED]).fetchall()]
        old_by_id = best(lambda: rolled_back(lambda: con.execute(
            "DELETE FROM messages WHERE conversation_id IN (SELECT unnest(?))", [oldest])))
        old_written = best(lambda: rolled_back(lambda: delete_messages(con, oldest)))
        print(f"{size:>10,} {by_id:>10.1f} {first:>9.1f} {written:>11.1f} {written / by_id:>16.2f} "
              f"{written / first:>16.2f} {old_by_id:>13.1f} {old_written:>15.1f} {old_written / old_by_id:>6.2f}",
              flush=True)


SPANS_PER_COMMIT = 512
SPANS_PER_TRACE = 8


def trace_reads(con: duckdb.DuckDBPyConnection, steps: list[int]) -> None:
    con.execute(STORE_SCHEMA)
    filled = 0
    print(f"\n{'spans':>10} {'from first ms':>14} {'within ms':>10} {'within / from first':>20} "
          f"{'facts whole ms':>15} {'facts within ms':>16} {'within / whole':>14} {'api view ms':>12} "
          f"{'api placed ms':>13} {'placed / view':>13}")
    for size in steps:
        for lo in range(filled, size, INSERT_ROWS):
            con.execute("INSERT INTO span_records (trace_id, span_id, name, attributes, received_at, batch_id) "
                        "SELECT md5('t' || (i // ?)::VARCHAR), (i % ?)::VARCHAR, 'chat', '{\"a\": \"' || repeat('x', 400) || '\"}', now(), "
                        "i // ? FROM range(?, ?) t(i)",
                        [SPANS_PER_TRACE, SPANS_PER_TRACE, SPANS_PER_COMMIT, lo, min(size, lo + INSERT_ROWS)])
        filled = size
        con.execute("CHECKPOINT")
        last_trace = size // SPANS_PER_TRACE
        numbers = [0, *range(last_trace - LOOKUP + 1, last_trace)]  # the long conversation's first trace, and recent ones
        batches = {n: (n * SPANS_PER_TRACE // SPANS_PER_COMMIT, ((n + 1) * SPANS_PER_TRACE - 1) // SPANS_PER_COMMIT)
                   for n in numbers}
        ids = {r[0]: n for n, r in zip(numbers, (con.execute("SELECT md5('t' || ?::VARCHAR)", [str(n)]).fetchone()
                                                  for n in numbers))}
        first = min(lo for lo, _ in batches.values())

        def read(where: object) -> None:
            got = RowCache(0).get(DuckData(con), list(ids), where=where)  # type: ignore[arg-type]
            assert sum(len(r.spans) for r in got.values()) == len(ids) * SPANS_PER_TRACE

        from_first = best(lambda: read(lambda ts: {t: (first, None) for t in ts}), repeat=5)
        within = best(lambda: read(lambda ts: {t: batches[ids[t]] for t in ts}), repeat=5)
        # The sampling rules' read of one conversation (four recent traces), without and with the trace map.
        recent = list(ids)[-4:]
        conversation = {"trace_ids": json.dumps(recent), "conversation_id": "c", "ended_by": "idle", "service": "s",
                        "models": None, "user_turns": 1}
        con.execute("DELETE FROM trace_conversations")
        whole = best(lambda: conversation_facts(con, conversation, {"gen_ai.request.model"}, True), repeat=5)
        con.executemany("INSERT INTO trace_conversations (trace_id, conversation_id, first_batch, last_batch) "
                        "VALUES (?, 'c', ?, ?)", [(t, *batches[ids[t]]) for t in recent])
        facts = best(lambda: conversation_facts(con, conversation, {"gen_ai.request.model"}, True), repeat=5)
        # The API's read of one recent trace: the view, against the rows from its first commit on.
        tid = recent[-1]
        view = best(lambda: con.execute("SELECT * FROM spans WHERE trace_id = ?", [tid]).fetchall(), repeat=5)

        def placed() -> list[Any]:
            conversation_id, first = trace_place(con, tid)
            one_trace = "(SELECT ?::VARCHAR AS trace_id, ?::VARCHAR AS conversation_id)"
            return con.execute(f"SELECT * FROM ({SPANS.format(map=one_trace)}) WHERE trace_id = ? AND batch_id >= ?",
                               [tid, conversation_id, tid, first]).fetchall()

        assert len(placed()) == SPANS_PER_TRACE
        api = best(placed, repeat=5)
        print(f"{size:>10,} {from_first:>14.1f} {within:>10.1f} {within / from_first:>20.2f} "
              f"{whole:>15.1f} {facts:>16.1f} {facts / whole:>14.2f} {view:>12.1f} {api:>13.1f} "
              f"{api / view:>13.2f}", flush=True)


if __name__ == "__main__":
    main()
