"""OpenTelemetry GenAI per-message events, v1.28-1.36 (deprecated in v1.37).

One event per message: ``gen_ai.{system,user,assistant,tool}.message`` for the
history and ``gen_ai.choice`` for the answer. Python SDKs send them as log
records (body = the message, name in ``event_name`` or the ``event.name``
attribute); Azure SDKs and custom code attach span events whose message is JSON
in ``gen_ai.event.content`` or spread over the event's attributes. The caller
passes one span's events in emission order.
"""

from __future__ import annotations

import threading
from typing import Any, Mapping, Sequence

from ._messages import fold, folds, read_message, split_system
from ._model import Content, Event, Message, Truncated, loads_maybe

NAME = "otel-events"

# event name -> role of the message it carries; None marks the answer.
EVENT_ROLES: Mapping[str, str | None] = {
    "gen_ai.system.message": "system",
    "gen_ai.user.message": "user",
    "gen_ai.assistant.message": "assistant",
    "gen_ai.tool.message": "tool",
    "gen_ai.choice": None,
}
# Keys that, when present, say the event carries content (capture was on).
CONTENT_FIELDS = ("content", "tool_calls", "parts")


def _payload(ev: Event) -> Any:
    if isinstance(ev.body, dict):
        return ev.body
    if isinstance(ev.body, str) and ev.body:
        try:
            parsed = loads_maybe(ev.body)
        except Truncated:
            return None
        return parsed if isinstance(parsed, dict) else {"content": ev.body}
    raw = ev.attributes.get("gen_ai.event.content")
    if raw is not None:
        parsed = loads_maybe(raw)
        return parsed if isinstance(parsed, dict) else None
    return dict(ev.attributes)


def _message(ev: Event, role: str | None) -> list[Message] | None:
    payload = _payload(ev)
    if not isinstance(payload, dict):
        return None
    if role is None:  # gen_ai.choice: {index, finish_reason, message: {...}}
        if payload.get("index") not in (None, 0, "0"):
            return None
        inner = payload.get("message")
        if isinstance(inner, str):  # Strands: the message content as a JSON string
            inner = {"content": inner}
        payload = dict(inner) if isinstance(inner, dict) else {
            k: v for k, v in payload.items() if k in CONTENT_FIELDS}
        payload.setdefault("role", "assistant")
    elif "role" not in payload:
        payload = {**payload, "role": role}
    if not any(payload.get(f) not in (None, "", []) for f in CONTENT_FIELDS):
        return None  # capture was off: the event says a message was sent, not what
    return read_message(payload)


def _unrepeated(history: list[Message], msgs: list[Message]) -> list[Message]:
    """``msgs`` without the tool results the tool messages just before them hold already.

    The botocore instrumentation (Bedrock) sends each tool result as a
    ``gen_ai.tool.message`` event and then the user message that carried them
    (Converse ``toolResult`` blocks) as a ``gen_ai.user.message`` event.
    """
    seen: set[str] = set()
    for m in reversed(history):
        if m.role != "tool":
            break
        if m.tool_call_id:
            seen.add(m.tool_call_id)
    return [m for m in msgs if not (m.role == "tool" and m.tool_call_id in seen)]


class _LastEvents(threading.local):
    """The previous span's events and what they read as (see ``_messages._LastHistory``).

    Every call re-emits the whole history as events, so a span's events mostly
    equal the previous span's, position by position.
    """

    events: Sequence[Event] = ()
    read: list[list[Message] | None] = []


_last = _LastEvents()


def read_events(events: Sequence[Event]) -> Content | None:
    """History and answer from one span's per-message events, in order."""
    history: list[Message] = []
    output: list[Message] | None = None
    truncated = False
    prev, prev_read = _last.events, _last.read
    reuse = True
    per_event: list[list[Message] | None] = []
    for i, ev in enumerate(events):
        role = EVENT_ROLES.get(ev.name, "")
        if role == "":
            per_event.append(None)
            continue
        if reuse and i < len(prev) and prev[i] == ev:
            msgs = prev_read[i]
        else:
            reuse = False
            try:
                msgs = _message(ev, role)
            except Truncated:
                truncated = True
                msgs = None
        per_event.append(msgs)
        if msgs is None:
            continue
        if role == "user" and history and history[-1].role == "tool":
            msgs = _unrepeated(history, msgs)
        if role is None:
            if output is None:
                output = msgs
        elif msgs and history and folds(history[-1], msgs[0]):  # a parallel call sent as a message of its own
            history[-1] = fold(history[-1], msgs[0])
            history.extend(msgs[1:])
        else:
            history.extend(msgs)
    if not truncated:
        _last.events, _last.read = events, per_event
    if not history and output is None:
        return Content(NAME, truncated=True) if truncated else None
    rest, system = split_system(history)
    return Content(NAME, input=rest if history else None, output=output, system=system,
                   truncated=truncated)
