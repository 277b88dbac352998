"""What a backend type declares (``Backend``), what it reads of its exporter (``Settings``), and the rules
that several share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class Settings(Protocol):
    """What a backend reads of its exporter's configuration (``collector.config.Exporter``)."""

    @property
    def endpoint(self) -> str | None: ...
    @property
    def url(self) -> str: ...
    @property
    def api_key(self) -> str | None: ...
    @property
    def project(self) -> str | None: ...
    @property
    def workspace(self) -> str | None: ...


def no_problem(exp: Settings) -> str | None:
    """A backend that takes any settings."""
    return None


@dataclass(frozen=True)
class Backend:
    """A backend type (``exporters.<name>.type``) and its conventions (``../reference/backends.md``)."""

    name: str
    endpoint: str | None
    """Its cloud traces URL, the default; None: the exporter's ``endpoint`` is required."""
    signals: tuple[str, ...]
    """What is forwarded when the exporter does not say (``signals``)."""
    headers: Callable[[Settings], dict[str, str]]
    """Its own headers: the key, and what names a workspace or project."""
    check: Callable[[Settings], str | None] = no_problem
    """What it would refuse in the exporter's settings, if anything: said at start-up, not at the first send."""
    thread_attribute: bool = False
    """Each span carrying a conversation id gets ``langsmith.metadata.thread_id`` (``collector.forward.rewrite``)."""

    def problem(self, exp: Settings) -> str | None:
        """What is wrong with an exporter's settings for this backend, if anything."""
        if self.endpoint is None and exp.endpoint is None:
            return f"an {self.name} exporter needs its endpoint (the traces URL)"
        return self.check(exp)


def api_key(exp: Settings) -> str:
    """The exporter's key, "" when unset."""
    return (exp.api_key or "").strip()


def bearer(exp: Settings) -> dict[str, str]:
    """``Authorization: Bearer <key>`` when there is a key."""
    key = api_key(exp)
    return {"Authorization": f"Bearer {key}"} if key else {}


def missing_key(name: str, exp: Settings) -> str | None:
    """The problem of an exporter without a key, for a backend that refuses requests without one."""
    if api_key(exp):
        return None
    return (f"api_key is missing or empty: {name} refuses requests without one "
            "(set it, e.g. api_key: ${env:NAME:-} with NAME set)")
