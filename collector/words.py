"""How counts and rates are written for people, in the CLI's output and the daemon's log."""

from __future__ import annotations


def plural(n: int, word: str, words: str | None = None) -> str:
    """``1 turn``, ``2 turns``; ``words`` for an irregular plural (``criterion``, ``criteria``)."""
    return f"{n} {word if n == 1 else words or word + 's'}"


def percent(rate: float) -> str:
    """A probability as a percentage: 0.1 -> ``10%``, 1 -> ``100%``, 0.125 -> ``12.5%``."""
    return f"{rate * 100:.3g}%"
