"""Memory probe: where the daemon's memory goes as the stored history grows.

Feeds the real daemon ``bench/ingest.py``'s workload in steps (each step new
traces: four-turn conversations, idle-ended after 2 s, sampled for a code check
that always fails, so the evaluator and the review queue work too), waits after
each step until conversations are current and ended, and reads /metrics: the
resident set, DuckDB's memory by what holds it (``duckdb_memory()``: cached
table blocks, primary-key indexes, ...), the rest (the interpreter, its heap,
the allocator's free lists) and what each stage holds in rows. Then it restarts
the daemon on the same file: what memory the data itself needs. Figures are
printed against the first step of the same run. Run by hand:

    .venv/bin/python bench/memory.py [--steps 4] [--step-spans 250000] [--transport grpc|http] [--keep DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ingest  # noqa: E402  (the workload and the daemon launcher of the ingest benchmark)

CRITERIA = """criteria:
  - id: never-passes
    version: 1
    kind: code
    check: tool_called
    name: no_such_tool
"""
MB = 1_000_000


def get(api: str, path: str) -> Any:
    with urllib.request.urlopen(api + path, timeout=60) as resp:
        body = resp.read().decode()
    return json.loads(body) if path.startswith("/api") else body


def settled(api: str, timeout: float = 600) -> float:
    """Wait until conversations are current and none is open; seconds it took."""
    t = time.perf_counter()
    while time.perf_counter() - t < timeout:
        st = get(api, "/api/status")
        if (st["conversations_batch"] >= st["committed_batch"] and not st["conversations_pending"]
                and not st["queue_depth"] and not get(api, "/api/conversations?state=open&limit=1")["conversations"]
                and not st.get("evals_pending")):
            return time.perf_counter() - t
        time.sleep(0.25)
    raise SystemExit(f"not settled after {timeout}s: {st}")


def sample(api: str, count: bool = True) -> dict[str, float]:
    text = get(api, "/metrics")
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r'^(process_resident_memory_bytes|tracejudge_duckdb_memory_bytes\{tag="(\w+)"\}|'
                     r'tracejudge_stage_held\{stage="(\w+)",what="(\w+)"\}|'
                     r'(tracejudge_conversations_process_resident_memory_bytes)) (\S+)$', line)
        if not m:
            if a := re.match(r'^tracejudge_allocator_bytes\{kind="(\w+)"\} (\S+)$', line):
                out[f"alloc {a.group(1)}"] = float(a.group(2)) / MB
            continue
        value = float(m.group(6))
        if m.group(5):
            out["stage process"] = value / MB
        elif m.group(2):
            out[f"duckdb {m.group(2)}"] = value / MB
        elif m.group(3):
            out[f"{m.group(3)} {m.group(4)}"] = value
        else:
            out["rss"] = value / MB
    duck = sum(v for k, v in out.items() if k.startswith("duckdb "))
    out["duckdb total"] = duck
    out["outside duckdb"] = out["rss"] - duck
    out["rss"] += out.get("stage process", 0.0)  # the conversation stage's process is the daemon's memory too
    if count:
        out["spans stored"] = get(api, "/api/spans/count")["spans"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--step-spans", type=int, default=250_000)
    ap.add_argument("--transport", choices=("grpc", "http"), default="grpc")
    ap.add_argument("--keep", type=Path, help="Keep the daemon's folder (config, DuckDB file) here, to reuse "
                                               "the file (bench/reindex.py, bench/restart.py).")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = args.keep or Path(tmp)
        data.mkdir(parents=True, exist_ok=True)
        (data / "criteria.yaml").write_text(CRITERIA)
        extra = ("conversations: {idle_timeout: 2s}\nsampling: {rate: 0.1}\n"
                 f"judges: {{criteria: ['{data / 'criteria.yaml'}']}}\n")
        proc, info = ingest.start_daemon(data, extra)
        rows: list[dict[str, float]] = []
        try:
            per_step = args.step_spans // ingest.SPANS_PER_REQUEST
            for step in range(args.steps):
                bodies = ingest.make_requests(args.step_spans, first=step * per_step)
                target = info["grpc"] if args.transport == "grpc" else f"http://{info['http']}/v1/traces"
                elapsed, lat, _ = asyncio.run(ingest.send_all(bodies, args.transport, target))
                del bodies
                lag = settled(info["api"])
                row = sample(info["api"])
                row.update({"peak rss": ingest.peak_rss_mb(proc.pid), "spans/s": args.step_spans / elapsed,
                            "p99 ms": ingest.latency_figures(lat)["p99_ms"], "settled s": lag})
                rows.append(row)
                print(f"step {step + 1}: {row['spans stored']:,.0f} spans stored, RSS {row['rss']:.0f} MB "
                      f"(peak {row['peak rss']:.0f}), DuckDB {row['duckdb total']:.0f} MB, settled in {lag:.0f}s",
                      flush=True)
        finally:
            proc.terminate()
            proc.wait()
        proc, info = ingest.start_daemon(data, extra)  # the same file, nothing held yet
        try:
            settled(info["api"])
            restart = sample(info["api"])
        finally:
            proc.terminate()
            proc.wait()
    keys = ["spans stored", "rss", "peak rss", "duckdb total"]
    keys += sorted(k for k in rows[-1] if k.startswith("duckdb ") and k != "duckdb total")
    keys += ["outside duckdb", "stage process"] + sorted(k for k in rows[-1] if k.split(" ")[0] in
                                        ("conversations", "evaluator", "retention"))
    keys += ["spans/s", "p99 ms", "settled s"]
    first = rows[0]
    print(f"\n{'':28}" + "".join(f"{'step ' + str(i + 1):>16}" for i in range(len(rows))) + f"{'restart':>16}")
    for k in keys:
        cells = []
        for r in rows + [restart]:
            v = r.get(k)
            if v is None:
                cells.append(f"{'-':>16}")
                continue
            ratio = f" ({v / first[k]:.2f}x)" if first.get(k) else ""
            cells.append(f"{v:>9,.0f}{ratio:>7}")
        print(f"{k:28}" + "".join(cells))
    print("\nMB for memory rows; held rows are entries; the ratio is against step 1 of this run.")


if __name__ == "__main__":
    main()
