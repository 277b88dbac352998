"""The OpenAI Responses API, wherever an instrumentation records its raw objects.

Input is a string or a list of items: messages (``{"role", "content"}``, or
``{"type": "message", ...}`` with ``input_text`` / ``output_text`` parts),
``function_call`` (``call_id``, ``name``, ``arguments``) and
``function_call_output`` (``call_id``, ``output``), and ``reasoning`` items,
whose summaries are never message content (conversation-v1). The shared reader
reads each item; the calls of one parallel answer, one item each, become one
assistant message (``_messages.folds``). The answer is a ``response`` object
(``"object": "response"``): its ``output`` items are one assistant message and
its ``instructions`` the system prompt.

Seen in: OpenInference's ``input.value`` / ``output.value`` on the OpenAI
Agents SDK's ``response`` spans, Logfire's ``raw_input`` / ``response`` on its
``Responses API with ...`` spans.
"""

from __future__ import annotations

from typing import Any

from ._messages import fold_calls, history_texts, read_message
from ._model import Message


def is_response(value: Any) -> bool:
    """A Responses API ``response`` object (as JSON)."""
    return isinstance(value, dict) and value.get("object") == "response" and isinstance(value.get("output"), list)


def output(value: Any) -> list[Message] | None:
    """The answer a ``response`` object holds (None: not one); reasoning-only output is no message."""
    if not is_response(value):
        return None
    # Read item by item, not through read_messages: an answer must not evict the history it caches.
    msgs = fold_calls([m for item in value["output"] for m in read_message(item)])
    return [m for m in msgs if m.content or m.tool_calls] or None


def instructions(value: Any) -> str | None:
    """The ``instructions`` (system prompt) a ``response`` object was made with."""
    text = value.get("instructions") if isinstance(value, dict) else None
    return text if isinstance(text, str) and text else None


def input_messages(value: Any) -> tuple[list[Message], list[str]] | None:
    """A request's ``input`` (a string: one user message, or a list of items): (messages, system texts);
    None if it is neither."""
    if isinstance(value, str):
        return ([Message("user", value)], []) if value else None
    if isinstance(value, list):
        return history_texts(value)
    return None
