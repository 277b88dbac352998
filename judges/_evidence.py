"""Evidence check: is every quote a judge gave really in the transcript, and where?

A judge can invent a quote. Each quote is looked up in the transcript as the
judge saw it (rendered and neutralized), after folding Unicode compatibility
forms (NFKC), case, typographic quote marks and whitespace. Tolerated:
surrounding quote marks, a speaker prefix (``BOT:``, ``User:``, ``Assistant:``;
then the rest must be in a message of that speaker), and an ellipsis standing
for omitted words (then the pieces must appear in that order within one message).

``locate_evidence`` runs the same lookup and says where each quote was found, in
the messages' own text, so a page that highlights those ranges shows exactly
what ``verify_evidence`` accepted.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Iterable
from typing import NamedTuple

from ._transcript import Message, Piece, neutralize, render_pieces

_QUOTES = str.maketrans({"“": '"', "”": '"', "„": '"', "«": '"', "»": '"', "‘": "'", "’": "'", "‚": "'"})
_SPACE = re.compile(r"\s+")
_ELLIPSIS = re.compile(r"\s*(?:\.\.\.+|…|\[\s*(?:\.\.\.|…)\s*\])\s*")
_PREFIX = re.compile(r"^(user|bot|assistant|tool(?: [\w.\-]+)?)\s*:\s*")
_WRAP = "\"' "
_SPEAKER = {"user": "user", "bot": "bot", "assistant": "bot"}


@functools.cache
def _composition_seconds() -> frozenset[str]:
    # Characters that canonical composition joins onto the character before them.
    out = {chr(c) for c in (*range(0x1161, 0x1176), *range(0x11A8, 0x11C3))}  # Hangul vowels, final consonants
    for c in range(0xC0, 0x30000):
        d = unicodedata.decomposition(chr(c)).split()
        if len(d) == 2 and not d[0].startswith("<"):
            out.add(chr(int(d[1], 16)))
    return frozenset(out)


@functools.lru_cache(maxsize=8192)
def _starts_cluster(ch: str) -> bool:
    """True when NFKC never joins ``ch`` onto what precedes it, so the text may be folded in two there."""
    first = unicodedata.normalize("NFKD", ch)[0]
    return unicodedata.combining(first) == 0 and first not in _composition_seconds()


def fold(text: str) -> str:
    """Fold text for comparison: NFKC, case, typographic quotes, runs of whitespace."""
    return _SPACE.sub(" ", unicodedata.normalize("NFKC", text).casefold().translate(_QUOTES)).strip()


def _fold_map(text: str) -> tuple[list[int], list[int]] | None:
    """For each character of ``fold(text)``, the range of ``text`` it comes from; None if that cannot be told.

    The text is folded cluster by cluster (where NFKC cannot join a character
    onto the one before), which gives ``fold``'s result; the check below keeps it so.
    """
    if text.isascii():  # NFKC and the quote marks leave ASCII alone; casefold is lower
        folded, starts, ends = text.lower(), list(range(len(text))), list(range(1, len(text) + 1))
    else:
        parts: list[str] = []
        starts, ends = [], []
        at = 0
        for i in range(1, len(text) + 1):
            if i < len(text) and not (text[i].isascii() or _starts_cluster(text[i])):
                continue
            part = unicodedata.normalize("NFKC", text[at:i]).casefold().translate(_QUOTES)
            parts.append(part)
            starts += [at] * len(part)
            ends += [i] * len(part)
            at = i
        folded = "".join(parts)
    out: list[str] = []
    new_starts: list[int] = []
    new_ends: list[int] = []
    at = 0
    for m in _SPACE.finditer(folded):  # a run of whitespace becomes one space standing for the whole run
        out += [folded[at:m.start()], " "]
        new_starts += [*starts[at:m.start()], starts[m.start()]]
        new_ends += [*ends[at:m.start()], ends[m.end() - 1]]
        at = m.end()
    out.append(folded[at:])
    new_starts += starts[at:]
    new_ends += ends[at:]
    spaced = "".join(out)
    lead, keep = len(spaced) - len(spaced.lstrip()), len(spaced.rstrip())
    if spaced[lead:keep] != fold(text):
        return None
    return new_starts[lead:keep], new_ends[lead:keep]


_Hit = list[tuple[int, int, int]]
"""Where a quote was found: (line, start, end) in folded lines."""


class EvidenceIndex:
    """A transcript prepared for looking up quotes; build it once per conversation.

    Args:
        rendered: the transcript's lines as ``render_lines`` gives them.
    """

    def __init__(self, rendered: Iterable[str]) -> None:
        self._rendered = list(rendered)
        self._lines = [fold(line) for line in self._rendered]
        self._joined = " ".join(self._lines)

    def _speaker_lines(self, speaker: str) -> list[tuple[int, int]]:
        """(line, offset of the text after its label) of each line of a speaker."""
        out = []
        for n, line in enumerate(self._lines):
            label, sep, _ = line.partition(": ")
            if label == speaker or (speaker == "tool" and label.startswith("tool ")):
                out.append((n, len(label) + len(sep)))
        return out

    def hit(self, quote: str) -> _Hit | None:
        """Where the quote is in the folded lines; None when it is not there (see the module docstring)."""
        q = fold(neutralize(quote)).strip(_WRAP)
        if not q:
            return None
        at = self._joined.find(q)
        if at >= 0:
            return self._spread(at, at + len(q))
        lines = [(n, 0) for n in range(len(self._lines))]
        m = _PREFIX.match(q)
        if m:
            q = q[m.end():].strip(_WRAP)
            lines = self._speaker_lines(_SPEAKER.get(m.group(1), m.group(1)))
        pieces = [p.strip(_WRAP) for p in _ELLIPSIS.split(q) if p.strip(_WRAP)]
        if not pieces:
            return None
        for n, offset in lines:
            found = _in_order(pieces, self._lines[n], offset)
            if found is not None:
                return [(n, start, end) for start, end in found]
        return None

    def _spread(self, start: int, end: int) -> _Hit:
        """A range of the joined lines as ranges of each line it covers."""
        out, base = [], 0
        for n, line in enumerate(self._lines):
            lo, hi = max(start, base), min(end, base + len(line))
            if lo < hi:
                out.append((n, lo - base, hi - base))
            base += len(line) + 1
        return out

    def found(self, quote: str) -> bool:
        """True when the quote is in the transcript (see the module docstring for tolerances)."""
        return self.hit(quote) is not None

    def verify(self, evidence: Iterable[str]) -> bool:
        """True when every quote is found (an empty list is trivially verified)."""
        return all(self.found(q) for q in evidence)

    def source_ranges(self, hit: _Hit) -> list[tuple[int, int, int]]:
        """A hit as (line, start, end) ranges of the rendered (unfolded) lines."""
        out = []
        for n, start, end in hit:
            maps = _fold_map(self._rendered[n]) if start < end else None
            if maps is not None:
                out.append((n, maps[0][start], maps[1][end - 1]))
            elif start < end:  # not expected (a test pins it): the whole line rather than nothing
                out.append((n, 0, len(self._rendered[n])))
        return out


def _in_order(pieces: list[str], text: str, at: int) -> list[tuple[int, int]] | None:
    out = []
    for piece in pieces:
        at = text.find(piece, at)
        if at < 0:
            return None
        out.append((at, at + len(piece)))
        at += len(piece)
    return out


def verify_evidence(evidence: Iterable[str], messages: Iterable[Message]) -> bool:
    """Check that every quote is in the transcript.

    Args:
        evidence: the quotes a judge gave.
        messages: the transcript it judged.

    Returns:
        True when every quote was found (after folding; see the module docstring).
    """
    return all(located.found for located in locate_evidence(evidence, messages))


class TextRange(NamedTuple):
    """A stretch of one message's text that a quote matched."""

    message: int
    """The message's index in the transcript."""
    part: int
    """``-1``: its ``content``; ``k >= 0``: its k-th tool call, as ``tool_call_text`` writes it."""
    start: int
    end: int


class Located(NamedTuple):
    """One quote, looked up."""

    quote: str
    found: bool
    """What ``verify_evidence`` says of it."""
    ranges: list[TextRange]
    """Where it matched in the messages' text (not in the labels the renderer adds)."""


def locate_evidence(evidence: Iterable[str], messages: Iterable[Message]) -> list[Located]:
    """Look up each quote as ``verify_evidence`` does, and say where it was found.

    Args:
        evidence: the quotes a judge gave.
        messages: the transcript.

    Returns:
        One ``Located`` per quote, in order.
    """
    lines = list(render_pieces(messages))
    index = EvidenceIndex("".join(p[0] for p in line) for line in lines)
    out = []
    for quote in evidence:
        hit = index.hit(quote)
        ranges = [] if hit is None else [
            r for n, start, end in index.source_ranges(hit) for r in _in_sources(n, lines[n], start, end)]
        out.append(Located(quote, hit is not None, ranges))
    return out


def _in_sources(message: int, pieces: list[Piece], start: int, end: int) -> list[TextRange]:
    out, base = [], 0
    for text, source, offset in pieces:
        lo, hi = max(start, base), min(end, base + len(text))
        if source is not None and lo < hi:
            out.append(TextRange(message, source, offset + lo - base, offset + hi - base))
        base += len(text)
    return out
