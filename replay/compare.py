"""Simulated and real conversations side by side (``tracejudge replay compare``): descriptive, never a gate.

Both files are conversation/v1 JSONL, read a line at a time through judges'
reader (``judges.parse_conversations``); a bad line stops the comparison with a
``judges.ConversationError`` naming the file and the line. For each side it
measures:

- the distribution (count, mean, min, p10, median, p90, max and a histogram)
  of user messages per conversation, user message length in characters and in
  words (whitespace-separated), assistant message length likewise, questions
  per user message, and facts in the first user message and in the later ones;
- the share of conversations cut off early by their ``ended_by``
  (``unanswered``, ``turn_limit``), the share whose last message is the user's
  (nobody answered it, whatever ``ended_by`` says), and the ``ended_by`` mix;
- the language mix of user messages (``LanguageDetector``).

The two sides of a histogram share their bins, so they can be laid side by
side. Per-message figures are kept as compact integer arrays (a few bytes a
message), never the records.

A question is a run of question marks (``?``, ``？``, ``؟``) in a user
message. A fact is a clause (``clauses``: text between sentence punctuation,
commas, semicolons and line breaks; a point, comma or colon between digits does
not split) that carries a digit (an amount, a date, a time, an order number, a
dose), a date word (weekdays, months, today, yesterday, ago, ...), a
capitalised word other than the clause's first (a name, a place, a product),
or a statement of state or symptom (``I have``, ``I'm``, ``my ... is``,
``pain``, ``fever``, ...); a clause counts once however many it carries. The
word lists are English: in other languages a fact is found by its digits and
capitalised words only. It is a simple, stable heuristic (``FACT_HEURISTIC``
names its version), meant to show where facts arrive, not to count them exactly.
"""

from __future__ import annotations

import math
import re
from array import array
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from judges import Conversation, ConversationError, parse_conversations

REPORT_VERSION = 1
"""``version`` of the ``--json`` output; its keys are only ever added to."""

FACT_HEURISTIC = "clauses-v1"
"""The fact heuristic of the module docstring; a new version gets a new name."""

CUT_OFF = ("unanswered", "turn_limit")
"""``ended_by`` values that mean a conversation was cut off early."""

DISTRIBUTIONS = (
    ("user_messages_per_conversation", "user messages / conversation", True),
    ("user_message_chars", "user message length (chars)", False),
    ("user_message_words", "user message length (words)", False),
    ("assistant_message_chars", "assistant message length (chars)", False),
    ("assistant_message_words", "assistant message length (words)", False),
    ("questions_per_user_message", "questions / user message", True),
    ("facts_in_first_user_message", "facts in the first user message", True),
    ("facts_in_later_user_messages", "facts in later user messages", True),
)
"""Each distribution's key, its label, and whether its values are small counts (one bin per value)."""

MAX_COUNT_BINS = 25
"""Bins of a count histogram at most: one per value 0, 1, 2, ..., the last also holding every larger one."""
LENGTH_BINS = 20
"""Bins of a length histogram, of equal width up to the larger side's 99th percentile."""


# --------------------------------------------------------------- text heuristics

_QUESTION = re.compile(r"[?？؟]+")
_CLAUSE_END = re.compile(r"[!?;\n\r…。！？；，、؟]+|[.,:](?=\s|$)")
_DIGIT = re.compile(r"\d")
_DATE = re.compile(
    r"\b(?:mon|tues|wednes|thurs|fri|satur|sun)days?\b|\b(?:january|february|march|april|june|july|august|"
    r"september|october|november|december|jan|feb|mar|apr|jun|jul|aug|sept?|oct|nov|dec)\b|"
    r"\b(?:today|tonight|yesterday|tomorrow|ago|weekend|last (?:night|week|month|year)|"
    r"this (?:morning|afternoon|evening|week|month))\b", re.IGNORECASE)
_NAME = re.compile(r"\s(?!I['’]|I\b)[A-Z][\w'’-]+")
_STATE = re.compile(
    r"\b(?:i am|i'm|i’m|i have|i've|i’ve|i had|i feel|i felt|i was|i got|i can't|i can’t|i cannot|it hurts|"
    r"my \w+ (?:is|was|are|were|has|have|had|hurts?|keeps?|won't|won’t|doesn't|doesn’t))\b|"
    r"\b(?:pain|painful|ache|aches|aching|fever|cough\w*|bleed\w*|dizz\w*|nause\w*|vomit\w*|rash|swollen|"
    r"swelling|broken|injur\w*|allerg\w*|itch\w*|numb\w*|tired|breath\w*|sick)\b", re.IGNORECASE)


def clauses(text: str) -> list[str]:
    """The clauses of a message (see the module docstring), stripped, empty ones left out."""
    return [c.strip() for c in _CLAUSE_END.split(text) if c.strip()]


def is_fact(clause: str) -> bool:
    """Whether a clause carries a fact (see the module docstring)."""
    return bool(_DIGIT.search(clause) or _DATE.search(clause) or _NAME.search(clause) or _STATE.search(clause))


def facts(text: str) -> int:
    """The facts of a message: its clauses that carry one."""
    return sum(1 for c in clauses(text) if is_fact(c))


def questions(text: str) -> int:
    """The questions of a message: its runs of question marks."""
    return len(_QUESTION.findall(text))


class LanguageDetector:
    """The language of a user message: ``py3langid`` (langid.py's model, bundled in the package).

    A message with fewer than ``MIN_LETTERS`` letters, or whose most likely
    language has a probability under ``MIN_PROBABILITY``, is ``und``
    (undetermined): "ok", "thanks" and order numbers say nothing of a language.
    """

    MIN_LETTERS = 10
    MIN_PROBABILITY = 0.5
    _CACHE = 50_000  # texts remembered: users repeat themselves ("thanks", "yes")

    def __init__(self) -> None:
        from importlib.metadata import version

        from py3langid.langid import MODEL_FILE, LanguageIdentifier

        self.name = f"py3langid {version('py3langid')}"
        self._identifier = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
        self._seen: dict[str, str] = {}

    def __call__(self, text: str) -> str:
        found = self._seen.get(text)
        if found is not None:
            return found
        if sum(1 for ch in text if ch.isalpha()) < self.MIN_LETTERS:
            found = "und"
        else:
            lang, probability = self._identifier.classify(text)
            found = str(lang) if probability >= self.MIN_PROBABILITY else "und"
        if len(self._seen) >= self._CACHE:
            self._seen.clear()
        self._seen[text] = found
        return found


# --------------------------------------------------------------- one side


@dataclass
class Side:
    """What one file holds, as it is read (integer arrays per message or per conversation)."""

    path: str
    conversations: int = 0
    values: dict[str, array[int]] = field(default_factory=lambda: {key: array("l") for key, _, _ in DISTRIBUTIONS})
    ended_by: Counter[str] = field(default_factory=Counter)
    sources: Counter[str] = field(default_factory=Counter)
    languages: Counter[str] = field(default_factory=Counter)
    last_from_user: int = 0
    with_question: int = 0

    def add(self, c: Conversation, language: LanguageDetector) -> None:
        """Take in one conversation."""
        v = self.values
        self.conversations += 1
        self.ended_by[c.ended_by] += 1
        self.sources[c.source] += 1
        users = [m.content for m in c.messages if m.role == "user"]
        v["user_messages_per_conversation"].append(len(users))
        if c.messages and c.messages[-1].role == "user":
            self.last_from_user += 1
        for text in users:
            v["user_message_chars"].append(len(text))
            v["user_message_words"].append(len(text.split()))
            q = questions(text)
            v["questions_per_user_message"].append(q)
            self.with_question += q > 0
            self.languages[language(text)] += 1
        for m in c.messages:
            if m.role == "assistant" and m.content:  # a turn that only calls tools says nothing to the user
                v["assistant_message_chars"].append(len(m.content))
                v["assistant_message_words"].append(len(m.content.split()))
        if users:
            v["facts_in_first_user_message"].append(facts(users[0]))
            v["facts_in_later_user_messages"].append(sum(facts(t) for t in users[1:]))


def records(path: str | Path) -> Iterator[Conversation]:
    """The conversation/v1 records of a file, a line at a time.

    Raises:
        ConversationError: the file cannot be read, or a line is not UTF-8, not JSON, not an object,
            of another ``schema``, or not a valid record (a missing ``messages``, a message without
            ``role`` or ``content``...): one line naming the file and the line.
    """
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed by the generator
    except OSError as exc:
        raise ConversationError(f"{path}: cannot read: {exc.strerror}") from None
    with fh:
        yield from parse_conversations(_text_lines(fh, str(path)), source=str(path))


def _text_lines(fh: IO[bytes], source: str) -> Iterator[str]:
    for n, raw in enumerate(fh, 1):
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ConversationError(f"{source}:{n}: not UTF-8 text") from None


def read_side(path: str | Path, language: LanguageDetector) -> Side:
    """Read one file into a ``Side`` (see ``records`` for the errors)."""
    side = Side(str(path))
    for c in records(path):
        side.add(c, language)
    return side


# --------------------------------------------------------------- figures


def _share(n: int, of: int) -> float | None:
    return n / of if of else None


def _nice_ceiling(x: float) -> float:
    """The smallest of 1, 2, 2.5, 5 times a power of ten that is at least ``x``."""
    if x <= 1:
        return 1.0
    power = 10 ** math.floor(math.log10(x))
    for step in (1, 2, 2.5, 5, 10):
        if step * power >= x:
            return float(step * power)
    return float(10 * power)


def _edges(arrays: Iterable[array[int]], counts: bool) -> list[float]:
    import numpy as np

    highs = [float(np.percentile(np.asarray(a), 99)) for a in arrays if len(a)]
    high = max(highs, default=0.0)
    if counts:
        top = int(min(max(math.ceil(high), 1), MAX_COUNT_BINS - 1))
        return [float(e) for e in range(top + 2)]
    top_edge = _nice_ceiling(high)
    return [top_edge * i / LENGTH_BINS for i in range(LENGTH_BINS + 1)]


def _distribution(values: array[int], edges: list[float]) -> dict[str, Any]:
    import numpy as np

    if not len(values):
        return {"count": 0, "mean": None, "min": None, "p10": None, "median": None, "p90": None, "max": None,
                "histogram": {"edges": edges, "counts": [0] * (len(edges) - 1)}}
    a = np.asarray(values, dtype=np.int64)
    p10, median, p90 = (round(float(x), 3) for x in np.percentile(a, [10, 50, 90]))
    bins = np.minimum(np.searchsorted(np.asarray(edges), a, side="right") - 1, len(edges) - 2)
    counts = np.bincount(bins, minlength=len(edges) - 1)
    return {"count": int(a.size), "mean": round(float(a.mean()), 3), "min": int(a.min()), "p10": p10,
            "median": median, "p90": p90, "max": int(a.max()),
            "histogram": {"edges": edges, "counts": [int(n) for n in counts]}}


def _mix(counter: Counter[str]) -> dict[str, dict[str, Any]]:
    total = sum(counter.values())
    return {k: {"count": n, "share": n / total} for k, n in sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))}


def _side_figures(side: Side, edges: dict[str, list[float]]) -> dict[str, Any]:
    v, n = side.values, side.conversations
    users = len(v["user_message_chars"])
    first, later = sum(v["facts_in_first_user_message"]), sum(v["facts_in_later_user_messages"])
    out: dict[str, Any] = {
        "file": side.path,
        "conversations": n,
        "sources": dict(sorted(side.sources.items())),
        "user_messages": users,
        "assistant_messages": len(v["assistant_message_chars"]),
    }
    for key, _, _ in DISTRIBUTIONS:
        out[key] = _distribution(v[key], edges[key])
    cut = {reason: _share(side.ended_by[reason], n) for reason in CUT_OFF}
    out.update({
        "user_messages_with_a_question": _share(side.with_question, users),
        "facts_first_share": _share(first, first + later),
        "cut_off_early": {**cut, "any": _share(sum(side.ended_by[r] for r in CUT_OFF), n)},
        "last_message_from_user": _share(side.last_from_user, n),
        "ended_by": _mix(side.ended_by),
        "languages": _mix(side.languages),
    })
    return out


def compare(sim: str | Path, real: str | Path) -> dict[str, Any]:
    """Read both files and measure them side by side.

    Returns:
        ``{"version", "language_detector", "fact_heuristic", "sim": {...}, "real": {...}}``, each side
        with the keys docs/scenarios.md lists (its ``--json`` contract).

    Raises:
        ConversationError: a file that cannot be read or a bad line, naming the file and the line.
    """
    language = LanguageDetector()
    sides = {"sim": read_side(sim, language), "real": read_side(real, language)}
    edges = {key: _edges([s.values[key] for s in sides.values()], counts) for key, _, counts in DISTRIBUTIONS}
    return {
        "version": REPORT_VERSION,
        "language_detector": language.name,
        "fact_heuristic": FACT_HEURISTIC,
        **{name: _side_figures(side, edges) for name, side in sides.items()},
    }


# --------------------------------------------------------------- the terminal table


def number_text(x: float | None) -> str:
    """A figure as people read it: ``3``, ``2.5``, ``1,234``; ``-`` for none."""
    if x is None:
        return "-"
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


def _pct(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.0%}" if x == 0 or x >= 0.1 or x == 1 else f"{x:.1%}"


def distribution_text(d: dict[str, Any]) -> str:
    """``median 3 (p10 1, p90 6)``, or ``-`` for no values."""
    if not d["count"]:
        return "-"
    n = number_text
    return f"median {n(d['median'])} (p10 {n(d['p10'])}, p90 {n(d['p90'])}; mean {n(d['mean'])})"


def mix_text(mix: dict[str, dict[str, Any]], top: int = 5) -> str:
    """``idle 80%, handover 15%, +2 more`` (the largest first)."""
    if not mix:
        return "-"
    items = list(mix.items())
    text = ", ".join(f"{k} {_pct(v['share'])}" for k, v in items[:top])
    return text + (f", +{len(items) - top} more" if len(items) > top else "")


def rows(result: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The comparison as (what, simulated, real) rows of text."""
    sim, real = result["sim"], result["real"]

    def both(fn: Any) -> tuple[str, str]:
        return fn(sim), fn(real)

    out = [("", "simulated", "real"), ("file", *both(lambda s: s["file"])),
           ("conversations", *both(lambda s: f"{s['conversations']:,}")),
           ("user / assistant messages", *both(lambda s: f"{s['user_messages']:,} / {s['assistant_messages']:,}"))]
    for key, label, _ in DISTRIBUTIONS:
        out.append((label, *both(lambda s, k=key: distribution_text(s[k]))))
    out += [
        ("user messages with a question", *both(lambda s: _pct(s["user_messages_with_a_question"]))),
        ("share of facts in the first message", *both(lambda s: _pct(s["facts_first_share"]))),
        ("cut off early (unanswered, turn_limit)", *both(lambda s: (
            f"{_pct(s['cut_off_early']['any'])} ({_pct(s['cut_off_early']['unanswered'])}, "
            f"{_pct(s['cut_off_early']['turn_limit'])})"))),
        ("last message from the user", *both(lambda s: _pct(s["last_message_from_user"]))),
        ("ended by", *both(lambda s: mix_text(s["ended_by"]))),
        ("languages of user messages", *both(lambda s: mix_text(s["languages"]))),
    ]
    return out


def table_text(result: dict[str, Any]) -> str:
    """The terminal table: both sides side by side, and what the figures rest on."""
    lines = rows(result)
    w0 = max(len(r[0]) for r in lines)
    w1 = max(len(r[1]) for r in lines)
    text = "\n".join(f"{a.ljust(w0)}  {b.ljust(w1)}  {c}".rstrip() for a, b, c in lines)
    return (text + f"\n\nlanguages: {result['language_detector']} (und: too short or unsure); "
            f"facts: {result['fact_heuristic']} heuristic (see docs/scenarios.md)")
