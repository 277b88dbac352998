"""Ingest benchmark: tracejudge next to two reference receivers, measured in the same run.

Sends realistic GenAI spans (chat spans with the history in gen_ai.input.messages
and their invoke_agent parents, 1-2 KB each, 512 per request) over OTLP/gRPC and
OTLP/HTTP protobuf with 8 concurrent senders, to:

  null       a grpcio / aiohttp receiver that parses nothing (the transport's ceiling)
  walk       parses each request and walks every span's ids, times, status and
             attributes into Python tuples, storing nothing (the parse+walk reference)
  tracejudge the real daemon: parse, walk, DuckDB commit, then the answer

Runs alternate (null, walk, tracejudge per round) so that the machine's noise
hits all three alike, and prints spans/s, p50/p99 request latency and peak RSS,
with tracejudge as a ratio of each reference. Run by hand:

    .venv/bin/python bench/ingest.py [--spans 200000] [--rounds 2] [--transports grpc,http]

BENCH_STORAGE=", max_batch_spans: 4096" tries a storage setting on tracejudge's side.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SPANS_PER_REQUEST = 512
SYSTEM = ("You are ShopBot, the support assistant of an online bookshop. Always look an order up with the "
          "lookup_order tool before saying anything about it; never invent tracking numbers, dates or carriers. "
          "Offer a refund only for damaged or lost items and within 30 days of delivery. When the user asks for "
          "a person, or is upset twice in a row, hand the conversation over with the handover tool. Answer in "
          "the user's language, briefly, without marketing phrases.")
CONCURRENCY = 8
STORAGE_EXTRA = os.environ.get("BENCH_STORAGE", "")  # e.g. ", max_batch_spans: 4096" to try a setting

# ----------------------------------------------------------------- payloads


@functools.lru_cache(maxsize=1)
def _template() -> Any:
    """The request every body is made from, built once: a paced sender makes a body per request, and
    building this each time (the JSON of every history) took a tenth of a core from the daemon it measured
    at 10,000 spans/s. Only ids change from one body to the next (``make_requests``)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    def attr(span: Any, key: str, value: Any) -> None:
        kv = span.attributes.add()
        kv.key = key
        if isinstance(value, bool):
            kv.value.bool_value = value
        elif isinstance(value, int):
            kv.value.int_value = value
        else:
            kv.value.string_value = value

    template = ExportTraceServiceRequest()
    rs = template.resource_spans.add()
    for k, v in (("service.name", "shopbot"), ("service.version", "1.4.2"), ("telemetry.sdk.language", "python")):
        attr(rs.resource, k, v)
    ss = rs.scope_spans.add()
    ss.scope.name = "opentelemetry.instrumentation.openai_v2"
    user_lines = ["Hi, my order B-1042 has not arrived, where is it?", "Can I change the address?",
                  "Ok thanks. And the invoice?", "Perfect, thank you very much for the help today."]
    bot_lines = ["Your order B-1042 shipped on Monday with BRT and is out for delivery today before 6pm.",
                 "It is already out for delivery, so the address cannot be changed any more, sorry.",
                 "The invoice is attached to your order page under Documents; I can email it too.",
                 "You are welcome. Have a good day!"]
    t0 = 1_764_478_800_000_000_000
    for turn in range(SPANS_PER_REQUEST // 4):
        agent = ss.spans.add()
        agent.name = "invoke_agent ShopBot"
        agent.kind = 1
        attr(agent, "gen_ai.operation.name", "invoke_agent")
        attr(agent, "gen_ai.agent.name", "ShopBot")
        attr(agent, "gen_ai.conversation.id", f"conv-{turn:06d}")
        history: list[dict[str, Any]] = [{"role": "system", "parts": [{"type": "text", "content": SYSTEM}]}]
        for step in range(3):
            history.append({"role": "user", "parts": [{"type": "text", "content": user_lines[step]}]})
            chat = ss.spans.add()
            chat.name = "chat gpt-4o-mini"
            chat.kind = 3
            chat.start_time_unix_nano = t0 + turn * 1000 + step
            chat.end_time_unix_nano = chat.start_time_unix_nano + 800_000_000
            for k, v in (("gen_ai.operation.name", "chat"), ("gen_ai.provider.name", "openai"),
                         ("gen_ai.request.model", "gpt-4o-mini"), ("gen_ai.response.model", "gpt-4o-mini-2024-07-18"),
                         ("gen_ai.response.id", f"chatcmpl-{turn:08d}{step}"), ("gen_ai.usage.input_tokens", 120 + step),
                         ("gen_ai.usage.output_tokens", 40), ("server.address", "api.openai.com")):
                attr(chat, k, v)
            out = {"role": "assistant", "parts": [{"type": "text", "content": bot_lines[step]}], "finish_reason": "stop"}
            attr(chat, "gen_ai.input.messages", json.dumps(history))
            attr(chat, "gen_ai.output.messages", json.dumps([out]))
            history.append({"role": "assistant", "parts": out["parts"]})
        agent.start_time_unix_nano = t0 + turn * 1000
        agent.end_time_unix_nano = agent.start_time_unix_nano + 3_000_000_000
    return template


def _random_id(size: int, *parts: int) -> bytes:
    return hashlib.blake2b(repr(parts).encode(), digest_size=size).digest()


def make_requests(total_spans: int, first: int = 0) -> list[bytes]:
    """Distinct ExportTraceServiceRequest bodies of 512 spans each (``first``: the number of the first
    request, so that later steps of a run send new traces)."""
    template = _template()
    bodies = []
    n_requests = max(1, total_spans // SPANS_PER_REQUEST)
    spans = template.resource_spans[0].scope_spans[0].spans
    for r in range(first, first + n_requests):
        for i, sp in enumerate(spans):
            turn = i // 4
            # Random ids, as tracers make them (the same in every run): sequential ones fill an index on
            # them along one edge, and hid what random ones cost DuckDB's memory.
            sp.trace_id = _random_id(16, r, turn)
            sp.span_id = _random_id(8, r, i)
            sp.parent_span_id = b"" if i % 4 == 0 else _random_id(8, r, turn * 4)
            if i % 4 == 0:  # each conversation: four turns, one per request of four in a row
                sp.attributes[2].value.string_value = f"conv-{r // 4:05d}-{turn:03d}"
        bodies.append(template.SerializeToString())
    return bodies


# ----------------------------------------------------------------- reference receivers


def serve_reference(kind: str, transport: str) -> None:
    """Run a reference receiver until killed; prints its port on stdout."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    def walk(body: bytes) -> int:
        req = ExportTraceServiceRequest.FromString(body)
        rows = []
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                for sp in ss.spans:
                    attrs = tuple((kv.key, getattr(kv.value, kv.value.WhichOneof("value") or "string_value"))
                                  for kv in sp.attributes)
                    rows.append((sp.trace_id, sp.span_id, sp.parent_span_id, sp.start_time_unix_nano,
                                 sp.end_time_unix_nano, sp.status.code, attrs))
        return len(rows)

    handle = (lambda body: 0) if kind == "null" else walk

    async def main() -> None:
        if transport == "grpc":
            import grpc

            async def export(request: bytes, context: Any) -> bytes:
                handle(request)
                return b""

            server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)])
            server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
                "opentelemetry.proto.collector.trace.v1.TraceService",
                {"Export": grpc.unary_unary_rpc_method_handler(export, request_deserializer=None,
                                                               response_serializer=None)})])
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            print(port, flush=True)
            await server.wait_for_termination()
        else:
            from aiohttp import web

            async def h(request: web.Request) -> web.Response:
                handle(await request.read())
                return web.Response(body=b"", content_type="application/x-protobuf")

            app = web.Application(client_max_size=64 * 1024 * 1024)
            app.router.add_post("/v1/traces", h)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            print(site._server.sockets[0].getsockname()[1], flush=True)  # type: ignore[union-attr]
            await asyncio.Event().wait()

    asyncio.run(main())


# ----------------------------------------------------------------- load

async def send_all(bodies: list[bytes], transport: str, target: str) -> tuple[float, list[float], int]:
    """Send every body with CONCURRENCY senders, retrying refusals; (seconds, latencies, refusals)."""
    latencies: list[float] = []
    failures = 0
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    for b in bodies:
        queue.put_nowait(b)
    if transport == "grpc":
        import grpc

        channel = grpc.aio.insecure_channel(target, options=[("grpc.max_send_message_length", 64 * 1024 * 1024)])
        call = channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export",
                                   request_serializer=None, response_deserializer=None)

        async def send(body: bytes) -> bool:
            try:
                await call(body, timeout=60)
                return True
            except grpc.aio.AioRpcError:
                return False
    else:
        import aiohttp

        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CONCURRENCY))

        async def send(body: bytes) -> bool:
            async with session.post(target, data=body, headers={"Content-Type": "application/x-protobuf"}) as r:
                await r.read()
                return r.status == 200

    async def worker() -> None:
        nonlocal failures
        while not queue.empty():
            body = queue.get_nowait()
            while True:  # a refused request is retried, as exporters do
                t = time.perf_counter()
                ok = await send(body)
                latencies.append(time.perf_counter() - t)
                if ok:
                    break
                failures += 1
                await asyncio.sleep(0.05)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    elapsed = time.perf_counter() - start
    if transport == "grpc":
        await channel.close()
    else:
        await session.close()
    return elapsed, latencies, failures


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            out += [int(c) for c in task.read_text().split()]
        except FileNotFoundError:
            continue
    return out


def pss_mb(pid: int) -> float:
    """The proportional set of the process and its children, summed: what they take together, each shared
    page (the libraries every process maps) counted once, as a container's memory limit counts it."""
    return sum(pss_parts(pid).values())


def pss_parts(pid: int) -> dict[int, float]:
    """The proportional set (MB) of the process and of each of its children, by pid."""
    parts: dict[int, float] = {}
    for p in [pid, *_children(pid)]:
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    parts[p] = int(line.split()[1]) / 1024
        except FileNotFoundError:
            continue
    return parts


def peak_rss_mb(pid: int, children: bool = True) -> float:
    """The process's peak resident set, plus each child's (the daemon's conversation stage and rewrite
    processes): an upper bound of the peak of their sum."""
    def hwm(p: int) -> float:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        except FileNotFoundError:
            pass
        return 0.0

    total = hwm(pid) or float("nan")
    if children:
        total += sum(hwm(c) for c in _children(pid))
    return total


def checkout(ref: str, into: Path) -> Path:
    """``ref``'s tree of this repository, unpacked into ``into`` (to run another commit's daemon beside this one)."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def start_daemon(data: Path, extra_config: str = "") -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """Start `tracejudge serve` on a config in ``data`` (plus ``extra_config`` YAML); its runtime info."""
    cfg = data / "otel-config.yaml"
    cfg.write_text(
        "receivers: {otlp: {protocols: {grpc: {endpoint: '127.0.0.1:0'}, http: {endpoint: '127.0.0.1:0'}}}}\n"
        f"storage: {{duckdb: {{path: '{data / 'bench.duckdb'}'}}{STORAGE_EXTRA}}}\napi: {{endpoint: '127.0.0.1:0'}}\n"
        + extra_config)
    proc = subprocess.Popen([sys.executable, "-m", "collector", "serve", "--config", str(cfg),
                             "--log-level", "warning"], stdout=subprocess.DEVNULL, cwd=REPO)
    runtime = data / "bench.duckdb.daemon.json"
    while not runtime.exists():
        if proc.poll() is not None:
            raise SystemExit("tracejudge did not start")
        time.sleep(0.05)
    return proc, json.loads(runtime.read_text())


def latency_figures(latencies: list[float]) -> dict[str, float]:
    """p50 and p99 request latency in ms."""
    lat = sorted(latencies)
    return {"p50_ms": statistics.median(lat) * 1000, "p99_ms": lat[int(len(lat) * 0.99) - 1] * 1000}


def run_one(name: str, transport: str, bodies: list[bytes], workdir: Path) -> dict[str, Any]:
    proc: subprocess.Popen[Any]
    if name == "tracejudge":
        proc, info = start_daemon(Path(tempfile.mkdtemp(dir=workdir)))
        target = info["grpc"] if transport == "grpc" else f"http://{info['http']}/v1/traces"
    else:
        proc = subprocess.Popen([sys.executable, __file__, "--serve-reference", name, transport],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        target = f"127.0.0.1:{port}" if transport == "grpc" else f"http://127.0.0.1:{port}/v1/traces"
    try:
        elapsed, lat, failures = asyncio.run(send_all(bodies, transport, target))
        rss = peak_rss_mb(proc.pid)
        stored = None
        lag = None
        if name == "tracejudge":
            import urllib.request

            with urllib.request.urlopen(info["api"] + "/api/spans/count") as resp:
                stored = json.loads(resp.read())["spans"]
            t_acked = time.perf_counter()
            while True:  # how long after the last ack the conversations are current
                with urllib.request.urlopen(info["api"] + "/api/status") as resp:
                    st = json.loads(resp.read())
                if st["conversations_batch"] >= st["committed_batch"] and not st["conversations_pending"]:
                    break
                time.sleep(0.1)
            lag = time.perf_counter() - t_acked
            rss = peak_rss_mb(proc.pid)
    finally:
        proc.terminate()
        proc.wait()
    spans = len(bodies) * SPANS_PER_REQUEST
    return {"name": name, "transport": transport, "spans_per_s": spans / elapsed, **latency_figures(lat),
            "rss_mb": rss, "refused": failures, "stored": stored, "sent": spans, "lag_s": lag}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spans", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--transports", default="grpc,http")
    ap.add_argument("--serve-reference", nargs=2, metavar=("KIND", "TRANSPORT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_reference:
        serve_reference(*args.serve_reference)
        return
    t = time.perf_counter()
    bodies = make_requests(args.spans)
    size = sum(len(b) for b in bodies) / (len(bodies) * SPANS_PER_REQUEST)
    print(f"{len(bodies)} requests x {SPANS_PER_REQUEST} spans, {size:.0f} bytes/span on the wire "
          f"(built in {time.perf_counter() - t:.1f}s); concurrency {CONCURRENCY}", flush=True)
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for transport in args.transports.split(","):
                for name in ("null", "walk", "tracejudge"):
                    r = run_one(name, transport, bodies, Path(tmp))
                    results.setdefault((transport, name), []).append(r)
                    print(f"  round {rnd + 1} {transport:4} {name:10} {r['spans_per_s']:>9,.0f} spans/s  "
                          f"p50 {r['p50_ms']:6.1f} ms  p99 {r['p99_ms']:6.1f} ms  peak RSS {r['rss_mb']:5.0f} MB"
                          + (f"  stored {r['stored']:,}/{r['sent']:,}, refused+retried {r['refused']}, "
                             f"conversations current {r['lag_s']:.1f}s after the last ack"
                             if r["stored"] is not None else ""), flush=True)
    print("\nmedian over rounds; tracejudge as a share of each reference in the same run:")
    for transport in args.transports.split(","):
        med = {n: {k: statistics.median(r[k] for r in results[(transport, n)])
                   for k in ("spans_per_s", "p50_ms", "p99_ms", "rss_mb")}
               for n in ("null", "walk", "tracejudge")}
        tj = med["tracejudge"]
        print(f"  {transport:4}: tracejudge {tj['spans_per_s']:,.0f} spans/s = "
              f"{tj['spans_per_s'] / med['walk']['spans_per_s']:.0%} of parse+walk "
              f"({med['walk']['spans_per_s']:,.0f}), {tj['spans_per_s'] / med['null']['spans_per_s']:.0%} of null "
              f"({med['null']['spans_per_s']:,.0f}); p50 {tj['p50_ms']:.0f} ms, p99 {tj['p99_ms']:.0f} ms, "
              f"peak RSS {max(r['rss_mb'] for r in results[(transport, 'tracejudge')]):.0f} MB")
    print("targets: >= 25% of parse+walk (aim 50%), peak RSS < 400 MB, p99 < 500 ms")


if __name__ == "__main__":
    main()
