"""The review queue as server-side HTML: the queue page, an item page, the sign-in page.

Pure functions from the dicts of ``review.queue`` (``list_reviews``,
``review_item``) to complete HTML documents; the server serves them. Every
value from storage is production text (user messages, judge replies, reviewer
notes) and is escaped; text of any direction is shown with ``dir="auto"``.
Quoted evidence is highlighted where ``judges.locate_evidence`` found it (the
lookup behind ``evidence_verified``), and each quote links to its message,
which is highlighted in place when followed (``:target``).

The item page puts the decision where the eye already is: beside the
transcript on a wide screen, in a bar kept at the bottom of a narrow one. Its
form (``application/x-www-form-urlencoded``) posts to ``action`` the fields
``decision`` (``confirm`` | ``reject`` | ``unclear`` | ``skip``), ``reviewer``,
``note`` and, on an item decided already, ``force`` (``1``); saving goes on to
the next item of the queue. One same-origin script (``static/review.js``) adds the
keyboard and local times; without it every page works through its links and
forms.
"""

from __future__ import annotations

import datetime as dt
import html
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import quote, urlencode

from pydantic import ValidationError

from judges import Located, Message, ToolCall, locate_evidence, tool_call_text

from ..evals.criterion_text import describe_criterion
from ..words import calibration_rate_text

_STYLE = """
:root { color-scheme: light; --ink: #1a1a1a; --muted: #4a4a4a; --line: #c8c8c8; --accent: #0b5cad;
        --bad: #a4161a; --good: #1b6e20; --warn-bg: #fff4ce; }
* { box-sizing: border-box; }
body { margin: 0; font: 1rem/1.5 system-ui, -apple-system, "Segoe UI", Roboto, "Noto Sans", "Noto Sans Arabic",
       sans-serif; color: var(--ink); background: #fff; }
main { max-width: 56rem; margin: 0 auto; padding: 1rem; }
h1 { font-size: 1.4rem; margin: 0 0 .75rem; } h2 { font-size: 1.15rem; margin: 1.5rem 0 .5rem; }
a { color: var(--accent); } a:focus, button:focus, input:focus, select:focus, textarea:focus {
  outline: 3px solid #f2a900; outline-offset: 2px; }
.muted { color: var(--muted); }
.text { white-space: pre-wrap; overflow-wrap: anywhere; unicode-bidi: plaintext; }
.box { border: 1px solid var(--line); border-radius: .4rem; padding: .75rem; margin: .5rem 0; }
.warn { background: var(--warn-bg); border-color: #b88a00; }
.badge { display: inline-block; padding: 0 .45rem; border-radius: .3rem; border: 1px solid currentColor;
         font-weight: 600; font-size: .9rem; }
.fail, .rejected { color: var(--bad); } .pass, .confirmed { color: var(--good); } .pending { color: var(--muted); }
ol.transcript { list-style: none; padding: 0; margin: 0; }
.msg { border-left: .35rem solid var(--line); padding: .4rem .75rem; margin: .5rem 0; background: #f7f7f7; }
.msg.user { border-color: #6a4fb3; } .msg.assistant { border-color: var(--accent); } .msg.tool { border-color: #777; }
.role { font-weight: 700; font-size: .85rem; text-transform: uppercase; letter-spacing: .03em; }
mark { background: #ffd84d; color: #000; padding: 0 .1rem; border-bottom: 2px solid #000; }
table { border-collapse: collapse; width: 100%; } th, td { text-align: start; padding: .45rem; vertical-align: top;
  border-bottom: 1px solid var(--line); }
form.filters { display: flex; flex-wrap: wrap; gap: .75rem; align-items: end; margin-bottom: 1rem; }
label { display: block; font-weight: 600; margin: .5rem 0 .2rem; }
input[type=text], select, textarea { font: inherit; padding: .45rem; border: 1px solid #767676; border-radius: .3rem;
  width: 100%; max-width: 30rem; color: var(--ink); background: #fff; }
textarea { min-height: 5rem; }
.buttons { display: flex; flex-wrap: wrap; gap: .75rem; margin-top: .75rem; }
button { font: inherit; font-weight: 600; padding: .6rem 1rem; border-radius: .3rem; border: 2px solid; cursor: pointer;
         min-height: 2.75rem; }
button.confirm { background: var(--bad); border-color: var(--bad); color: #fff; }
button.reject { background: #fff; border-color: var(--good); color: var(--good); }
button.plain { background: var(--accent); border-color: var(--accent); color: #fff; }
button.unclear { background: #fff; border-color: #8a6d00; color: #6b5500; }
button.skip { background: #fff; border-color: #767676; color: var(--muted); }
kbd { font: .8rem ui-monospace, monospace; border: 1px solid #999; border-bottom-width: 2px; border-radius: .2rem;
      padding: 0 .25rem; color: var(--muted); }
button kbd { color: inherit; border-color: currentColor; }
main.item { max-width: 90rem; }
.layout { display: grid; grid-template-columns: minmax(22rem, 34rem) minmax(0, 1fr); gap: 1.25rem; align-items: start; }
.panel { position: sticky; top: 0; max-height: 100vh; overflow-y: auto; padding-bottom: 1rem; }
.panel h1 { font-size: 1.2rem; }
.quote { display: block; margin: .3rem 0; }
.actions { display: grid; grid-template-columns: 1fr 1fr; gap: .5rem; margin-top: .75rem; }
.actions button { width: 100%; }
.msg { border-radius: .5rem; max-width: 46rem; }
.msg.user { margin-inline-end: 12%; background: #f3f0fa; } .msg.assistant { margin-inline-start: 12%; background: #eef4fb; }
.msg:target { outline: 3px solid #f2a900; outline-offset: 2px; background: #fff3c4; }
.nav { display: flex; flex-wrap: wrap; gap: 1rem; align-items: baseline; margin-bottom: .5rem; }
.progress { color: var(--muted); }
@media (max-width: 64rem) {
  .layout { grid-template-columns: 1fr; }
  .panel { position: static; max-height: none; overflow: visible; }
  .actions { position: sticky; bottom: 0; background: #fff; padding: .5rem 0; border-top: 1px solid var(--line);
             z-index: 1; }
}
@media (max-width: 40rem) { .wide { display: none; } main { padding: .6rem; } .msg.user, .msg.assistant {
  margin-inline: 0; } }
"""

_RESULT_WORDS = {"fail": "fail", "pass": "pass", "not_applicable": "not applicable", "error": "error"}
_ROLE_WORDS = {"user": "User", "assistant": "Bot", "tool": "Tool"}


def _e(value: object) -> str:
    # NUL is not allowed in HTML text; everything else is escaped, quotes included (attributes).
    return html.escape("" if value is None else str(value).replace("\x00", "\ufffd"), quote=True)


SCRIPT = "/review/static/review.js"
"""The pages' one script (same origin: the CSP allows ``script-src 'self'`` and nothing inline)."""


def _page(title: str, body: str, *, main_class: str = "") -> str:
    return ("<!doctype html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
            # As the header says: under no-referrer the form's own posts would carry "Origin: null".
            "<meta name=\"referrer\" content=\"same-origin\">\n"
            f"<title>{_e(title)}</title>\n<style>{_STYLE}</style>\n"
            f'<script src="{SCRIPT}" defer></script>\n</head>\n'
            f"<body>\n<main{f' class={chr(34)}{main_class}{chr(34)}' if main_class else ''}>\n{body}\n</main>\n"
            "</body>\n</html>\n")


def render_message(title: str, text: str) -> str:
    """A page with one message (an error, a notice), linking back to the queue."""
    return _page(title, f'<h1>{_e(title)}</h1><p class="box" role="alert" dir="auto">{_e(text)}</p>'
                        '<p><a href="/review">Review queue</a></p>')


def render_sign_in(*, error: str | None = None, next_url: str = "/review") -> str:
    """The sign-in page: a token field posting to ``/review/sign-in`` (``token``, ``next``)."""
    alert = f'<p class="box warn" role="alert">{_e(error)}</p>' if error else ""
    return _page("Sign in", f'<h1>Sign in to the review page</h1>{alert}'
                 '<form method="post" action="/review/sign-in" class="box">'
                 '<label for="token">API token</label>'
                 '<input type="password" id="token" name="token" required autocomplete="current-password" '
                 'autofocus>'
                 f'<input type="hidden" name="next" value="{_e(next_url)}">'
                 '<p class="muted">The token is <code>api.auth.bearer_token</code> of the daemon (or a reviewer '
                 'token of <code>review.reviewers</code>); ask whoever runs it.</p>'
                 '<div class="buttons"><button class="plain" type="submit">Sign in</button></div></form>')


def _badge(kind: str, text: str | None = None) -> str:
    return f'<span class="badge {_e(kind)}">{_e(text or kind)}</span>'


def _item_url(base: str, item_id: object) -> str:
    return f"{base}/{quote(str(item_id), safe='')}"


def when(value: object) -> str:
    """A stored UTC time as ``<time>``: readable UTC (minutes, no microseconds); the script shows it local."""
    text = str(value or "")
    if not text:
        return ""
    try:
        at = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return _e(text)
    if at.tzinfo is None:
        at = at.replace(tzinfo=dt.timezone.utc)
    at = at.astimezone(dt.timezone.utc)
    return (f'<time datetime="{_e(at.isoformat(timespec="seconds").replace("+00:00", "Z"))}">'
            f'{_e(at.strftime("%Y-%m-%d %H:%M"))} UTC</time>')


FILTERS = ("state", "criterion", "severity", "service", "flagged", "since", "assignee")
STATES = ("pending", "confirmed", "rejected", "unclear", "all")


def _select(name: str, label: str, options: Iterable[tuple[str, str]], chosen: str) -> str:
    opts = "".join(f'<option value="{_e(v)}"{" selected" if v == chosen else ""}>{_e(t)}</option>' for v, t in options)
    return f'<div><label for="{name}">{label}</label><select id="{name}" name="{name}">{opts}</select></div>'


def render_list(items: Sequence[Mapping[str, Any]], *, filters: Mapping[str, str] | None = None,
                criteria: Iterable[str] = (), services: Iterable[str] = (),
                progress: Mapping[str, Any] | None = None, message: str | None = None, base: str = "/review") -> str:
    """The review queue page: filters, progress, and one row per item in the queue's order (high severity
    first, then the oldest).

    Args:
        items: from ``queue.list_reviews``.
        filters: the filters in use, by name (``FILTERS``), as the query string gave them.
        criteria, services: offered in the filters (the ones in use always are).
        progress: from ``queue.progress``.
        message: a notice on top (the last item was decided).
        base: the URL of this page; items live at ``{base}/{id}``.

    Returns:
        A complete HTML document; the filter form submits by GET to ``base``.
    """
    f = {k: str(v) for k, v in (filters or {}).items() if v}
    state = f.get("state", "pending")
    names = sorted(set(criteria) | ({f["criterion"]} if f.get("criterion") else set()))
    svcs = sorted(set(services) | ({f["service"]} if f.get("service") else set()))
    form = ('<form class="filters" method="get" action="' + _e(base) + '">'
            + _select("state", "State", ((s, s) for s in STATES), state)
            + _select("criterion", "Criterion", [("", "all criteria"), *((c, c) for c in names)], f.get("criterion", ""))
            + _select("severity", "Severity", [("", "any"), ("high", "high"), ("medium", "medium"), ("low", "low")],
                      f.get("severity", ""))
            + _select("service", "Service", [("", "all services"), *((v, v) for v in svcs)], f.get("service", ""))
            + _select("flagged", "Quotes", [("", "any"), ("1", "flagged: no verified quote"), ("0", "not flagged")],
                      f.get("flagged", ""))
            + f'<div><label for="since">Since</label><input type="text" id="since" name="since" placeholder="7d" '
              f'value="{_e(f.get("since", ""))}" size="8"></div>'
            + f'<div><label for="assignee">Claimed by</label><input type="text" id="assignee" name="assignee" '
              f'dir="auto" value="{_e(f.get("assignee", ""))}" size="12"></div>'
            + '<div><button class="plain" type="submit">Show</button></div></form>')
    top = f'<p class="box" role="status" dir="auto">{_e(message)}</p>' if message else ""
    if progress:
        people = ", ".join(f'<span dir="auto">{_e(name)}</span> {_e(n)}' for name, n in
                           (progress.get("by_reviewer") or {}).items())
        top += (f'<p class="progress">{_e(progress.get("pending"))} pending &middot; {_e(progress.get("done_today"))} '
                f'decided today (UTC)' + (f": {people}" if people else "") + "</p>")
    if not items:
        table = f'<p class="box">No {"" if state == "all" else _e(state) + " "}review items.</p>'
    else:
        rows = []
        for it in items:
            result = str(it.get("result") or "")
            flags = []
            if it.get("flagged"):
                flags.append(_badge("fail", "no verified quote"))
            if it.get("superseded"):
                flags.append(_badge("pending", "transcript changed since"))
            held = (f' <span class="muted">claimed by <span dir="auto">{_e(it["claimed_by"])}</span></span>'
                    if it.get("claimed_by") else "")
            rows.append(
                "<tr>"
                f'<td><a href="{_e(_item_url(base, it.get("id")))}">#{_e(it.get("id"))}</a></td>'
                f'<td>{_e(it.get("severity") or "")}</td>'
                f'<td><span dir="auto">{_e(it.get("criterion_id"))}</span><br>'
                f'<span class="muted text" dir="auto">{_e(it.get("conversation_id"))}</span></td>'
                f'<td>{_badge(result, _RESULT_WORDS.get(result, result))} {" ".join(flags)}</td>'
                f'<td>{_badge(str(it.get("state")))}'
                + (f' <span class="muted" dir="auto">{_e(it.get("reviewer"))}</span>' if it.get("reviewer") else "")
                + held + "</td>"
                f'<td class="wide text" dir="auto">{_e(it.get("service") or "")}</td>'
                f'<td class="wide muted">{when(it.get("created_at"))}</td>'
                "</tr>")
        table = ('<table><caption class="muted">' + _e(f"{len(items)} item" + ("s" if len(items) != 1 else ""))
                 + '</caption><thead><tr><th scope="col">Item</th><th scope="col">Severity</th>'
                 '<th scope="col">Criterion, conversation</th><th scope="col">Judge said</th><th scope="col">Review</th>'
                 '<th scope="col" class="wide">Service</th><th scope="col" class="wide">Queued</th></tr></thead>'
                 f'<tbody>{"".join(rows)}</tbody></table>')
    query = urlencode(f)
    return _page("Review queue", f'<h1>Review queue</h1>{top}{form}{table}'
                 f'<p class="muted"><a href="{_e(base)}?{_e(query)}">Refresh</a> &middot; '
                 '<a href="/calibration">Calibration</a></p>')


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


def mark_ranges(text: str, ranges: Iterable[tuple[int, int]], *, before: str, after: str,
                escape: Callable[[str], str] = lambda t: t) -> str:
    """Wrap each range of ``text`` (overlapping ones merged) in ``before`` ... ``after``.

    ``escape`` is applied to the text, never to the marks.
    """
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        elif start < end:
            merged.append((start, end))
    out, at = [], 0
    for start, end in merged:
        out += [escape(text[at:start]), before, escape(text[start:end]), after]
        at = end
    out.append(escape(text[at:]))
    return "".join(out)


def highlight(text: str, ranges: Iterable[tuple[int, int]]) -> str:
    """Escape ``text`` for HTML and wrap each range in ``<mark>``."""
    return mark_ranges(text, ranges, before="<mark>", after="</mark>", escape=_e)


# --- item page ------------------------------------------------------------------------------------------


def _render_message(m: Mapping[str, Any], marks: Marks, n: int) -> str:
    role = str(m.get("role") or "")
    label = _ROLE_WORDS.get(role, role)
    if role == "tool" and m.get("name"):
        label += f" {m['name']}"
    parts = []
    content = str(m.get("content") or "")
    if content:
        parts.append(f'<div class="text" dir="auto">{highlight(content, marks.get((n - 1, -1), ()))}</div>')
    for k, call in enumerate(m.get("tool_calls") or []):
        try:  # as the judge read it, so a quote of it is highlighted where it matched
            text = tool_call_text(ToolCall.model_validate(call))
        except ValidationError:
            text = _json(call)
        parts.append(f'<div class="text muted" dir="auto">{highlight(text, marks.get((n - 1, k), ()))}</div>')
    if m.get("truncated"):
        parts.append('<div class="muted">(the instrumentation cut this message)</div>')
    if not parts:
        parts.append('<div class="muted">(empty)</div>')
    return (f'<li class="msg {_e(role)}" id="m{n}" tabindex="-1"><div class="role">{_e(label)}'
            + (f' <span class="muted">{when(m.get("at"))}</span>' if m.get("at") else "")
            + f'</div>{"".join(parts)}</li>')


def _json(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


DECISIONS = (("confirm", "c", "Confirm: a real failure"), ("reject", "r", "Reject: the judge is wrong"),
             ("unclear", "u", "Criterion unclear"), ("skip", "s", "Skip for now"))


def _token_needed(what: str) -> str:
    """In place of a form, when reviewers have tokens and the one signed in with (the API token) names nobody."""
    return (f'<p class="box warn" id="decide">Signed in with the API token, which names no reviewer: {_e(what)} '
            'carry the reviewer of the token they are made with. <a href="/review/sign-in">Sign in with your own '
            'reviewer token</a>.</p>')


def _name_field(reviewer: str, signed_in: bool, what: str) -> str:
    """The reviewer's name: shown, not editable, when their own token names them."""
    if signed_in:
        return ('<label for="reviewer">Your name</label><input type="text" id="reviewer" name="reviewer" readonly '
                f'dir="auto" value="{_e(reviewer)}"><p class="muted">Signed in with your own token: {_e(what)} '
                'carry this name.</p>')
    return ('<label for="reviewer">Your name</label><input type="text" id="reviewer" name="reviewer" required '
            f'autocomplete="name" dir="auto" value="{_e(reviewer)}">')


def _decision_form(item: Mapping[str, Any], action: str, reviewer: str, signed_in: bool = False,
                   waiting: str = "", token_needed: bool = False) -> str:
    state = str(item.get("state"))
    decided = state != "pending"
    notice = ""
    if decided:
        notice = (f'<p class="box warn">Already <strong>{_e(state)}</strong>'
                  + (f' by <span dir="auto">{_e(item.get("reviewer"))}</span>' if item.get("reviewer") else "")
                  + (f' at {when(item.get("decided_at"))}' if item.get("decided_at") else "")
                  + ". Deciding again replaces that decision; the earlier one stays in the history.</p>")
    if item.get("claimed_by"):
        notice += (f'<p class="box">Claimed by <span dir="auto">{_e(item["claimed_by"])}</span> until '
                   f'{when(item.get("claimed_until"))}: only they can decide it until then.</p>')
    notice += f'<p class="box">{_e(waiting)}</p>' if waiting else ""
    if token_needed:
        return notice + _token_needed("decisions")
    force = ('<input type="hidden" name="force" value="1">' if decided else "")
    buttons = "".join(f'<button class="{value}" type="submit" name="decision" value="{value}" '
                      f'accesskey="{key}">{_e(text)} <kbd>{key}</kbd></button>' for value, key, text in DECISIONS)
    return (f'<form method="post" action="{_e(action)}" id="decide">{notice}'
            '<label for="note">Note <span class="muted">(optional: why) <kbd>n</kbd></span></label>'
            '<textarea id="note" name="note" dir="auto"></textarea>'
            f'{_name_field(reviewer, signed_in, "decisions")}{force}'
            f'<div class="actions">{buttons}</div></form>')


def _help() -> str:
    keys = (("j", "next item"), ("k", "previous item"), ("c", "confirm"), ("r", "reject"),
            ("u", "criterion unclear"), ("s", "skip"), ("n", "write a note"), ("?", "this help"))
    rows = "".join(f"<li><kbd>{_e(k)}</kbd> {_e(what)}</li>" for k, what in keys)
    return f'<details class="box" id="help"><summary>Keyboard <kbd>?</kbd></summary><ul>{rows}</ul></details>'


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
    evidence = [str(q) for q in verdict.get("evidence") or []]
    item_id = item.get("id")
    action = action or _item_url(base, item_id) + "/decision"
    result = str(verdict.get("result") or "")
    judge = verdict.get("judge") or {}

    top = ""
    if error:
        top += f'<p class="box warn" role="alert"><strong>Not saved:</strong> <span dir="auto">{_e(error)}</span></p>'
    if message:
        top += f'<p class="box" role="status" dir="auto">{_e(message)}</p>'
    nav = (f'<nav class="nav"><a href="{_e(base)}">&larr; Review queue</a>'
           + (f'<span class="progress">{_e(position)}</span>' if position else "")
           + (f'<a href="{_e(prev_url)}" rel="prev" id="prev">Previous <kbd>k</kbd></a>' if prev_url else "")
           + (f'<a href="{_e(next_url)}" rel="next" id="next">Next <kbd>j</kbd></a>' if next_url else "")
           + "</nav>")
    head = (f'<h1>#{_e(item_id)} <span dir="auto">{_e(crit.get("id"))}</span> '
            f'<span class="muted">v{_e(crit.get("version"))}</span></h1>'
            f'<p>The judge said {_badge(result, _RESULT_WORDS.get(result, result))} '
            f'&middot; review {_badge(str(item.get("state")))}'
            + (f' &middot; severity <strong>{_e(crit.get("severity"))}</strong>' if crit.get("severity") else "")
            + (f' &middot; group <span dir="auto">{_e(crit.get("group"))}</span>' if crit.get("group") else "")
            + "</p>")
    warnings = []
    if verdict.get("superseded"):
        warnings.append("The conversation changed after this verdict (late data or a new turn); "
                        "the transcript is the current one, which may differ from what the judge read.")
    if verdict.get("flagged") or not verdict.get("evidence_verified", True):
        warnings.append("At least one quote the judge gave was not found in the transcript: "
                        "the judge may have misquoted or invented it. Check the conversation yourself.")
    warn_html = "".join(f'<p class="box warn">{_e(w)}</p>' for w in warnings)

    crit_text = crit.get("text")
    criterion_html = (f'<div class="box text" dir="auto">{_e(describe_criterion(crit_text))}</div>' if crit_text else
                      '<p class="muted">The criterion text was not recorded for this version.</p>')
    reasoning = str(verdict.get("reasoning") or "")
    reasoning_html = ('<h2>Judge\'s reasoning</h2>'
                      + (f'<div class="text" dir="auto">{_e(reasoning)}</div>' if reasoning else
                         '<p class="muted">No reasoning given.</p>')
                      + f'<p class="muted">Judge: {_e(judge.get("provider"))} / {_e(judge.get("model"))}'
                      + (f' &middot; judged {when(verdict.get("judged_at"))}' if verdict.get("judged_at") else "")
                      + "</p>")
    if verdict.get("error_reason"):
        reasoning_html += f'<p class="box warn text" dir="auto">Error: {_e(verdict.get("error_reason"))}</p>'

    messages = list((conv or {}).get("messages") or [])
    located = _located(messages, evidence)
    marks = _marks(located)
    if evidence:
        quotes = []
        for q in located:
            first = min((r.message for r in q.ranges), default=None)
            if q.found and first is not None:
                quotes.append(f'<a class="quote text" href="#m{first + 1}" dir="auto">&ldquo;{_e(q.quote)}&rdquo;</a>')
            else:
                quotes.append(f'<span class="quote text" dir="auto">&ldquo;{_e(q.quote)}&rdquo; '
                              '<span class="muted">(not found in the transcript)</span></span>')
        evidence_html = "<h2>Quoted evidence</h2>" + "".join(quotes)
    else:
        evidence_html = '<h2>Quoted evidence</h2><p class="muted">The judge quoted nothing.</p>'

    if conv is None:
        transcript_html = '<h2>Transcript</h2><p class="box warn">The conversation is no longer stored.</p>'
    else:
        system = conv.get("system")
        transcript_html = (
            f'<h2>Transcript</h2><p class="muted">Conversation <span dir="auto">{_e(conv.get("id"))}</span>'
            + (f' &middot; {_e(conv.get("service"))}' if conv.get("service") else "")
            + (" &middot; still open" if conv.get("ended_by") == "open" else
               f' &middot; ended by {_e(conv.get("ended_by"))}' if conv.get("ended_by") else "") + "</p>"
            + (f'<details class="box"><summary>System instructions</summary>'
               f'<div class="text" dir="auto">{_e(system)}</div></details>' if system else "")
            + '<ol class="transcript">'
            + "".join(_render_message(m, marks, n) for n, m in enumerate(messages, 1)) + "</ol>")

    history = list(detail.get("history") or [])
    history_html = ""
    if history:
        rows = "".join(
            f'<li>{when(h.get("decided_at"))}: <span dir="auto">{_e(h.get("reviewer"))}</span> '
            f'{_badge(str(h.get("state")))} (was {_e(h.get("previous_state"))})'
            + (f' &mdash; <span class="text" dir="auto">{_e(h.get("note"))}</span>' if h.get("note") else "")
            + "</li>" for h in history)
        history_html = f"<h2>History</h2><ol>{rows}</ol>"

    panel = (f'<aside class="panel">{head}{warn_html}{criterion_html}{evidence_html}'
             f'{_decision_form(item, action, reviewer, signed_in, _waiting(detail), token_needed)}{reasoning_html}'
             f'{_help()}</aside>')
    body = (top + nav + f'<div class="layout">{panel}<section class="chat">{transcript_html}{history_html}'
            '</section></div>')
    return _page(f"Review #{item_id}: {crit.get('id') or ''}", body, main_class="item")


# --- blind labelling and calibration ------------------------------------------------------------------

LABEL_CHOICES = (("pass", "p", "Pass"), ("fail", "f", "Fail"), ("not_applicable", "a", "Not applicable"))


def render_label_task(detail: Mapping[str, Any], *, reviewer: str = "", message: str | None = None,
                      error: str | None = None, next_url: str | None = None, position: str = "",
                      signed_in: bool = False, token_needed: bool = False) -> str:
    """A blind labelling task (``calibration.item``): the criterion and the conversation, never the verdict,
    and a form posting ``label`` (pass | fail | not_applicable), ``reviewer`` and ``note`` to
    ``/review/label/{id}``. ``signed_in`` and ``token_needed`` as for ``render_item``."""
    item = detail.get("item") or {}
    crit = detail.get("criterion") or {}
    conv = detail.get("conversation")
    mine = detail.get("your_label") or {}
    top = (f'<p class="box warn" role="alert"><strong>Not saved:</strong> <span dir="auto">{_e(error)}</span></p>'
           if error else "") + (f'<p class="box" role="status" dir="auto">{_e(message)}</p>' if message else "")
    nav = ('<nav class="nav"><a href="/review">&larr; Review queue</a><a href="/calibration">Calibration</a>'
           + (f'<span class="progress">{_e(position)}</span>' if position else "")
           + (f'<a href="{_e(next_url)}" rel="next" id="next">Next <kbd>j</kbd></a>' if next_url else "") + "</nav>")
    buttons = "".join(f'<button class="{"confirm" if v == "fail" else "reject" if v == "pass" else "unclear"}" '
                      f'type="submit" name="label" value="{v}" accesskey="{k}">{_e(t)} <kbd>{k}</kbd></button>'
                      for v, k, t in LABEL_CHOICES)
    already = (f'<p class="box">You labelled it <strong>{_e(mine.get("label"))}</strong>; labelling again '
               "replaces it.</p>" if mine.get("label") else "")
    form = (_token_needed("labels") if token_needed else
            f'<form method="post" action="/review/label/{_e(quote(str(item.get("id")), safe=""))}" id="decide">'
            f'{already}<label for="note">Note <span class="muted">(optional) <kbd>n</kbd></span></label>'
            '<textarea id="note" name="note" dir="auto"></textarea>'
            f'{_name_field(reviewer, signed_in, "labels")}<div class="actions">{buttons}</div></form>')
    text = crit.get("text")
    panel = (f'<aside class="panel"><h1>Label #{_e(item.get("id"))}: <span dir="auto">{_e(crit.get("id"))}</span></h1>'
             '<p class="muted">A blind task: the judge\'s verdict is not shown. Read the conversation and say '
             'whether it passes this criterion.</p>'
             + (f'<div class="box text" dir="auto">{_e(describe_criterion(text))}</div>' if text else "")
             + form + _help() + "</aside>")
    messages = list((conv or {}).get("messages") or [])
    transcript = ('<p class="box warn">The conversation is no longer stored.</p>' if conv is None else
                  '<ol class="transcript">' + "".join(_render_message(m, {}, n) for n, m in enumerate(messages, 1))
                  + "</ol>")
    body = top + nav + f'<div class="layout">{panel}<section class="chat"><h2>Transcript</h2>{transcript}</section></div>'
    return _page(f"Label #{item.get('id')}", body, main_class="item")


def _pct(value: Any) -> str:
    return "n/a" if value is None else f"{float(value):.0%}"


def render_calibration(report: Mapping[str, Any], *, unlabelled: int = 0,
                       realism: Sequence[Mapping[str, Any]] = ()) -> str:
    """The calibration page: per criterion, the judge against people on the blind labels; then, per simulated
    user, the share of its conversations people found realistic (``realism.realism_by_user``)."""
    parts = [f'<p><a href="/review">&larr; Review queue</a> &middot; <a href="/review/label">Label blind tasks</a> '
             f'<span class="muted">({_e(unlabelled)} waiting for you)</span></p>']
    criteria = list(report.get("criteria") or [])
    if not criteria:
        parts.append('<p class="box">No blind labels yet.</p>')
    for c in criteria:
        ok = c.get("calibrated")
        mark = _badge("pass", "calibrated") if ok else _badge("fail", "not calibrated")
        why = "" if ok else f'<p class="box warn">Not calibrated: {_e(c.get("reason_text"))}</p>'
        fp, ff = c["false_pass"], c["false_fail"]
        cells = "".join(
            f'<tr><th scope="row">{_e(h)}</th>' + "".join(f"<td>{_e(c['confusion'][h][j])}</td>" for j in
                                                          ("pass", "fail", "not_applicable")) + "</tr>"
            for h in ("pass", "fail", "not_applicable"))
        kappa = "n/a" if c.get("kappa") is None else f"{c['kappa']:.2f}"
        reviewers = c.get("reviewers") or {}
        parts.append(
            f'<section class="box" id="c-{_e(c["criterion_id"])}"><h2 dir="auto">{_e(c["criterion_id"])} {mark}</h2>'
            f'<p><span class="n">{_e(c["n"])}</span> labelled &middot; agreement {_pct(c.get("agreement"))} &middot; '
            f"Cohen's kappa {_e(kappa)}</p>"
            f'<p>False pass (people said fail, the judge pass): <strong>{_e(calibration_rate_text(fp))}</strong> '
            f'&middot; false fail: {_e(calibration_rate_text(ff))}</p>{why}'
            '<table class="confusion"><caption class="muted">Rows: what people said; columns: the judge</caption>'
            '<thead><tr><th></th><th scope="col">pass</th><th scope="col">fail</th><th scope="col">not applicable</th>'
            f'</tr></thead><tbody>{cells}</tbody></table>'
            + (f'<p class="muted">Between people: {_e(reviewers.get("items"))} task(s) with several labels, agreement '
               f'{_pct(reviewers.get("agreement"))}</p>' if reviewers.get("items") else "")
            + "</section>")
    return _page("Calibration", "<h1>Is the judge right? Blind calibration</h1>" + "".join(parts)
                 + _realism(realism))


def _realism(figures: Sequence[Mapping[str, Any]]) -> str:
    if not figures:
        return ""
    rows = []
    for f in figures:
        who = f["simulated_user"]
        mark = (_badge("pass", "validated") if f["validated"] else
                _badge("fail", f"not validated: needs a lower bound of {f['min_realism']:.0%}"))
        rows.append(
            f'<tr><th scope="row" dir="auto">{_e(who["provider"])} {_e(who["model"])}</th>'
            f'<td><code>{_e(who["prompt_sha256"][:12])}</code></td><td>{_e(who["temperature"])}</td>'
            f'<td>{_e(f["realistic"])} of {_e(f["labelled"])}</td><td>{_pct(f["share"])}</td>'
            f'<td>{_pct(f["lower"])}</td><td>{mark}</td><td>{_e(f["unlabelled"])}</td></tr>')
    return ('<section class="box" id="realism"><h2>Is the simulated user realistic?</h2>'
            '<p class="muted">Blind tasks of <code>simulated_user_realistic</code> on imported simulated '
            'conversations, per simulated user: its labels count for its provider, model, prompt and temperature '
            'only.</p><table><thead><tr><th scope="col">simulated user</th><th scope="col">prompt</th>'
            '<th scope="col">temperature</th><th scope="col">realistic</th><th scope="col">share</th>'
            '<th scope="col">lower 95%</th><th scope="col"></th><th scope="col">unlabelled</th></tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table></section>')
