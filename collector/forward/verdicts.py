"""The daemon's ``verdict_events`` stage: each stored verdict, and each review decision on it, out as an
OpenTelemetry ``gen_ai.evaluation.result`` event to the exporters whose ``signals`` include logs.

Events are made with the OpenTelemetry SDK, on a ``LoggerProvider`` of the
stage's own (never the global one: the daemon must not export to itself),
whose exporter encodes each record as OTLP protobuf and puts it on the same
durable queues as the bot's requests (``Forwarder.put``). The attributes
follow the GenAI conventions' event (``model/gen-ai/events.yaml``):

- ``gen_ai.evaluation.name``: the criterion id;
- ``gen_ai.evaluation.score.label``: pass, fail, not_applicable or error;
- ``gen_ai.evaluation.score.value``: 1 for pass, 0 for fail, absent otherwise;
- ``gen_ai.evaluation.explanation``: the reasoning, then the quoted evidence;
- ``error.type`` on an error (its reason);

with ours beside them: ``tracejudge.conversation.id``,
``tracejudge.criterion.version``, ``tracejudge.judge.model``,
``tracejudge.evidence_verified`` and ``tracejudge.review.state`` (``none``
when no review item was opened; an event of its own, the same attributes,
each time a reviewer decides). An event is parented to the conversation's last
LLM call: the newest trace and the span of the last assistant message.

The stage follows ``verdicts.seq`` and ``review_history.id`` and keeps how far
it got in ``tracejudge_state``, written after the events are on disk: a
restart goes on from there (an event queued just before a crash may be sent
twice, never lost); ``/api/status`` shows it (``verdict_events_seq``,
``review_events_id``). Superseded verdicts are not sent, nor are simulated
conversations' verdicts, which are kept apart (``evals.simulations``) and
never read here. Nor are live verdicts (made turn by turn on an open
conversation, ``evals.live``): a backend that turns these events into scores
would count a conversation once per turn; the verdict at its end is sent, with
the state of the live item that stands for it, and decisions on live items are
sent like any other.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import orjson
from opentelemetry._logs import LogRecord
from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs
from opentelemetry.sdk._logs import LoggerProvider, ReadableLogRecord
from opentelemetry.sdk._logs.export import LogRecordExporter, LogRecordExportResult, SimpleLogRecordProcessor
from opentelemetry.sdk.resources import Resource
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

from ..background import Stage
from ..metrics import Counter, Metrics
from ..review import queue as review_queue
from ..store import Store
from ..store.transactions import one

log = logging.getLogger("tracejudge.forward")

INTERVAL = 1.0  # seconds between two looks for new verdicts and decisions
BATCH = 500
EVENT = "gen_ai.evaluation.result"
_VERDICT_KEY, _REVIEW_KEY = "forward.verdict_events.seq", "forward.review_events.id"


class _ToQueues(LogRecordExporter):
    """Encodes the SDK's records as one OTLP logs request and hands it to ``put``."""

    def __init__(self, put: Callable[[bytes], None]) -> None:
        self.put = put

    def export(self, batch: Sequence[ReadableLogRecord]) -> LogRecordExportResult:
        self.put(encode_logs(batch).SerializeToString())
        return LogRecordExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True  # nothing held: each record is handed over as it is made

    def shutdown(self) -> None:
        pass


class VerdictEvents(Stage):
    """Sends verdicts and review decisions as events (see the module docstring)."""

    name = "verdict_events"

    def __init__(self, store: Store, metrics: Metrics, put: Callable[[bytes], None], *,
                 service: str = "tracejudge", interval: float = INTERVAL) -> None:
        """
        Args:
            put: queues one OTLP logs request (protobuf) for every exporter sending logs, and returns once it
                is on disk.
        """
        super().__init__(store, metrics)
        self.interval = interval
        self._batch: list[bytes] = []
        self.provider = LoggerProvider(resource=Resource.create({"service.name": service}), shutdown_on_exit=False)
        self.provider.add_log_record_processor(SimpleLogRecordProcessor(_ToQueues(self._batch.append)))
        self.logger = self.provider.get_logger("tracejudge.verdicts")
        self.put = put
        self.verdict_at = self.review_at = 0  # how far it got (``status``), read from the store at ``_open``
        self.sent = Counter("tracejudge_verdict_events_total", "Evaluation events queued for the exporters, by kind.",
                            ("kind",))
        for kind in ("verdict", "review"):
            self.sent.declare(kind=kind)
        metrics.add_instruments(self.sent)

    def _open(self) -> None:
        assert self.cur is not None
        review_queue.ensure_schema(self.cur)
        self.verdict_at, self.review_at = self._position(_VERDICT_KEY), self._position(_REVIEW_KEY)

    def status(self) -> dict[str, int]:
        """For /api/status: the last verdict (``verdicts.seq``) and decision (``review_history.id``) queued."""
        return {"verdict_events_seq": self.verdict_at, "review_events_id": self.review_at}

    def _run(self) -> None:
        try:  # a queue it cannot write, for now: the next cycle tries again
            self.run_cycles(self.cycle, "sending verdict events failed", self.interval)
        finally:
            self.provider.shutdown()

    def cycle(self) -> bool:
        """Queue the events of up to ``BATCH`` new verdicts and decisions; whether there may be more."""
        assert self.cur is not None
        cur = self.cur
        verdict_at, review_at = self.verdict_at, self.review_at
        rows = cur.execute(
            "SELECT v.seq, v.conversation_id, v.criterion_id, v.criterion_version, v.judge_model, v.result, "
            "v.error_reason, v.reasoning, v.evidence, v.evidence_verified, coalesce(r.state, l.state), "
            "c.newest_trace_id, "
            "(SELECT span_id FROM messages m WHERE m.conversation_id = v.conversation_id AND m.role = 'assistant' "
            " ORDER BY seq DESC LIMIT 1) "
            "FROM verdicts v LEFT JOIN review_items r ON r.verdict_id = v.id "
            "LEFT JOIN review_items l ON l.live AND v.result = 'fail' AND l.conversation_id = v.conversation_id "
            "AND l.criterion_id = v.criterion_id "
            "LEFT JOIN conversations c ON c.conversation_id = v.conversation_id "
            "WHERE v.seq > ? AND NOT v.superseded AND NOT v.live ORDER BY v.seq LIMIT ?",
            [verdict_at, BATCH]).fetchall()
        decisions = cur.execute(
            "SELECT h.id, v.seq, v.conversation_id, v.criterion_id, v.criterion_version, v.judge_model, v.result, "
            "v.error_reason, v.reasoning, v.evidence, v.evidence_verified, h.state, c.newest_trace_id, "
            "(SELECT span_id FROM messages m WHERE m.conversation_id = v.conversation_id AND m.role = 'assistant' "
            " ORDER BY seq DESC LIMIT 1) "
            "FROM review_history h JOIN review_items r ON r.id = h.item_id JOIN verdicts v ON v.id = r.verdict_id "
            "LEFT JOIN conversations c ON c.conversation_id = v.conversation_id "
            "WHERE h.id > ? ORDER BY h.id LIMIT ?", [review_at, BATCH]).fetchall()
        if not rows and not decisions:
            return False
        for row in rows:
            self._emit(row)
        for row in decisions:
            self._emit(row[1:])
        if self._batch:
            body, self._batch[:] = b"".join(self._batch), []
            self.put(body)
        if rows:
            self._remember(_VERDICT_KEY, rows[-1][0])
            self.verdict_at = rows[-1][0]
            self.sent.inc(len(rows), kind="verdict")
        if decisions:
            self._remember(_REVIEW_KEY, decisions[-1][0])
            self.review_at = decisions[-1][0]
            self.sent.inc(len(decisions), kind="review")
        return len(rows) == BATCH or len(decisions) == BATCH

    def _emit(self, row: Sequence[Any]) -> None:
        (_, cid, criterion, version, model, result, error, reasoning, evidence, verified, state, trace_id,
         span_id) = row
        attrs: dict[str, Any] = {
            "gen_ai.evaluation.name": criterion, "gen_ai.evaluation.score.label": result,
            "gen_ai.evaluation.explanation": explanation(reasoning, evidence),
            "tracejudge.conversation.id": cid, "tracejudge.criterion.version": int(version),
            "tracejudge.judge.model": model, "tracejudge.evidence_verified": bool(verified),
            "tracejudge.review.state": state or "none",
        }
        if result in ("pass", "fail"):
            attrs["gen_ai.evaluation.score.value"] = 1.0 if result == "pass" else 0.0
        if result == "error":
            attrs["error.type"] = error or "error"
        tid, sid = _id(trace_id, 32), _id(span_id, 16)
        parent = None
        if tid and sid:  # the record's context: the bot's span, as a remote parent
            parent = set_span_in_context(NonRecordingSpan(SpanContext(
                tid, sid, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))))
        self.logger.emit(LogRecord(event_name=EVENT, attributes=attrs, context=parent))

    def _position(self, key: str) -> int:
        assert self.cur is not None
        row = one(self.cur.execute("SELECT value FROM tracejudge_state WHERE key = ?", [key]))
        return int(row[0]) if row else 0

    def _remember(self, key: str, value: int) -> None:
        assert self.cur is not None
        self.cur.execute("INSERT OR REPLACE INTO tracejudge_state VALUES (?, ?)", [key, str(value)])


def explanation(reasoning: str | None, evidence: str | None) -> str:
    """The judge's reasoning, then each quoted piece of evidence on a line of its own."""
    quotes: list[str] = []
    for e in orjson.loads(evidence) if evidence else []:
        quote = e.get("quote") if isinstance(e, dict) else e
        if quote:
            quotes.append(f'"{quote}"')
    return "\n".join([reasoning or "", *quotes]).strip()


def _id(text: str | None, width: int) -> int | None:
    if not text or len(text) != width:
        return None
    try:
        return int(text, 16) or None
    except ValueError:
        return None
