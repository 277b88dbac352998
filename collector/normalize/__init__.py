"""Normalizer: any GenAI telemetry dialect -> canonical messages and call facts.

Pure functions over decoded attribute dicts; no I/O. One module per dialect,
each a ``read(attrs) -> Content | None`` (span attributes) or
``read_events(events) -> Content | None`` (span events / log records of one
span), registered below in priority order. Adding a library means a fixture,
a reader (usually a few key names, as the shared message reader in
``_messages`` understands OpenAI, Anthropic, OTel parts, Vercel and Gemini
message shapes) and, for call facts, a row in ``_meta``'s tables.

Lifecycle: stateless; safe to call from any thread.
"""

from __future__ import annotations

from functools import lru_cache
from itertools import repeat
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

from . import (haystack, langfuse, litellm, logfire, mastra, openinference, openllmetry, otel_events, otel_genai, others,
               vercel_ai)
from ._meta import read_meta, span_kind
from ._indexed import INDEXED_PREFIXES
from ._model import Attrs, Content, Event, Message, Meta, SpanKind, ToolCall, Truncated, as_int, as_str, repair_text, repaired

__all__ = [
    "Attrs",
    "Content",
    "Dialect",
    "EVENT_READERS",
    "Event",
    "Message",
    "Meta",
    "SPAN_DIALECTS",
    "SpanKind",
    "ToolCall",
    "Truncated",
    "as_int",
    "as_str",
    "combine",
    "mastra",
    "read_events",
    "read_meta",
    "read_span",
    "repair_text",
    "repaired",
    "span_dialects",
    "span_kind",
]


class Dialect(NamedTuple):
    """A span-attribute reader, the source name it records, and the keys it reads.

    ``read`` returns None unless one of ``keys`` is present or a key starts with
    one of ``prefixes`` (all in ``INDEXED_PREFIXES``), so ``read_span`` skips it
    without looking further: most spans speak one dialect.
    """

    name: str
    read: Callable[[Attrs], Content | None]
    keys: tuple[str, ...]
    prefixes: tuple[str, ...] = ()


# First match wins per side (input, output, system); later ones fill gaps.
# Flattened / raw-payload dialects come after the structured ones so that a
# span carrying both (OpenInference's input.value, Logfire v2's request_data)
# is read from the structured copy.
SPAN_DIALECTS: tuple[Dialect, ...] = (
    Dialect(litellm.NAME, litellm.read, litellm.KEYS),  # otel_genai's keys, with a fix of its own
    Dialect(otel_genai.NAME, otel_genai.read, otel_genai.KEYS),
    Dialect(openllmetry.NAME, openllmetry.read, (), openllmetry.KEY_PREFIXES),
    Dialect(openinference.NAME, openinference.read, openinference.KEYS, openinference.KEY_PREFIXES),
    Dialect(vercel_ai.NAME, vercel_ai.read, vercel_ai.KEYS),
    Dialect(mastra.NAME, mastra.read, mastra.KEYS),
    Dialect(langfuse.NAME, langfuse.read, langfuse.KEYS),
    Dialect(logfire.NAME, logfire.read, logfire.KEYS),
    Dialect(haystack.NAME, haystack.read, haystack.KEYS),
    Dialect(others.ADK, others.read_adk, others.ADK_KEYS),
    Dialect(others.SENTRY, others.read_sentry, others.SENTRY_KEYS),
    Dialect(others.PYDANTIC_AI, others.read_pydantic_ai, others.PYDANTIC_AI_KEYS),
)

_DIALECT_KEYS = frozenset(k for d in SPAN_DIALECTS for k in d.keys)


@lru_cache(maxsize=1024)
def _dialects_of(keys: frozenset[str]) -> tuple[Dialect, ...]:
    flattened = any(map(str.startswith, keys, repeat(INDEXED_PREFIXES)))
    known = _DIALECT_KEYS.intersection(keys)
    return tuple(d for d in SPAN_DIALECTS if not known.isdisjoint(d.keys) or (flattened and d.prefixes))


def span_dialects(attributes: Mapping[str, Any]) -> tuple[Dialect, ...]:
    """The dialects that may find content in ``attributes``, in priority order.

    The others would read nothing there. Decided by key names alone; spans of one
    library have the same keys, so the answer is cached by them (a third of the
    time of the prefix checks, which ran for every span).
    """
    return _dialects_of(frozenset(attributes))


EVENT_READERS: tuple[Callable[[Sequence[Event]], Content | None], ...] = (
    otel_genai.read_events,
    otel_events.read_events,
)


def combine(contents: Iterable[Content | None]) -> Content | None:
    """Merge one call's content from several sources, first source first.

    Each side (input, output, system) comes from the first source that has it,
    so the same text sent twice (SPAN_AND_EVENT mode: attributes and a log
    record) is taken once. ``source`` names the source of the messages.
    """
    out: Content | None = None
    for c in contents:
        if c is None:
            continue
        if out is None:
            out = Content(c.source, c.input, c.output, c.system, c.truncated)
            continue
        if not out.has_messages() and c.has_messages():
            out.source = c.source
        if not out.input and c.input:
            out.input = c.input
        if out.output is None and c.output:
            out.output = c.output
        if out.system is None:
            out.system = c.system
        out.truncated = out.truncated or c.truncated
    return out


def read_span(attributes: Mapping[str, Any], name: str = "") -> tuple[Meta, Content | None]:
    """Read one span's attributes: its facts and its message content, if any."""
    attrs = Attrs(attributes)
    meta = read_meta(attrs, name)
    content = combine(_tag(d.read(attrs), "span") for d in span_dialects(attributes))
    if content is not None and attrs.salvaged:
        content.truncated = True
    return meta, content


def read_events(events: Sequence[Event], where: str = "event") -> Content | None:
    """Read the content of one span's events or log records (in emission order)."""
    if not events:
        return None
    return combine(_tag(read(events), where) for read in EVENT_READERS)


def _tag(content: Content | None, where: str) -> Content | None:
    if content is not None:
        content.source = f"{content.source}/{where}"
    return content
