"""The review pages: the queue, an item, a blind labelling task, calibration, sign-in and notices.

Each ``render_*`` function turns the dicts of ``review.queue`` and
``review.calibration`` into the data its template (``templates/*.html``, Jinja2
with autoescaping) shows, and returns the complete HTML document. Code hands
templates data, never HTML: every value from storage is production text (user
messages, judge replies, reviewer notes) and is escaped by the template; text
of any direction is shown with ``dir="auto"``. Quoted evidence is highlighted
where ``judges.locate_evidence`` found it (the lookup behind
``evidence_verified``), and each quote links to its message, which is
highlighted in place when followed (``:target``).

The item page puts the decision where the eye already is: beside the
transcript on a wide screen, in a bar kept at the bottom of a narrow one. Its
form (``application/x-www-form-urlencoded``) posts to ``action`` the fields
``decision`` (``confirm`` | ``reject`` | ``unclear`` | ``skip``), ``reviewer``,
``note`` and, on an item decided already, ``force`` (``1``); saving goes on to
the next item of the queue. One same-origin script (``static/review.js``) adds the
keyboard (on the queue: ``j`` / ``k`` select a row, ``Enter`` opens it) and
local times; without it every page works through its links and forms.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple
from urllib.parse import quote, urlencode

from jinja2 import Environment, PackageLoader, select_autoescape
from pydantic import ValidationError

from judges import Located, Message, ToolCall, locate_evidence, tool_call_text

from ..alerts import TITLES
from ..evals.criterion_text import describe_criterion
from ..words import calibration_rate_text

SCRIPT = "/review/static/review.js"
"""The pages' one script (same origin: the CSP allows ``script-src 'self'`` and nothing inline)."""
FILTERS = ("state", "criterion", "severity", "service", "flagged", "since", "assignee")
STATES = ("pending", "confirmed", "rejected", "unclear", "all")
DECISIONS = (("confirm", "c", "Confirm: a real failure"), ("reject", "r", "Reject: the judge is wrong"),
             ("unclear", "u", "Criterion unclear"), ("skip", "s", "Skip for now"))
LABEL_CHOICES = (("pass", "p", "Pass"), ("fail", "f", "Fail"), ("not_applicable", "a", "Not applicable"))
_LABEL_LOOKS = {"fail": "confirm", "pass": "reject", "not_applicable": "unclear"}
"""A label's button looks like the decision it matches: fail like confirm (red), pass like reject (green)."""
# The keys review.js answers on each page, as its help lists them.
QUEUE_KEYS = (("j", "select the next item"), ("k", "select the previous item"), ("Enter", "open the selected item"),
              ("?", "this help"))
ITEM_KEYS = (("j", "next item"), ("k", "previous item"), ("c", "confirm"), ("r", "reject"),
             ("u", "criterion unclear"), ("s", "skip"), ("n", "write a note"), ("?", "this help"))
LABEL_KEYS = (("j", "next task"), ("p", "pass"), ("f", "fail"), ("a", "not applicable"), ("n", "write a note"),
              ("?", "this help"))

_RESULT_WORDS = {"fail": "fail", "pass": "pass", "not_applicable": "not applicable", "error": "error"}
_ROLE_WORDS = {"user": "User", "assistant": "Bot", "tool": "Tool"}


class Moment(NamedTuple):
    """A stored time as a page shows it: ``iso`` for ``<time datetime>`` (empty when the value is no time) and
    ``text``, readable UTC to the minute (the script shows it in the browser's zone)."""

    iso: str
    text: str


def moment(value: object) -> Moment:
    """A stored UTC time (ISO 8601, ``Z`` or an offset; naive is UTC) as a ``Moment``."""
    text = str(value or "")
    try:
        at = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return Moment("", text)
    at = (at if at.tzinfo else at.replace(tzinfo=dt.timezone.utc)).astimezone(dt.timezone.utc)
    return Moment(at.isoformat(timespec="seconds").replace("+00:00", "Z"), at.strftime("%Y-%m-%d %H:%M"))


def _shown(value: Any) -> Any:
    # Every {{ value }} passes here before it is escaped: None shows as nothing, NUL (not allowed in HTML text)
    # as U+FFFD.
    if value is None:
        return ""
    return value.replace("\x00", "\ufffd") if isinstance(value, str) else value


def _pct(value: Any) -> str:
    return "n/a" if value is None else f"{float(value):.0%}"


def _item_url(base: str, item_id: object) -> str:
    return f"{base}/{quote(str(item_id), safe='')}"


_ENV = Environment(loader=PackageLoader("collector.review", "templates"), autoescape=select_autoescape(["html"]),
                   trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, finalize=_shown)
_ENV.globals.update(script=SCRIPT, moment=moment, item_url=_item_url)
_ENV.filters.update(pct=_pct, said=lambda result: _RESULT_WORDS.get(result, result))


def _render(template: str, **data: Any) -> str:
    return _ENV.get_template(template).render(**data)


def render_message(title: str, text: str) -> str:
    """A page with one message (an error, a notice), linking back to the queue."""
    return _render("message.html", title=title, text=text)


def render_sign_in(*, error: str | None = None, next_url: str = "/review") -> str:
    """The sign-in page: a token field posting to ``/review/sign-in`` (``token``, ``next``)."""
    return _render("sign_in.html", error=error, next_url=next_url)


class AlertShown(NamedTuple):
    """An open alert as the queue page shows it, above the queue."""

    id: str
    title: str
    at: object
    facts: list[tuple[str, str]]
    """The body's own values, by key (the type's: conversation, severity...; a monitor's value...)."""
    evidence: list[str]
    link: str | None
    """The item's review page, when the body names one on http(s)."""
    action: str
    """Where its Acknowledge form posts."""


_ALERT_APART = ("id", "type", "at", "state", "evidence", "review_url", "reasoning")


def _alert_shown(a: Mapping[str, Any]) -> AlertShown:
    body = a.get("body") or {}
    title = TITLES.get(str(a.get("type")), str(a.get("type"))) + (f": {body['criterion']}" if body.get("criterion")
                                                                   else "")
    facts = [(str(k), v if isinstance(v, str) else json.dumps(v, ensure_ascii=False))
             for k, v in body.items() if k not in _ALERT_APART and k != "criterion"]
    if body.get("reasoning"):
        facts.append(("reasoning", str(body["reasoning"])))
    link = str(body.get("review_url") or "")
    evidence = [str(q) for q in body.get("evidence") or []] if isinstance(body.get("evidence"), list) else []
    return AlertShown(str(a.get("id")), title, a.get("at"), facts, evidence,
                      link if link.startswith(("http://", "https://")) else None,
                      _item_url("/review/alerts", a.get("id")) + "/ack")


def render_list(items: Sequence[Mapping[str, Any]], *, filters: Mapping[str, str] | None = None,
                criteria: Iterable[str] = (), services: Iterable[str] = (),
                progress: Mapping[str, Any] | None = None, message: str | None = None, base: str = "/review",
                alerts: Sequence[Mapping[str, Any]] = (), reviewer: str = "", signed_in: bool = False,
                token_needed: bool = False) -> str:
    """The review queue page: the open alerts, each with an Acknowledge button, then filters, progress, and one
    row per item in the queue's order (high severity first, then the oldest).

    Args:
        items: from ``queue.list_reviews``.
        filters: the filters in use, by name (``FILTERS``), as the query string gave them.
        criteria, services: offered in the filters (the ones in use always are).
        progress: from ``queue.progress``.
        message: a notice on top (the last item was decided, an alert acknowledged).
        base: the URL of this page; items live at ``{base}/{id}``.
        alerts: the open alerts (``alerts.store.list_alerts``); each form posts ``reviewer`` to
            ``/review/alerts/{id}/ack``.
        reviewer, signed_in, token_needed: who looks, as for ``render_item``.

    Returns:
        A complete HTML document; the filter form submits by GET to ``base``.
    """
    f = {k: str(v) for k, v in (filters or {}).items() if v}
    state = f.get("state", "pending")
    names = sorted(set(criteria) | ({f["criterion"]} if f.get("criterion") else set()))
    svcs = sorted(set(services) | ({f["service"]} if f.get("service") else set()))
    selects = [  # (name, label, options as (value, text), chosen)
        ("state", "State", [(s, s) for s in STATES], state),
        ("criterion", "Criterion", [("", "all criteria"), *((c, c) for c in names)], f.get("criterion", "")),
        ("severity", "Severity", [("", "any"), ("high", "high"), ("medium", "medium"), ("low", "low")],
         f.get("severity", "")),
        ("service", "Service", [("", "all services"), *((v, v) for v in svcs)], f.get("service", "")),
        ("flagged", "Quotes", [("", "any"), ("1", "flagged: no verified quote"), ("0", "not flagged")],
         f.get("flagged", "")),
    ]
    return _render("queue.html", items=items, state=state, selects=selects, filters=f, progress=progress,
                   message=message, base=base, query=urlencode(f), keys=QUEUE_KEYS,
                   alerts=[_alert_shown(a) for a in alerts], reviewer=reviewer, signed_in=signed_in,
                   token_needed=token_needed)


# --- evidence highlighting ----------------------------------------------------------------------------

Marks = dict[tuple[int, int], list[tuple[int, int]]]
"""Ranges to highlight, by (message index, part): part ``-1`` is the content, ``k`` the k-th tool call's text."""


def _located(messages: Sequence[Mapping[str, Any]], evidence: Sequence[str]) -> list[Located]:
    try:
        msgs = [Message.model_validate(m) for m in messages]
    except ValidationError:  # a transcript the judges' model refuses highlights nothing
        return [Located(q, False, []) for q in evidence]
    return locate_evidence(evidence, msgs)


def _marks(located: Sequence[Located]) -> Marks:
    marks: Marks = {}
    for r in (r for q in located for r in q.ranges):
        marks.setdefault((r.message, r.part), []).append((r.start, r.end))
    return marks


def locate_quotes(messages: Sequence[Mapping[str, Any]], evidence: Sequence[str]) -> tuple[list[bool], Marks]:
    """Which quotes are in the transcript and where, as ``judges.locate_evidence`` finds them.

    The same lookup gives a verdict its ``evidence_verified``, so what is
    highlighted is what the evidence check accepted.
    """
    located = _located(messages, evidence)
    return [q.found for q in located], _marks(located)


Pieces = list[tuple[str, bool]]
"""A text cut at its highlighted ranges, in order: (piece, highlighted)."""


def pieces(text: str, ranges: Iterable[tuple[int, int]]) -> Pieces:
    """``text`` cut at each range (overlapping ones merged)."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        elif start < end:
            merged.append((start, end))
    out: Pieces = []
    at = 0
    for start, end in merged:
        out += [(text[at:start], False), (text[start:end], True)]
        at = end
    out.append((text[at:], False))
    return [p for p in out if p[0]]


def mark_ranges(text: str, ranges: Iterable[tuple[int, int]], *, before: str, after: str,
                escape: Callable[[str], str] = lambda t: t) -> str:
    """Wrap each range of ``text`` (overlapping ones merged) in ``before`` ... ``after`` (the terminal's marks).

    ``escape`` is applied to the text, never to the marks.
    """
    return "".join(before + escape(t) + after if marked else escape(t) for t, marked in pieces(text, ranges))


def highlight(text: str, ranges: Iterable[tuple[int, int]]) -> str:
    """``text`` as the pages show it: escaped, each range in ``<mark>`` (the templates' ``marked`` macro)."""
    return str(_ENV.get_template("macros.html").module.marked(pieces(text, ranges)))  # type: ignore[attr-defined]


# --- item page ------------------------------------------------------------------------------------------


class Shown(NamedTuple):
    """A message of the transcript as a page shows it."""

    n: int
    """Its place, from 1: the element's id is ``m{n}``, which quotes link to."""
    role: str
    label: str
    at: object
    parts: list[tuple[Pieces, bool]]
    """The content, then each tool call's text (muted), with their highlights."""
    truncated: bool


class Quote(NamedTuple):
    text: str
    href: str | None
    """``#m{n}``, the first message it was found in; None when it was not found."""


def _shown_messages(messages: Sequence[Mapping[str, Any]], marks: Marks) -> list[Shown]:
    shown = []
    for i, m in enumerate(messages):
        role = str(m.get("role") or "")
        label = _ROLE_WORDS.get(role, role) + (f" {m['name']}" if role == "tool" and m.get("name") else "")
        parts: list[tuple[Pieces, bool]] = []
        content = str(m.get("content") or "")
        if content:
            parts.append((pieces(content, marks.get((i, -1), ())), False))
        for k, call in enumerate(m.get("tool_calls") or []):
            try:  # as the judge read it, so a quote of it is highlighted where it matched
                text = tool_call_text(ToolCall.model_validate(call))
            except ValidationError:
                text = json.dumps(call, ensure_ascii=False, sort_keys=True)
            parts.append((pieces(text, marks.get((i, k), ())), True))
        shown.append(Shown(i + 1, role, label, m.get("at"), parts, bool(m.get("truncated"))))
    return shown


def _quotes(located: Sequence[Located]) -> list[Quote]:
    firsts = (min((r.message for r in q.ranges), default=None) if q.found else None for q in located)
    return [Quote(q.quote, None if first is None else f"#m{first + 1}") for q, first in zip(located, firsts)]


def _waiting(detail: Mapping[str, Any]) -> str:
    """"2 of 3 reviewers decided" on a pending item several people decide (their decisions stay hidden)."""
    n = int(detail.get("reviewers_per_item") or 1)
    if n <= 1 or (detail.get("item") or {}).get("state") != "pending":
        return ""
    return (f"{detail.get('decisions', 0)} of {n} reviewers decided this item; you see the others' decisions "
            "once it is decided.")


def render_item(detail: Mapping[str, Any], *, base: str = "/review", action: str | None = None,
                reviewer: str = "", message: str | None = None, error: str | None = None,
                next_url: str | None = None, prev_url: str | None = None, position: str = "",
                signed_in: bool = False, token_needed: bool = False) -> str:
    """The page of one review item: the decision beside the transcript, with the criterion, the judge's
    reasoning and its quotes (each linking to its message) above the form.

    Args:
        detail: from ``queue.review_item``.
        base: the queue page's URL (the way back, the default ``action``).
        action: where the decision form posts; default ``{base}/{id}/decision``.
        reviewer: prefills the reviewer field (the name remembered in a cookie).
        message: a notice to show on top (``"Saved #12: confirmed"``).
        error: an error to show on top (a refused decision).
        next_url, prev_url: the neighbouring items in the queue (``j`` / ``k``).
        position: where this item is in the queue (``"3 of 12 pending"``).
        signed_in: ``reviewer`` is the name of the reviewer token in use (not to be retyped).
        token_needed: reviewers have tokens and the one in use names nobody: no form, a way to sign in.

    Returns:
        A complete HTML document.
    """
    item = detail.get("item") or {}
    verdict = detail.get("verdict") or {}
    crit = detail.get("criterion") or {}
    conv = detail.get("conversation")
    messages = list((conv or {}).get("messages") or [])
    located = _located(messages, [str(q) for q in verdict.get("evidence") or []])
    warnings = []
    if item.get("live"):
        warnings.append("Judged live, while the conversation was still going on: on the transcript up to that "
                        "answer. The transcript here is the current one, with what came after.")
    elif verdict.get("superseded"):
        warnings.append("The conversation changed after this verdict (late data or a new turn); "
                        "the transcript is the current one, which may differ from what the judge read.")
    if verdict.get("flagged") or not verdict.get("evidence_verified", True):
        warnings.append("At least one quote the judge gave was not found in the transcript: "
                        "the judge may have misquoted or invented it. Check the conversation yourself.")
    return _render(
        "item.html", item=item, verdict=verdict, judge=verdict.get("judge") or {}, crit=crit, conv=conv,
        warnings=warnings, criterion_text=describe_criterion(crit["text"]) if crit.get("text") else None,
        quotes=_quotes(located), messages=_shown_messages(messages, _marks(located)),
        history=list(detail.get("history") or []), waiting=_waiting(detail),
        base=base, action=action or _item_url(base, item.get("id")) + "/decision", reviewer=reviewer,
        message=message, error=error, next_url=next_url, prev_url=prev_url, position=position,
        signed_in=signed_in, token_needed=token_needed, decisions=DECISIONS, keys=ITEM_KEYS)


# --- blind labelling and calibration ------------------------------------------------------------------


def render_label_task(detail: Mapping[str, Any], *, reviewer: str = "", message: str | None = None,
                      error: str | None = None, next_url: str | None = None, position: str = "",
                      signed_in: bool = False, token_needed: bool = False) -> str:
    """A blind labelling task (``calibration.item``): the criterion and the conversation, never the verdict,
    and a form posting ``label`` (pass | fail | not_applicable), ``reviewer`` and ``note`` to
    ``/review/label/{id}``. ``signed_in`` and ``token_needed`` as for ``render_item``."""
    item = detail.get("item") or {}
    crit = detail.get("criterion") or {}
    conv = detail.get("conversation")
    return _render(
        "label.html", item=item, crit=crit, conv=conv, mine=detail.get("your_label") or {},
        criterion_text=describe_criterion(crit["text"]) if crit.get("text") else None,
        messages=_shown_messages(list((conv or {}).get("messages") or []), {}),
        action=_item_url("/review/label", item.get("id")), reviewer=reviewer, message=message, error=error,
        next_url=next_url, position=position, signed_in=signed_in, token_needed=token_needed,
        choices=[(v, k, t, _LABEL_LOOKS[v]) for v, k, t in LABEL_CHOICES], keys=LABEL_KEYS)


def render_calibration(report: Mapping[str, Any], *, unlabelled: int = 0,
                       realism: Sequence[Mapping[str, Any]] = ()) -> str:
    """The calibration page: per criterion, the judge against people on the blind labels; then, per simulated
    user, the share of its conversations people found realistic (``realism.realism_by_user``)."""
    return _render("calibration.html", criteria=list(report.get("criteria") or []), unlabelled=unlabelled,
                   realism=realism, results=("pass", "fail", "not_applicable"), rate_text=calibration_rate_text)
