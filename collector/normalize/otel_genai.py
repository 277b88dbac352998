"""OpenTelemetry GenAI conventions: v1.37+ attributes and the operation-details event.

Also reads the v1.26-1.27 ``gen_ai.prompt`` / ``gen_ai.completion`` JSON (as span
attributes or in ``gen_ai.content.prompt`` / ``gen_ai.content.completion``
events). The per-message events of v1.28-1.36 are in ``otel_events``.

Used as is by Logfire (v2 and ``'latest'``), OpenLLMetry >= 0.5 for most
providers, pydantic-ai model spans, Vercel AI SDK v7, Strands.
"""

from __future__ import annotations

from typing import Sequence

from ._messages import answer, history_texts, join_system, system_texts
from ._model import Attrs, Content, Event, Truncated

NAME = "otel-genai"

# Where each side lives, newest convention first.
INPUT_KEYS = ("gen_ai.input.messages", "gen_ai.prompt")
OUTPUT_KEYS = ("gen_ai.output.messages", "gen_ai.completion")
SYSTEM_KEYS = ("gen_ai.system_instructions",)
KEYS = INPUT_KEYS + OUTPUT_KEYS + SYSTEM_KEYS  # ``read`` finds nothing without one of these

DETAILS_EVENT = "gen_ai.client.inference.operation.details"
# v1.26-1.27 events and the attribute each carries.
CONTENT_EVENTS = {"gen_ai.content.prompt": "gen_ai.prompt", "gen_ai.content.completion": "gen_ai.completion"}


def read(attrs: Attrs) -> Content | None:
    """Content from the ``gen_ai.input.messages`` family of attributes.

    ``system`` is the system instructions, then the system messages of the input.
    """
    content = Content(NAME)
    instructions: list[str] = []
    in_input: list[str] = []
    for key in INPUT_KEYS:
        if key in attrs:
            try:
                content.input, in_input = history_texts(attrs.json(key))
            except Truncated:
                content.truncated = True
            break
    for key in OUTPUT_KEYS:
        if key in attrs:
            try:
                content.output = answer(attrs.json(key))
            except Truncated:
                content.truncated = True
            break
    for key in SYSTEM_KEYS:
        if key in attrs:
            try:
                instructions += system_texts(attrs.json(key))
            except Truncated:
                content.truncated = True
    content.system = join_system(instructions, in_input)
    if content.input is None and content.output is None and content.system is None:
        return content if content.truncated else None
    return content


def read_events(events: Sequence[Event]) -> Content | None:
    """Content from operation-details events/log records, or the v1.26 content events."""
    merged: dict[str, object] = {}
    for ev in events:
        if ev.name == DETAILS_EVENT:
            merged.update({k: v for k, v in ev.attributes.items() if k.startswith("gen_ai.")})
            if isinstance(ev.body, dict):  # some emitters put the fields in the body
                merged.update({k: v for k, v in ev.body.items() if k.startswith("gen_ai.")})
        elif ev.name in CONTENT_EVENTS:
            key = CONTENT_EVENTS[ev.name]
            value = ev.attributes.get(key)
            if value is not None:
                merged[key] = value
    return read(Attrs(merged)) if merged else None
