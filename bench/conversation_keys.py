"""DuckDB's index memory per conversation kept: every conversation keyed (as before) against an archive.

Every conversation kept holds rows in several tables. A primary key's index stays whole in DuckDB's
memory (``ART_INDEX`` in ``duckdb_memory()``) for as long as the rows are kept, so what it costs per
conversation decides how many conversations fit in ``storage.memory_limit``. This fills two DuckDB
files with the same rows, in steps, as the daemon leaves them for each ended conversation, and
checkpoints after each step as the daemon does when its WAL grows (DuckDB frees the index nodes of
deleted keys at a checkpoint, and loads the index back at the next write):

  keyed     every conversation in the keyed ``live_conversations`` (the layout before the archive)
  archived  ended conversations past ``ARCHIVE_KEPT`` moved to ``archived_conversations`` after each
            step, a move at a time as the stage does (``ConversationArchive.move``), with the filter

Each conversation has a random 36-character id, a row and a sampling decision; ``--sampled`` of them
are judged (a progress row, a verdict per ``--criteria``) and, for want of a provider, get as many
not-run records. At each step it prints the index memory (MB) of both after the checkpoint and the next
write, and their ratio, the
filter's bytes per conversation, the milliseconds of the evaluator's scan (``Evaluator._scan``'s joins)
over everything kept, and those of the stage's lookup of 50 ids it has not seen (as for each commit:
the live table by key, then the archive for those the filter may have), all new, then one archived.
Run by hand:

    .venv/bin/python bench/conversation_keys.py [--conversations 1000000] [--sampled 0.1] [--criteria 3]
"""

from __future__ import annotations

import argparse
import tempfile
import datetime as dt
import time
import uuid
from pathlib import Path
from random import Random

import duckdb

from collector.conversations.archive import ConversationArchive
from collector.conversations.tables import SCHEMA as CONVERSATIONS
from collector.conversations.duck import DuckData
from collector.conversations.tracemap import TraceMap
from collector.evals.judging import JUDGEMENT_DUE
from collector.evals.judging import ensure_schema as evals_schema

SCAN = ("SELECT count(*) FROM conversations c LEFT JOIN sampling_decisions s USING (conversation_id) "
        f"LEFT JOIN eval_progress p USING (conversation_id) WHERE c.state = 'ended' AND c.updated_at > ? "
        f"AND {JUDGEMENT_DUE.replace('c.conversation_id', 'conversation_id')}")


def database(path: Path) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect(str(path), config={"memory_limit": "4GB"})
    con.execute(CONVERSATIONS)
    evals_schema(con)
    return con


def fill(con: duckdb.DuckDBPyConnection, ids: list[str], sampled: list[str], criteria: int) -> None:
    old = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    con.execute("INSERT INTO live_conversations (conversation_id, state, revision, updated_at, last_arrival_at) "
                "SELECT x, 'ended', 1, ?, ? FROM unnest(?::VARCHAR[]) t(x)", [old, old, ids])
    con.execute("INSERT INTO sampling_decisions SELECT x, 1, NULL, list_contains(?, x), 0.1, NULL, NULL, ? "
                "FROM unnest(?::VARCHAR[]) t(x)", [sampled, old, ids])
    con.execute("INSERT INTO eval_progress SELECT x, 1, ?, 0, 1, NULL FROM unnest(?::VARCHAR[]) t(x)", [old, sampled])
    con.execute("INSERT INTO verdicts SELECT md5(x || k), nextval('verdict_seq'), x, 'c' || k, 1, 'anthropic', 'm', "
                "md5(x), 'pass', NULL, '', '[]', true, false, 0, 0, NULL, 0.1, NULL, ?, false "
                "FROM unnest(?::VARCHAR[]) t(x), range(?) r(k)", [old, sampled, criteria])
    con.execute("INSERT INTO not_run SELECT x, 'llm' || k, 1, 'no provider configured', ? "
                "FROM unnest(?::VARCHAR[]) t(x), range(?) r(k)", [old, sampled, criteria])


def index_bytes(con: duckdb.DuckDBPyConnection) -> int:
    rows = con.execute("SELECT memory_usage_bytes FROM duckdb_memory() WHERE tag = 'ART_INDEX'").fetchall()
    return rows[0][0] if rows else 0


def scan_ms(con: duckdb.DuckDBPyConnection) -> float:
    since = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)
    times = []
    for _ in range(5):
        began = time.perf_counter()
        con.execute(SCAN, [since]).fetchall()
        times.append(time.perf_counter() - began)
    return sorted(times)[2] * 1000


def lookup_ms(con: duckdb.DuckDBPyConnection, archive: ConversationArchive, ids: list[str]) -> float:
    times = []
    for _ in range(5):
        tracked = TraceMap(archive)
        began = time.perf_counter()
        tracked.load(DuckData(con), ids)
        times.append(time.perf_counter() - began)
    return sorted(times)[2] * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=1_000_000)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--sampled", type=float, default=0.1, help="share of conversations judged")
    p.add_argument("--criteria", type=int, default=3, help="verdicts (and not-run records) per judged conversation")
    args = p.parse_args()
    rnd = Random(1)
    folder = Path(tempfile.mkdtemp(prefix="conversation-keys-"))
    dbs = {name: database(folder / f"{name}.duckdb") for name in ("keyed", "archived")}
    # The keyed layout never moves: a filter that is never written says no to every id.
    archives = {"keyed": ConversationArchive(kept=2**62), "archived": ConversationArchive()}
    step = args.conversations // args.steps
    print(f"{'conversations':>13} {'index MB keyed':>15} {'archived':>9} {'ratio':>6} {'filter B/conv':>14} "
          f"{'scan ms keyed':>14} {'archived':>9} {'lookup ms keyed':>16} {'archived':>9} {'one archived':>13}")
    oldest = ""
    print(f"files in {folder}")
    for n in range(step, step * args.steps + 1, step):
        ids = [str(uuid.UUID(int=rnd.getrandbits(128))) for _ in range(step)]
        oldest = oldest or ids[0]
        sampled = [c for c in ids if rnd.random() < args.sampled]
        for con in dbs.values():
            fill(con, ids, sampled, args.criteria)
        while archives["archived"].move(DuckData(dbs["archived"]), ()):
            pass
        for con in dbs.values():
            con.execute("CHECKPOINT")
            # the next flush of the stage, a few conversations written: DuckDB loads the index back
            con.execute("INSERT INTO live_conversations (conversation_id, state) SELECT x, 'open' "
                        "FROM unnest(?::VARCHAR[]) t(x)", [[str(uuid.UUID(int=rnd.getrandbits(128))) for _ in range(100)]])
        per = {name: index_bytes(con) / 1e6 for name, con in dbs.items()}
        ms = {name: scan_ms(con) for name, con in dbs.items()}
        new = [str(uuid.UUID(int=rnd.getrandbits(128))) for _ in range(50)]
        look = {name: lookup_ms(con, archives[name], new) for name, con in dbs.items()}
        back = lookup_ms(dbs["archived"], archives["archived"], [*new[:49], oldest])
        print(f"{n:>13,} {per['keyed']:>15.1f} {per['archived']:>9.1f} {per['archived'] / per['keyed']:>5.2f}x "
              f"{archives['archived'].filter.nbytes() / n:>14.2f} {ms['keyed']:>14.1f} {ms['archived']:>9.1f} "
              f"{look['keyed']:>16.2f} {look['archived']:>9.2f} {back:>13.2f}")


if __name__ == "__main__":
    main()
