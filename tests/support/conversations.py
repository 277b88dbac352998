"""Helpers for conversation tests: fixture requests reshaped, messages compared."""

from __future__ import annotations

from typing import Any

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

from .wire import wire_body


def comparable_message(m: dict[str, Any]) -> dict[str, Any]:
    """A conversation/v1 or ground-truth message reduced to what both must agree on."""
    out: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
    if m.get("tool_calls"):
        out["tool_calls"] = [{"id": tc.get("id"), "name": tc["name"], "arguments": tc["arguments"]}
                             for tc in m["tool_calls"]]
    if m["role"] == "tool":
        out["tool_call_id"] = m.get("tool_call_id")
        out["name"] = m.get("name")
    return out


def one_timestamp_per_call(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The requests, with every log record of a call given the same time (a coarse clock)."""
    first: dict[bytes, int] = {}
    out = []
    for req in requests:
        if req["signal"] != "logs":
            out.append(req)
            continue
        msg = ExportLogsServiceRequest.FromString(wire_body(req))
        for rl in msg.resource_logs:
            for sl in rl.scope_logs:
                for rec in sl.log_records:
                    t = first.setdefault(rec.span_id, rec.observed_time_unix_nano)
                    rec.time_unix_nano = rec.observed_time_unix_nano = t
        out.append({**req, "body": msg.SerializeToString(), "content_encoding": None})
    return out
