"""Restart and reindex on a large file: how long the daemon takes to end what became overdue while it was
down, how fast it stops on SIGTERM meanwhile, and a reindex's time and peak RSS.

Takes the folder ``bench/memory.py --keep DIR`` leaves (a config and a DuckDB file
of its workload), and works on copies of the file:

  downtime   every conversation marked open again, as if the daemon had stopped
             before any went idle; a start with a 2 s idle timeout must end them
             all: seconds from the start until none is open
  sigterm    the same, with SIGTERM sent once the sweep has begun: seconds until
             the daemon exits
  reindex    ``tracejudge reindex`` on the file: seconds, peak RSS, and whether it
             wrote the same conversations and messages the live stage did

Each is printed against a start on an empty file measured in the same run
(the fixed cost of a start). Run by hand:

    .venv/bin/python bench/restart.py DIR
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import duckdb

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ingest  # noqa: E402
import memory  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SAME = ("SELECT * EXCLUDE (updated_at, closed_at, first_arrival_at, revision, messages_batch) FROM conversations "
        "ORDER BY ALL", "SELECT * EXCLUDE (first_batch) FROM messages ORDER BY ALL",  # where written: its own
        "SELECT * FROM trace_map ORDER BY ALL")


def copy_of(src: Path, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    for name in ("bench.duckdb", "bench.duckdb.wal", "criteria.yaml"):
        if (src / name).exists():
            shutil.copy(src / name, into / name)
    cfg = (src / "otel-config.yaml").read_text().replace(str(src), str(into))
    (into / "otel-config.yaml").write_text(cfg)
    return into


def reopen_all(db: Path) -> int:
    con = duckdb.connect(str(db))
    try:
        con.execute("UPDATE live_conversations SET state = 'open', ended_at = NULL, ended_by = NULL, closed_at = NULL")
        return int(con.execute("SELECT count(*) FROM conversations").fetchone()[0])
    finally:
        con.close()


def start(folder: Path) -> tuple[subprocess.Popen[bytes], dict[str, Any], float]:
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "collector", "serve", "--config", str(folder / "otel-config.yaml"),
                             "--log-level", "warning"], stdout=subprocess.DEVNULL, cwd=REPO)
    runtime = folder / "bench.duckdb.daemon.json"
    while True:
        if proc.poll() is not None:
            raise SystemExit("tracejudge did not start")
        if runtime.exists():
            try:
                info = json.loads(runtime.read_text())
                memory.get(info["api"], "/api/status")
                return proc, info, time.perf_counter() - t
            except (ValueError, OSError):
                pass
        time.sleep(0.02)


def open_count(api: str) -> int:
    return int(memory.get(api, "/api/status").get("conversations_pending", 0)) + len(
        memory.get(api, "/api/conversations?state=open&limit=1")["conversations"])


def downtime(src: Path, work: Path) -> tuple[int, float, float]:
    folder = copy_of(src, work / "downtime")
    n = reopen_all(folder / "bench.duckdb")
    t = time.perf_counter()
    proc, info, _ = start(folder)
    try:
        while memory.get(info["api"], "/api/conversations?state=open&limit=1")["conversations"]:
            time.sleep(0.1)
        ended = time.perf_counter() - t
        return n, ended, ingest.peak_rss_mb(proc.pid)
    finally:
        proc.terminate()
        proc.wait()


def sigterm(src: Path, work: Path) -> float:
    folder = copy_of(src, work / "sigterm")
    reopen_all(folder / "bench.duckdb")
    proc, info, _ = start(folder)
    time.sleep(1.0)  # the sweep has begun (its first chunks are written within a second)
    t = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=300)
    return time.perf_counter() - t


def reindex(src: Path, work: Path) -> tuple[float, float, bool]:
    folder = copy_of(src, work / "reindex")
    con = duckdb.connect(str(folder / "bench.duckdb"), read_only=True)
    live = [con.execute(q).fetchall() for q in SAME]
    con.close()
    peak = [0.0]
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "collector", "reindex", "--config", str(folder / "otel-config.yaml")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)

    def watch() -> None:
        while proc.poll() is None:
            try:
                peak[0] = max(peak[0], ingest.peak_rss_mb(proc.pid))
            except (OSError, ValueError):
                pass
            time.sleep(0.2)

    w = threading.Thread(target=watch, daemon=True)
    w.start()
    rc = proc.wait()
    took = time.perf_counter() - t
    w.join()
    if rc != 0:
        raise SystemExit(f"reindex exited {rc}")
    con = duckdb.connect(str(folder / "bench.duckdb"), read_only=True)
    same = [con.execute(q).fetchall() for q in SAME] == live
    con.close()
    return took, peak[0], same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        empty = copy_of(args.folder, work / "empty")
        (empty / "bench.duckdb").unlink()
        proc, _, base = start(empty)
        proc.terminate()
        proc.wait()
        print(f"baseline: a start on an empty file takes {base:.2f}s", flush=True)
        n, ended, rss = downtime(args.folder, work)
        print(f"downtime: {n:,} overdue conversations ended {ended:.1f}s after the start "
              f"({ended / base:.1f}x a start; target 60 s), peak RSS {rss:.0f} MB", flush=True)
        stop = sigterm(args.folder, work)
        print(f"sigterm:  exited {stop:.1f}s after SIGTERM during that sweep ({stop / base:.1f}x a start; "
              "target 5 s)", flush=True)
        took, peak, same = reindex(args.folder, work)
        print(f"reindex:  {took:.0f}s ({took / base:.0f}x a start), peak RSS {peak:.0f} MB (target 400), "
              f"{'the same' if same else 'NOT the same'} conversations and messages as the live stage", flush=True)


if __name__ == "__main__":
    main()
