"""LangSmith: ``x-api-key`` and ``Langsmith-Project``; it builds threads from ``langsmith.metadata.thread_id``,
which its exporter adds from the conversation id."""

from __future__ import annotations

from ._backend import Backend, Settings, api_key, missing_key


def headers(exp: Settings) -> dict[str, str]:
    h = {"x-api-key": api_key(exp)}
    if exp.project:
        h["Langsmith-Project"] = exp.project
    return h


def check(exp: Settings) -> str | None:
    return missing_key("langsmith", exp)


BACKEND = Backend("langsmith", "https://api.smith.langchain.com/otel/v1/traces", ("traces",), headers, check,
                  thread_attribute=True)
"""Traces only by default: no evidence LangSmith reads evaluation events."""
