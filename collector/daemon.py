"""The daemon: one asyncio loop running the OTLP receivers and the API over one store.

Start: refuse if a daemon already serves this DuckDB file, open the store
(a damaged file stops the start with one line naming it), start the
conversation, eval and retention stages, the alerts' and the monitors' (then any a downstream package
adds: `serve` adds replay's scenarios stage), bind every listener, write the runtime file,
print where to look.
Stop (SIGTERM or SIGINT, see ``shutdown``; a second signal changes nothing):
stop intake on every listener at once (in-flight requests still get their
answer after their commit), commit everything queued, let the conversation
stage take in the last commits, close DuckDB, remove the runtime file, log
what was committed and refused while stopping, exit 0. A signal during
start-up stops it at its next step, through the same teardown, and exits 0.
If the store's writer stops for good, readiness fails and the daemon stops
the same way but exits 1, for a supervisor to restart it; a shutdown whose
last commits failed exits 1 too.

The daemon never installs a global OpenTelemetry TracerProvider: SDKs used
inside it would feed its own calls back into ingestion.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import sqlite3
import sys
from dataclasses import dataclass
from importlib.metadata import version
from collections.abc import Callable, Sequence
from typing import Awaitable, TextIO

import duckdb
import grpc
from aiohttp import web

from judges import Criterion, Provider, set_check_workers

from .alerts import store as alerts_store
from .alerts.delivery import AlertDelivery
from .alerts.live import on_live_fail
from .alerts.monitors import Monitors
from .api.app import API
from .background import Stage
from .config import Config, is_loopback
from .conversations import conversation_counts
from .conversations.process import StageProcess
from .conversations.reindex import Runner
from .errors import StoreUnavailable, UserError
from .evals.evaluator import Evaluator
from .evals.judging import ensure_schema as evals_schema
from .evals.setup import daemon_provider, load_configured_criteria
from .forward import Forwarder
from .forward.verdicts import VerdictEvents
from .ingest.receiver import MiB, Intake, add_grpc_port, grpc_server, http_app
from .system.listen import address, split_endpoint, start_site
from .system.memory import allocators, duckdb_memory, resident_bytes
from .metrics import Metrics
from .retention import Retention
from .review import queue as review_queue
from .system.runtime import RuntimeInfo, running_daemon
from .system.shutdown import StopSignals
from .store import Store, file_fault, unreadable
from .words import duration_text, masked_url, percent, plural

log = logging.getLogger("tracejudge.daemon")

# Seconds in-flight gRPC requests get to finish at shutdown; one cut off is still committed.
GRPC_GRACE = 10.0


CAPTURE_HINT = ("set OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY (with "
                "OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental) in the bot to capture content")


def _conversation_gauges(store: Store) -> list[str]:
    try:
        cur = store.cursor()
        try:
            counts = conversation_counts(cur)
        finally:
            cur.close()
    except (duckdb.Error, StoreUnavailable) as exc:  # the file is being attached again: /metrics still answers
        return [f"# tracejudge_conversations unavailable: {str(exc).splitlines()[0]}"]
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


def _memory_gauges(store: Store) -> list[str]:
    """Where the daemon's memory is: its resident set, and DuckDB's share of it by what holds it."""
    lines = ["# HELP process_resident_memory_bytes Resident memory of the daemon.",
             "# TYPE process_resident_memory_bytes gauge",
             f"process_resident_memory_bytes {resident_bytes()}",
             "# HELP tracejudge_allocator_bytes What DuckDB's allocator holds: duckdb_allocated in use, "
             "duckdb_resident kept resident (freed pages not yet returned included).",
             "# TYPE tracejudge_allocator_bytes gauge"]
    lines += [f'tracejudge_allocator_bytes{{kind="{kind}"}} {value}' for kind, value in allocators().items()]
    try:
        cur = store.cursor()
        try:
            rows = [(tag, used, spilled) for tag, (used, spilled) in duckdb_memory(cur).items() if used or spilled]
        finally:
            cur.close()
    except (duckdb.Error, StoreUnavailable):
        return lines
    lines += ["# HELP tracejudge_duckdb_memory_bytes DuckDB's memory by what holds it (BASE_TABLE: cached "
              "table blocks, ART_INDEX: primary keys, ...), within storage.memory_limit.",
              "# TYPE tracejudge_duckdb_memory_bytes gauge"]
    lines += [f'tracejudge_duckdb_memory_bytes{{tag="{tag}"}} {used}' for tag, used, _ in rows]
    lines += ["# HELP tracejudge_duckdb_spilled_bytes DuckDB's temporary files, by what they hold.",
              "# TYPE tracejudge_duckdb_spilled_bytes gauge"]
    lines += [f'tracejudge_duckdb_spilled_bytes{{tag="{tag}"}} {spilled}' for tag, _, spilled in rows if spilled]
    return lines


def _process_gauges(convs: StageProcess) -> list[str]:
    """The conversation stage's process (its memory is the daemon's too) and how far behind it is."""
    child = convs.process()
    commits, seconds = convs.lag()
    return ["# HELP tracejudge_conversations_lag_commits Commits stored that the conversation stage has not taken "
            "in yet.",
            "# TYPE tracejudge_conversations_lag_commits gauge",
            f"tracejudge_conversations_lag_commits {commits}",
            "# HELP tracejudge_conversations_lag_seconds How long ago the oldest commit the conversation stage has "
            "not taken in yet arrived (0: conversations are current).",
            "# TYPE tracejudge_conversations_lag_seconds gauge",
            f"tracejudge_conversations_lag_seconds {seconds:.3f}",
            "# HELP tracejudge_conversations_process_resident_memory_bytes Resident memory of the conversation "
            "stage's process (count it with the daemon's).",
            "# TYPE tracejudge_conversations_process_resident_memory_bytes gauge",
            f"tracejudge_conversations_process_resident_memory_bytes {child['rss_bytes']}",
            "# HELP tracejudge_conversations_process_restarts_total Times the conversation stage's process "
            "ended and was started again.",
            "# TYPE tracejudge_conversations_process_restarts_total counter",
            f"tracejudge_conversations_process_restarts_total {child['restarts']}"]


class Parts:
    """What start-up has opened so far: the teardown closes exactly these."""

    def __init__(self) -> None:
        self.metrics = Metrics()
        self.broken = asyncio.Event()  # set when the store's writer stops for good
        self.store: Store | None = None
        self.convs: StageProcess | None = None
        self.evaluator: Evaluator | None = None
        self.retention: Retention | None = None
        self.extra: list[Stage] = []
        self.reindexer: Runner | None = None
        self.api: API | None = None
        self.api_runner: web.AppRunner | None = None
        self.gserver: grpc.aio.Server | None = None
        self.http_runner: web.AppRunner | None = None
        self.forwarder: Forwarder | None = None
        self.intake: Intake | None = None


@dataclass(frozen=True)
class Stopped:
    """How a run ended: the exit status and the last log line."""

    status: int
    message: str


async def _open(store: Store, signals: StopSignals) -> bool:
    """Open the store off the loop, so that a stop signal cuts a long open short (the one-time rebuild of
    an older file's tables, half a minute at ten million spans): False when a signal came first, with
    the file as it was and nothing left open. The evals tables are made there too, for their own
    one-time rebuild (about a second a million conversations)."""
    opening = asyncio.ensure_future(asyncio.to_thread(store.open, evals_schema))
    stop = asyncio.ensure_future(signals.wait())
    try:
        await asyncio.wait({opening, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
    if not opening.done():
        log.info("stop requested while opening the DuckDB file: interrupting it; the file stays as it was")
        store.interrupt_open()
        try:
            await opening
        except duckdb.InterruptException:
            return False
        store.close()  # it finished first
        return False
    opening.result()  # what the open raised
    return True


def _refused(m: Metrics) -> int:
    """Spans and log records the store refused (queue full, shutting down, commit failed)."""
    return int(sum(c.value(reason=r) for c in (m.spans_rejected, m.logs_rejected)
                   for r in ("backpressure", "storage_error")))


async def _each(*steps: Awaitable[object]) -> None:
    """Run teardown steps side by side; one that fails is logged and stops none of the others."""
    for result in await asyncio.gather(*steps, return_exceptions=True):
        if isinstance(result, BaseException):
            log.error("a shutdown step failed: %r", result, exc_info=result)


StageFactory = Callable[[Store, Config, Metrics], Stage]
"""Makes a stage of a downstream package (``replay``'s scenarios) that ``collector`` does not import."""


@dataclass
class Daemon:
    config: Config
    out: TextIO = sys.stdout
    parts: Parts | None = None  # what the current run has opened
    extra_stages: Sequence[StageFactory] = ()
    """Started after the built-in stages, stopped with the evaluator."""

    async def run(self, signals: StopSignals) -> Stopped:
        """Start, serve until a stop signal or a broken store, then stop.

        Raises:
            UserError: start-up failed (a port in use, a damaged DuckDB file...); what it opened is closed.
        """
        signals.attach()
        self.parts = parts = Parts()
        try:
            if not await self._start(parts, signals):
                await self._teardown(parts)
                return Stopped(0, f"stopped during start-up ({signals.received[0]}); nothing was left open")
            why = await self._serve(parts, signals)
        except BaseException:
            await self._teardown(parts)
            raise
        (log.error if parts.store is not None and parts.store.broken else log.info)(
            "stopping (%s): no new requests; committing what is queued", why)
        m = parts.metrics
        spans, logs, refused = m.spans_stored.value(), m.logs_stored.value(), _refused(m)
        await self._teardown(parts)
        while_stopping = (f"while stopping {plural(int(m.spans_stored.value() - spans), 'span')} and "
                          f"{plural(int(m.logs_stored.value() - logs), 'log record')} were committed, "
                          f"{_refused(m) - refused} refused")
        stored = f"{plural(int(m.spans_stored.value()), 'span')} stored this run"
        assert parts.store is not None
        if parts.store.failure is not None:
            return Stopped(1, f"stopped, but the store could not commit ({parts.store.failure}); "
                              f"{stored}; {while_stopping}")
        return Stopped(0, f"stopped cleanly; {stored}; {while_stopping}")

    async def _start(self, parts: Parts, signals: StopSignals) -> bool:
        """Open everything, step by step; False when a stop signal came first (start-up stops there)."""
        cfg = self.config
        log.debug("starting (pid %d) on %s", os.getpid(), cfg.storage.duckdb.path)
        other = running_daemon(cfg.runtime_file)
        if other is not None and other.pid != os.getpid():
            raise UserError(f"a tracejudge daemon (pid {other.pid}) already serves {cfg.storage.duckdb.path}; "
                            f"its API is {other.api}")
        criteria = load_configured_criteria(cfg)  # a typo in a criteria file stops the start, not a judge
        provider, no_provider = daemon_provider(cfg)
        if signals.requested:
            return False
        metrics = parts.metrics
        store = Store(cfg.storage.duckdb.path, memory_limit=cfg.storage.memory_limit,
                      max_queue_spans=cfg.storage.max_queue_spans, max_batch_spans=cfg.storage.max_batch_spans,
                      retry_after=cfg.storage.retry_after, metrics=metrics)
        if not await _open(store, signals):
            return False
        parts.store = store
        loop = asyncio.get_running_loop()
        store.on_broken(lambda reason: loop.call_soon_threadsafe(parts.broken.set))
        if signals.requested:
            return False
        try:
            # Each stage is recorded before it starts: its stop() closes whatever its start opened.
            parts.convs = convs = StageProcess(store, cfg.conversations, metrics)
            convs.start()
            store.on_commit(convs.on_commit)
            metrics.add_collector(lambda: _conversation_gauges(store))
            metrics.add_collector(lambda: _memory_gauges(store) + _process_gauges(convs))
            if signals.requested:
                return False
            cur = store.cursor()
            try:
                review_queue.ensure_schema(cur)  # before the evaluator, which opens items as it stores
                alerts_store.ensure_schema(cur)  # before every stage that may fire one
            finally:
                cur.close()
            set_check_workers(cfg.judges.check_workers)  # the process's pool: the daemon's to size
            parts.evaluator = evaluator = Evaluator(store, cfg, metrics, criteria=criteria, provider=provider,
                                                    on_stored=review_queue.item_opener(cfg),
                                                    no_provider=no_provider)
            evaluator.start()
            parts.retention = retention = Retention(store, cfg.storage.retention, metrics)
            retention.start()
            delivery = AlertDelivery(store, metrics, cfg.alerts.webhooks)
            parts.extra.append(delivery)
            delivery.start()
            monitors = Monitors(store, cfg.alerts.monitors, metrics)  # also with none: it resolves removed ones'
            parts.extra.append(monitors)
            monitors.start()
            for make in self.extra_stages:
                stage = make(store, cfg, metrics)
                parts.extra.append(stage)
                stage.start()
        except duckdb.Error as exc:  # the stages' first reads find what the store's did not
            if file_fault(exc):
                raise unreadable(store.path, exc) from None
            raise
        if signals.requested:
            return False
        if cfg.exporters:
            try:
                parts.forwarder = forwarder = Forwarder(cfg, metrics)
            except (sqlite3.Error, OSError) as exc:
                raise UserError(f"cannot open the forward queues in {cfg.forward_dir}: {exc}") from None
            forwarder.start()
            if forwarder.sends("logs"):  # verdicts go out as evaluation events with the logs
                events = VerdictEvents(store, metrics, lambda body: forwarder.put("logs", body))
                parts.extra.append(events)
                events.start()
        rcv = cfg.receivers.otlp
        parts.intake = intake = Intake(store, metrics, int(rcv.max_request_size_mib * MiB),
                                       rcv.auth.bearer_token, forward=parts.forwarder,
                                       retry_after=cfg.storage.retry_after)
        parts.reindexer = reindexer = Runner(store, cfg.conversations, convs)
        parts.api = api = API(store, metrics, cfg.api, stages=(convs, evaluator, retention, *parts.extra),
                              evaluator=evaluator,
                              reindexer=reindexer, forwarder=parts.forwarder, review_settings=cfg.review,
                              seed=cfg.sampling.seed, simulate_settings=cfg.simulate)
        parts.api_runner, api_port = await start_site(api.app, cfg.api, "API")
        grpc_addr = http_addr = None
        if rcv.protocols.grpc is not None:
            parts.gserver = grpc_server(intake, rcv.protocols.grpc)
            try:
                port = add_grpc_port(parts.gserver, rcv.protocols.grpc.endpoint, rcv.protocols.grpc.tls)
            except (OSError, RuntimeError) as exc:
                raise UserError(f"cannot listen on {rcv.protocols.grpc.endpoint} (OTLP/gRPC): {exc}") from None
            await parts.gserver.start()
            grpc_addr = address(rcv.protocols.grpc.endpoint, port)
        if rcv.protocols.http is not None:
            h = rcv.protocols.http
            parts.http_runner, port = await start_site(http_app(intake), h, "OTLP/HTTP")
            http_addr = address(h.endpoint, port)
        if signals.requested:
            return False
        scheme = "https" if cfg.api.tls.enabled else "http"
        api_url = f"{scheme}://{address(cfg.api.endpoint, api_port)}"
        evaluator.go_live(on_live_fail(api_url))  # now that its alerts can link to the review page
        RuntimeInfo(
            pid=os.getpid(), version=version("tracejudge"), duckdb=str(cfg.storage.duckdb.path),
            grpc=grpc_addr, http=http_addr, api=api_url,
            started_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        ).write(cfg.runtime_file)
        self._banner(grpc_addr, http_addr, api_url)
        self._judging(criteria, provider, no_provider)
        self._retention()
        self._reviewers()
        open_to = [lst.endpoint for lst in (rcv.protocols.grpc, rcv.protocols.http)
                   if lst is not None and not is_loopback(split_endpoint(lst.endpoint)[0])]
        if open_to and not rcv.auth.bearer_token:
            log.warning("OTLP receivers listen beyond loopback (%s) without receivers.otlp.auth.bearer_token "
                        "($TRACEJUDGE_INGEST_TOKEN): anyone who reaches them can write spans", ", ".join(open_to))
        api.ready = True  # last: whoever waits for /readyz finds the banner and the start-up log written
        return True

    async def _serve(self, parts: Parts, signals: StopSignals) -> str:
        """Wait for a stop signal, or for the store's writer to stop for good; say which came."""
        assert parts.store is not None
        by_signal = asyncio.ensure_future(signals.wait())
        by_store = asyncio.ensure_future(parts.broken.wait())
        try:
            await asyncio.wait({by_signal, by_store}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            by_signal.cancel()
            by_store.cancel()
        if parts.store.broken is not None:
            return f"{parts.store.broken}; exiting for a supervisor to restart the daemon"
        return by_signal.result()

    async def _teardown(self, parts: Parts) -> None:
        """Close what start-up opened, in the order that commits everything queued."""
        if parts.api is not None:
            parts.api.ready = False
        # Intake first, every listener at once: in-flight requests still get their answer
        # after their commit; one the gRPC grace cuts off is committed all the same.
        await _each(*([parts.gserver.stop(grace=GRPC_GRACE)] if parts.gserver is not None else []),
                    *([parts.http_runner.cleanup()] if parts.http_runner is not None else []))
        if parts.intake is not None:  # requests whose clients gave up: committed, and queued to be forwarded
            await _each(parts.intake.drain())
        await _each(*([asyncio.to_thread(parts.evaluator.stop)] if parts.evaluator is not None else []),
                    *([asyncio.to_thread(parts.retention.stop)] if parts.retention is not None else []),
                    *(asyncio.to_thread(stage.stop) for stage in parts.extra),
                    *([asyncio.to_thread(parts.reindexer.stop)] if parts.reindexer is not None else []),
                    *([asyncio.to_thread(parts.store.drain)] if parts.store is not None else []))
        if parts.forwarder is not None:  # after the receivers and the verdict events: nothing more to queue
            await _each(parts.forwarder.stop())
        if parts.api_runner is not None:
            await _each(parts.api_runner.cleanup())
        if parts.convs is not None:  # after the drain: it takes in the last commits
            await _each(asyncio.to_thread(parts.convs.stop))
        if parts.store is not None:
            await _each(asyncio.to_thread(parts.store.close))
        runtime_path = self.config.runtime_file
        info = RuntimeInfo.read(runtime_path)
        if info is not None and info.pid == os.getpid():
            runtime_path.unlink(missing_ok=True)

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
            *self._exporters(),
            *self._webhooks(),
            "Point your bot at it: OTEL_EXPORTER_OTLP_ENDPOINT=http://"
            f"{grpc_addr or http_addr}  (Ctrl-C or SIGTERM stops it)",
        ]
        print("\n".join(lines), file=self.out, flush=True)

    def _exporters(self) -> list[str]:
        """A banner line per exporter: where it forwards what, and how (``tracejudge status`` says how it goes)."""
        exporters = self.config.exporters
        if not exporters:
            return ["  exporters   none: nothing is forwarded"]
        return [f"  exporter    {name}: {exp.type} {masked_url(exp.url)} ({', '.join(exp.sends)}; "
                f"redact {exp.redact.mode})" for name, exp in exporters.items()]

    def _webhooks(self) -> list[str]:
        """A banner line per alert webhook: where it is (masked) and which alerts it takes."""
        return [f"  webhook     {masked_url(w.url)} ({w.format}: {', '.join(w.events)}"
                f"{'' if w.secret else '; unsigned'})" for w in self.config.alerts.webhooks]

    def _retention(self) -> None:
        keep = self.config.storage.retention
        if keep.spans is None and keep.conversations is None:
            log.info("storage.retention is not set: nothing is ever deleted, so %s grows with the data "
                     "(otel-config.yaml shows a production setting)", self.config.storage.duckdb.path)
            return
        log.info("retention: spans kept %s, conversations kept %s%s",
                 duration_text(keep.spans), duration_text(keep.conversations),
                 ", reviewed ones as long as their review items" if keep.keep_reviewed else "")

    def _reviewers(self) -> None:
        """Say whose names decisions and labels carry, and warn where nothing checks them."""
        review, token = self.config.review, self.config.api.auth.bearer_token
        if review.reviewers:
            log.info("review: %s, each with a token of their own (review.reviewers): every claim, decision and "
                     "label carries the reviewer of the token it is made with, never a typed name",
                     plural(len(review.reviewers), "reviewer"))
            return
        risks = (["whoever holds api.auth.bearer_token can decide as anyone"] if token else []) + (
            [f"one person can settle an item alone by typing review.reviewers_per_item ({review.reviewers_per_item}) "
             "names"] if review.reviewers_per_item > 1 else [])
        if risks:
            log.warning("review.reviewers is not set, so decisions and labels carry the name each caller types and "
                        "nothing checks it: %s. Give each reviewer a token of their own in review.reviewers",
                        "; ".join(risks))
        else:
            log.info("review: decisions and labels carry the name typed (review.reviewers is not set): fit for the "
                     "people of this machine (the API listens on loopback, without a token); give each reviewer a "
                     "token in review.reviewers for names that hold")

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


def serve(config: Config, signals: StopSignals, extra_stages: Sequence[StageFactory] = ()) -> int:
    """Run the daemon until SIGTERM/SIGINT (``signals`` installed before start-up); the exit status."""
    try:
        stopped = asyncio.run(Daemon(config, extra_stages=extra_stages).run(signals))
    finally:
        signals.ignore()
    (log.info if stopped.status == 0 else log.error)(stopped.message)
    return stopped.status
