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


def comparable_messages(rebuilt: list[dict[str, Any]], truth: list[dict[str, Any]]
                        ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Rebuilt and ground-truth messages reduced to what both must agree on, for ``==``.

    Where the model's wire carried no tool-call ids (Gemini's function calls mostly come without), an
    instrumentation that makes its own must still join each result to its call: the k-th tool message
    after an assistant message answers its k-th call, by id. Such ids are then left out; a result that
    does not answer its call keeps a marker saying so, which the comparison shows.
    """
    got, exp = [comparable_message(m) for m in rebuilt], [comparable_message(m) for m in truth]
    if any(tc["id"] for m in exp for tc in m.get("tool_calls", [])) or any(m.get("tool_call_id") for m in exp):
        return got, exp
    calls: list[dict[str, Any]] = []
    k = 0
    for m in got:
        if m.get("tool_calls"):
            calls, k = m["tool_calls"], 0
        elif m["role"] == "tool":
            call = calls[k] if k < len(calls) else None
            joined = call is not None and m["tool_call_id"] and m["tool_call_id"] == call["id"]
            m["tool_call_id"] = None if joined else f"{m['tool_call_id']!r} does not answer call #{k} before it"
            k += 1
    for m in got:
        for tc in m.get("tool_calls", []):
            tc["id"] = None
    return got, exp


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
