"""Retention benchmark: does deletion keep pace with ingestion, after a burst and under a steady load?

Three phases, each against a real daemon (``bench/ingest.py``'s launcher, 1-2 KB GenAI spans):

burst   ``--burst`` spans (300,000) of bench/ingest.py's four-turn conversations (``--workload
        one-span``: each span its own trace and conversation, the most conversations per span),
        sent as fast as the daemon takes them (the ingest throughput), with no retention, until
        every conversation has ended and been sampled. Then, on a copy of that file for each
        code (``--baseline REF`` first, then this tree), the daemon starts with
        ``storage.retention.spans: --keep`` (2s), by which all of it has expired: the time to zero
        stored spans (target < 60 s) and the deletion throughput, as a share of the ingest
        throughput. Retention deletes nothing the stages upstream have not finished with, so
        their lag after a burst (minutes, for one-span conversations on two busy cores) is left
        out: this is retention's own pace.
live    the same burst of four-turn conversations sent to a daemon of each code keeping
        ``--live-keep`` seconds (60) of spans, with the stages upstream catching up as they go:
        the time from the last span's expiry (its ack plus the retention) to zero stored spans.
steady  ``--rate`` spans/s (5,000) of bench/ingest.py's four-turn conversations for ``--minutes``
        (10) with ``retention.spans: --steady-keep`` (2m) and, with ``--steady-conversations``,
        ``retention.conversations``: the stored span count, the file size (with its WAL; also the WAL
        alone, and the largest the two were within the minute, sampled every second: a checkpoint folds
        the WAL, up to DuckDB's 16 MiB, into the file at any moment, so one sample a minute falls either
        side of it) and retention's lag behind its horizon (spans; conversations from ``/api/status``)
        each minute, and whether the count and the file are flat (within 10%) from the fourth minute on.
        A tenth of the conversations fail their code check, each queueing a review item, which is
        never deleted: with ``retention.keep_reviewed`` (the daemon's default) its conversation is kept
        too, and the file grows by about 1,900 of them a minute. So this phase runs with
        ``keep_reviewed: false``, where everything the load sends expires; ``--keep-reviewed`` keeps them.

conversations  the burst of four-turn conversations, settled (ended, sampled, judged), then on a
        copy for each code a daemon keeping 2 s of spans and of conversations: the time until
        the last conversation but the reviewed ones has gone, and conversations deleted per second
        (the stages upstream idle: retention's own pace).

``--baseline REF`` deletes the burst first with another commit's code (``git archive REF``, e.g.
``main``), then with this tree's, in the same run, and prints the ratio; the live and steady phases
run it first too. Run by hand:

    .venv/bin/python bench/retention.py [--baseline main] [--burst 300000] [--workload four-turn|one-span]
                                        [--phases burst,conversations,live,steady] [--rate 5000] [--minutes 10] [--steady-keep 2m] [--keep-reviewed]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ingest
import memory
import soak

HERE = ingest.REPO
POLL = 0.5
MB = 1_000_000


def one_span_requests(total: int) -> list[bytes]:
    """Bodies of 512 spans each, every span its own trace and its own conversation."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    template = ExportTraceServiceRequest()
    template.CopyFrom(ingest._template())
    spans = template.resource_spans[0].scope_spans[0].spans
    slots = []
    for sp in spans:  # the conversation id: the agent spans' own attribute, one added to the others
        found = [i for i, kv in enumerate(sp.attributes) if kv.key == "gen_ai.conversation.id"]
        if not found:
            kv = sp.attributes.add()
            kv.key = "gen_ai.conversation.id"
            found = [len(sp.attributes) - 1]
        slots.append(found[0])
    bodies = []
    for r in range(max(1, total // ingest.SPANS_PER_REQUEST)):
        for i, sp in enumerate(spans):
            sp.trace_id = ingest._random_id(16, "one", r, i)
            sp.span_id = ingest._random_id(8, "one", r, i)
            sp.parent_span_id = b""
            sp.attributes[slots[i]].value.string_value = f"one-{r:05d}-{i:03d}"
        bodies.append(template.SerializeToString())
    return bodies


def daemon(code: Path, data: Path, keep: str | None, conversations: str | None = None, keep_reviewed: bool = True
           ) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """``tracejudge serve`` from ``code``'s tree, keeping ``keep`` of spans; conversations end 2 s idle and a
    tenth are judged by a code check (the evaluator and the review queue work, as in bench/soak.py).
    ``keep_reviewed``: ``retention.keep_reviewed`` (with ``conversations``)."""
    data.mkdir(parents=True, exist_ok=True)
    (data / "criteria.yaml").write_text(memory.CRITERIA)
    ingest.REPO = code  # the launcher runs ``python -m collector`` in this folder: its code
    kept = ", ".join(f"{what}: {value}" for what, value in (("spans", keep), ("conversations", conversations)) if value)
    if conversations and not keep_reviewed:
        kept += ", keep_reviewed: false"
    ingest.STORAGE_EXTRA = f", retention: {{{kept}}}" if kept else ""
    try:
        return ingest.start_daemon(data, "conversations: {idle_timeout: 2s}\nsampling: {rate: 0.1}\n"
                                         f"judges: {{criteria: ['{data / 'criteria.yaml'}']}}\n")
    finally:
        ingest.REPO = HERE


def metric(api: str, name: str) -> float:
    """The sum of a metric's samples on /metrics (0 when absent)."""
    total = 0.0
    for line in memory.get(api, "/metrics").splitlines():
        if re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? ", line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def burst(runs: list[tuple[str, Path]], work: Path, bodies: list[bytes], keep: str) -> dict[str, dict[str, float]]:
    """Ingest the burst with no retention and wait until every conversation has ended and been sampled
    (retention deletes only what the stages upstream are done with, and their lag is not retention's);
    then, on a copy of that file for each run's code, start the daemon keeping ``keep``, by which all of
    it has expired, and time it to zero stored spans."""
    spans = len(bodies) * ingest.SPANS_PER_REQUEST
    proc, info = daemon(HERE, work / "burst", None)
    try:
        elapsed, _, refused = asyncio.run(ingest.send_all(bodies, "grpc", info["grpc"]))
        print(f"  ingest: {spans:,} spans in {elapsed:.1f} s ({spans / elapsed:,.0f} spans/s, {refused} refusals "
              "retried)", flush=True)
        settled = memory.settled(info["api"], timeout=1800)
        print(f"  conversations ended and sampled {settled:.0f} s after the last ack", flush=True)
    finally:
        proc.terminate()
        proc.wait()
    out = {}
    for name, code in runs:
        data = work / name.replace(" ", "-").replace("/", "-")
        data.mkdir()
        shutil.copy(work / "burst" / "bench.duckdb", data / "bench.duckdb")
        started = time.perf_counter()
        proc, info = daemon(code, data, keep)
        stored, report = spans, started + 15
        try:
            while stored:
                time.sleep(POLL)
                stored = memory.get(info["api"], "/api/spans/count")["spans"]
                now = time.perf_counter()
                if now >= report:
                    print(f"  {name}: {now - started:5.0f} s after the start: {stored:,} spans stored", flush=True)
                    report += 15
                if now > started + 900:
                    print(f"  {name}: {stored:,} spans still stored after 15 minutes", flush=True)
                    break
            cleared = time.perf_counter() - started
        finally:
            proc.terminate()
            proc.wait()
        out[name] = {"ingest": spans / elapsed, "clear": cleared, "delete": (spans - stored) / cleared,
                     "left": stored, "file": (data / "bench.duckdb").stat().st_size / MB}
        print(f"  {name}: {spans - stored:,} spans deleted {cleared:.1f} s after the start", flush=True)
    return out


def conversations_burst(runs: list[tuple[str, Path]], work: Path, bodies: list[bytes]) -> dict[str, dict[str, float]]:
    """The burst of four-turn conversations ingested with no retention, settled (every conversation ended,
    sampled and judged); then, on a copy of that file for each run's code, the daemon keeping 2 s of spans
    and of conversations, by which all of it has expired: the time until the last conversation that may go
    (all but the reviewed) has gone, and conversations deleted per second. The stages upstream are idle:
    this is retention's own pace, whatever the machine's other load does to theirs."""
    proc, info = daemon(HERE, work / "conversations-burst", None)
    try:
        asyncio.run(ingest.send_all(bodies, "grpc", info["grpc"]))
        settled = memory.settled(info["api"], timeout=1800)
        print(f"  conversations ended, sampled and judged {settled:.0f} s after the last ack", flush=True)
    finally:
        proc.terminate()
        proc.wait()
    source = work / "conversations-burst" / "bench.duckdb"
    out = {}
    for name, code in runs:
        data = work / f"conversations-{name.replace(' ', '-').replace('/', '-')}"
        data.mkdir()
        shutil.copy(source, data / "bench.duckdb")
        started = time.perf_counter()
        proc, info = daemon(code, data, "2s", "2s")
        gone, report, first, last = 0, started + 15, 0.0, started
        try:
            # Until none has gone for 30 s (some are due for the evaluator at the start: they go once judged).
            while time.perf_counter() < min(started + 900, last + 30):
                time.sleep(POLL / 5)
                now = memory.get(info["api"], "/api/status")["storage"]["retention"]["deleted"]["conversations"]
                if now > gone:
                    gone, last = now, time.perf_counter()
                    first = first or last
                if time.perf_counter() >= report:
                    print(f"  {name}: {time.perf_counter() - started:5.0f} s after the start: {gone:,} conversations "
                          "deleted", flush=True)
                    report += 15
        finally:
            proc.terminate()
            proc.wait()
        cleared = last - started
        out[name] = {"clear": cleared, "gone": gone, "rate": gone / cleared}
        print(f"  {name}: {gone:,} conversations deleted, the last {cleared:.1f} s after the start, the first "
              f"{first - started:.1f} s after ({gone / cleared:,.0f}/s, the start included)", flush=True)
    return out


def live(name: str, code: Path, work: Path, bodies: list[bytes], keep: float) -> dict[str, float]:
    """The burst sent to a daemon of ``code`` keeping ``keep`` seconds of spans: the time from the last span's
    expiry (its ack plus ``keep``) to zero stored, and when conversations were current (retention waits for them)."""
    spans = len(bodies) * ingest.SPANS_PER_REQUEST
    proc, info = daemon(code, work / f"live-{name.replace(' ', '-')}", f"{keep:g}s")
    try:
        start = time.perf_counter()
        elapsed, _, _ = asyncio.run(ingest.send_all(bodies, "grpc", info["grpc"]))
        last_expiry = start + elapsed + keep
        stored, current, report = spans, None, last_expiry
        while stored and time.perf_counter() < last_expiry + 900:
            time.sleep(POLL)
            stored = memory.get(info["api"], "/api/spans/count")["spans"]
            now = time.perf_counter()
            if current is None:
                st = memory.get(info["api"], "/api/status")
                if st["conversations_batch"] >= st["committed_batch"] and not st["conversations_pending"]:
                    current = now
            if now >= report:
                print(f"  live {name}: {now - last_expiry:5.0f} s after the last expiry: {stored:,} spans stored",
                      flush=True)
                report += 15
        zero = time.perf_counter()
    finally:
        proc.terminate()
        proc.wait()
    return {"clear": zero - last_expiry, "left": stored, "current": (current or zero) - (start + elapsed),
            "delete": (spans - stored) / (zero - start - keep), "ingest": spans / elapsed}


def steady(name: str, code: Path, work: Path, rate: float, minutes: float, keep: str,
           conversations: str | None = None, keep_reviewed: bool = False) -> list[dict[str, float]]:
    data = work / f"steady-{name.replace(' ', '-').replace('/', '-')}"
    proc, info = daemon(code, data, keep, conversations, keep_reviewed)
    db = data / "bench.duckdb"
    rows: list[dict[str, float]] = []
    answered: list[tuple[float, float]] = []

    wal = Path(f"{db}.wal")
    peak = [0.0]  # the largest file with its WAL since the last minute's sample

    async def sample_every_second() -> None:
        while True:
            peak[0] = max(peak[0], soak.file_bytes(db) / MB)
            await asyncio.sleep(1.0)

    async def run() -> None:
        sender = asyncio.ensure_future(soak.paced(info["grpc"], int(rate * minutes * 60), rate, answered))
        sampler = asyncio.ensure_future(sample_every_second())
        start = time.perf_counter()
        for minute in range(1, int(minutes) + 1):
            await asyncio.sleep(max(0.0, start + 60 * minute - time.perf_counter()))
            file_now = soak.file_bytes(db) / MB
            wal_now = (wal.stat().st_size if wal.exists() else 0) / MB
            peak_now, peak[0] = max(peak[0], file_now), file_now
            stored = (await asyncio.to_thread(memory.get, info["api"], "/api/spans/count"))["spans"]
            behind = await asyncio.to_thread(metric, info["api"], "tracejudge_retention_behind_seconds")
            # Retention deletes only what the stages upstream are done with: their lag bounds its pace.
            status = await asyncio.to_thread(memory.get, info["api"], "/api/status")
            review = (await asyncio.to_thread(memory.get, info["api"], "/api/review/progress"))["pending"]
            # How far behind its horizon step 3 is (the daemon's figure; absent from older code: -1).
            kept = status.get("storage", {}).get("retention", {}).get("conversations", {})
            rows.append({"minute": minute, "stored": stored, "file": file_now, "wal": wal_now, "peak": peak_now,
                         "behind": behind,
                         "conversations_behind": float(kept.get("behind_seconds", -1) or 0),
                         "sent": len(answered) * ingest.SPANS_PER_REQUEST,
                         "stage": float(status.get("conversations_lag_seconds") or 0),
                         "pending": float(status.get("evals_pending") or 0), "review": review})
            r = rows[-1]
            print(f"  {name}, minute {minute:2}: {r['stored']:>9,.0f} spans stored, file {r['file']:6.0f} MB "
                  f"(WAL {r['wal']:.0f}; the minute's largest {r['peak']:.0f}), "
                  f"retention {r['behind']:4.0f} s behind (conversations "
                  + (f"{r['conversations_behind']:.0f} s" if r["conversations_behind"] >= 0 else "-")
                  + f"), {r['sent']:>9,.0f} sent; conversation stage "
                  f"{r['stage']:4.0f} s behind, {r['pending']:,.0f} conversations waiting for the evaluator; "
                  f"{r['review']:,.0f} review items pending",
                  flush=True)
        await sender
        sampler.cancel()

    try:
        asyncio.run(run())
    finally:
        proc.terminate()
        proc.wait()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phases", default="burst,live,steady")
    ap.add_argument("--baseline", help="a git ref whose retention the burst also runs on, first (e.g. main)")
    ap.add_argument("--burst", type=int, default=300_000)
    ap.add_argument("--keep", default="2s", help="retention.spans after the burst (all of it has expired)")
    ap.add_argument("--live-keep", type=float, default=60, help="seconds of spans kept in the live phase")
    ap.add_argument("--workload", choices=("four-turn", "one-span"), default="four-turn")
    ap.add_argument("--rate", type=float, default=5000)
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--steady-keep", default="2m")
    ap.add_argument("--steady-conversations", help="also retention.conversations in the steady phase (e.g. 2m): "
                    "without it, transcripts and verdicts are kept and the file grows by them")
    ap.add_argument("--keep-reviewed", action="store_true",
                    help="with --steady-conversations, keep reviewed conversations (retention.keep_reviewed, the "
                    "daemon's default): a tenth of the load fails its check, and its review items, never deleted, "
                    "keep their conversations, so the file grows by them (about 1,900 a minute at 5,000 spans/s)")
    args = ap.parse_args()
    phases = args.phases.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if "burst" in phases:
            one_span = args.workload == "one-span"
            bodies = one_span_requests(args.burst) if one_span else ingest.make_requests(args.burst)
            print(f"burst: {len(bodies) * ingest.SPANS_PER_REQUEST:,} spans of "
                  f"{'one-span' if one_span else 'four-turn'} conversations, then retention.spans {args.keep}",
                  flush=True)
            runs = [("this tree", HERE)]
            if args.baseline:
                runs.insert(0, (args.baseline, ingest.checkout(args.baseline, work / "baseline-code")))
            results = burst(runs, work, bodies, args.keep)
            del bodies
            for name, r in results.items():
                print(f"  {name}: deleted {r['delete']:,.0f} spans/s = {r['delete'] / r['ingest']:.0%} of ingest "
                      f"({r['ingest']:,.0f} spans/s); all expired at the start, zero expired spans after "
                      f"{r['clear']:.1f} s (target < 60 s); {r['left']:,} left; file {r['file']:.0f} MB")
            if args.baseline:
                new, old = results["this tree"], results[args.baseline]
                print(f"  this tree vs {args.baseline}: deletion {new['delete'] / old['delete']:.1f}x as fast; "
                      f"cleared in {new['clear']:.1f} s vs {old['clear']:.1f} s")
        if "conversations" in phases:
            bodies = ingest.make_requests(args.burst)
            print(f"conversations: {len(bodies) * ingest.SPANS_PER_REQUEST:,} spans of four-turn conversations, "
                  "then retention.spans and retention.conversations 2s", flush=True)
            runs = [("this tree", HERE)]
            if args.baseline:
                runs.insert(0, (args.baseline, ingest.checkout(args.baseline, work / "conversations-baseline-code")))
            cleared = conversations_burst(runs, work, bodies)
            if args.baseline:
                new, old = cleared["this tree"], cleared[args.baseline]
                print(f"  this tree vs {args.baseline}: conversations deleted {new['rate'] / old['rate']:.1f}x as fast; "
                      f"cleared in {new['clear']:.1f} s vs {old['clear']:.1f} s")
        if "live" in phases:
            bodies = ingest.make_requests(args.burst)
            print(f"live: {len(bodies) * ingest.SPANS_PER_REQUEST:,} spans of four-turn conversations sent to a daemon "
                  f"keeping {args.live_keep:g} s of spans", flush=True)
            runs = [("this tree", HERE)]
            if args.baseline:
                runs.insert(0, (args.baseline, ingest.checkout(args.baseline, work / "live-baseline-code")))
            for name, code in runs:
                r = live(name, code, work, bodies, args.live_keep)
                print(f"  live {name}: zero stored {r['clear']:.1f} s after the last span expired (target < 60 s), "
                      f"{r['left']:,} left; deleted {r['delete']:,.0f} spans/s from the first expiry = "
                      f"{r['delete'] / r['ingest']:.0%} of ingest ({r['ingest']:,.0f} spans/s); conversations "
                      f"current {r['current']:.0f} s after the last ack", flush=True)
        if "steady" in phases:
            print(f"steady: {args.rate:,.0f} spans/s for {args.minutes:g} minutes, retention.spans "
                  f"{args.steady_keep}" + (f", conversations {args.steady_conversations}"
                                           if args.steady_conversations else "")
                  + (", reviewed ones kept" if args.steady_conversations and args.keep_reviewed else ""), flush=True)
            runs = [("this tree", HERE)]
            if args.baseline:  # one after the other: each has the machine to itself
                runs.insert(0, (args.baseline, ingest.checkout(args.baseline, work / "steady-baseline-code")))
            for name, code in runs:
                rows = steady(name, code, work, args.rate, args.minutes, args.steady_keep, args.steady_conversations,
                              args.keep_reviewed)
                later = [r for r in rows if r["minute"] >= 4]
                if later:
                    for key, label in (("stored", "stored spans"), ("file", "file size"),
                                       ("peak", "the minute's largest file size")):
                        lo, hi = min(r[key] for r in later), max(r[key] for r in later)
                        print(f"  {name}: {label} from minute 4: {lo:,.0f} to {hi:,.0f}, spread "
                              f"{hi / lo - 1 if lo else 0:.1%} (target <= 10%)")
                    print(f"  {name}: retention at most {max(r['behind'] for r in rows):.0f} s behind its horizon",
                          flush=True)


if __name__ == "__main__":
    main()
