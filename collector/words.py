"""How counts, rates, sizes, durations, times and URLs are written for people and read from them: the CLI's output,
the log, the config, and what listings in the API and the CLI share (``since``, ``limit``, times as they print)."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|KiB|MB|MiB|GB|GiB|TB|TiB)\s*$")
_UNITS = {"B": 1, "KB": 1000, "KiB": 1024, "MB": 1000**2, "MiB": 1024**2, "GB": 1000**3, "GiB": 1024**3,
          "TB": 1000**4, "TiB": 1024**4}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def plural(n: int, word: str, words: str | None = None) -> str:
    """``1 turn``, ``2 turns``; ``words`` for an irregular plural (``criterion``, ``criteria``)."""
    return f"{n} {word if n == 1 else words or word + 's'}"


def percent(rate: float) -> str:
    """A probability as a percentage: 0.1 -> ``10%``, 1 -> ``100%``, 0.125 -> ``12.5%``."""
    return f"{rate * 100:.3g}%"


def rate_text(estimate: float, low: float, high: float, *, count: int, n: int, too_few: bool) -> str:
    """A share of ``count`` in ``n`` with its 95% interval, as people read it: ``12.5% (4.3% to 31.0%)``;
    ``0% (at most 5.0%, rule of three)`` when ``count`` is 0; and when ``too_few`` (``judges.MIN_N``), the
    count alone, ``too few to tell (1 of 4)``: an interval that wide would read as a finding."""
    if too_few:
        return f"too few to tell ({count} of {n})"
    if count == 0:
        return f"0% (at most {high:.1%}, rule of three)"
    return f"{estimate:.1%} ({low:.1%} to {high:.1%})"


_NOT_CALIBRATED = {"too_few_labels": "too few labels", "no_failures_found": "people found no failure",
                   "false_pass_too_high": "false passes may be too many"}


def not_calibrated_text(reason: str | None) -> str:
    """The mark beside the failure rate of a criterion whose judge the blind labels do not show right enough,
    with ``judges.calibrate``'s reason code in a few words: ``NOT CALIBRATED (too few labels)``."""
    words = _NOT_CALIBRATED.get(reason or "")
    return f"NOT CALIBRATED ({words})" if words else "NOT CALIBRATED"


def calibration_rate_text(r: Mapping[str, Any]) -> str:
    """A false-pass or false-fail rate of calibration (the JSON of ``judges.RateInterval``), ``rate_text``'s
    way with its denominator: ``too few to tell (0 of 2)``, ``10.0% (2.8% to 30.1%) of 20``."""
    text = rate_text(r["rate"], r["low"], r["high"], count=r["count"], n=r["n"], too_few=r["too_few"])
    return text if r["too_few"] else f"{text} of {r['n']}"


def parse_duration(value: Any) -> float:
    """``500ms`` / ``10s`` / ``15m`` / ``1h`` / ``1d`` -> seconds."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 500ms, 10s, 15m or 1h")
    if isinstance(value, (int, float)):
        raise ValueError(f"{value!r} has no unit; write it like 500ms, 10s, 15m or 1h")
    m = _DURATION.match(str(value))
    if not m:
        raise ValueError(f"{value!r} is not a duration; write it like 500ms, 10s, 15m or 1h")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2)]


def duration_text(seconds: float | None) -> str:
    """A kept duration as written in the config: 1209600 -> ``14d``, 5400 -> ``90m``; None -> ``for ever``."""
    if seconds is None:
        return "for ever"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def size_text(n: int) -> str:
    """Bytes as people read them: 1234567 -> ``1.2 MB``."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def is_size(value: str) -> bool:
    """Whether ``value`` is a size as the config writes it (512MB, 2GiB)."""
    return _SIZE.match(value) is not None


def size_bytes(value: str) -> int:
    """A size as the config writes it, in bytes, with DuckDB's units: KB is 1000 bytes, KiB 1024."""
    m = _SIZE.match(value)
    if m is None:
        raise ValueError(f"{value!r} is not a size")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def masked_url(url: str) -> str:
    """``url`` fit to print: the user and password, every query value (a bare one whole) and the fragment
    replaced by ``***``: any of them can hold a secret."""
    u = urlsplit(url)
    netloc = u.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    query = "&".join(f"{k}=***" if sep else "***" for k, sep, _ in (p.partition("=") for p in u.query.split("&"))
                     ) if u.query else ""
    return urlunsplit((u.scheme, netloc, u.path, query, "***" if u.fragment else ""))

MAX_LIMIT = 100_000
"""The most rows a listing returns at once (``limit``), in the API and the CLI."""


def iso_utc(value: Any) -> Any:
    """A datetime (naive ones are UTC, as DuckDB returns them) as RFC 3339 UTC text; anything else as is."""
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=dt.timezone.utc)
        elif value.tzinfo is not dt.timezone.utc:
            value = value.astimezone(dt.timezone.utc)
        return value.isoformat().replace("+00:00", "Z")
    return value


def parse_since(text: str, now: dt.datetime | None = None) -> dt.datetime:
    """``15m`` / ``2h`` / ``7d`` ago, or an ISO 8601 time (UTC when it has no zone)."""
    now = now or dt.datetime.now(dt.timezone.utc)
    try:
        seconds = parse_duration(text)
    except ValueError:
        seconds = None
    try:
        if seconds is not None:
            return now - dt.timedelta(seconds=seconds)
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
        return (when if when.tzinfo else when.replace(tzinfo=dt.timezone.utc)).astimezone(dt.timezone.utc)
    except OverflowError:
        raise ValueError(f"since: {text!r} is before the year 1") from None
    except ValueError:
        raise ValueError(f"since: {text!r} is neither a duration (15m, 2h, 7d) nor an ISO 8601 time") from None
