"""Forwarding benchmark: ingest with two exporters on, next to none, in the same run.

The workload is ``bench/ingest.py``'s (realistic GenAI spans, 512 per request,
8 concurrent senders over OTLP/gRPC). Each round runs the daemon twice:

  none   no exporters
  two    an otlphttp exporter and a langsmith one (which adds
         langsmith.metadata.thread_id to each span with a conversation id, in
         its rewrite process), both sending to a fast local sink (a separate
         process answering 200 at once)
  redact the same two with ``redact: content``: every string of every span
         through the redactor, in each exporter's rewrite process

and prints spans/s, p50/p99 request latency and peak RSS of each (the daemon's
plus its rewrite process's), ``two`` as a
ratio of ``none``, and how long after the last ack the sink had every request
(targets: at least 80% of the throughput without exporters, p99 under 500 ms).
Run by hand:

    .venv/bin/python bench/forward.py [--spans 200000] [--rounds 2] [--modes none,two,redact]

For ``redact``, the time the sink took to have everything after the last ack
says how far redaction falls behind; spans / (send time + that time) is the
rate each redacting exporter sustains.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import ingest  # bench/ingest.py: the workload and the senders


def serve_sink() -> None:
    """A backend that takes every request and counts its bytes; prints its port."""
    from aiohttp import web

    received = {"bytes": 0, "requests": 0}

    async def take(request: web.Request) -> web.Response:
        received["bytes"] += len(await request.read())
        received["requests"] += 1
        return web.Response()

    async def count(request: web.Request) -> web.Response:
        return web.json_response(received)

    async def main() -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/{tail:.*}", take)
        app.router.add_get("/count", count)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        print(runner.addresses[0][1], flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


def children(pid: int) -> list[int]:
    """The daemon's child processes (the rewrite process of the langsmith exporter)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def run_one(mode: str, bodies: list[bytes], workdir: Path, sink: str) -> dict[str, Any]:
    extra = ""
    if mode != "none":
        redact = ", redact: content" if mode == "redact" else ""
        extra = (f"exporters:\n  raw: {{type: otlphttp, endpoint: '{sink}/raw/v1/traces'{redact}}}\n"
                 f"  ls: {{type: langsmith, endpoint: '{sink}/ls/otel/v1/traces', api_key: bench{redact}}}\n")
    proc, info = ingest.start_daemon(Path(tempfile.mkdtemp(dir=workdir)), extra)
    try:
        elapsed, lat, failures = asyncio.run(ingest.send_all(bodies, "grpc", info["grpc"]))
        acked = time.perf_counter()
        drained = None
        if mode != "none":  # until both exporters have delivered every request
            while True:
                with urllib.request.urlopen(info["api"] + "/api/status") as resp:
                    exporters = json.loads(resp.read())["exporters"]
                if all(e["sent"] >= len(bodies) and not e["queued_requests"] for e in exporters.values()):
                    break
                time.sleep(0.1)
            drained = time.perf_counter() - acked
        rss = ingest.peak_rss_mb(proc.pid) + sum(ingest.peak_rss_mb(c) for c in children(proc.pid))
    finally:
        proc.terminate()
        proc.wait()
    spans = len(bodies) * ingest.SPANS_PER_REQUEST
    return {"mode": mode, "spans_per_s": spans / elapsed, **ingest.latency_figures(lat), "rss_mb": rss,
            "refused": failures, "drained_s": drained,
            "delivered_per_s": spans / (elapsed + drained) if drained is not None else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spans", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--modes", default="none,two,redact", help="which of none, two, redact to run (none is the base)")
    ap.add_argument("--sink", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.sink:
        serve_sink()
        return
    bodies = ingest.make_requests(args.spans)
    print(f"{len(bodies)} requests x {ingest.SPANS_PER_REQUEST} spans over OTLP/gRPC, "
          f"concurrency {ingest.CONCURRENCY}", flush=True)
    sink_proc = subprocess.Popen([sys.executable, __file__, "--sink"], stdout=subprocess.PIPE, text=True)
    assert sink_proc.stdout is not None
    sink = f"http://127.0.0.1:{int(sink_proc.stdout.readline())}"
    modes = ["none", *(m for m in args.modes.split(",") if m in ("two", "redact"))]
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for rnd in range(args.rounds):
                for mode in modes:
                    r = run_one(mode, bodies, Path(tmp), sink)
                    results[mode].append(r)
                    print(f"  round {rnd + 1} {mode:6} {r['spans_per_s']:>9,.0f} spans/s  p50 {r['p50_ms']:6.1f} ms  "
                          f"p99 {r['p99_ms']:6.1f} ms  peak RSS {r['rss_mb']:5.0f} MB  refused+retried {r['refused']}"
                          + (f"  sink had everything {r['drained_s']:.1f}s after the last ack "
                             f"({r['delivered_per_s']:,.0f} spans/s delivered)"
                             if r["drained_s"] is not None else ""), flush=True)
    finally:
        sink_proc.terminate()
        sink_proc.wait()
    keys = ("spans_per_s", "p50_ms", "p99_ms", "rss_mb")
    med = {m: {k: statistics.median(r[k] for r in rs) for k in keys} for m, rs in results.items()}
    none = med["none"]
    print("\nmedian over rounds:")
    for m in modes[1:]:
        two = med[m]
        delivered = statistics.median(r["delivered_per_s"] for r in results[m])
        print(f"  {m:6} {two['spans_per_s']:,.0f} spans/s = {two['spans_per_s'] / none['spans_per_s']:.0%} of none "
              f"({none['spans_per_s']:,.0f}); p99 {two['p99_ms']:.0f} ms (none {none['p99_ms']:.0f} ms); peak RSS "
              f"{two['rss_mb']:.0f} MB (none {none['rss_mb']:.0f} MB); delivered {delivered:,.0f} spans/s = "
              f"{delivered / none['spans_per_s']:.0%} of none's ingest")
    print("targets: >= 80% of the throughput without exporters, p99 < 500 ms")


if __name__ == "__main__":
    main()
