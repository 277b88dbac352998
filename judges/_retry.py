"""When to try again: the one retry rule of judges and of the daemon.

``Backoff`` is the wait before a retry: it grows by ``factor`` with each failure
in a row up to a limit, and ``jitter`` takes a random part off each wait so that
clients that failed together (a fleet of daemons, judge calls sent at once) do
not all come back at the same moment. ``parse_retry_after`` reads the wait a
server asked for. Judge calls (``RetryPolicy``), forwarding, the evaluator's
retries of judge errors and the daemon's background stages all use them.
"""

from __future__ import annotations

import email.utils
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """Waits that grow: ``first`` seconds after one failure, ``factor`` times more after each next, at most ``most``."""

    first: float
    """Seconds to wait after the first failure."""
    most: float
    """No wait is longer."""
    factor: float = 2.0
    """How much each wait grows on the one before."""
    jitter: float = 0.0
    """Up to this fraction of each wait is taken off at random (0.5: between half of it and all of it)."""
    rand: Callable[[], float] = random.random
    """Uniform in [0, 1): the jitter's source (tests pass a fixed one)."""

    def delay(self, failures: int) -> float:
        """Seconds to wait after ``failures`` failures in a row (1 after the first)."""
        try:
            wait = min(self.most, self.first * self.factor ** (failures - 1))
        except OverflowError:  # failing for days, thousands of times in a row: long past the limit
            wait = self.most if self.first > 0 else 0.0
        return wait * (1.0 - self.jitter * self.rand())


def parse_retry_after(headers: Mapping[str, str], *, most: float = math.inf,
                      now: Callable[[], float] = time.time) -> float | None:
    """The seconds a server's answer asks to wait before the next try, at most ``most``.

    ``retry-after-ms`` (the OpenAI and Anthropic APIs send it) is read first, then
    ``retry-after``: seconds or an HTTP date. A date in the past is 0.

    Args:
        headers: the answer's headers, found by lower-case name (a case-insensitive mapping, or names lowered).
        most: the longest wait returned; a longer one asked for is cut to it.
        now: the clock an HTTP date is counted from (epoch seconds).

    Returns:
        Seconds, or None when the server did not say (no header, or none readable).
    """
    for name, unit in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value) * unit
        except ValueError:
            try:
                seconds = email.utils.parsedate_to_datetime(value).timestamp() - now()
            except (TypeError, ValueError):
                continue  # unreadable: as if the server had not said
        if math.isnan(seconds):
            continue
        return min(most, max(0.0, seconds))
    return None
