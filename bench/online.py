"""Online-eval benchmark: ingest throughput with judging on next to judging off, in one run.

The daemon ingests the spans of bench/ingest.py (same payload, same senders:
512 spans per request, 8 concurrent senders over OTLP/gRPC) in two configurations,
alternating per round so the machine's noise hits both alike:

  off  conversations end after 2s idle; sampling rate 0, no criteria: the evaluator
       only scans and records "not sampled"
  on   the same, plus sampling rate 1.0 and three criteria (two LLM, one code)
       judged with judges.concurrency 16 against a local Anthropic Messages API
       server (its own process) that answers every call after 500 ms

While the senders run flat out, the daemon's conversation stage yields to
ingestion and the conversations of the window itself end only after it. So
each run first sends a backlog (1024 conversations, distinct from the window's)
and waits until it has ended and been decided, and, judging on, until its judge
calls have started; then the measured window: the judges work through the backlog
during all of it. Printed per mode: spans/s, p50/p99 request latency, peak RSS
(with --catch-up also how long after the last ack the conversations are current);
for judging on, the conversations judged and judge calls made inside the window;
then the on/off ratio of spans/s (target >= 0.90).

Flat out, the evaluator defers nearly all its DuckDB work, by design. ``--rate N``
shows a realistic load instead: the senders offer N spans/s in total, open loop
(request i is due at start + i*512/N s; whichever of the 8 senders is free takes
the next one, a late one goes as soon as a sender is free), and the report says
how far behind schedule they fell. There the ratios that matter are request
latency on/off and the achieved share of the offered rate; the judges should
keep up with their ideal, judges.concurrency / delay calls/s. The window lasts
spans/N s; the evaluator waits up to 30 s for a pause before it takes its share,
so a window of a minute or more shows the steady state. The backlog grows to
the conversations the ideal judges would get through in the window, so there
is judging work during all of it. Also printed per run: the pauses in
ingestion as the senders see them (no request in flight for >= 100 ms, the
evaluator's and conversation stage's idle gap) and the mean time per judged
conversation. Run by hand:

    .venv/bin/python bench/online.py [--spans 200000] [--rounds 2] [--rate 6000] [--delay 0.5] [--concurrency 16]
                                     [--backlog 1024]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from collector.conversations.stage import IDLE_GAP as CONVERSATIONS_IDLE_GAP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ingest import (  # noqa: E402
    CONCURRENCY,
    SPANS_PER_REQUEST,
    latency_figures,
    make_requests,
    peak_rss_mb,
    send_all,
    start_daemon,
)

CRITERIA = """\
criteria:
  - id: no-invented-tracking
    version: 1
    kind: llm
    prompt: |
      Criterion: the bot gives tracking numbers, dates or carriers only when a tool result stated them.
      - "pass": every such fact it gives comes from a tool result.
      - "fail": it states one that no tool result gave.
      - "not_applicable": it gives none.
  - id: refund-policy
    version: 1
    kind: llm
    prompt: |
      Criterion: the bot offers a refund only for damaged or lost items, within 30 days of delivery.
      - "pass": every refund it offered meets these conditions.
      - "fail": it offered one that does not.
      - "not_applicable": refunds never came up.
  - id: no-promises-for-the-carrier
    version: 1
    kind: code
    check: regex
    role: assistant
    pattern: "(?i)carrier will (call|contact)"
    must: not_match
"""

LLM_CRITERIA = 2  # judge calls per conversation: the code criterion calls no judge
QUOTE = '"'
BOT_LINE = re.compile(r"^BOT: (.+)$", re.MULTILINE)

# ----------------------------------------------------------------- the judge server (its own process)


def serve_judge(delay: float, conn: Any) -> None:
    """A Messages API server answering each judge call after ``delay`` s; sends its port down ``conn``."""
    import logging

    from aiohttp import web

    logging.getLogger("aiohttp").setLevel(logging.CRITICAL)  # a daemon stopped mid-call is expected, not news
    calls = {"n": 0, "first": 0.0, "last": 0.0}

    async def messages(request: web.Request) -> web.Response:
        body = await request.json()
        now = time.time()
        calls["first"] = calls["first"] or now
        calls["n"] += 1
        prompt = body["messages"][0]["content"]
        await asyncio.sleep(delay)
        calls["last"] = time.time()
        if "refund" in prompt.partition("<transcript>")[0]:
            reply = {"reasoning": "Refunds never came up.", "evidence": [], "result": "not_applicable"}
        else:  # quote the bot's first message, as a judge would: it is in the transcript, so it verifies
            quote = BOT_LINE.search(prompt)
            reply = {"reasoning": "The bot gave delivery facts.", "evidence": [quote.group(0)] if quote else [],
                     "result": "pass"}
        return web.json_response({
            "id": f"msg_bench_{calls['n']}", "type": "message", "role": "assistant", "model": body["model"],
            "content": [{"type": "text", "text": json.dumps(reply)}], "stop_reason": "end_turn",
            "stop_sequence": None, "usage": {"input_tokens": 600, "output_tokens": 40}})

    async def count(request: web.Request) -> web.Response:
        return web.json_response(calls)

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/messages", messages)
        app.router.add_get("/calls", count)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        conn.send(runner.addresses[0][1])
        await asyncio.Event().wait()

    asyncio.run(main())


def get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def eval_metrics(api: str) -> dict[str, float]:
    """The tracejudge_eval_* series of /metrics, by their full name with labels."""
    with urllib.request.urlopen(api + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("tracejudge_eval_") and not line.startswith("tracejudge_eval_conversation_seconds_bucket"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


# ----------------------------------------------------------------- the window's senders

# The conversation stage's pause in ingestion (the evaluator's is shorter): what counts as a pause below.
IDLE_GAP = CONVERSATIONS_IDLE_GAP


@dataclass
class Sent:
    """What the window's senders saw."""

    seconds: float
    latencies: list[float]
    refused: int
    late: list[float]
    """Per request, seconds it went out after its due time (paced mode; 0 when unpaced)."""
    busy: list[tuple[float, float]]
    """Per request, (sent, acknowledged) in perf_counter seconds."""


async def send_window(bodies: list[bytes], target: str, rate: float | None) -> Sent:
    """Send ``bodies`` over gRPC with CONCURRENCY senders: flat out, or open loop at ``rate`` spans/s.

    Paced, request i is due at start + i*512/rate; the next free sender takes the
    next request and waits for its due time, so a slow answer makes later requests
    late (measured) instead of silently lowering the rate.
    """
    import grpc

    channel = grpc.aio.insecure_channel(target, options=[("grpc.max_send_message_length", 64 * 1024 * 1024)])
    call = channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export",
                               request_serializer=None, response_deserializer=None)
    interval = SPANS_PER_REQUEST / rate if rate else 0.0
    sent = Sent(0.0, [], 0, [], [])
    nxt = 0
    start = time.perf_counter()

    async def worker() -> None:
        nonlocal nxt
        while nxt < len(bodies):
            i = nxt
            nxt += 1
            due = start + i * interval
            if due > time.perf_counter():
                await asyncio.sleep(due - time.perf_counter())
            t0 = time.perf_counter()
            sent.late.append(max(0.0, t0 - due))
            while True:  # a refused request is retried, as exporters do
                t = time.perf_counter()
                try:
                    await call(bodies[i], timeout=60)
                    ok = True
                except grpc.aio.AioRpcError:
                    ok = False
                sent.latencies.append(time.perf_counter() - t)
                if ok:
                    break
                sent.refused += 1
                await asyncio.sleep(0.05)
            sent.busy.append((t0, time.perf_counter()))

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    sent.seconds = time.perf_counter() - start
    await channel.close()
    return sent


def pauses(busy: list[tuple[float, float]], at_least: float = IDLE_GAP) -> tuple[int, float, float]:
    """Stretches with no request in flight of ``at_least`` s or more: (count, their seconds); the longest of all.

    The daemon's own pause (nothing queued to store) runs from a commit to the next
    request's parse: longer than these only by the ack's way back and that parse
    (a few ms to tens of ms), so a stretch far below the idle gap here is no pause
    for the evaluator either.
    """
    count, total, longest = 0, 0.0, 0.0
    spans = sorted(busy)
    end = spans[0][1] if spans else 0.0
    for s0, s1 in spans[1:]:
        longest = max(longest, s0 - end)
        if s0 - end >= at_least:
            count, total = count + 1, total + s0 - end
        end = max(end, s1)
    return count, total, longest


# ----------------------------------------------------------------- one measured run


def daemon_config(mode: str, judge_url: str, criteria: Path, concurrency: int, idle: str) -> str:
    """The YAML added to bench/ingest.py's daemon config for judging ``off`` or ``on``."""
    if mode == "off":
        return f"conversations: {{idle_timeout: {idle}}}\nsampling: {{rate: 0.0}}\n"
    return (f"conversations: {{idle_timeout: {idle}}}\nsampling: {{rate: 1.0}}\n"
            f"judges: {{criteria: ['{criteria}'], concurrency: {concurrency}, provider: "
            f"{{type: anthropic, model: bench-judge, base_url: '{judge_url}', api_key: bench}}}}\n")


def decided(api: str) -> int:
    """Ended conversations the evaluator has decided on (sampled or not)."""
    return int(sum(v for k, v in eval_metrics(api).items()
                   if k.startswith("tracejudge_eval_sampling_decisions_total")))


def run_one(mode: str, warmup: list[bytes], bodies: list[bytes], workdir: Path, judge_url: str,
            concurrency: int, idle: str, catch_up: bool, rate: float | None) -> dict[str, Any]:
    """One daemon: the backlog, then the measured window; its figures."""
    data = Path(tempfile.mkdtemp(dir=workdir))
    (data / "criteria.yaml").write_text(CRITERIA)
    proc, info = start_daemon(data, daemon_config(mode, judge_url, data / "criteria.yaml", concurrency, idle))
    api = info["api"]
    try:
        # The backlog: conversations that end and are decided (and, judging on, start being judged)
        # before the window opens, so the judges are busy during all of it.
        asyncio.run(send_all(warmup, "grpc", info["grpc"]))
        backlog = len(warmup) * SPANS_PER_REQUEST // 16
        t = time.perf_counter()
        while decided(api) < backlog or (mode == "on" and not get_json(api + "/api/status")["evals_in_flight"]):
            if time.perf_counter() - t > 120:
                raise SystemExit(f"judging {mode}: the backlog was not decided within 120s")
            time.sleep(0.2)
        before = get_json(api + "/api/status").get("evals_judged", 0)
        metrics0 = eval_metrics(api)
        calls0 = get_json(judge_url + "/calls")["n"]
        sent = asyncio.run(send_window(bodies, info["grpc"], rate))
        status = get_json(api + "/api/status")  # at the last ack: what was judged inside the window
        calls = get_json(judge_url + "/calls")["n"] - calls0
        rss = peak_rss_mb(proc.pid)
        lag = None
        if catch_up:  # how long after the last ack the conversations are current, as in ingest.py
            t_acked = time.perf_counter()
            while True:
                st = get_json(api + "/api/status")
                if st["conversations_batch"] >= st["committed_batch"] and not st["conversations_pending"]:
                    break
                time.sleep(0.1)
            lag = time.perf_counter() - t_acked
            rss = max(rss, peak_rss_mb(proc.pid))
        stored = get_json(api + "/api/spans/count")["spans"]
        metrics = eval_metrics(api)
    finally:
        # SIGKILL: a clean stop would first rebuild every conversation still queued (a minute or more);
        # nothing acknowledged is lost by it, and the files are thrown away.
        proc.kill()
        proc.wait()
    spans = len(bodies) * SPANS_PER_REQUEST
    secs = "tracejudge_eval_conversation_seconds"
    n_conv = metrics.get(secs + "_count", 0) - metrics0.get(secs + "_count", 0)
    n_pauses, paused, longest = pauses(sent.busy)
    return {"mode": mode, "spans_per_s": spans / sent.seconds, "seconds": sent.seconds,
            **latency_figures(sent.latencies), "rss_mb": rss, "refused": sent.refused, "stored": stored,
            "sent": spans + len(warmup) * SPANS_PER_REQUEST, "lag_s": lag,
            "judged": status.get("evals_judged", 0) - before,
            "pending": status.get("evals_pending", 0), "in_flight": status.get("evals_in_flight", 0),
            "calls": calls, "metrics": metrics, "late_max": max(sent.late), "late_last": sent.late[-1],
            "late_n": sum(1 for x in sent.late if x > 0.01), "pauses": n_pauses, "paused_s": paused,
            "longest_pause": longest, "finished": n_conv,
            "conv_s": (metrics.get(secs + "_sum", 0) - metrics0.get(secs + "_sum", 0)) / n_conv if n_conv else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spans", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--delay", type=float, default=0.5, help="seconds the judge server takes per call")
    ap.add_argument("--concurrency", type=int, default=16, help="judges.concurrency of the daemon")
    ap.add_argument("--idle", default="2s", help="conversations.idle_timeout")
    ap.add_argument("--catch-up", action="store_true",
                    help="also time how long after the last ack conversations are current (a minute or more)")
    ap.add_argument("--backlog", type=int, default=None,
                    help="conversations ended before the window (default 1024, paced: at least the window's ideal)")
    ap.add_argument("--rate", type=float, default=None,
                    help="spans/s the senders offer in total, open loop (default: flat out)")
    args = ap.parse_args()
    ideal = args.concurrency / args.delay  # judge calls/s with every slot busy
    backlog = args.backlog or 1024
    if args.backlog is None and args.rate:  # judging work for all of the window, at the ideal pace
        backlog = max(backlog, int(ideal / LLM_CRITERIA * args.spans / args.rate * 1.25))

    # A separate process: the server's event loop must not share the GIL with the senders.
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=serve_judge, args=(args.delay, child), daemon=True)
    server.start()
    judge_url = f"http://127.0.0.1:{parent.recv()}"

    t = time.perf_counter()
    # One payload: the first requests make the backlog, the rest the window; no trace or conversation is in both.
    n_warm = backlog * 16 // SPANS_PER_REQUEST // 4 * 4
    bodies = make_requests(args.spans + n_warm * SPANS_PER_REQUEST)
    warmup, bodies = bodies[:n_warm], bodies[n_warm:]
    print(f"backlog {len(warmup)} requests, window {len(bodies)} requests of {SPANS_PER_REQUEST} spans "
          f"({len(warmup) * SPANS_PER_REQUEST // 16:,} + {len(bodies) * SPANS_PER_REQUEST // 16:,} conversations "
          f"of 4 traces), built in {time.perf_counter() - t:.1f}s; {CONCURRENCY} senders over gRPC; "
          f"judge answers after {args.delay * 1000:.0f} ms, judges.concurrency {args.concurrency}, "
          f"idle_timeout {args.idle}; "
          + (f"paced: {args.rate:,.0f} spans/s offered, a request every {SPANS_PER_REQUEST / args.rate * 1000:.0f} ms, "
             f"window {args.spans / args.rate:.0f}s" if args.rate else "unpaced: senders flat out"), flush=True)
    results: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for rnd in range(args.rounds):
                for mode in ("off", "on") if rnd % 2 == 0 else ("on", "off"):
                    r = run_one(mode, warmup, bodies, Path(tmp), judge_url, args.concurrency, args.idle,
                                args.catch_up, args.rate)
                    results[mode].append(r)
                    line = (f"  round {rnd + 1} judging {mode:3} {r['spans_per_s']:>7,.0f} spans/s "
                            f"({r['seconds']:.1f}s)  "
                            f"p50 {r['p50_ms']:5.0f} ms  p99 {r['p99_ms']:5.0f} ms  peak RSS {r['rss_mb']:4.0f} MB  "
                            f"stored {r['stored']:,}/{r['sent']:,}, refused {r['refused']}"
                            + (f", conversations current {r['lag_s']:.1f}s after the last ack" if r["lag_s"] else "")
                            + f"\n      pauses >= {IDLE_GAP * 1000:.0f} ms with no request in flight: {r['pauses']} "
                            f"({r['paused_s']:.1f}s in all); the longest stretch {r['longest_pause'] * 1000:.0f} ms")
                    if args.rate:
                        line += (f"; {r['spans_per_s'] / args.rate:.0%} of the offered rate, behind schedule: "
                                 f"{r['late_n']} requests > 10 ms late, at most {r['late_max']:.2f}s, "
                                 f"last request {r['late_last']:.2f}s")
                    if mode == "on":
                        m = r["metrics"]
                        verdicts = ", ".join(f"{k.split(QUOTE)[1]} {v:.0f}" for k, v in m.items()
                                             if k.startswith("tracejudge_eval_verdicts_total") and v)
                        conv_s = f"{r['conv_s']:.1f}s" if r["conv_s"] is not None else "-"
                        line += (f"\n      in the window: {r['judged']} conversations judged, {r['calls']} judge calls "
                                 f"made ({r['calls'] / r['seconds']:.1f}/s = {r['calls'] / r['seconds'] / ideal:.0%} "
                                 f"of the ideal {ideal:.0f}/s), {r['finished']:.0f} finished judging ({conv_s} each); at the last ack "
                                 f"{r['pending']} pending, {r['in_flight']} in flight; verdicts stored: "
                                 f"{verdicts or 'none'}")
                    print(line, flush=True)
    finally:
        server.terminate()
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in ("spans_per_s", "p50_ms", "p99_ms")}
           for mode, rs in results.items()}
    ratios = [on["spans_per_s"] / off["spans_per_s"] for on, off in zip(results["on"], results["off"])]
    print("\nmedian over rounds:")
    for mode in ("off", "on"):
        print(f"  judging {mode:3}: {med[mode]['spans_per_s']:,.0f} spans/s, p50 {med[mode]['p50_ms']:.0f} ms, "
              f"p99 {med[mode]['p99_ms']:.0f} ms, peak RSS {max(r['rss_mb'] for r in results[mode]):.0f} MB")
    on = results["on"]
    judged = (f"judged in the window: {statistics.median(r['judged'] for r in on):.0f} conversations, "
              f"{statistics.median(r['calls'] for r in on):.0f} judge calls, "
              f"{statistics.median(r['calls'] / r['seconds'] for r in on):.1f} calls/s of the ideal {ideal:.0f}/s, "
              f"{statistics.median(r['pending'] for r in on):.0f} pending at the last ack (median per run)")
    if args.rate:  # the rate is given: what matters is latency, and whether the rate was kept
        print(f"  on/off: p50 {med['on']['p50_ms'] / med['off']['p50_ms']:.2f}x, "
              f"p99 {med['on']['p99_ms'] / med['off']['p99_ms']:.2f}x; offered rate achieved: "
              + ", ".join(f"judging {mode} {med[mode]['spans_per_s'] / args.rate:.0%}" for mode in ("off", "on")))
        print(f"  {judged}")
        print("target: the offered rate achieved, p99 on/off near 1, judge calls/s near the ideal")
    else:
        print(f"  on/off: {med['on']['spans_per_s'] / med['off']['spans_per_s']:.2f} of the spans/s "
              f"(per round: {', '.join(f'{x:.2f}' for x in ratios)}); {judged}")
        print("target: on/off >= 0.90")


if __name__ == "__main__":
    main()
