"""Which finished conversations get judged, and with what inclusion probability.

Lifecycle: the daemon builds one ``Sampler`` from the ``sampling:`` config
section when it starts (and ``restore``s its budget windows from what it stored),
then calls ``decide`` exactly once per conversation, the first time that
conversation ends, and stores the ``Decision`` (sampled, probability, rule,
skipped). After each judge call it reports the tokens spent with
``record_tokens``. A conversation that ends again later keeps its stored
decision; ``decide`` is never asked twice for the same conversation, because
budgets count every admission.

How a decision is made:

1. The rules are tried in order; the first whose ``when`` holds gives the rate
   (``rules[0]``, ``rules[1]``, ...), otherwise the default ``rate`` does
   (``default``). That rate is the conversation's inclusion probability.
2. ``blake2b(seed, conversation id)`` mapped to [0, 1) is compared with the rate:
   the same conversation gets the same answer in every run and on every
   replica.
3. A conversation the rate picked is stopped when a budget is used up; the
   decision then says ``skipped="budget:..."``. The caller stores and counts
   it and keeps it out of the estimates: a skipped conversation is not a
   sampled one, and it does not stand for anybody.

Budgets run on the injected clock (epoch seconds: UTC, the daemon's clock,
never span timestamps): ``conversations_per_hour`` is a sliding window over the
last 3600 seconds; ``judge_tokens_per_day`` is a fixed window, the UTC calendar
day, which starts again at 00:00 UTC. The token budget is checked before a
conversation is admitted and charged after it is judged, so the calls already
in flight when it runs out may overshoot it.
"""

from __future__ import annotations

import hashlib
import json
import math
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import regex

from ..config import AttributeMatch, SamplingSettings, When

log = logging.getLogger("tracejudge.sampling")

HOUR = 3600.0
DAY = 86400.0
MATCH_TIMEOUT = 1.0
"""Seconds a rule's ``matches`` may search one attribute value (traffic writes the values: a pattern
that backtracks on a long one must not hold up the daemon). Out of time counts as no match."""

SKIPPED_CONVERSATIONS = "budget:conversations_per_hour"
SKIPPED_TOKENS = "budget:judge_tokens_per_day"

# --------------------------------------------------------------- facts and decisions


@dataclass(frozen=True)
class ConversationFacts:
    """What a sampling rule can look at, gathered by the caller when a conversation ends."""

    conversation_id: str
    ended_by: str | None = None
    service: str | None = None
    models: tuple[str, ...] = ()
    user_turns: int = 0
    attributes: Mapping[str, Any] = field(default_factory=dict)
    """Span and resource attributes of the conversation, values as stored. When an
    attribute has several values across spans, give them as a set, tuple or list:
    a test holds when it holds for any of them."""
    has_error: bool = False
    """Some span of the conversation has status ERROR."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", tuple(self.models))
        object.__setattr__(self, "attributes", MappingProxyType(dict(self.attributes)))


@dataclass(frozen=True)
class Decision:
    """The outcome of ``Sampler.decide``, stored once per conversation."""

    sampled: bool
    """Judge it. False when the rate passed it over or a budget stopped it."""
    probability: float
    """The inclusion probability: the rate of the rule that matched (its weight is 1 / probability)."""
    rule: str
    """``rules[0]``, ``rules[1]``, ... or ``default``."""
    skipped: str | None = None
    """``budget:conversations_per_hour`` or ``budget:judge_tokens_per_day`` when a budget
    stopped a conversation the rate had picked; keep these out of the estimates."""


@dataclass(frozen=True)
class BudgetUsage:
    """What the budgets have counted so far in their current windows."""

    conversations_last_hour: int
    judge_tokens_today: int


def unit_hash(conversation_id: str, seed: int) -> float:
    """A stable draw in [0, 1) for (conversation id, seed): blake2b, the same on every machine and run."""
    digest = hashlib.blake2b(f"{seed}\x00{conversation_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 18446744073709551616.0  # 2**64


# --------------------------------------------------------------- matching


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return str(value)


def _values(value: Any) -> Iterable[Any]:
    if isinstance(value, (set, frozenset, tuple, list)):
        return value
    return (value,)


def _equals(stored: Any, wanted: str | int | float | bool) -> bool:
    if type(stored) is type(wanted):
        return bool(stored == wanted)
    if stored is None:
        return False
    if (isinstance(stored, (int, float)) and isinstance(wanted, (int, float))
            and not isinstance(stored, bool) and not isinstance(wanted, bool)):
        return bool(stored == wanted)  # 5 == 5.0
    # The same value written in another type ("5" for 5, "true" for True) still counts.
    return _text(stored) == _text(wanted)


_Check = Callable[[ConversationFacts], bool]


def _attribute_check(match: AttributeMatch) -> _Check:
    key = match.key
    if match.matches is not None:
        pattern = regex.compile(match.matches)
        warned = False

        def test(value: Any) -> bool:
            nonlocal warned
            try:
                # concurrent: the interpreter lock is released while it searches, so ingestion goes on.
                return pattern.search(_text(value), timeout=MATCH_TIMEOUT, concurrent=True) is not None
            except TimeoutError:
                if not warned:
                    warned = True
                    log.warning("sampling rule on %s: /%s/ ran out of time (%gs) on a value; counted as no "
                                "match (this is logged once)", key, match.matches, MATCH_TIMEOUT)
                return False
    else:
        wanted = match.equals
        assert wanted is not None

        def test(value: Any) -> bool:
            return _equals(value, wanted)

    def check(f: ConversationFacts) -> bool:
        value = f.attributes.get(key)
        if value is None:
            return False
        if isinstance(value, (str, int, float)):
            return test(value)
        return any(v is not None and test(v) for v in _values(value))

    return check


def _compile(when: When) -> tuple[_Check, ...]:
    """One check per key given, cheapest first; the rule holds when all do."""
    checks: list[_Check] = []
    if (ended_by := when.ended_by) is not None:
        checks.append(lambda f: f.ended_by == ended_by)
    if (service := when.service) is not None:
        checks.append(lambda f: f.service == service)
    if (low := when.min_user_turns) is not None:
        checks.append(lambda f: f.user_turns >= low)
    if (high := when.max_user_turns) is not None:
        checks.append(lambda f: f.user_turns <= high)
    if when.status == "error":
        checks.append(lambda f: f.has_error)
    if (model := when.model) is not None:
        checks.append(lambda f: model in f.models)
    if when.attribute is not None:
        checks.append(_attribute_check(when.attribute))
    return tuple(checks)


# --------------------------------------------------------------- the sampler


class Sampler:
    """Decides, once per finished conversation, whether it is judged.

    Thread-safe: the budget windows are guarded by a lock, so decisions and
    ``record_tokens`` may come from different threads.

    Args:
        settings: the ``sampling:`` config section.
        clock: epoch seconds on the daemon's clock (UTC); injected in tests.
    """

    def __init__(self, settings: SamplingSettings, clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self._clock = clock
        self._rules = [(f"rules[{i}]", r.rate, _compile(r.when)) for i, r in enumerate(settings.rules)]
        self._lock = threading.Lock()
        self._admitted: deque[float] = deque()
        self._day = -1
        self._tokens_today = 0

    def rule_for(self, facts: ConversationFacts) -> tuple[str, float]:
        """The first rule whose ``when`` holds, as (name, rate); ``("default", rate)`` when none does."""
        for name, rate, checks in self._rules:
            for check in checks:
                if not check(facts):
                    break
            else:
                return name, rate
        return "default", self.settings.rate

    def decide(self, facts: ConversationFacts) -> Decision:
        """Sample one finished conversation; call once per conversation and store the result.

        A conversation the rate picks counts against the hourly budget; one a
        budget stops is returned with ``sampled=False`` and ``skipped`` set.
        """
        name, rate = self.rule_for(facts)
        if unit_hash(facts.conversation_id, self.settings.seed) >= rate:
            return Decision(sampled=False, probability=rate, rule=name)
        budget = self.settings.budget
        with self._lock:
            now = self._clock()
            if budget.judge_tokens_per_day is not None:
                self._roll_day(now)
                if self._tokens_today >= budget.judge_tokens_per_day:
                    return Decision(sampled=False, probability=rate, rule=name, skipped=SKIPPED_TOKENS)
            self._trim_hour(now)
            if budget.conversations_per_hour is not None and len(self._admitted) >= budget.conversations_per_hour:
                return Decision(sampled=False, probability=rate, rule=name, skipped=SKIPPED_CONVERSATIONS)
            self._admitted.append(now)
        return Decision(sampled=True, probability=rate, rule=name)

    def record_tokens(self, n: int) -> None:
        """Charge ``n`` judge tokens (input + output) to today's budget; call after each judge call."""
        if n < 0:
            raise ValueError(f"tokens spent cannot be negative, got {n}")
        with self._lock:
            self._roll_day(self._clock())
            self._tokens_today += n

    def restore(self, *, admitted_at: Iterable[float] = (), tokens: Iterable[tuple[float, int]] = ()) -> None:
        """Refill the budget windows after a restart from what the daemon stored.

        Args:
            admitted_at: clock times (epoch seconds) at which conversations were
                sampled; those within the last hour count again.
            tokens: ``(clock time, tokens)`` of judge calls; those of today (UTC) count again.
        """
        with self._lock:
            now = self._clock()
            self._roll_day(now)
            self._admitted.extend(sorted(t for t in admitted_at if t > now - HOUR))
            self._trim_hour(now)
            self._tokens_today += sum(n for t, n in tokens if math.floor(t / DAY) == self._day)

    def usage(self) -> BudgetUsage:
        """The budgets' counts in their current windows (for metrics and status)."""
        with self._lock:
            now = self._clock()
            self._roll_day(now)
            self._trim_hour(now)
            return BudgetUsage(conversations_last_hour=len(self._admitted), judge_tokens_today=self._tokens_today)

    def _trim_hour(self, now: float) -> None:
        while self._admitted and self._admitted[0] <= now - HOUR:
            self._admitted.popleft()

    def _roll_day(self, now: float) -> None:
        # Epoch seconds count UTC days exactly (no leap seconds), so day n starts at n * 86400.
        day = math.floor(now / DAY)
        if day != self._day:
            self._day = day
            self._tokens_today = 0
