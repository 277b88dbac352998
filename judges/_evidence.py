"""Evidence check: is every quote a judge gave really in the transcript?

A judge can invent a quote. Each quote is looked up in the transcript as the
judge saw it (rendered and neutralized), after folding Unicode compatibility
forms, case, typographic quote marks and whitespace. Tolerated: surrounding
quote marks, a speaker prefix (``BOT:``, ``User:``, ``Assistant:``; then the
rest must be in a message of that speaker), and an ellipsis standing for
omitted words (then the pieces must appear in order within one message).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable

from ._transcript import Message, neutralize, render_lines

_QUOTES = str.maketrans({"“": '"', "”": '"', "„": '"', "«": '"', "»": '"', "‘": "'", "’": "'", "‚": "'"})
_SPACE = re.compile(r"\s+")
_ELLIPSIS = re.compile(r"\s*(?:\.\.\.+|…|\[\s*(?:\.\.\.|…)\s*\])\s*")
_PREFIX = re.compile(r"^(user|bot|assistant|tool(?: [\w.\-]+)?)\s*:\s*")
_WRAP = "\"' "
_SPEAKER = {"user": "user", "bot": "bot", "assistant": "bot"}


def fold(text: str) -> str:
    """Fold text for comparison: NFKC, case, typographic quotes, runs of whitespace."""
    text = unicodedata.normalize("NFKC", text).casefold().translate(_QUOTES)
    return _SPACE.sub(" ", text).strip()


class EvidenceIndex:
    """A transcript prepared for looking up quotes; build it once per conversation.

    Args:
        rendered: the transcript's lines as ``render_lines`` gives them.
    """

    def __init__(self, rendered: Iterable[str]) -> None:
        self._lines = [fold(line) for line in rendered]
        self._joined = " ".join(self._lines)

    def _speaker_lines(self, speaker: str) -> list[str]:
        out = []
        for line in self._lines:
            label, _, rest = line.partition(": ")
            if label == speaker or (speaker == "tool" and label.startswith("tool ")):
                out.append(rest)
        return out

    def found(self, quote: str) -> bool:
        """True when the quote is in the transcript (see the module docstring for tolerances)."""
        q = fold(neutralize(quote)).strip(_WRAP)
        if not q:
            return False
        if q in self._joined:
            return True
        lines = self._lines
        m = _PREFIX.match(q)
        if m:
            q = q[m.end():].strip(_WRAP)
            lines = self._speaker_lines(_SPEAKER.get(m.group(1), m.group(1)))
        pieces = [p.strip(_WRAP) for p in _ELLIPSIS.split(q) if p.strip(_WRAP)]
        if not pieces:
            return False
        return any(_in_order(pieces, line) for line in lines)

    def verify(self, evidence: Iterable[str]) -> bool:
        """True when every quote is found (an empty list is trivially verified)."""
        return all(self.found(q) for q in evidence)


def _in_order(pieces: list[str], text: str) -> bool:
    at = 0
    for piece in pieces:
        at = text.find(piece, at)
        if at < 0:
            return False
        at += len(piece)
    return True


def verify_evidence(evidence: Iterable[str], messages: Iterable[Message]) -> bool:
    """Check that every quote is in the transcript.

    Args:
        evidence: the quotes a judge gave.
        messages: the transcript it judged.

    Returns:
        True when every quote was found (after folding; see the module docstring).
    """
    return EvidenceIndex(render_lines(messages)).verify(evidence)
