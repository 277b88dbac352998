"""The review queue as server-side HTML: a list page and an item page.

Pure functions from the dicts of ``review.queue`` (``list_reviews``,
``review_item``) to complete HTML documents; the server serves them. No
JavaScript and no external assets. Every value from storage is production
text (user messages, judge replies, reviewer notes) and is escaped; text of any
direction is shown with ``dir="auto"``. Quoted evidence is highlighted where
``judges.locate_evidence`` found it, the lookup behind ``evidence_verified``.

The item page posts a form (``application/x-www-form-urlencoded``) to its
``action`` with the fields ``decision`` (``confirm`` | ``reject``),
``reviewer``, ``note`` and, on an item decided already, ``force`` (``1``).
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import quote, urlencode

from pydantic import ValidationError

from judges import Message, ToolCall, locate_evidence, tool_call_text

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
@media (max-width: 40rem) { .wide { display: none; } main { padding: .6rem; } }
"""

_RESULT_WORDS = {"fail": "fail", "pass": "pass", "not_applicable": "not applicable", "error": "error"}
_ROLE_WORDS = {"user": "User", "assistant": "Bot", "tool": "Tool"}


def _e(value: object) -> str:
    # NUL is not allowed in HTML text; everything else is escaped, quotes included (attributes).
    return html.escape("" if value is None else str(value).replace("\x00", "\ufffd"), quote=True)


def _page(title: str, body: str) -> str:
    return ("<!doctype html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
            # As the header says: under no-referrer the form's own posts would carry "Origin: null".
            "<meta name=\"referrer\" content=\"same-origin\">\n"
            f"<title>{_e(title)}</title>\n<style>{_STYLE}</style>\n</head>\n"
            f"<body>\n<main>\n{body}\n</main>\n</body>\n</html>\n")


def render_message(title: str, text: str) -> str:
    """A page with one message (an error, a sign-in hint), linking back to the queue."""
    return _page(title, f'<h1>{_e(title)}</h1><p class="box" role="alert" dir="auto">{_e(text)}</p>'
                        '<p><a href="/review">Review queue</a></p>')


def _badge(kind: str, text: str | None = None) -> str:
    return f'<span class="badge {_e(kind)}">{_e(text or kind)}</span>'


def _item_url(base: str, item_id: object) -> str:
    return f"{base}/{quote(str(item_id), safe='')}"


def render_list(items: Sequence[Mapping[str, Any]], *, state: str = "pending", criterion: str | None = None,
                criteria: Iterable[str] = (), base: str = "/review") -> str:
    """The review queue page: filters (state, criterion) and one row per item.

    Args:
        items: from ``queue.list_reviews``.
        state: the state filter in use (``pending``, ``confirmed``, ``rejected``, ``all``).
        criterion: the criterion filter in use, if any.
        criteria: criterion ids offered in the filter (the one in use is always offered).
        base: the URL of this page; items live at ``{base}/{id}``.

    Returns:
        A complete HTML document; the filter form submits ``state`` and ``criterion`` by GET to ``base``.
    """
    states = ("pending", "confirmed", "rejected", "all")
    state_options = "".join(
        f'<option value="{s}"{" selected" if s == state else ""}>{s}</option>' for s in states)
    names = sorted(set(criteria) | ({criterion} if criterion else set()))
    crit_options = '<option value="">all criteria</option>' + "".join(
        f'<option value="{_e(c)}"{" selected" if c == criterion else ""}>{_e(c)}</option>' for c in names)
    filters = (f'<form class="filters" method="get" action="{_e(base)}">'
               f'<div><label for="state">State</label><select id="state" name="state">{state_options}</select></div>'
               f'<div><label for="criterion">Criterion</label>'
               f'<select id="criterion" name="criterion">{crit_options}</select></div>'
               '<div><button class="plain" type="submit">Show</button></div></form>')
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
            rows.append(
                "<tr>"
                f'<td><a href="{_e(_item_url(base, it.get("id")))}">#{_e(it.get("id"))}</a></td>'
                f'<td dir="auto">{_e(it.get("criterion_id"))}</td>'
                f'<td>{_badge(result, _RESULT_WORDS.get(result, result))} {" ".join(flags)}</td>'
                f'<td>{_badge(str(it.get("state")))}'
                + (f' <span class="muted" dir="auto">{_e(it.get("reviewer"))}</span>' if it.get("reviewer") else "")
                + "</td>"
                f'<td class="wide text" dir="auto">{_e(it.get("conversation_id"))}</td>'
                f'<td class="wide muted">{_e(it.get("created_at"))}</td>'
                "</tr>")
        table = ('<table><caption class="muted">' + _e(f"{len(items)} item" + ("s" if len(items) != 1 else ""))
                 + '</caption><thead><tr><th scope="col">Item</th><th scope="col">Criterion</th>'
                 '<th scope="col">Judge said</th><th scope="col">Review</th>'
                 '<th scope="col" class="wide">Conversation</th><th scope="col" class="wide">Queued</th></tr></thead>'
                 f'<tbody>{"".join(rows)}</tbody></table>')
    query = urlencode({k: v for k, v in (("state", state), ("criterion", criterion)) if v})
    return _page("Review queue", f'<h1>Review queue</h1>{filters}{table}'
                 f'<p class="muted"><a href="{_e(base)}?{_e(query)}">Refresh</a></p>')


# --- evidence highlighting ----------------------------------------------------------------------------

Marks = dict[tuple[int, int], list[tuple[int, int]]]
"""Ranges to highlight, by (message index, part): part ``-1`` is the content, ``k`` the k-th tool call's text."""


def locate_quotes(messages: Sequence[Mapping[str, Any]], evidence: Sequence[str]) -> tuple[list[bool], Marks]:
    """Which quotes are in the transcript and where, as ``judges.locate_evidence`` finds them.

    The same lookup gives a verdict its ``evidence_verified``, so what is
    highlighted is what the evidence check accepted. A transcript the judges'
    model refuses highlights nothing.
    """
    try:
        msgs = [Message.model_validate(m) for m in messages]
    except ValidationError:
        return [False] * len(evidence), {}
    located = locate_evidence(evidence, msgs)
    marks: Marks = {}
    for r in (r for q in located for r in q.ranges):
        marks.setdefault((r.message, r.part), []).append((r.start, r.end))
    return [q.found for q in located], marks


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
    return (f'<li class="msg {_e(role)}" id="m{n}"><div class="role">{_e(label)}'
            + (f' <span class="muted">{_e(m.get("at"))}</span>' if m.get("at") else "")
            + f'</div>{"".join(parts)}</li>')


def _json(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def _decision_form(item: Mapping[str, Any], action: str, reviewer: str) -> str:
    state = str(item.get("state"))
    decided = state != "pending"
    notice = ""
    if decided:
        notice = (f'<p class="box warn">Already <strong>{_e(state)}</strong>'
                  + (f' by <span dir="auto">{_e(item.get("reviewer"))}</span>' if item.get("reviewer") else "")
                  + (f' at {_e(item.get("decided_at"))}' if item.get("decided_at") else "")
                  + ". Deciding again replaces that decision; the earlier one stays in the history below.</p>")
    force = ('<input type="hidden" name="force" value="1">' if decided else "")
    return (f'<h2 id="decide">Your decision</h2>{notice}'
            f'<form method="post" action="{_e(action)}" class="box">'
            '<label for="reviewer">Your name</label>'
            f'<input type="text" id="reviewer" name="reviewer" required autocomplete="name" dir="auto" '
            f'value="{_e(reviewer)}">'
            '<label for="note">Note <span class="muted">(optional: why)</span></label>'
            '<textarea id="note" name="note" dir="auto"></textarea>'
            f"{force}"
            '<div class="buttons">'
            '<button class="confirm" type="submit" name="decision" value="confirm">'
            "Confirm: this is a real failure</button>"
            '<button class="reject" type="submit" name="decision" value="reject">'
            "Reject: the judge is wrong</button></div></form>")


def render_item(detail: Mapping[str, Any], *, base: str = "/review", action: str | None = None,
                reviewer: str = "", message: str | None = None, error: str | None = None) -> str:
    """The page of one review item: criterion, judge's reasoning, evidence, transcript and the decision form.

    Args:
        detail: from ``queue.review_item``.
        base: the list page's URL (for the way back and the default ``action``).
        action: where the decision form posts; default ``{base}/{id}/decision``.
        reviewer: prefills the reviewer field (the last name used).
        message: a notice to show on top (``"Saved: confirmed"``).
        error: an error to show on top (a refused decision).

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
    head = (f'<p><a href="{_e(base)}">&larr; Review queue</a></p>'
            f'<h1>Review item #{_e(item_id)}: <span dir="auto">{_e(crit.get("id"))}</span> '
            f'<span class="muted">v{_e(crit.get("version"))}</span></h1>'
            f'<p>The judge said {_badge(result, _RESULT_WORDS.get(result, result))} '
            f'&middot; review {_badge(str(item.get("state")))}'
            + (f' &middot; severity {_e(crit.get("severity"))}' if crit.get("severity") else "")
            + (f' &middot; group <span dir="auto">{_e(crit.get("group"))}</span>' if crit.get("group") else "")
            + "</p>")
    warnings = []
    if verdict.get("superseded"):
        warnings.append("The conversation changed after this verdict (late data or a new turn); "
                        "the transcript below is the current one, which may differ from what the judge read.")
    if verdict.get("flagged") or not verdict.get("evidence_verified", True):
        warnings.append("At least one quote the judge gave was not found in the transcript: "
                        "the judge may have misquoted or invented it. Check the conversation yourself.")
    warn_html = "".join(f'<p class="box warn">{_e(w)}</p>' for w in warnings)

    crit_text = crit.get("text")
    criterion_html = ('<h2>Criterion</h2>' + (
        f'<div class="box text" dir="auto">{_e(crit_text)}</div>' if crit_text else
        '<p class="muted">The criterion text was not recorded for this version.</p>'))
    reasoning = str(verdict.get("reasoning") or "")
    reasoning_html = ('<h2>Judge\'s reasoning</h2>'
                      + (f'<div class="box text" dir="auto">{_e(reasoning)}</div>' if reasoning else
                         '<p class="muted">No reasoning given.</p>')
                      + f'<p class="muted">Judge: {_e(judge.get("provider"))} / {_e(judge.get("model"))}'
                      + (f' &middot; judged {_e(verdict.get("judged_at"))}' if verdict.get("judged_at") else "")
                      + "</p>")
    if verdict.get("error_reason"):
        reasoning_html += f'<p class="box warn text" dir="auto">Error: {_e(verdict.get("error_reason"))}</p>'

    messages = list((conv or {}).get("messages") or [])
    found, marks = locate_quotes(messages, evidence)
    if evidence:
        quotes = "".join(
            f'<li><q class="text" dir="auto">{_e(q)}</q> <span class="muted">('
            + ("highlighted in the transcript" if ok else "not found in the transcript")
            + ")</span></li>" for q, ok in zip(evidence, found))
        evidence_html = f"<h2>Quoted evidence</h2><ul>{quotes}</ul>"
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
            f'<li>{_e(h.get("decided_at"))}: <span dir="auto">{_e(h.get("reviewer"))}</span> '
            f'{_badge(str(h.get("state")))} (was {_e(h.get("previous_state"))})'
            + (f' &mdash; <span class="text" dir="auto">{_e(h.get("note"))}</span>' if h.get("note") else "")
            + "</li>" for h in history)
        history_html = f"<h2>History</h2><ol>{rows}</ol>"

    body = (top + head + warn_html + criterion_html + reasoning_html + evidence_html + transcript_html
            + _decision_form(item, action, reviewer) + history_html)
    return _page(f"Review #{item_id}: {crit.get('id') or ''}", body)
