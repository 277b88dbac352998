"""Errors the collector raises on purpose.

    TracejudgeError            anything we raise knowingly
    ├── UserError              the user can fix it: exit 2, one line, no traceback
    │   ├── ConfigError        otel-config.yaml is wrong (every problem, each with its key path)
    │   └── DatabaseLocked     another process holds the DuckDB file
    └── StoreUnavailable       the writer cannot take or commit data now (retryable)
"""

from __future__ import annotations


class TracejudgeError(Exception):
    """Base of every error raised on purpose."""


class UserError(TracejudgeError):
    """A problem with what the user gave us; the CLI prints it as one line and exits 2."""


class ConfigError(UserError):
    """The configuration is invalid; ``problems`` lists each one as ``key.path: message``."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: " + "; ".join(problems))


class DatabaseLocked(UserError):
    """The DuckDB file is held by another process that is not a daemon we can talk to."""


class StoreUnavailable(TracejudgeError):
    """The store refuses new data for now (queue full, shutting down, commit failed)."""

    def __init__(self, message: str, retry_after: float = 1.0, reason: str = "backpressure") -> None:
        self.retry_after = retry_after
        self.reason = reason
        super().__init__(message)
