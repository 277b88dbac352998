"""The daemon: one asyncio loop running the OTLP receivers and the API over one store.

Start: refuse if a daemon already serves this DuckDB file, open the store,
bind every listener, write the runtime file, print where to look.
Stop (SIGTERM or SIGINT): stop intake (in-flight requests still get their
answer after their commit), commit what is queued, close DuckDB, remove the
runtime file, exit 0.

The daemon never installs a global OpenTelemetry TracerProvider: SDKs used
inside it would feed its own calls back into ingestion.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import signal
import sys
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any, TextIO

import grpc
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler, Middleware

from judges import Criterion, Provider

from .api import API
from .config import Config, Listener
from .conversations import Conversations
from .queries import conversation_counts
from .errors import UserError
from .evaluator import Evaluator
from .judge_setup import daemon_provider, load_configured_criteria
from .metrics import Metrics
from .receiver import MiB, Intake, add_grpc_port, grpc_server, http_app, ssl_context
from .runtime import RuntimeInfo, running_daemon
from .store import Store
from .words import percent, plural

log = logging.getLogger("tracejudge.daemon")


def _loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1", "[::1]") or host.startswith("127.")


def _split(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


async def _start_site(app: web.Application, listener: Listener, what: str) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``listener``; returns the runner and the actual port (port 0 picks one).

    No client holds a connection for ever: one with no request in flight, or still
    sending headers, is closed after ``idle_timeout`` (aiohttp's keep-alive timer
    runs from the connection's start and from each answer); a request body still
    arriving ``read_timeout`` after its headers has its connection closed. A client
    that goes away mid-request, or sends what is not HTTP, is logged at debug, not as
    an error.
    """
    app.middlewares.insert(0, _unfinished_requests(listener.read_timeout))  # outermost: sees every handler
    # Bodies are inflated by us, with a size bound, not by aiohttp.
    runner = web.AppRunner(app, access_log=None, auto_decompress=False, handle_signals=False,
                           keepalive_timeout=listener.idle_timeout, logger=_ServerLog(_aiohttp_log, {}))
    await runner.setup()
    host, port = _split(listener.endpoint)
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context(listener.tls))
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise UserError(f"cannot listen on {listener.endpoint} ({what}): {exc.strerror or exc}") from None
    server = site._server
    sockets = getattr(server, "sockets", None) or []
    actual = sockets[0].getsockname()[1] if sockets else port
    return runner, actual


_aiohttp_log = logging.getLogger("aiohttp.server")


class _ServerLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's server log, where a request it cannot parse (answered 400) is the client's
    mistake: one debug line, not an ERROR traceback. Anything else is logged as aiohttp does."""

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        if isinstance(exc_info, HttpProcessingError):
            self.debug("%s: %s", str(msg) % args, " ".join(str(exc_info.message).split()))
        else:
            super().exception(msg, *args, exc_info=exc_info, **kwargs)


def _unfinished_requests(read_timeout: float) -> Middleware:
    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        timer = None
        if not request.content.is_eof():
            timer = asyncio.get_running_loop().call_later(read_timeout, _close_if_unread, request, read_timeout)
        try:
            return await handler(request)
        except ConnectionResetError:
            if request.transport is not None and not request.transport.is_closing():
                raise  # not this client's connection
            log.debug("client %s went away during %s %s", request.remote, request.method, request.path)
            return web.Response(status=400)  # nobody reads it: aiohttp drops it quietly
        finally:
            if timer is not None:
                timer.cancel()

    return guard


def _close_if_unread(request: web.Request, read_timeout: float) -> None:
    if not request.content.is_eof() and request.transport is not None:
        log.debug("closing the connection of %s: the body of %s %s did not arrive within read_timeout (%gs)",
                  request.remote, request.method, request.path, read_timeout)
        request.transport.close()


CAPTURE_HINT = ("set OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY (with "
                "OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental) in the bot to capture content")


def _conversation_gauges(store: Store) -> list[str]:
    cur = store.cursor()
    try:
        counts = conversation_counts(cur)
    finally:
        cur.close()
    return [
        "# HELP tracejudge_conversations Conversations by state.",
        "# TYPE tracejudge_conversations gauge",
        f'tracejudge_conversations{{state="open"}} {counts["open"]}',
        f'tracejudge_conversations{{state="ended"}} {counts["ended"]}',
        "# HELP tracejudge_conversations_without_content Conversations whose spans carry no message content; "
        f"stored and counted, never judged: {CAPTURE_HINT}.",
        "# TYPE tracejudge_conversations_without_content gauge",
        f"tracejudge_conversations_without_content {counts['without_content']}",
    ]


@dataclass
class Daemon:
    config: Config
    out: TextIO = sys.stdout

    async def run(self, stop: asyncio.Event | None = None) -> None:
        cfg = self.config
        runtime_path = cfg.runtime_file
        other = running_daemon(runtime_path)
        if other is not None and other.pid != os.getpid():
            raise UserError(f"a tracejudge daemon (pid {other.pid}) already serves {cfg.storage.duckdb.path}; "
                            f"its API is {other.api}")
        criteria = load_configured_criteria(cfg)  # a typo in a criteria file stops the start, not a judge
        provider, no_provider = daemon_provider(cfg)
        metrics = Metrics()
        store = Store(cfg.storage.duckdb.path, memory_limit=cfg.storage.memory_limit,
                      max_queue_spans=cfg.storage.max_queue_spans, max_batch_spans=cfg.storage.max_batch_spans,
                      retry_after=cfg.storage.retry_after, metrics=metrics)
        store.open()
        convs = Conversations(store, cfg.conversations, metrics)
        convs.start()
        store.on_commit(convs.on_commit)
        metrics.add_collector(lambda: _conversation_gauges(store))
        evaluator = Evaluator(store, cfg, metrics, criteria=criteria, provider=provider, no_provider=no_provider)
        evaluator.start()
        rcv = cfg.receivers.otlp
        intake = Intake(store, metrics, int(rcv.max_request_size_mib * MiB), rcv.auth.bearer_token)
        api = API(store, metrics, cfg.api,
                  status=lambda: {**convs.status(), **evaluator.status()}, evaluator=evaluator)
        runners: list[web.AppRunner] = []
        gserver: grpc.aio.Server | None = None
        try:
            api_runner, api_port = await _start_site(api.app, cfg.api, "API")
            runners.append(api_runner)
            grpc_addr = http_addr = None
            if rcv.protocols.grpc is not None:
                gserver = grpc_server(intake, rcv.protocols.grpc)
                try:
                    port = add_grpc_port(gserver, rcv.protocols.grpc.endpoint, rcv.protocols.grpc.tls)
                except (OSError, RuntimeError) as exc:
                    raise UserError(f"cannot listen on {rcv.protocols.grpc.endpoint} (OTLP/gRPC): {exc}") from None
                await gserver.start()
                grpc_addr = f"{_split(rcv.protocols.grpc.endpoint)[0]}:{port}"
            if rcv.protocols.http is not None:
                h = rcv.protocols.http
                http_runner, port = await _start_site(http_app(intake), h, "OTLP/HTTP")
                runners.append(http_runner)
                http_addr = f"{_split(h.endpoint)[0]}:{port}"
            api_host = _split(cfg.api.endpoint)[0]
            scheme = "https" if cfg.api.tls.enabled else "http"
            api_url = f"{scheme}://{api_host}:{api_port}"
            RuntimeInfo(
                pid=os.getpid(), version=version("tracejudge"), duckdb=str(cfg.storage.duckdb.path),
                grpc=grpc_addr, http=http_addr, api=api_url,
                started_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            ).write(runtime_path)
            api.ready = True
            self._banner(grpc_addr, http_addr, api_url)
            self._judging(criteria, provider, no_provider)
            if not _loopback(api_host) and not cfg.api.auth.bearer_token:
                log.warning("the API listens on %s without api.auth.bearer_token: anyone who can reach it "
                            "can read production conversations", cfg.api.endpoint)
            await self._wait(stop)
            log.info("stopping: no new requests; committing what is in flight")
        finally:
            api.ready = False
            if gserver is not None:
                await gserver.stop(grace=10)
            for runner in reversed(runners):
                await runner.cleanup()
            await asyncio.to_thread(evaluator.stop)
            await asyncio.to_thread(store.drain)
            await asyncio.to_thread(convs.stop)
            await asyncio.to_thread(store.close)
            if RuntimeInfo.read(runtime_path) and RuntimeInfo.read(runtime_path).pid == os.getpid():  # type: ignore[union-attr]
                runtime_path.unlink(missing_ok=True)
        log.info("stopped cleanly; %d spans stored this run", int(metrics.spans_stored.value()))

    async def _wait(self, stop: asyncio.Event | None) -> None:
        # The handlers stay until the process exits: a second signal (Ctrl-C reaches
        # every process of the group, then `demo` forwards SIGTERM) must not cut the
        # shutdown short with the default action.
        event = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, event.set)
        await event.wait()

    def _banner(self, grpc_addr: str | None, http_addr: str | None, api_url: str) -> None:
        lines = [f"tracejudge {version('tracejudge')} is running (pid {os.getpid()})"]
        if grpc_addr:
            lines.append(f"  OTLP/gRPC   {grpc_addr}")
        if http_addr:
            lines.append(f"  OTLP/HTTP   http://{http_addr}/v1/traces  (also /v1/logs, /v1/metrics)")
        lines += [
            f"  review      {api_url}/review",
            f"  API         {api_url}  (/healthz, /metrics, /api/status, /api/conversations, /api/stats, /api/review)",
            f"  DuckDB      {self.config.storage.duckdb.path}",
            f"  runtime     {self.config.runtime_file}",
            "Point your bot at it: OTEL_EXPORTER_OTLP_ENDPOINT=http://"
            f"{grpc_addr or http_addr}  (Ctrl-C or SIGTERM stops it)",
        ]
        print("\n".join(lines), file=self.out, flush=True)


    def _judging(self, criteria: list[Criterion], provider: Provider | None, no_provider: str | None) -> None:
        sampling = self.config.sampling
        if not criteria:
            log.info("no criteria (judges.criteria): conversations are sampled but not judged")
            return
        llm = sum(1 for c in criteria if c.kind == "llm")
        rules = f"; {plural(len(sampling.rules), 'sampling rule')} may set other rates" if sampling.rules else ""
        log.info("judging %s (%d code, %d LLM) on %s of ended conversations%s",
                 plural(len(criteria), "criterion", "criteria"), len(criteria) - llm, llm, percent(sampling.rate), rules)
        if llm and provider is None:
            log.warning("LLM criteria are reported as not run: %s", no_provider)
        elif provider is not None:
            log.info("judge: %s %s", provider.name, provider.model)


def serve(config: Config) -> None:
    """Run the daemon until SIGTERM/SIGINT."""
    asyncio.run(Daemon(config).run())
