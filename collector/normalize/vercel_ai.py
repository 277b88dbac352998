"""Vercel AI SDK legacy telemetry (``ai`` 3.3-6, ``LegacyOpenTelemetry``): ``ai.*`` keys.

Each model step (``ai.generateText.doGenerate`` / ``ai.streamText.doStream``)
has ``ai.prompt.messages`` (JSON, AI SDK message format) and the answer in
``ai.response.text`` + ``ai.response.toolCalls`` (``ai.result.*`` before
3.3.25). The outer ``ai.generateText`` span has ``ai.prompt`` =
``{system?, prompt?, messages?}`` and only the final text: it is an agent turn.
AI SDK v7 emits ``otel_genai`` instead.
"""

from __future__ import annotations

from typing import Any

from ._messages import history, history_texts, join_system
from ._model import Attrs, Content, Message, ToolCall, Truncated, parse_json_or_raw

NAME = "vercel-ai"

TEXT_KEYS = ("ai.response.text", "ai.result.text", "ai.response.object", "ai.result.object")
TOOL_CALL_KEYS = ("ai.response.toolCalls", "ai.result.toolCalls")
KEYS = ("ai.prompt.messages", "ai.prompt") + TEXT_KEYS + TOOL_CALL_KEYS  # ``read`` finds nothing without one


def _tool_calls(value: Any) -> tuple[ToolCall, ...]:
    if not isinstance(value, list):
        return ()
    calls = []
    for c in value:
        if isinstance(c, dict) and isinstance(c.get("toolName"), str):
            args = c.get("input", c.get("args"))
            calls.append(ToolCall(c.get("toolCallId") or None, c["toolName"],
                                  parse_json_or_raw(args if args is not None else {})))
    return tuple(calls)


def _output(attrs: Attrs) -> list[Message] | None:
    text = next((attrs.get(k) for k in TEXT_KEYS if isinstance(attrs.get(k), str)), None)
    calls: tuple[ToolCall, ...] = ()
    for key in TOOL_CALL_KEYS:
        if key in attrs:
            calls = _tool_calls(attrs.json(key))
            break
    if text is None and not calls:
        return None
    return [Message("assistant", text or "", tool_calls=calls)]


def read(attrs: Attrs) -> Content | None:
    """Content from ``ai.prompt.messages`` / ``ai.prompt`` and ``ai.response.*``."""
    if not any(k in attrs for k in KEYS):
        return None
    content = Content(NAME)
    try:
        if "ai.prompt.messages" in attrs:
            content.input, content.system = history(attrs.json("ai.prompt.messages"))
        elif "ai.prompt" in attrs:
            prompt = attrs.json("ai.prompt")
            if isinstance(prompt, dict):
                msgs: list[Message] = []
                in_input: list[str] = []
                if isinstance(prompt.get("messages"), list):
                    msgs, in_input = history_texts(prompt["messages"])
                elif isinstance(prompt.get("prompt"), str):
                    msgs = [Message("user", prompt["prompt"])]
                content.input = msgs
                system = prompt.get("system")
                content.system = join_system([system] if isinstance(system, str) else [], in_input)
        content.output = _output(attrs)
    except Truncated:
        content.truncated = True
    return content
