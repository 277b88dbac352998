"""Pydantic Logfire's own format (``version=1``, the default before 2025).

The raw provider payloads are JSON in ``request_data`` (OpenAI ``messages``, or
Anthropic ``system`` + ``messages``) and ``response_data`` (``message``, or
``combined_chunk_content`` for streams); some releases also list semconv-style
events in an ``events`` attribute. Logfire v2 and ``'latest'`` emit
``otel_genai`` attributes, read by that module (``request_data`` then holds only
the model).

``logfire.instrument_openai_agents()`` puts each model call of the OpenAI
Agents SDK on a ``Responses API with ...`` span: the input items in
``raw_input``, the Responses ``response`` object in ``response`` (read by
``responses``), and its own rendering of both as ``events``, the fallback.
"""

from __future__ import annotations

from typing import Any

from . import otel_events, responses
from ._messages import answer, history_texts, join_system, system_texts
from ._model import Attrs, Content, Event, Message, Truncated

NAME = "logfire"
KEYS = ("request_data", "events", "raw_input", "response")  # ``read`` finds nothing without one of these


def _events(value: Any) -> Content | None:
    if not isinstance(value, list):
        return None
    evs = [Event(e["event.name"], e, None) for e in value
           if isinstance(e, dict) and isinstance(e.get("event.name"), str)]
    got = otel_events.read_events(evs)
    if got is not None:
        got.source = NAME
    return got


def _responses(attrs: Attrs) -> Content | None:
    """The Agents SDK's model call: ``raw_input`` items and the ``response`` object."""
    response = attrs.json("response")
    if not responses.is_response(response):
        return None
    content = Content(NAME, output=responses.output(response))
    got = responses.input_messages(attrs.json("raw_input"))
    if got is not None:
        content.input, in_input = got
        content.system = join_system([t for t in [responses.instructions(response)] if t], in_input)
    return content if content.has_messages() else None


def read(attrs: Attrs) -> Content | None:
    """Content from ``request_data`` / ``response_data`` (or ``events``)."""
    if not any(k in attrs for k in KEYS):
        return None
    content = Content(NAME)
    try:
        request = attrs.json("request_data")
        if isinstance(request, dict) and isinstance(request.get("messages"), list):
            content.input, in_input = history_texts(request["messages"])
            instructions = system_texts(request["system"]) if isinstance(request.get("system"), (str, list)) else []
            content.system = join_system(instructions, in_input)
        response = attrs.json("response_data")
        if isinstance(response, dict):
            if isinstance(response.get("message"), dict):
                content.output = answer({"role": "assistant", **response["message"]})
            elif isinstance(response.get("combined_chunk_content"), str):
                content.output = [Message("assistant", response["combined_chunk_content"])]
            elif isinstance(response.get("content"), list):  # Anthropic message
                content.output = answer({"role": "assistant", "content": response["content"]})
        if not content.has_messages():
            return _responses(attrs) or _events(attrs.json("events"))
    except Truncated:
        content.truncated = True
    return content if content.has_messages() or content.truncated else None
