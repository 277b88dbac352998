"""Errors the judges library raises on purpose.

    JudgesError                 anything raised knowingly
    ├── InputError              the caller's input is wrong; the message says where
    │   ├── CriteriaError       a criteria file: names the file, the criterion id and the key
    │   └── ConversationError   a conversation/v1 record: names the file and line
    ├── ProviderSetupError      a provider cannot be built (unknown type, no model, missing package)
    └── ProviderError           one judge call failed; the runner turns it into an ``error`` verdict

``ProviderError`` never escapes ``run_judges``: a judge that fails records
``error`` with the reason, never ``pass``.
"""

from __future__ import annotations


class JudgesError(Exception):
    """Base of every error the judges library raises on purpose."""


class InputError(JudgesError):
    """Input given to the library is wrong; the message names where."""


class CriteriaError(InputError):
    """A criteria file is invalid; every problem found is reported at once.

    Attributes:
        file: the criteria file.
        problems: ``(criterion id or None, key or None, message)`` for each problem.
    """

    def __init__(self, file: str, problems: list[tuple[str | None, str | None, str]]) -> None:
        self.file = file
        self.problems = problems
        parts = []
        for criterion, key, message in problems:
            where = f"criterion {criterion!r}: " if criterion is not None else ""
            where += f"{key}: " if key is not None else ""
            parts.append(where + message)
        super().__init__(f"{file}: " + "; ".join(parts))


class ConversationError(InputError):
    """A conversation/v1 record cannot be read; the message names the file and line."""


class ProviderSetupError(JudgesError):
    """A provider cannot be built from the settings given.

    Attributes:
        missing: the setting that is needed and was not given (``model``, ``base_url``), when that is why.
        env: the environment variable that would give it too.
    """

    def __init__(self, message: str, *, missing: str | None = None, env: str | None = None) -> None:
        self.missing = missing
        self.env = env
        super().__init__(message)

    @classmethod
    def no(cls, provider: str, setting: str, env: str) -> ProviderSetupError:
        """A needed setting not given anywhere."""
        return cls(f"{provider}: no {setting} (set judges.provider.{setting} or ${env})", missing=setting, env=env)


class ProviderError(JudgesError):
    """One judge call failed.

    Attributes:
        code: a short stable reason (``timeout``, ``rate_limited``, ``server_error``,
            ``connection``, ``http_error``, ``bad_response``).
        retryable: the same call may succeed later (429, 529, 5xx, connection loss).
        retry_after: seconds the server asked us to wait, when it said so.
        raw: the body received, when there was one.
    """

    def __init__(
        self, code: str, detail: str, *, retryable: bool = False, retry_after: float | None = None, raw: str = ""
    ) -> None:
        self.code = code
        self.detail = detail
        self.retryable = retryable
        self.retry_after = retry_after
        self.raw = raw
        super().__init__(f"{code}: {detail}")
