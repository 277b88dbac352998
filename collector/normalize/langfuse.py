"""Langfuse SDK (OTel based): ``langfuse.observation.input`` / ``.output``.

Generations hold the provider request as JSON (a message list, or an object
with ``messages`` and ``tools``) and the assistant message as output. Agent and
span observations hold whatever the app passed, usually the plain user text
and the final answer.
"""

from __future__ import annotations

from typing import Any

from ._messages import answer, history
from ._model import Attrs, Content, Message, Truncated

NAME = "langfuse"

INPUT_KEY = "langfuse.observation.input"
OUTPUT_KEY = "langfuse.observation.output"
KEYS = (INPUT_KEY, OUTPUT_KEY)  # ``read`` finds nothing without one of these


def _input(value: Any) -> tuple[list[Message], str | None] | None:
    if isinstance(value, str):
        return ([Message("user", value)], None) if value else None
    if isinstance(value, dict) and not ("role" in value or "messages" in value):
        return None  # app-defined input of a span observation
    if isinstance(value, (dict, list)):
        return history(value)
    return None


def _output(value: Any) -> list[Message] | None:
    if isinstance(value, str):
        return [Message("assistant", value)] if value else None
    if isinstance(value, dict) and "role" not in value and "content" in value:
        value = {"role": "assistant", **value}
    if isinstance(value, (dict, list)):
        return answer(value) or None
    return None


def _plain_or_json(attrs: Attrs, key: str) -> Any:
    try:
        return attrs.json(key)
    except Truncated:
        if attrs.get("langfuse.observation.type") == "generation":
            raise
        return attrs.get(key)  # free text that happens to start with a bracket


def read(attrs: Attrs) -> Content | None:
    """Content from the observation's input and output."""
    if INPUT_KEY not in attrs and OUTPUT_KEY not in attrs:
        return None
    content = Content(NAME)
    try:
        if INPUT_KEY in attrs:
            got = _input(_plain_or_json(attrs, INPUT_KEY))
            if got is not None:
                content.input, content.system = got
        if OUTPUT_KEY in attrs:
            content.output = _output(_plain_or_json(attrs, OUTPUT_KEY))
    except Truncated:
        content.truncated = True
    return content if content.has_messages() or content.truncated else None
