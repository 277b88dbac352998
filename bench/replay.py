"""``tracejudge replay export`` from the file: conversations/s and peak RSS against a plain read of the same rows.

Fills a fresh store with N synthetic conversations (``--conversations``, a
million by default) written as rows with SQL, not through OTLP: 8 messages each
(4 user, 4 assistant, one tool call), each conversation's messages together
(as the conversation stage writes them, a conversation at a time), ids that are
not in insertion order (as in production, where conversations interleave), and
a sampling decision for each (one in ten picked), then measures, each in a process
of its own and with no daemon running:

  baseline   a plain ``SELECT`` of the same rows and columns, the conversations
             and their messages, each in one query ordered by conversation id,
             fetched into Python a batch at a time: the read an export cannot
             avoid
  export     ``tracejudge replay export --out FILE``: a walk of the store by
             storage position (``collector.api.export``), each record built by
             the one conversation/v1 builder and written as a JSON line

and prints conversations/s and peak RSS of each, the export as a ratio of the
baseline (targets: at least 5,000 conversations/s, peak RSS under 300 MB).

Run by hand, not part of the tests::

    .venv/bin/python bench/replay.py [--conversations 1000000] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, this file's folder leads sys.path and this file would shadow the replay package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


REPO = Path(__file__).resolve().parent.parent
MESSAGES = 8

FILL_CONVERSATIONS = """
INSERT INTO live_conversations
SELECT 'c-' || md5(i::VARCHAR), 'shopbot', ts - INTERVAL 5 MINUTE, CASE WHEN i % 20 = 0 THEN NULL ELSE ts END,
       CASE WHEN i % 20 = 0 THEN NULL WHEN i % 7 = 0 THEN 'handover' ELSE 'idle' END,
       CASE WHEN i % 20 = 0 THEN 'open' ELSE 'ended' END, 4, 2000 + i % 500, 300 + i % 90, 5, 8,
       '["gpt-4o-mini"]', 'You are ShopBot, the support assistant of an online bookshop. Answer briefly.', true, NULL,
       md5('hash' || i), 1, '["' || md5('trace' || i) || '"]', md5('trace' || i), ts - INTERVAL 5 MINUTE, ts,
       CASE WHEN i % 20 = 0 THEN NULL ELSE ts END, ts, 0, 0, '["otel_genai"]', NULL
FROM (SELECT i, TIMESTAMPTZ '2026-11-01 00:00:00+00' + i * INTERVAL 1 SECOND AS ts FROM range(?, ?) t(i))
"""

FILL_MESSAGES = f"""
INSERT INTO messages
SELECT 'c-' || md5(i::VARCHAR), k, CASE WHEN k % 2 = 0 THEN 'user' ELSE 'assistant' END,
       CASE WHEN k = 1 THEN ''
            WHEN k % 2 = 0 THEN 'Hi, my order B-' || i || ' has not arrived yet, it was due on Monday. Where is it? ' || k
            ELSE 'Your order B-' || i || ' shipped on Monday with the carrier and is out for delivery today '
                 || 'before 6pm. Anything else I can do for you? ' || k END,
       CASE WHEN k = 1 THEN '[{{"id": "call_' || i || '", "name": "lookup_order", "arguments": {{"order_id": "B-'
                            || i || '"}}}}]' END,
       NULL, NULL, TIMESTAMPTZ '2026-11-01 00:00:00+00' + i * INTERVAL 1 SECOND + k * INTERVAL 5 SECOND,
       substr(md5('span' || i || k), 1, 16), 'otel_genai', false, NULL
FROM range(?, ?) t(i), range({MESSAGES}) s(k)
ORDER BY i, k
"""

# A sampling decision per conversation, one in ten picked, as the sampler leaves them.
FILL_DECISIONS = """
INSERT INTO sampling_decisions
SELECT 'c-' || md5(i::VARCHAR), 1, md5('hash' || i), i % 10 = 0, 0.1, 'default', NULL,
       TIMESTAMPTZ '2026-11-01 00:00:00+00' + i * INTERVAL 1 SECOND
FROM range(?, ?) t(i)
"""

BASELINE = """
import sys, duckdb
from collector.conversations.record import message_select, stored_select
con = duckdb.connect(sys.argv[1], read_only=True)
n = 0
for sql in (f"SELECT {stored_select()} FROM conversations ORDER BY conversation_id",
            f"SELECT {message_select(text_times=True)} FROM messages ORDER BY conversation_id, seq"):
    cur = con.cursor()
    cur.execute(sql)
    while True:
        rows = cur.fetchmany(10000)
        if not rows:
            break
        n += len(rows)
print(n)
"""


def fill(folder: Path, n: int) -> Path:
    """A store in ``folder`` holding ``n`` conversations; its config file.

    Run in a process of its own (``--fill``): a child's peak RSS, as the kernel reports it, starts at its
    parent's, so the process that starts the measured commands must stay small.
    """
    import duckdb

    from collector.conversations.tables import SCHEMA as CONVERSATIONS_SCHEMA
    from collector.evals import judging
    from collector.review import queue as review_queue
    from collector.store import Store

    db = folder / "bench.duckdb"
    store = Store(db)
    store.open()
    cur = store.cursor()
    cur.execute(CONVERSATIONS_SCHEMA)
    judging.ensure_schema(cur)
    review_queue.ensure_schema(cur)
    cur.close()
    store.close()
    con = duckdb.connect(str(db))
    step = 200_000
    for start in range(0, n, step):
        con.execute(FILL_CONVERSATIONS, [start, min(n, start + step)])
        con.execute(FILL_MESSAGES, [start, min(n, start + step)])
        con.execute(FILL_DECISIONS, [start, min(n, start + step)])
        print(f"  filled {min(n, start + step):,} of {n:,}", file=sys.stderr, flush=True)
    con.execute("CHECKPOINT")
    con.close()
    cfg = folder / "otel-config.yaml"
    cfg.write_text(f"storage:\n  duckdb:\n    path: '{db}'\napi:\n  endpoint: 127.0.0.1:0\n", encoding="utf-8")
    return cfg


def timed(cmd: list[str]) -> tuple[float, float, float, str]:
    """Seconds, CPU seconds (user and system, every thread), peak RSS (MB) and output of a process run to
    its end."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    took = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    out, err = proc.stdout.read() if proc.stdout else "", proc.stderr.read() if proc.stderr else ""
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}: {err}")
    return took, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, out + err  # ru_maxrss: KiB on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=1_000_000)
    ap.add_argument("--keep", type=Path, help="Build the store in this folder and leave it there.")
    ap.add_argument("--fill", type=Path, help=argparse.SUPPRESS)  # the child that fills the store
    args = ap.parse_args()
    n = args.conversations
    if args.fill:
        fill(args.fill, n)
        return
    with tempfile.TemporaryDirectory(prefix="tracejudge-bench-replay-") as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--fill", str(folder), "--conversations", str(n)], check=True,
                       cwd=REPO)
        cfg = folder / "otel-config.yaml"
        print(f"store: {n:,} conversations, {n * MESSAGES:,} messages, "
              f"{(folder / 'bench.duckdb').stat().st_size / 2**20:.0f} MB, filled in {time.perf_counter() - t:.0f}s")
        base_s, base_cpu, base_rss, _ = timed([sys.executable, "-c", BASELINE, str(folder / "bench.duckdb")])
        out = folder / "real.jsonl"
        export_s, export_cpu, export_rss, said = timed([sys.executable, "-m", "collector", "replay", "export",
                                                        "--config", str(cfg), "--out", str(out)])
        lines = sum(1 for _ in out.open("rb"))
        assert lines == n, (lines, said)
        # CPU seconds too: on a busy machine the wall clock says more about the neighbours than about this.
        print(f"baseline (plain SELECT of the rows): {n / base_s:>9,.0f} conversations/s  {base_s:6.1f}s  "
              f"(CPU {base_cpu:5.1f}s)  peak RSS {base_rss:4.0f} MB")
        print(f"replay export from the file:         {n / export_s:>9,.0f} conversations/s  {export_s:6.1f}s  "
              f"(CPU {export_cpu:5.1f}s)  peak RSS {export_rss:4.0f} MB")
        print(f"  export / baseline: {base_s / export_s:.2f}x the rate, {export_cpu / base_cpu:.1f}x the CPU; "
              f"{n / export_cpu:,.0f} conversations per CPU second (targets: 5,000/s, 300 MB)")
        print(f"  wrote {out.stat().st_size / 2**20:.0f} MB")


if __name__ == "__main__":
    main()
