"""Best-effort dialects without a captured fixture yet: Google ADK, Sentry, pydantic-ai.

- ADK: ``gcp.vertex.agent.llm_request`` (JSON ``{model, contents: [{role,
  parts}], config: {system_instruction}}``) and ``gcp.vertex.agent.llm_response``
  (``{content: {role, parts}, usage_metadata}``), Gemini parts.
- Sentry: ``gen_ai.request.messages`` (JSON message list), answer in
  ``gen_ai.response.text`` (a string or a JSON list of strings) and
  ``gen_ai.response.tool_calls``.
- pydantic-ai agent spans: ``pydantic_ai.all_messages`` (OTel parts format, the
  whole run), used only as agent-turn content.

Azure SDK span events are per-message events, read by ``otel_events``.
"""

from __future__ import annotations

from typing import Any

from ._messages import answer, history, history_texts, join_system, read_messages, system_texts
from ._model import Attrs, Content, Message, Truncated

ADK = "adk"
SENTRY = "sentry"
PYDANTIC_AI = "pydantic-ai"
# Each reader finds nothing without one of its keys.
ADK_KEYS = ("gcp.vertex.agent.llm_request", "gcp.vertex.agent.llm_response")
SENTRY_KEYS = ("gen_ai.request.messages",)
PYDANTIC_AI_KEYS = ("pydantic_ai.all_messages",)


def read_adk(attrs: Attrs) -> Content | None:
    """Content from ADK's ``llm_request`` / ``llm_response`` JSON."""
    if not any(k in attrs for k in ADK_KEYS):
        return None
    content = Content(ADK)
    try:
        request = attrs.json("gcp.vertex.agent.llm_request")
        if isinstance(request, dict):
            content.input, in_input = history_texts(request.get("contents"))
            config = request.get("config")
            instructions = system_texts(config.get("system_instruction")) if isinstance(config, dict) else []
            content.system = join_system(instructions, in_input)
        response = attrs.json("gcp.vertex.agent.llm_response")
        if isinstance(response, dict) and isinstance(response.get("content"), dict):
            content.output = answer(response["content"])
    except Truncated:
        content.truncated = True
    return content if content.has_messages() or content.truncated else None


def _sentry_text(value: Any) -> str | None:
    if isinstance(value, list):
        return "\n".join(v for v in value if isinstance(v, str)) or None
    return value if isinstance(value, str) and value else None


def read_sentry(attrs: Attrs) -> Content | None:
    """Content from Sentry's ``gen_ai.request.messages`` and ``gen_ai.response.*``."""
    if SENTRY_KEYS[0] not in attrs:
        return None
    content = Content(SENTRY)
    try:
        content.input, content.system = history(attrs.json("gen_ai.request.messages"))
        text = _sentry_text(attrs.json("gen_ai.response.text"))
        calls = read_messages({"role": "assistant",
                               "tool_calls": attrs.json("gen_ai.response.tool_calls") or []})
        tool_calls = calls[0].tool_calls if calls else ()
        if text is not None or tool_calls:
            content.output = [Message("assistant", text or "", tool_calls=tool_calls)]
    except Truncated:
        content.truncated = True
    return content if content.has_messages() or content.truncated else None


def read_pydantic_ai(attrs: Attrs) -> Content | None:
    """The whole run's messages from a pydantic-ai agent span."""
    if PYDANTIC_AI_KEYS[0] not in attrs:
        return None
    content = Content(PYDANTIC_AI)
    try:
        content.input, content.system = history(attrs.json("pydantic_ai.all_messages"))
    except Truncated:
        content.truncated = True
    return content
