"""The one retry rule: backoff with jitter, and the wait a server asks for."""

from __future__ import annotations

from datetime import datetime, timezone
from email.utils import format_datetime

from judges import Backoff, parse_retry_after

T0 = datetime(2025, 11, 30, 12, 0, tzinfo=timezone.utc).timestamp()


def test_backoff_doubles_up_to_its_limit() -> None:
    backoff = Backoff(0.5, 30.0)
    assert [backoff.delay(n) for n in range(1, 10)] == [0.5, 1, 2, 4, 8, 16, 30, 30, 30]


def test_jitter_takes_up_to_its_fraction_off_each_wait() -> None:
    assert Backoff(1.0, 60.0, jitter=0.5, rand=lambda: 0.0).delay(3) == 4.0
    assert Backoff(1.0, 60.0, jitter=0.5, rand=lambda: 0.5).delay(3) == 3.0
    assert Backoff(1.0, 60.0, jitter=0.5, rand=lambda: 1.0).delay(3) == 2.0


def test_another_factor() -> None:
    assert [Backoff(60.0, 3600.0, factor=10.0).delay(n) for n in (1, 2, 3, 4)] == [60, 600, 3600, 3600]


def test_failing_for_days_stays_at_the_limit() -> None:
    # A backend down for a day fails thousands of times in a row; the power of 2 outgrows a float.
    assert Backoff(0.5, 30.0).delay(5000) == 30.0
    assert Backoff(0.0, 30.0).delay(5000) == 0.0


def test_retry_after_forms() -> None:
    assert parse_retry_after({"retry-after": "7"}) == 7.0
    assert parse_retry_after({"retry-after-ms": "1500", "retry-after": "9"}) == 1.5
    later = format_datetime(datetime.fromtimestamp(T0 + 120, timezone.utc), usegmt=True)
    assert parse_retry_after({"retry-after": later}, now=lambda: T0) == 120.0
    assert parse_retry_after({"retry-after": later}, now=lambda: T0 + 500) == 0.0  # a date gone by
    assert parse_retry_after({"retry-after": "-3"}) == 0.0
    assert parse_retry_after({"retry-after": "soon"}) is None
    assert parse_retry_after({"retry-after": "nan"}) is None
    assert parse_retry_after({"retry-after-ms": "soon", "retry-after": "2"}) == 2.0
    assert parse_retry_after({}) is None


def test_retry_after_is_cut_to_the_most_allowed() -> None:
    assert parse_retry_after({"retry-after": "3600"}, most=300.0) == 300.0
    assert parse_retry_after({"retry-after": "30"}, most=300.0) == 30.0
