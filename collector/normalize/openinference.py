"""OpenInference (Arize Phoenix): ``llm.input_messages.<i>.message.*`` and ``input.value``.

Messages are flattened as ``message.{role,content,name,tool_call_id}``,
``message.contents.<k>.message_content.{type,text}`` and
``message.tool_calls.<j>.tool_call.{id,function.name,function.arguments}``.
``input.value`` / ``output.value`` repeat the raw request and response; they are
read only when the flattened messages are absent (AGENT and CHAIN spans carry
plain text there), so the same text is never counted twice.
"""

from __future__ import annotations

from typing import Any

from . import responses
from ._indexed import OPENINFERENCE_PREFIXES, unflatten
from ._messages import answer, history
from ._model import Attrs, Content, Message, Truncated

NAME = "openinference"
# ``read`` finds nothing without one of these keys or a key with one of these prefixes.
KEYS = ("openinference.span.kind",)
KEY_PREFIXES = OPENINFERENCE_PREFIXES


def _openai_shape(item: Any) -> Any:
    """``{message: {...}}`` with OpenInference's nesting -> an OpenAI chat message."""
    msg = item.get("message") if isinstance(item, dict) else None
    if not isinstance(msg, dict):
        return None
    out: dict[str, Any] = {k: msg[k] for k in ("role", "content", "name", "tool_call_id") if k in msg}
    contents = msg.get("contents")
    if isinstance(contents, list) and "content" not in out:
        out["content"] = [c.get("message_content") for c in contents
                          if isinstance(c, dict) and isinstance(c.get("message_content"), dict)]
    calls = msg.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [c["tool_call"] for c in calls
                             if isinstance(c, dict) and isinstance(c.get("tool_call"), dict)]
    return out


def _raw_input(value: Any) -> tuple[list[Message], str | None] | None:
    if isinstance(value, str):
        return ([Message("user", value)], None) if value else None
    if isinstance(value, dict) and isinstance(value.get("messages"), list):
        return history(value)
    if isinstance(value, list):
        return history(value)
    return None  # a chain's app-defined input object


def _raw_output(value: Any) -> list[Message] | None:
    if isinstance(value, str):
        return [Message("assistant", value)] if value else None
    if responses.is_response(value):  # the Agents SDK's response spans
        return responses.output(value)
    if isinstance(value, dict) and ("choices" in value or "role" in value):
        return answer(value) or None
    return None


def _value(attrs: Attrs, side: str) -> Any:
    """``input.value`` / ``output.value``, parsed unless its mime type says plain text."""
    if attrs.get(f"{side}.mime_type") == "text/plain":
        return attrs.get(f"{side}.value")
    return attrs.json(f"{side}.value")


def read(attrs: Attrs) -> Content | None:
    """Content from flattened messages, else from the raw input/output values."""
    in_prefix, out_prefix = OPENINFERENCE_PREFIXES
    inputs = unflatten(attrs.indexed(in_prefix), in_prefix)
    outputs = unflatten(attrs.indexed(out_prefix), out_prefix)
    if inputs or outputs:
        content = Content(NAME)
        if inputs:
            content.input, content.system = history([_openai_shape(i) for i in inputs])
        if outputs:
            content.output = answer([_openai_shape(o) for o in outputs])
        return content
    if KEYS[0] not in attrs:
        return None  # input.value alone is too generic a key to claim
    content = Content(NAME)
    try:
        raw_in = _raw_input(_value(attrs, "input"))
        if raw_in is not None:
            content.input, content.system = raw_in
        raw_out = _value(attrs, "output")
        content.output = _raw_output(raw_out)
        if content.system is None and responses.is_response(raw_out):
            content.system = responses.instructions(raw_out)
    except Truncated:
        content.truncated = True
    return content if content.has_messages() or content.truncated else None
