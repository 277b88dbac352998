"""Conversations sent through the real OpenTelemetry SDK, and waiting on the daemon's status."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from collector.demo.traffic import ConversationIdProcessor, Persona, ToolCall, Turn, play

from .daemon import DaemonProcess, wait_until
from .judge_server import FAIL_WORD, JUNK_WORD


def send(grpc: str, personas: Sequence[Persona], service: str = "shop-test", *, every_span: bool = False,
         start: int = 0) -> None:
    """Play each conversation through the OpenTelemetry SDK's OTLP/gRPC exporter and flush.

    ``every_span``: the conversation id on every span, through the demo's (the README's) span processor.
    ``start``: send the turns from this one on (the earlier ones were sent before: a conversation going on).
    """
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if every_span:
        provider.add_span_processor(ConversationIdProcessor())
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=grpc, insecure=True)))
    try:
        tracer = provider.get_tracer("tests")
        for persona in personas:
            play(tracer, persona, start)
        assert provider.force_flush(60_000), "the OTLP exporter could not deliver"
    finally:
        provider.shutdown()


def wait_status(daemon: DaemonProcess, done: Any, timeout: float = 90, what: str = "") -> dict[str, Any]:
    status: dict[str, Any] = {}

    def reached() -> dict[str, Any] | None:
        nonlocal status
        status = daemon.get("/api/status")[1]
        return status if done(status) else None

    return wait_until(reached, lambda: f"{what}: {status}\n{daemon.output()[-3000:]}", timeout, interval=0.1)


def persona(i: int, *, fail: bool = False, junk: bool = False, lookup: bool = True) -> Persona:
    answer = "Your order is on its way and arrives tomorrow."
    if fail:
        answer = f"Don't worry, this is a {FAIL_WORD}: you get your money back whatever happens."
    if junk:
        answer = f"Here is some {JUNK_WORD} for the judge."
    tool = ToolCall("lookup_order", {"order_id": f"B-{i}"}, '{"status": "shipped"}') if lookup else None
    return Persona(f"user {i}", "en", "shop-test", [
        Turn(f"Where is my order B-{i}?", answer, tool),
        Turn("Thanks.", "You're welcome."),
    ], conversation_id=f"conv-{i:03d}")
