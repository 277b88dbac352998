"""LangWatch: a bearer key; it reads logs too, verdicts as evaluation events among them."""

from __future__ import annotations

from ._backend import Backend, Settings, bearer, missing_key


def check(exp: Settings) -> str | None:
    return missing_key("langwatch", exp)


BACKEND = Backend("langwatch", "https://app.langwatch.ai/api/otel/v1/traces", ("traces", "logs"), bearer, check)
