"""Live-criteria benchmark: how soon a failing turn pages, and what judging open conversations costs ingestion.

Two parts, in one run, on the payload and senders of bench/ingest.py (512 spans
per request, 8 concurrent senders over OTLP/gRPC); the daemon judges one code
criterion (a regex that the background traffic passes) on every conversation
(sampling rate 1.0), at the end and, with live on, turn by turn:

1. **Time to page.** At each background load (default 100 and 2,000 spans/s,
   open loop as in bench/online.py --rate), a prober sends, every
   ``--probe-every`` seconds, one turn of a new conversation whose answer fails
   the live criterion, as its own OTLP request. Measured per probe: from the
   acknowledgement of that request (the span holding the failing message is
   committed) to the webhook receiver (its own process) receiving the alert.
   Printed: p50, p99 and the slowest, and how many of the probes paged (target:
   every one, p99 under 5 s). The background's own request latency is printed
   beside the same load with live off.
2. **Throughput.** The senders flat out, live off and live on (the same
   criterion without and with ``live: true``), alternating per round so the
   machine's noise hits both alike. Printed: spans/s of each and on/off (target
   at least 0.90).

Beside each load, how far the conversation stage was behind ingestion
(``conversations_lag_seconds`` of /api/status, read twice a second): a live
criterion sees a turn only once the stage has rebuilt its conversation, so a
page comes no sooner than that lag allows.

The webhook's process and the senders' clocks are the same machine's
(``time.time``). Conversations keep the default idle timeout (15 minutes), so
every conversation of a run is open, and looked at, for all of it. Run by hand:

    .venv/bin/python bench/live.py [--rates 100,2000] [--seconds 60] [--probe-every 0.5] [--spans 200000]
                                   [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ingest import SPANS_PER_REQUEST, latency_figures, make_requests, send_all, start_daemon  # noqa: E402
from online import send_window  # noqa: E402

FAIL = "I promise you a guaranteed-refund whatever happens"
CRITERIA = """\
criteria:
  - id: no-refund-promises
    version: 1
    kind: code
    severity: high
    check: regex
    pattern: "(?i)guaranteed-refund"
    must: not_match
    live: {live}
"""

# ----------------------------------------------------------------- the webhook receiver (its own process)


def serve_hook(conn: Any) -> None:
    """Records when each alert arrives, by conversation; ``GET /received`` lists them. Sends its port down
    ``conn``."""
    import logging

    from aiohttp import web

    logging.getLogger("aiohttp").setLevel(logging.CRITICAL)
    received: dict[str, float] = {}

    async def hook(request: web.Request) -> web.Response:
        body = await request.read()
        at = time.time()
        received.setdefault(json.loads(body)["conversation_id"], at)
        return web.Response(status=204)

    async def listing(request: web.Request) -> web.Response:
        return web.json_response(received)

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/hook", hook)
        app.router.add_get("/received", listing)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        conn.send(runner.addresses[0][1])
        await asyncio.Event().wait()

    asyncio.run(main())


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


# ----------------------------------------------------------------- probes


def probe_request(run: int, n: int) -> bytes:
    """One turn of conversation ``probe-<run>-<n>``: its agent span and its chat span, whose answer fails."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    def attr(span: Any, key: str, value: str) -> None:
        kv = span.attributes.add()
        kv.key, kv.value.string_value = key, value

    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    attr(rs.resource, "service.name", "shopbot")
    ss = rs.scope_spans.add()
    ss.scope.name = "opentelemetry.instrumentation.openai_v2"
    trace_id = run.to_bytes(4, "big") + n.to_bytes(4, "big") + b"probe..."
    now = time.time_ns()
    agent, chat = ss.spans.add(), ss.spans.add()
    agent.trace_id = chat.trace_id = trace_id
    agent.span_id, chat.span_id = n.to_bytes(4, "big") + b"agnt", n.to_bytes(4, "big") + b"chat"
    chat.parent_span_id = agent.span_id
    agent.name, chat.name = "invoke_agent ShopBot", "chat gpt-4o-mini"
    agent.kind, chat.kind = 1, 3
    for span in (agent, chat):
        span.start_time_unix_nano, span.end_time_unix_nano = now - 1_000_000_000, now
    attr(agent, "gen_ai.operation.name", "invoke_agent")
    attr(agent, "gen_ai.conversation.id", f"probe-{run}-{n}")
    for key, value in (("gen_ai.operation.name", "chat"), ("gen_ai.provider.name", "openai"),
                       ("gen_ai.request.model", "gpt-4o-mini"),
                       ("gen_ai.input.messages", json.dumps([{"role": "user", "parts": [
                           {"type": "text", "content": "My parcel arrived broken. What now?"}]}])),
                       ("gen_ai.output.messages", json.dumps([{"role": "assistant", "finish_reason": "stop",
                                                               "parts": [{"type": "text", "content": FAIL}]}]))):
        attr(chat, key, value)
    return req.SerializeToString()


async def probe(target: str, run: int, seconds: float, every: float) -> dict[str, float]:
    """A failing turn of a new conversation every ``every`` s for ``seconds``; conversation -> its ack time."""
    import grpc

    channel = grpc.aio.insecure_channel(target)
    call = channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export",
                               request_serializer=None, response_deserializer=None)
    acked: dict[str, float] = {}
    start = time.perf_counter()
    n = 0
    while time.perf_counter() - start < seconds:
        await asyncio.sleep(max(0.0, start + n * every - time.perf_counter()))
        body = probe_request(run, n)
        while True:  # refused (backpressure): sent again, as an exporter would; the ack is what counts
            try:
                await call(body, timeout=60)
                break
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.05)
        acked[f"probe-{run}-{n}"] = time.time()
        n += 1
    await channel.close()
    return acked


# ----------------------------------------------------------------- runs


def config(data: Path, live: bool, hook_url: str) -> str:
    (data / "criteria.yaml").write_text(CRITERIA.format(live=str(live).lower()))
    return (f"sampling: {{rate: 1.0}}\njudges: {{criteria: ['{data / 'criteria.yaml'}']}}\n"
            f"alerts: {{webhooks: [{{url: '{hook_url}/hook', secret: bench-secret, events: [live_failure]}}]}}\n")


def paced(workdir: Path, rate: float, seconds: float, every: float, live: bool, hook: str) -> dict[str, Any]:
    """One daemon at ``rate`` spans/s of background load for ``seconds``, with the prober when ``live``."""
    data = Path(tempfile.mkdtemp(dir=workdir))
    bodies = make_requests(max(SPANS_PER_REQUEST, int(rate * seconds)))
    proc, info = start_daemon(data, config(data, live, hook))
    try:
        lags: list[float] = []

        async def watch_lag() -> None:  # how far the conversation stage is behind, twice a second
            while True:
                status = await asyncio.to_thread(get_json, f"{info['api']}/api/status")
                lags.append(float(status.get("conversations_lag_seconds") or 0.0))
                await asyncio.sleep(0.5)

        async def both() -> tuple[Any, dict[str, float]]:
            window = asyncio.ensure_future(send_window(bodies, info["grpc"], rate))
            watcher = asyncio.ensure_future(watch_lag())
            acked = await probe(info["grpc"], int(rate), seconds, every) if live else {}
            sent = await window
            watcher.cancel()
            return sent, acked

        sent, acked = asyncio.run(both())
        deadline = time.time() + 30
        received: dict[str, float] = {}
        while time.time() < deadline:  # the last probes' alerts
            received = get_json(hook + "/received")
            if all(c in received for c in acked):
                break
            time.sleep(0.2)
    finally:
        proc.kill()  # nothing of it is kept: a clean stop would first rebuild every open conversation
        proc.wait()
    delays = sorted(received[c] - at for c, at in acked.items() if c in received)
    return {"sent": sent, "probes": len(acked), "paged": len(delays), "delays": delays,
            "requests": latency_figures(sent.latencies), "lag": sorted(lags) or [0.0]}


def flat_out(workdir: Path, bodies: list[bytes], live: bool, hook: str) -> float:
    data = Path(tempfile.mkdtemp(dir=workdir))
    proc, info = start_daemon(data, config(data, live, hook))
    try:
        elapsed, _, _ = asyncio.run(send_all(bodies, "grpc", info["grpc"]))
    finally:
        proc.kill()
        proc.wait()
    return len(bodies) * SPANS_PER_REQUEST / elapsed


def quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(len(values) * q))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="100,2000", help="background loads, spans/s")
    ap.add_argument("--seconds", type=float, default=60.0, help="probing time at each load")
    ap.add_argument("--probe-every", type=float, default=0.5)
    ap.add_argument("--spans", type=int, default=200_000, help="spans sent flat out per throughput run")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=serve_hook, args=(child,), daemon=True)
    server.start()
    hook = f"http://127.0.0.1:{parent.recv()}"
    print(f"one live code check on every conversation; {SPANS_PER_REQUEST} spans per request; a failing probe "
          f"turn every {args.probe_every}s for {args.seconds:.0f}s at each load", flush=True)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            print("\ntime to page: from the ack of the request holding the failing message to the webhook's receipt")
            for rate in (float(r) for r in args.rates.split(",")):
                off = paced(work, rate, args.seconds, args.probe_every, False, hook)
                on = paced(work, rate, args.seconds, args.probe_every, True, hook)
                d = on["delays"]
                pages = (f"p50 {statistics.median(d):.2f}s  p99 {quantile(d, 0.99):.2f}s  slowest {d[-1]:.2f}s"
                         if d else "no alert arrived")
                print(f"  {rate:>6,.0f} spans/s: {pages}; {on['paged']} of {on['probes']} probes paged; "
                      f"background requests p99 {on['requests']['p99_ms']:.0f} ms live on, "
                      f"{off['requests']['p99_ms']:.0f} ms live off "
                      f"({on['requests']['p99_ms'] / off['requests']['p99_ms']:.2f}x); conversation stage behind "
                      f"ingestion by p50 {statistics.median(on['lag']):.1f}s, at most {on['lag'][-1]:.1f}s "
                      f"(live off: {statistics.median(off['lag']):.1f}s, {off['lag'][-1]:.1f}s)", flush=True)
            print("target: every probe paged, p99 under 5 s")

            print("\nthroughput, senders flat out:")
            bodies = make_requests(args.spans)
            results: dict[bool, list[float]] = {False: [], True: []}
            for rnd in range(args.rounds):
                for live in (False, True) if rnd % 2 == 0 else (True, False):
                    results[live].append(flat_out(work, bodies, live, hook))
                    print(f"  round {rnd + 1} live {'on ' if live else 'off'} {results[live][-1]:>7,.0f} spans/s",
                          flush=True)
            ratios = [on / off for on, off in zip(results[True], results[False])]
            print(f"  on/off: {statistics.median(results[True]) / statistics.median(results[False]):.2f} of the "
                  f"spans/s (per round: {', '.join(f'{x:.2f}' for x in ratios)})")
            print("target: on/off >= 0.90")
    finally:
        server.terminate()


if __name__ == "__main__":
    main()
