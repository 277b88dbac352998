"""Opik, on Comet's cloud or self-hosted: the raw key (no "Bearer"), ``Comet-Workspace`` and ``projectName``."""

from __future__ import annotations

from urllib.parse import urlsplit

from ._backend import Backend, Settings, api_key, missing_key


def headers(exp: Settings) -> dict[str, str]:
    h: dict[str, str] = {}
    if key := api_key(exp):
        h["Authorization"] = key
    if exp.workspace:
        h["Comet-Workspace"] = exp.workspace
    if exp.project:
        h["projectName"] = exp.project
    return h


def check(exp: Settings) -> str | None:
    """Comet's cloud needs a key and a workspace; a self-hosted Opik may need neither."""
    if not (urlsplit(exp.url).hostname or "").endswith("comet.com"):
        return None
    return missing_key("opik", exp) or (None if exp.workspace else
                                        "workspace is missing: Opik on Comet's cloud needs Comet-Workspace")


BACKEND = Backend("opik", "https://www.comet.com/opik/api/v1/private/otel/v1/traces", ("traces",), headers, check)
"""Traces only by default: no evidence Opik reads evaluation events."""
