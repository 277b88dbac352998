"""Reviewer names as the daemon keeps and compares them.

``eve``, ``Eve`` and ``eve`` with a zero-width space are one reviewer: names are
compared by ``reviewer_key`` (NFKC, case-folded, invisible characters removed,
whitespace collapsed). ``clean_name`` is the spelling kept and shown: the same
without the case folding, so a name reads as it was written.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable

# Default-ignorable code points that are not format characters (Cf): invisible all the same, so a name
# padded with them would look like another's (Unicode's DerivedCoreProperties, Default_Ignorable_Code_Point).
_IGNORABLE = frozenset(
    [0x034F, 0x115F, 0x1160, 0x17B4, 0x17B5, 0x180B, 0x180C, 0x180D, 0x180F, 0x2065, 0x3164, 0xFFA0,
     *range(0xFE00, 0xFE10), *range(0xFFF0, 0xFFF9), *range(0xE0100, 0xE01F0)])


def _visible(text: str) -> str:
    """``text`` without invisible characters, its whitespace (line breaks, no-break spaces...) made spaces."""
    return "".join(" " if c.isspace() else c for c in text
                   if c.isspace() or (ord(c) not in _IGNORABLE and unicodedata.category(c) not in ("Cf", "Cc")))


def clean_name(name: str) -> str:
    """``name`` as it is kept: without invisible characters (format characters such as zero-width spaces and
    joiners, the BOM and soft hyphens; control characters; other default-ignorable ones), in NFKC, its
    whitespace collapsed to single spaces and trimmed. Letter case is kept."""
    # Removed before NFKC, so that an accent split from its letter by an invisible character composes with it;
    # and after, for what NFKC itself maps to one.
    return " ".join(_visible(unicodedata.normalize("NFKC", _visible(name))).split())


def reviewer_key(name: str) -> str:
    """What two names share when they name one reviewer: ``clean_name`` case-folded (``""``: no name)."""
    return unicodedata.normalize("NFKC", clean_name(name).casefold())


def spellings(stored: Iterable[str], name: str) -> list[str]:
    """The names among ``stored`` that are ``name``'s reviewer, however each was written."""
    key = reviewer_key(name)
    return [s for s in stored if reviewer_key(s) == key]
