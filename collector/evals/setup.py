"""The judges of the config: its criteria files and its provider, for the daemon and the CLI.

Kept apart from the evaluator so that ``tracejudge judge`` loads neither DuckDB nor gRPC.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any, Callable

from judges import Criterion, CriteriaError, Provider, ProviderSetupError, load_criteria, make_provider

from ..config import Config, JudgeProvider
from ..errors import UserError

log = logging.getLogger("tracejudge.judging")

NO_PROVIDER = ("no provider configured", "no API key")
"""How the not-run reasons of a missing provider (``daemon_provider``, ``judges``) begin: a provider fixes them."""

PROVIDER_ENV = {"anthropic": ("ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL"), "openai_compatible": ("OPENAI_BASE_URL",)}
"""Provider type -> the variables, among those its ``judges`` class reads, that say it is there to use: a key or
an endpoint (the model and the rest are read by the class itself)."""


def load_configured_criteria(cfg: Config) -> list[Criterion]:
    """The criteria files of ``judges.criteria``; a problem in one is a ``UserError`` naming it."""
    if not cfg.judges.criteria:
        return []
    try:
        return load_criteria(cfg.judges.criteria)
    except (CriteriaError, OSError) as exc:
        raise UserError(f"judges.criteria: {exc}") from None


def provider_from_config(section: JudgeProvider, *, type_: str | None = None, model: str | None = None,
                         base_url: str | None = None, on_unused: Callable[[str], None] | None = None,
                         flags: Mapping[str, str] | None = None) -> Provider | None:
    """The judge provider of ``judges.provider`` (flags override it); None when none is named.

    Settings of the configured type do not carry over to another ``type_``: a
    different provider does not inherit its model, URL or key.

    Args:
        flags: setting -> the command-line flag that gives it, named first when that setting is missing.

    Raises:
        UserError: the provider cannot be built (no model, unknown type, ...).
    """
    chosen = type_ or section.type
    if chosen is None:
        return None
    same = chosen == section.type
    settings: dict[str, Any] = {
        "model": model or (section.model if same else None),
        "base_url": base_url or (section.base_url if same else None),
        "api_key": section.api_key if same else None,
        "max_tokens": section.max_tokens if same else None,
        "temperature": section.temperature if same and "temperature" in section.model_fields_set else None,
    }
    try:
        return make_provider(chosen, on_unused=on_unused or (lambda key: None), **settings)
    except ProviderSetupError as exc:
        flag = (flags or {}).get(exc.missing or "")
        if flag:
            raise UserError(f"{chosen}: no {exc.missing}: pass {flag}, or set judges.provider.{exc.missing} "
                            f"or ${exc.env}") from None
        raise UserError(f"judges.provider: {exc}") from None


def provider_type_from_env(environ: Mapping[str, str]) -> str | None:
    """The provider type ``environ`` gives (``PROVIDER_ENV``), as ``judges`` would read it; None when it gives none.

    Raises:
        UserError: it gives more than one (which one to use is the user's choice).
    """
    found = [t for t, names in PROVIDER_ENV.items() if any(environ.get(n) for n in names)]
    if len(found) > 1:
        given = " and ".join(next(f"${n}" for n in PROVIDER_ENV[t] if environ.get(n)) for t in found)
        raise UserError(f"{given} are both set: pass --provider {' or --provider '.join(found)}")
    return found[0] if found else None


def daemon_provider(cfg: Config) -> tuple[Provider | None, str | None]:
    """The provider the daemon judges with, and why there is none.

    An Anthropic provider with no API key anywhere (config, ``$ANTHROPIC_API_KEY``)
    and no URL of its own (``base_url``, ``$ANTHROPIC_BASE_URL``: a gateway may need
    no key) is left out rather than failing every call:
    its criteria are then reported as not run, saying which key to set.
    """
    section = cfg.judges.provider
    if section.type is None:
        return None, "no provider configured (judges.provider.type)"
    if section.type == "anthropic" and not (section.api_key or section.base_url
                                            or any(os.environ.get(n) for n in PROVIDER_ENV["anthropic"])):
        return None, "no API key: set ANTHROPIC_API_KEY (or judges.provider.api_key)"
    return provider_from_config(section, on_unused=lambda key: log.warning(
        "judges.provider.%s is not used by the %s provider", key, section.type)), None
