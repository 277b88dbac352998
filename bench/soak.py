"""Soak: the daemon under a paced load for a long run, with retention deleting as fast as data arrives.

Sends ``bench/ingest.py``'s workload (four-turn conversations, 512 spans per
request) over OTLP/gRPC at a paced rate, to a daemon that ends conversations
after 2 s idle, samples 10% of them (``--sampling``) for a code check that always fails (so the
evaluator and the review queue work) and keeps ``--retention`` of spans (twice
that of conversations). Every ``--interval`` seconds it samples the resident
set of the daemon and of its conversation stage's process (and the sum of
their peaks so far), their proportional set (shared pages counted once, as a
container's limit counts them; also every second, for the interval's peak, with the daemon's own share
and its processes' at that peak), the DuckDB file with its WAL, the p99 latency of the requests answered
in the interval, how far conversations lag (commits taken in
but not yet current), rows deleted, what the stages hold and the cores used by the daemon, by its
processes and by this load generator (CPU time over the interval); then it prints
them as a table against the first interval, checks the targets, and says how
long after the last ack the conversations were current, how much of the
file is in use at the end (the rest is free blocks DuckDB writes into next), and
the CPU each span cost the daemon, its processes and the load generator over the
run: the most spans/s the machine's cores sustain with all the stages keeping up.
``--trace`` keeps every second's sample: the proportional sets, DuckDB's memory by tag, what its
allocator holds (``tracejudge_allocator_bytes``) and the daemon's anonymous and file-backed shares.
Run by hand:

    .venv/bin/python bench/soak.py [--spans 3000000] [--rate 10000] [--interval 30] [--retention 90s|off]
                                   [--sampling 0.1] [--baseline c6e3abb --rounds 2]

``--retention off`` and ``--sampling 0`` leave out deleting and judging, to see what each costs per span.
``--baseline REF`` runs the same soak on another commit's code (``git archive``), alternating with this
tree's for ``--rounds``, and prints the CPU per span of each and their ratio: one run, one machine's noise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ingest  # noqa: E402  (the workload and the daemon launcher of the ingest benchmark)
import memory  # noqa: E402  (reading /metrics and the API)

PSS_EVERY = 1.0  # seconds between two samples of the proportional set
MB = 1_000_000
IN_FLIGHT = 8  # requests outstanding at most; the pace decides when the next one goes


async def paced(grpc_target: str, total: int, rate: float, answered: list[tuple[float, float]]) -> float:
    """Send ``total`` spans at ``rate`` spans/s; each answer is (when, latency). The time of the last ack."""
    import grpc

    channel = grpc.aio.insecure_channel(grpc_target, options=[("grpc.max_send_message_length", 64 * 1024 * 1024)])
    call = channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export",
                               request_serializer=None, response_deserializer=None)
    gate = asyncio.Semaphore(IN_FLIGHT)
    every = ingest.SPANS_PER_REQUEST / rate
    start = time.perf_counter()
    requests = total // ingest.SPANS_PER_REQUEST
    last_ack = start

    async def one(body: bytes) -> None:
        nonlocal last_ack
        try:
            while True:
                t = time.perf_counter()
                try:
                    await call(body, timeout=60)
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.5)  # refused (queue full): the exporter's retry
            now = time.perf_counter()
            answered.append((now, now - t))
            last_ack = max(last_ack, now)
        finally:
            gate.release()

    tasks = []
    for r in range(requests):
        due = start + r * every
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        body = ingest.make_requests(ingest.SPANS_PER_REQUEST, first=r)[0]
        await gate.acquire()
        tasks.append(asyncio.ensure_future(one(body)))
    await asyncio.gather(*tasks)
    await channel.close()
    return last_ack


def current_after(api: str, last_ack: float) -> float:
    """Seconds from the last ack until every commit is taken in and every conversation rebuilt."""
    while True:
        st = memory.get(api, "/api/status")
        if st["conversations_batch"] >= st["committed_batch"] and not st["conversations_pending"] \
                and not st["queue_depth"]:
            return time.perf_counter() - last_ack
        time.sleep(0.05)


def file_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in (path, Path(f"{path}.wal")) if p.exists())


def duckdb_tags(api: str) -> tuple[dict[str, float], dict[str, float]]:
    """DuckDB's memory (MB) by what holds it, and what the daemon's C allocators hold, from /metrics."""
    m = memory.sample(api, count=False)
    return ({k[len("duckdb "):]: v for k, v in m.items() if k.startswith("duckdb ") and k != "duckdb total"
             and v >= 0.05}, {k[len("alloc "):]: v for k, v in m.items() if k.startswith("alloc ")})


def rollup(pid: int) -> dict[str, float]:
    """The daemon's proportional set split into anonymous memory and mapped files (its libraries), MB."""
    out: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("Pss_Anon", "Pss_File"):
            out[key] = round(int(rest.split()[0]) / 1024, 1)
    return out


def cpu_seconds(pid: int) -> float:
    """User and system CPU time a process has used (all its threads), in seconds; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def cores(pid: int, last: dict[int, float], seconds: float) -> dict[str, float]:
    """Cores used since ``last`` (updated) by the daemon, its processes together, and this load generator."""
    now = {p: cpu_seconds(p) for p in (pid, *ingest._children(pid), os.getpid())}
    used = {p: max(0.0, t - last.get(p, 0.0)) / seconds for p, t in now.items()}
    last.clear()
    last.update(now)
    return {"cores: daemon": used[pid], "cores: its processes": sum(u for p, u in used.items()
                                                                     if p not in (pid, os.getpid())),
            "cores: load": used[os.getpid()]}


def sampler(info: dict[str, Any], pid: int, db: Path, interval: float, answered: list[tuple[float, float]],
            rows: list[dict[str, float]], done: list[bool], trace: Any) -> None:
    seen = 0
    start = time.perf_counter()
    cpu: dict[int, float] = {}
    cores(pid, cpu, 1.0)
    while not done[0]:
        # The proportional set every second: its largest in the interval is the peak a container's limit sees.
        # DuckDB's memory by tag too: its largest in the interval, and what held it then.
        peak_pss, peak_daemon, peak_duck, duck_tags, end = 0.0, 0.0, 0.0, {}, time.perf_counter() + interval
        while (left := end - time.perf_counter()) > 0:
            time.sleep(min(PSS_EVERY, left))
            parts = ingest.pss_parts(pid)
            tags, allocs = duckdb_tags(info["api"])
            if trace:
                trace.write(json.dumps({"t": round(time.perf_counter() - start, 1), "wall": time.strftime("%H:%M:%S"),
                                        "pss": {str(k): round(v, 1) for k, v in parts.items()},
                                        "duckdb": {k: round(v, 1) for k, v in tags.items()},
                                        "allocators": {k: round(v, 1) for k, v in allocs.items()},
                                        "daemon": rollup(pid)}) + "\n")
                trace.flush()
            if sum(parts.values()) > peak_pss:  # where the peak is: the daemon's own share, or its processes'
                peak_pss, peak_daemon = sum(parts.values()), parts.get(pid, 0.0)
            if sum(tags.values()) > peak_duck:
                peak_duck, duck_tags = sum(tags.values()), tags
        now = time.perf_counter()
        lat = [lat for at, lat in answered[seen:]]
        seen = len(answered)
        m = memory.sample(info["api"])
        st = memory.get(info["api"], "/api/status")
        deleted = st["storage"]["retention"].get("deleted", {})
        rows.append({
            "t": now - start, "spans stored": m["spans stored"], "rss": m["rss"],
            "peak rss": ingest.peak_rss_mb(pid), "pss": ingest.pss_mb(pid), "peak pss": peak_pss,
            "at peak: daemon": peak_daemon, "at peak: children": peak_pss - peak_daemon, "duckdb": m["duckdb total"],
            "duckdb index": m.get("duckdb ART_INDEX", 0.0), "outside duckdb": m["outside duckdb"],
            "stage process": m.get("stage process", 0.0), "duckdb peak": peak_duck,
            **cores(pid, cpu, now - (rows[-1]["t"] + start if rows else start)),
            "file": file_bytes(db) / MB, "p99 ms": sorted(lat)[int(len(lat) * 0.99) - 1] * 1000 if lat else 0.0,
            "spans/s": len(lat) * ingest.SPANS_PER_REQUEST / interval,
            "lag commits": st["committed_batch"] - st["conversations_batch"], "commits": st["committed_batch"],
            "deleted spans": deleted.get("spans", 0), "deleted convs": deleted.get("conversations", 0),
        })
        r = rows[-1]
        print(f"  {r['t']:5.0f}s  {r['spans stored']:>10,.0f} stored  RSS {r['rss']:4.0f} MB (peak {r['peak rss']:.0f})"
              f"  file {r['file']:5.0f} MB  p99 {r['p99 ms']:4.0f} ms  {r['spans/s']:>7,.0f} spans/s"
              f"  lag {r['lag commits']:.0f} of {r['commits']:.0f} commits  deleted {r['deleted spans']:,.0f}", flush=True)
        print("         DuckDB's peak " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(
            duck_tags.items(), key=lambda kv: -kv[1])) + " MB", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spans", type=int, default=3_000_000)
    ap.add_argument("--rate", type=float, default=10_000)
    ap.add_argument("--interval", type=float, default=30)
    ap.add_argument("--retention", default="90s", help="spans kept (conversations twice that), or off")
    ap.add_argument("--sampling", type=float, default=0.1, help="share of conversations judged [0.1]")
    ap.add_argument("--baseline", help="a git ref whose code also runs the same soak, alternating with this "
                                       "tree's (e.g. c6e3abb): the CPU per span of each, and the ratio")
    ap.add_argument("--rounds", type=int, default=1, help="runs of each code, alternated (with --baseline)")
    ap.add_argument("--trace", type=Path, help="Write every second's proportional sets and DuckDB memory by tag "
                                                 "here, as JSON lines (to line up with the daemon's log).")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        codes = [("this tree", ingest.REPO)]
        if args.baseline:
            codes.insert(0, (args.baseline, ingest.checkout(args.baseline, Path(tmp) / "baseline-code")))
        cpu: dict[str, list[float]] = {label: [] for label, _ in codes}
        for r in range(args.rounds if args.baseline else 1):
            for label, code in codes:
                print(f"\n=== {label}, round {r + 1}", flush=True)
                cpu[label].append(soak(code, Path(tmp) / f"run-{r}-{len(cpu[label])}-{label.replace(' ', '-')}", args))
    if args.baseline:
        old, new = (statistics.median(cpu[label]) for label, _ in codes)
        print(f"\nCPU per span, daemon and its processes (median of {args.rounds}): {args.baseline} "
              f"{old:.0f} µs, this tree {new:.0f} µs: {new / old:.2f}x  "
              + "; ".join(f"{label}: " + ", ".join(f"{us:.0f}" for us in runs) for label, runs in cpu.items()))


def soak(code: Path, data: Path, args: argparse.Namespace) -> float:
    """One soak of ``code``'s daemon, reported; its CPU per span (daemon and its processes), µs."""
    data.mkdir(parents=True)
    (data / "criteria.yaml").write_text(memory.CRITERIA)
    keep = args.retention
    extra = (f"conversations: {{idle_timeout: 2s}}\nsampling: {{rate: {args.sampling}}}\n"
             f"judges: {{criteria: ['{data / 'criteria.yaml'}']}}\n")
    kept = "no retention"
    ingest.STORAGE_EXTRA = ""
    if keep != "off":
        conv_keep = f"{2 * int(keep[:-1])}{keep[-1]}"
        ingest.STORAGE_EXTRA = f", retention: {{spans: {keep}, conversations: {conv_keep}}}"
        kept = f"retention {keep} of spans, {conv_keep} of conversations"
    here, ingest.REPO = ingest.REPO, code  # the launcher runs ``python -m collector`` in this folder: its code
    try:
        proc, info = ingest.start_daemon(data, extra)
    finally:
        ingest.REPO = here
    answered: list[tuple[float, float]] = []
    rows: list[dict[str, float]] = []
    done = [False]
    trace = args.trace.open("a") if args.trace else None
    watch = threading.Thread(target=sampler, args=(info, proc.pid, data / "bench.duckdb", args.interval,
                                                   answered, rows, done, trace), daemon=True)
    print(f"{args.spans:,} spans at {args.rate:,.0f} spans/s; {kept}; {args.sampling:.0%} of conversations "
          "judged", flush=True)
    try:
        watch.start()
        last_ack = asyncio.run(paced(info["grpc"], args.spans, args.rate, answered))
        current = current_after(info["api"], last_ack)
        memory.settled(info["api"], timeout=1800)
        lag_end = time.perf_counter() - last_ack
        done[0] = True
        watch.join()
    finally:
        proc.terminate()
        proc.wait()
        if trace:
            trace.close()
    blocks = file_blocks(data / "bench.duckdb")
    per_span = report(rows, lag_end, current, args.spans // ingest.SPANS_PER_REQUEST * ingest.SPANS_PER_REQUEST)
    print(f"  at the end: {blocks}")
    return per_span


def file_blocks(path: Path) -> str:
    """How much of the stopped daemon's file is in use, and how much is free blocks DuckDB reuses."""
    import duckdb

    con = duckdb.connect(str(path), read_only=True)
    try:
        size, total, used, free = con.execute(
            "SELECT block_size, total_blocks, used_blocks, free_blocks FROM pragma_database_size()").fetchone()
        tables = con.execute("SELECT table_name, estimated_size FROM duckdb_tables() WHERE schema_name = 'main' "
                             "ORDER BY estimated_size DESC LIMIT 4").fetchall()
    finally:
        con.close()
    rows = ", ".join(f"{name} {n:,}" for name, n in tables)
    return (f"the file holds {total * size / MB:.0f} MB of blocks, {used * size / MB:.0f} MB used and "
            f"{free * size / MB:.0f} MB free (reused by later writes); rows: {rows}")


def report(rows: list[dict[str, float]], lag_end: float, current: float, spans: int) -> float:
    """Print the run's table and targets; its CPU per span, daemon and its processes (µs)."""
    keys = ["spans stored", "rss", "peak rss", "pss", "peak pss", "at peak: daemon", "at peak: children", "duckdb", "duckdb peak", "duckdb index", "outside duckdb", "stage process", "file", "p99 ms", "spans/s", "cores: daemon", "cores: its processes", "cores: load",
            "lag commits", "deleted spans", "deleted convs"]
    first = rows[0]
    print(f"\n{'interval end (s)':18}" + "".join(f"{r['t']:>12.0f}" for r in rows))
    for k in keys:
        print(f"{k:18}" + "".join(f"{r[k]:>12,.{2 if k.startswith('cores') else 0}f}" for r in rows))
    print(f"{'vs interval 1':18}")
    for k in ("rss", "peak rss", "pss", "peak pss", "file", "p99 ms", "lag commits"):
        print(f"  {k:16}" + "".join(f"{(r[k] / first[k] if first[k] else 0):>12.2f}" for r in rows))
    if len(rows) >= 3:
        second, last = rows[1], rows[-1]
        print("\ntargets:")
        print(f"  peak memory in the last interval vs the second: {last['peak pss'] / second['peak pss']:.2f}x "
              f"(<= 1.10), {last['peak pss']:.0f} MB (< 400), highest in any interval "
              f"{max(r['peak pss'] for r in rows):.0f} MB (the daemon and its children's proportional set, "
              "sampled every second: shared pages counted once, as a container's limit counts them)")
        print(f"  upper bound, the sum of each process's peak resident set (shared pages in each): "
              f"{last['peak rss'] / second['peak rss']:.2f}x, {last['peak rss']:.0f} MB")
        print(f"  p99 over every interval: {max(r['p99 ms'] for r in rows):.0f} ms (< 500)")
        print(f"  conversation lag, last vs second interval: "
              f"{(last['lag commits'] + 1) / (second['lag commits'] + 1):.2f}x (<= 1.2)")
        growth = [b["file"] - a["file"] for a, b in zip(rows[len(rows) // 2:], rows[len(rows) // 2 + 1:])]
        print(f"  file growth per interval over the second half: {statistics.mean(growth) if growth else 0:.1f} MB")
    print(f"  conversations current {current:.1f} s after the last ack (<= 10 s at 10,000 spans/s); "
          f"every one ended and judged {lag_end:.1f} s after it")
    # What the machine can sustain: every span costs the daemon (ingest, serving the stage, judging,
    # retention), its processes (rebuilding) and the load generator this much CPU over the whole run.
    starts = [0.0] + [r["t"] for r in rows[:-1]]
    per_span = {who: sum(r[f"cores: {who}"] * (r["t"] - t0) for r, t0 in zip(rows, starts)) / spans * 1e6
                for who in ("daemon", "its processes", "load")}
    total = sum(per_span.values())
    print("  CPU per span over the run: " + ", ".join(f"{who} {us:.0f} µs" for who, us in per_span.items())
          + f"; {total:.0f} µs in all, so {os.cpu_count()} cores sustain at most {os.cpu_count() * 1e6 / total:,.0f} "
          "spans/s with none idle")
    return per_span["daemon"] + per_span["its processes"]


if __name__ == "__main__":
    main()
