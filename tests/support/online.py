"""Conversations sent through the real OpenTelemetry SDK, and waiting on the daemon's status."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from collector.demo import Persona, play

from .daemon import DaemonProcess


def send(grpc: str, personas: Sequence[Persona], service: str = "shop-test") -> None:
    """Play each conversation through the OpenTelemetry SDK's OTLP/gRPC exporter and flush."""
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=grpc, insecure=True)))
    try:
        tracer = provider.get_tracer("tests")
        for persona in personas:
            play(tracer, persona)
        assert provider.force_flush(30_000), "the OTLP exporter could not deliver"
    finally:
        provider.shutdown()


def wait_status(daemon: DaemonProcess, done: Any, timeout: float = 90, what: str = "") -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        status = daemon.get("/api/status")[1]
        if done(status):
            return status
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}: {status}\n{daemon.output()[-3000:]}")
