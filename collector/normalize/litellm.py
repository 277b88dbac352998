"""LiteLLM's OpenTelemetry callback (``litellm.callbacks = ["otel"]``).

It writes ``gen_ai.input.messages`` / ``gen_ai.output.messages`` (read by
``otel_genai``), but an answer that only calls tools comes out as an
assistant message with no parts; the calls are in
``gen_ai.completion.<i>.function_call.{name,arguments}``, one index per call,
without their ids (the next call's input names them with their ids). Spans of
the callback carry ``litellm.call_id``.

What the library loses, and this cannot rebuild: a call made without
streaming is written onto the application's current span, so a second call in
the same span overwrites the first (its tokens, and that it happened) and
leaves the first call's ``gen_ai.completion.<i>.*`` behind where the second has
fewer; a streamed call is logged from a worker thread as a ``litellm_request``
root span of a trace of its own, without the application's conversation id;
``metadata.session_id`` is not exported.
"""

from __future__ import annotations

from . import otel_genai
from ._model import Attrs, Content, Message, ToolCall, parse_json_or_raw

NAME = "litellm"
KEYS = ("litellm.call_id",)  # ``read`` finds nothing without it
_PREFIX = "gen_ai.completion."


def _calls(attrs: Attrs) -> tuple[ToolCall, ...]:
    calls = []
    i = 0
    while (name := attrs.get(f"{_PREFIX}{i}.function_call.name")) is not None:
        if isinstance(name, str) and name:
            calls.append(ToolCall(None, name, parse_json_or_raw(attrs.get(f"{_PREFIX}{i}.function_call.arguments")
                                                                 or {})))
        i += 1
    return tuple(calls)


def read(attrs: Attrs) -> Content | None:
    """``otel_genai``'s reading, with the tool calls of an answer that has no parts."""
    if KEYS[0] not in attrs:
        return None
    content = otel_genai.read(attrs)
    if content is None:
        return None
    content.source = NAME
    out = content.output
    finish = attrs.get("gen_ai.response.finish_reasons")
    # Only when this call's answer says it called tools: on the app's span, a later call's text answer
    # leaves an earlier call's function_call attributes behind.
    if out and len(out) == 1 and not out[0].content and not out[0].tool_calls and "tool_calls" in str(finish):
        calls = _calls(attrs)
        if calls:
            content.output = [Message("assistant", "", calls)]
    return content
