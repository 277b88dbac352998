"""Rebuild one conversation's transcript from its stored span and log rows.

Pure and deterministic: the same rows in any order, with any duplicates (OTLP
retries), give the same ``Transcript``. The rules (DESIGN.md, "Rebuilding
conversations"):

- content comes from LLM-call spans, their span events or their log records
  (where a library spreads a call over the spans around it, as Mastra does, put
  together from those: ``normalize.mastra``); agent-span content only for a
  trace where no LLM call has any;
- one LLM call counts once: spans with the same response id, an LLM span nested
  in another, or a sibling with the same tokens over the same time (the
  anthropic SDK's own span beside OpenLLMetry's) are one call, and the member
  with content and usage speaks for it;
- each call resends the history, so calls are merged by position (role, text,
  tool-call ids, in order; never as a set); a shorter history (compaction) is
  not a deletion;
- traces are ordered by start time, calls within a trace by start time and
  parent before child, log records by time, then as received.

Public: ``DEFAULT_ID_ATTRIBUTES``, ``conversation_key``, ``group_traces``,
``build_transcript``, ``ParseMemo``, ``Transcript``,
``TranscriptMessage``, ``Usage``, ``NO_CONTENT_REASON``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..normalize import (
    Attrs,
    Content,
    Event,
    Message,
    Meta,
    ToolCall,
    as_int,
    as_str,
    combine,
    mastra,
    read_events,
    read_meta,
    read_span,
    repair_text,
    repaired,
)
from .keys import (
    DEFAULT_ID_ATTRIBUTES,
    conversation_key,
    group_keyed,
    has_messages,
    json_column,
    load_json_column,
    response_links,
)
from .stitch import Stitcher, answered, opening
from .transcript import DigestMemo, Transcript, TranscriptMessage, Usage, from_unix_nano

__all__ = [
    "DEFAULT_ID_ATTRIBUTES",
    "NO_CONTENT_REASON",
    "NO_GENAI_REASON",
    "ParseMemo",
    "Transcript",
    "TranscriptMessage",
    "Usage",
    "build_transcript",
    "conversation_key",
    "group_traces",
    "merge_history",
    "response_links",
]

STITCH_KEPT = 10_000  # recent conversations without an id that a trace may continue (``stitch``)

NO_CONTENT_REASON = (
    "no message content was captured (the instrumentation sent only metadata); "
    "turn capture on, e.g. OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY "
    "with OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental "
    "(TRACELOOP_TRACE_CONTENT=true for OpenLLMetry)"
)
NO_GENAI_REASON = "no LLM call or agent span in these traces"


# ---------------------------------------------------------------- rows -> spans


@dataclass(eq=False)  # compared by identity: ParseMemo tells a reused parse from an equal one
class _Span:
    trace_id: str
    span_id: str
    parent: str | None
    start: int
    end: int
    service: str | None
    meta: Meta
    content: Content | None
    depth: int = 0


def _pick(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Duplicates of one span (OTLP retries), most complete first, deterministically."""
    if len(rows) == 1:
        return rows
    return sorted(rows, key=lambda r: (-(as_int(r.get("end_time_unix_nano")) or 0),
                                       -len(str(r.get("attributes") or "")),
                                       str(r.get("attributes") or ""), str(r.get("events") or "")))


def _row_start(rows: list[dict[str, Any]]) -> int:
    if len(rows) == 1:
        return as_int(rows[0].get("start_time_unix_nano")) or 0
    return min((as_int(r.get("start_time_unix_nano")) or 0 for r in rows), default=0)


def _span_events(row: dict[str, Any]) -> list[Event]:
    events = json_column(row, "events") or []
    return [Event(e.get("name") or "", e.get("attributes") or {}, None)
            for e in events if isinstance(e, dict)]


def _parse_span(row: dict[str, Any], logs: list[Event]) -> _Span:
    attrs = json_column(row, "attributes") or {}
    if not isinstance(attrs, dict):
        raise ValueError("attributes is not an object")
    name = str(row.get("name") or "")
    meta, content = read_span(attrs, name)
    content = combine([content, read_events(_span_events(row), "span-event"),
                       read_events(logs, "log")])
    if meta.kind == "other" and content is not None and content.has_messages():
        # Content with no classifying attribute: a model call if it names a model.
        meta.kind = "llm" if (meta.request_model or meta.response_model) else "agent"
    start = as_int(row.get("start_time_unix_nano")) or 0
    end = as_int(row.get("end_time_unix_nano")) or start
    parent = row.get("parent_span_id")
    return _Span(str(row["trace_id"]), str(row["span_id"]), parent if isinstance(parent, str) and parent else None,
                 start, end, as_str(row.get("service")), meta, content)


@dataclass
class _LogGroup:
    events: list[Event]
    attrs: dict[str, Any]
    start: int
    end: int
    service: str | None
    # Per event, what it was read from, for ParseMemo; None once an event came
    # from a value that could equal another reading differently (see _exact).
    sources: list[tuple[str, Any, Any]] | None


def _log_rank(row: dict[str, Any]) -> tuple[str, str]:
    return (str(row.get("body") or ""), str(row.get("attributes") or ""))


def _log_groups(logs: Sequence[dict[str, Any]], known_texts: dict[str, Any]
                ) -> tuple[dict[tuple[str, str | None], _LogGroup], int, dict[str, Any]]:
    """Log rows deduplicated and grouped by (trace, span), in emission order.

    Emission order is time, then observed time, then ``arrival`` (records of one
    call often share a timestamp; they were sent in order), then the id.

    Also returns the parsed JSON texts, by text; ``known_texts`` are those of
    the previous build (ParseMemo), taken instead of parsing again.
    """
    seen: dict[str, dict[str, Any]] = {}
    arrived: dict[str, tuple[int, Any]] = {}  # log id -> its first arrival; (1, ()) if not known
    for row in logs:
        lid = str(row.get("log_id") or json.dumps(
            [row.get(k) for k in ("trace_id", "span_id", "time_unix_nano", "observed_time_unix_nano",
                                  "event_name", "body", "attributes")], default=str))
        # Retries are byte-identical; if two rows share an id anyway, the pick
        # must not depend on arrival order.
        if lid not in seen or _log_rank(row) < _log_rank(seen[lid]):
            seen[lid] = row
        arrival = row.get("arrival")
        first = (1, ()) if arrival is None else (0, arrival)
        if lid not in arrived or first < arrived[lid]:
            arrived[lid] = first
    parsed: list[tuple[tuple[int, int, tuple[int, Any], str], tuple[str, str | None], Event, dict[str, Any],
                       str | None, tuple[str, Any, Any] | None]] = []
    bad = 0
    # Per-message events repeat the same bodies and attributes in every call of
    # a conversation: parse each distinct text once (nothing mutates the result).
    texts: dict[str, Any] = {}

    def load(text: Any) -> Any:
        if not isinstance(text, str):
            return load_json_column(text)
        if text not in texts:
            texts[text] = known_texts[text] if text in known_texts else load_json_column(text)
        return texts[text]

    for lid, row in seen.items():
        trace = row.get("trace_id")
        if not trace:
            continue  # not linked to any trace: cannot belong to a conversation
        try:
            attrs = load(row.get("attributes")) or {}
            body = load(row.get("body"))
            if not isinstance(attrs, dict):
                raise ValueError("attributes is not an object")
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's limit
            bad += 1
            continue
        name = row.get("event_name") or attrs.get("event.name") or ""
        t = as_int(row.get("time_unix_nano")) or 0
        obs = as_int(row.get("observed_time_unix_nano")) or 0
        # Per-message events of one call often share a zero time: observed time
        # (set at emission) keeps their order, and where a coarse clock gave them
        # the same one, the order they were received in.
        order = (int(t or obs), int(obs), arrived[lid], lid)
        span = row.get("span_id")
        raw_attrs, raw_body = row.get("attributes"), row.get("body")
        source = (str(name), raw_attrs, raw_body) if _exact(raw_attrs, raw_body) else None
        parsed.append((order, (str(trace), span if isinstance(span, str) and span else None),
                       Event(str(name), attrs, body),
                       attrs, as_str(row.get("service")), source))
    parsed.sort(key=lambda p: p[0])
    groups: dict[tuple[str, str | None], _LogGroup] = {}
    for order, key, ev, attrs, service, source in parsed:
        g = groups.get(key)
        if g is None:
            groups[key] = _LogGroup([ev], dict(attrs), order[0], order[0], service,
                                    None if source is None else [source])
        else:
            g.events.append(ev)
            g.end = max(g.end, order[0])
            for k, v in attrs.items():
                g.attrs.setdefault(k, v)
            if g.sources is not None:
                if source is None:
                    g.sources = None
                else:
                    g.sources.append(source)
    return groups, bad, texts


def _orphan_span(trace_id: str, span_id: str | None, g: _LogGroup) -> _Span | None:
    """A call known only from its log records (its span not stored, or never sent)."""
    content = read_events(g.events, "log")
    meta = read_meta(Attrs(g.attrs))
    if content is None or not content.has_messages():
        if meta.kind != "llm":
            return None
    elif meta.kind not in ("llm", "agent"):
        meta.kind = "llm"
    return _Span(trace_id, span_id or f"log:{trace_id}", None, g.start, g.end, g.service, meta, content)


# ---------------------------------------------------------------- calls


@dataclass
class _Call:
    order: tuple[int, int, int, str]
    span: _Span  # the member that speaks for the call
    content: Content | None
    meta: Meta


def _depths(spans: dict[str, _Span]) -> None:
    for sp in spans.values():
        depth, cur, seen = 0, sp.parent, {sp.span_id}
        while cur is not None and cur in spans and cur not in seen:
            seen.add(cur)
            depth += 1
            cur = spans[cur].parent
        sp.depth = depth


def _order(sp: _Span) -> tuple[int, int, int, str]:
    return (sp.start, sp.depth, sp.end, sp.span_id)


def _with_steps(spans: dict[str, _Span]) -> dict[str, _Span]:
    """The trace's spans, its model calls given the content that Mastra spreads over the spans
    around each call (``normalize.mastra``); the parsed spans are left as they are."""
    prefix = mastra.NAME + "/"
    if not any(s.content is not None and s.content.source.startswith(prefix) for s in spans.values()):
        return spans
    found = mastra.steps(sorted(spans.values(), key=_order), lambda s: s.meta.kind == "llm")
    if not found:
        return spans
    return {sid: replace(sp, content=found[sid]) if sid in found else sp for sid, sp in spans.items()}


def _has_messages(c: Content | None) -> bool:
    return c is not None and c.has_messages()


def _same_call(a: _Span, b: _Span) -> bool:
    """Two sibling LLM spans with equal tokens: one call seen by two instrumentations?

    Only if one lies inside the other's time, at most one of them has content
    (the SDK's own span carries none), and their response ids do not differ:
    two real calls that happen to use the same tokens stay two.
    """
    nested = (a.start <= b.start and b.end <= a.end) or (b.start <= a.start and a.end <= b.end)
    ids_differ = bool(a.meta.response_id and b.meta.response_id and a.meta.response_id != b.meta.response_id)
    return nested and not ids_differ and not (_has_messages(a.content) and _has_messages(b.content))


def _llm_calls(spans: dict[str, _Span]) -> list[_Call]:
    """One entry per distinct LLM call of a trace, in call order."""
    llm = sorted((s for s in spans.values() if s.meta.kind == "llm"), key=_order)
    parent_of: dict[str, str] = {s.span_id: s.span_id for s in llm}

    def find(x: str) -> str:
        while parent_of[x] != x:
            parent_of[x] = parent_of[parent_of[x]]
            x = parent_of[x]
        return x

    def union(a: str, b: str) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent_of[max(ra, rb)] = min(ra, rb)

    by_response: dict[str, str] = {}
    by_tokens: dict[tuple[str | None, int, int], list[_Span]] = {}
    for sp in llm:
        rid = sp.meta.response_id
        if rid:
            if rid in by_response:
                union(sp.span_id, by_response[rid])
            else:
                by_response[rid] = sp.span_id
        cur, seen = sp.parent, {sp.span_id}
        while cur is not None and cur in spans and cur not in seen:
            seen.add(cur)
            if spans[cur].meta.kind == "llm":  # a wrapper's LLM span around the SDK's
                union(sp.span_id, cur)
                break
            cur = spans[cur].parent
        if sp.meta.input_tokens is not None and sp.meta.output_tokens is not None:
            bucket = by_tokens.setdefault((sp.parent, sp.meta.input_tokens, sp.meta.output_tokens), [])
            for other in bucket:
                if _same_call(sp, other):
                    union(sp.span_id, other.span_id)
            bucket.append(sp)
    with_messages: dict[str | None, list[_Span]] = {}  # by parent
    for sp in llm:
        if _has_messages(sp.content):
            with_messages.setdefault(sp.parent, []).append(sp)
    for sp in llm:
        call = _helper_of(sp, with_messages.get(sp.parent, []))
        if call is not None:
            union(sp.span_id, call.span_id)
    groups: dict[str, list[_Span]] = {}
    for sp in llm:
        groups.setdefault(find(sp.span_id), []).append(sp)
    calls = []
    for members in groups.values():
        best = max(members, key=lambda s: (_has_messages(s.content),
                                           s.meta.input_tokens is not None or s.meta.output_tokens is not None,
                                           bool(s.content and s.content.output),
                                           -s.depth, s.span_id))
        meta = Meta(kind="llm", response_id=best.meta.response_id)
        for m in [best] + members:
            if meta.input_tokens is None and meta.output_tokens is None:
                meta.input_tokens, meta.output_tokens = m.meta.input_tokens, m.meta.output_tokens
            meta.request_model = meta.request_model or m.meta.request_model
            meta.response_model = meta.response_model or m.meta.response_model
        content = next((m.content for m in [best] + members if _has_messages(m.content)), best.content)
        calls.append(_Call(min(_order(m) for m in members), best, content, meta))
    calls.sort(key=lambda c: c.order)
    for sp in spans.values():
        if sp.meta.reported_model:
            _report_model(calls, sp)
    return calls


def _helper_of(sp: _Span, siblings: list[_Span]) -> _Span | None:
    """The call an LLM span with neither messages nor tokens belongs to, if a sibling holds one.

    Such a span beside (same parent) LLM spans with messages (``siblings``) is a helper's span of
    a call, not a call (LlamaIndex's ``OpenAI._prepare_chat_with_tools`` before ``OpenAI.achat``):
    it joins the nearest of them in time, a later one first. Without content beside it nothing
    joins, so calls seen with content capture off are still counted.
    """
    if _has_messages(sp.content) or sp.meta.input_tokens is not None or sp.meta.output_tokens is not None:
        return None
    return min(siblings, default=None,
               key=lambda s: (max(0, s.start - sp.end, sp.start - s.end), s.start < sp.start, s.span_id))


def _report_model(calls: list[_Call], sp: _Span) -> None:
    """A model named by a span after its call (``Meta.reported_model``) is that call's response model.

    The call is the latest one ended before ``sp`` starts; a response model of its own other than the
    request model wins.
    """
    before = [c for c in calls if c.span.end <= sp.start]
    if before:
        meta = max(before, key=lambda c: (c.span.end, c.order)).meta
        if meta.response_model in (None, meta.request_model):
            meta.response_model = sp.meta.reported_model


# ---------------------------------------------------------------- merge by position


@dataclass
class _Entry:
    msg: Message
    at: int
    span_id: str
    source: str


def _cut_copy(a: Message, b: Message) -> bool:
    """One of the two is the other cut short by an attribute length limit."""
    if a.truncated == b.truncated or a.role != b.role:
        return False
    cut, whole = (a, b) if a.truncated else (b, a)
    return whole.content.startswith(cut.content)


def merge_history(known: list[Message], sent: list[Message]) -> int:
    """Where the new messages of one call start in ``sent`` (its input + output).

    ``known`` is the transcript so far. Messages are compared in order by role,
    text and tool-call ids. If ``sent`` extends ``known``, the new ones follow
    the common prefix. If it diverges (compaction replaced older messages with a
    summary, or the call saw only a window), the new ones follow the place
    where ``known``'s last messages reappear in ``sent``, the longest such run
    winning; failing that, they follow the common prefix. A message cut short
    (``truncated``) matches its whole copy. Returns an index into ``sent``;
    ``len(sent)`` means nothing new.
    """
    return _merge_start(known, [m.key for m in known], sent, [m.key for m in sent])


def _merge_start(known: list[Message], kk: list[Any], sent: list[Message], sk: list[Any]) -> int:
    """``merge_history`` with both key lists given (the transcript keeps its own)."""
    n = min(len(kk), len(sk))
    if kk[:n] == sk[:n]:  # the usual case, a prefix either way, compared in C
        return n
    lcp = 0
    while lcp < n and (kk[lcp] == sk[lcp] or _cut_copy(known[lcp], sent[lcp])):
        lcp += 1
    if lcp == len(sk) or lcp == len(kk):
        return lcp
    best_q, best_len = -1, 0
    last = kk[-1]
    for q in range(len(sk)):
        if sk[q] != last:
            continue
        length = 1
        while length <= q and length < len(kk) and sk[q - length] == kk[-1 - length]:
            length += 1
        if length > best_len:
            best_q, best_len = q, length
    return best_q + 1 if best_q >= 0 else lcp


class _Known:
    """The transcript being merged: entries, their messages and keys, kept in step.

    Keys and the count of cut messages are kept as messages are added, so that
    merging one call costs C-level work over the history plus Python work over
    its new messages.
    """

    def __init__(self) -> None:
        self.entries: list[_Entry] = []
        self.msgs: list[Message] = []
        self.keys: list[Any] = []
        self.cut = 0  # messages flagged truncated

    def merge(self, call: _Call) -> None:
        c = call.content
        if c is None:
            return
        sent = list(c.input or []) + list(c.output or [])
        sk = [m.key for m in sent]
        n_in = len(c.input or [])
        known, kk = self.msgs, self.keys
        start = _merge_start(known, kk, sent, sk)
        sp = call.span
        for i in range(min(len(known), len(sent)) if self.cut else 0):
            # A message first seen cut short is replaced by a whole copy resent later.
            if known[i].truncated and not sent[i].truncated and _cut_copy(known[i], sent[i]):
                known[i], kk[i] = sent[i], sk[i]
                self.cut -= 1
                e = self.entries[i]
                self.entries[i] = _Entry(sent[i], e.at, e.span_id, e.source)
            elif kk[i] != sk[i] and not _cut_copy(known[i], sent[i]):
                break
        for i in range(start, len(sent)):
            msg = sent[i]
            self.entries.append(_Entry(msg, sp.start if i < n_in else sp.end, sp.span_id, c.source))
            known.append(msg)
            kk.append(sk[i])
            self.cut += msg.truncated


class _Assembly:
    """Everything the traces of a conversation add up to, trace by trace, in order."""

    def __init__(self) -> None:
        self.merged = _Known()
        self.system: str | None = None
        self.models: list[str] = []
        self.usage_in = self.usage_out = self.n_calls = 0
        self.usage_seen = False  # some call reported token counts
        self.genai_seen = False
        self.truncated: list[str] = []
        self.tool_names: dict[str, str] = {}
        self.service: str | None = None
        self.opening = 0  # messages the first call with content was sent: the history it resends

    def copy(self) -> _Assembly:
        """A copy that adding traces to leaves this one as it is."""
        out = _Assembly()
        out.__dict__.update(self.__dict__)
        out.merged = _Known()
        out.merged.entries, out.merged.msgs = list(self.merged.entries), list(self.merged.msgs)
        out.merged.keys, out.merged.cut = list(self.merged.keys), self.merged.cut
        out.models, out.truncated, out.tool_names = list(self.models), list(self.truncated), dict(self.tool_names)
        return out

    def add_trace(self, tspans: dict[str, _Span]) -> None:
        _depths(tspans)
        tspans = _with_steps(tspans)
        calls = _llm_calls(tspans)
        for call in calls:
            self.n_calls += 1
            self.usage_in += call.meta.input_tokens or 0
            self.usage_out += call.meta.output_tokens or 0
            self.usage_seen |= call.meta.input_tokens is not None or call.meta.output_tokens is not None
            model = call.meta.response_model or call.meta.request_model
            if model and model not in self.models:
                self.models.append(model)
        content_calls = [c for c in calls if _has_messages(c.content)]
        if not content_calls:  # agent turns speak only for a trace with no LLM content
            content_calls = [_Call(_order(s), s, s.content, s.meta) for s in sorted(tspans.values(), key=_order)
                             if s.meta.kind == "agent" and _has_messages(s.content)]
        for sp in sorted(tspans.values(), key=_order):
            self.genai_seen = self.genai_seen or sp.meta.kind in ("llm", "agent")
            if sp.content is not None and sp.content.truncated:
                self.truncated.append(sp.span_id)
            if sp.meta.kind == "tool" and sp.meta.tool_call_id and sp.meta.tool_name:
                self.tool_names.setdefault(sp.meta.tool_call_id, sp.meta.tool_name)
            if self.service is None and sp.service:
                self.service = sp.service
        for call in content_calls:
            if self.system is None and call.content is not None and call.content.system:
                self.system = call.content.system
            if not self.merged.msgs and call.content is not None:
                self.opening = len(call.content.input or [])
            self.merged.merge(call)


def _messages(entries: list[_Entry], tool_names: dict[str, str],
              memo: ParseMemo | None) -> tuple[TranscriptMessage, ...]:
    """The transcript's messages; with a memo, those of the last call are reused where unchanged."""
    prev = memo._messages if memo is not None else []
    out: list[tuple[_Entry, str | None, TranscriptMessage]] = []
    called: dict[str, str] = {}  # call id -> the tool the call named, for results that do not name it
    for i, e in enumerate(entries):
        msg = e.msg
        for tc in msg.tool_calls:
            if tc.id and tc.name:
                called.setdefault(tc.id, tc.name)
        name = (msg.name or tool_names.get(msg.tool_call_id or "") or called.get(msg.tool_call_id or "")
                if msg.role == "tool" else None)
        if i < len(prev) and prev[i][0] is e and prev[i][1] == name:
            out.append(prev[i])
            continue
        out.append((e, name, TranscriptMessage(
            role=msg.role, content=repair_text(msg.content), tool_calls=_repaired_calls(msg.tool_calls),
            tool_call_id=_repaired(msg.tool_call_id), name=_repaired(name), at=from_unix_nano(e.at),
            span_id=None if e.span_id.startswith("log:") else e.span_id, source=e.source,
            truncated=msg.truncated)))
    if memo is not None:
        memo._messages = out
    return tuple(m for _, _, m in out)


def _repaired(text: str | None) -> str | None:
    return None if text is None else repair_text(text)


def _repaired_calls(calls: tuple[ToolCall, ...]) -> tuple[ToolCall, ...]:
    return tuple(ToolCall(_repaired(c.id), repair_text(c.name), repaired(c.arguments)) for c in calls)


# ---------------------------------------------------------------- memo

# The row columns ``_parse_span`` reads besides the ids (which key the memo).
_PARSED_COLUMNS = ("attributes", "events", "name", "start_time_unix_nano", "end_time_unix_nano",
                   "parent_span_id", "service")
_EXACT_TYPES = frozenset({str, int, type(None)})


def _exact(*values: Any) -> bool:
    """Whether equal values here always read the same.

    Stored columns are text, ints or NULL. Anything else (``1 == 1.0 == True``,
    a column already decoded into a dict holding such numbers) is never taken
    from the memo.
    """
    return _EXACT_TYPES.issuperset(map(type, values))


def _row_sig(row: dict[str, Any]) -> tuple[Any, ...] | None:
    sig = tuple(map(row.get, _PARSED_COLUMNS))
    return sig if _exact(*sig) else None


class ParseMemo:
    """Parsed rows of one conversation, kept by the caller between rebuilds.

    ``build_transcript(spans, logs, memo)`` takes a span's parse from the memo
    when the span's rows (every column the parse reads) and the log records
    linked to it are equal to the last call's, compared as stored text, so late
    log records or a retried, more complete row are parsed again; so are log
    records' JSON texts. The transcript is the same with or without a memo.

    Lifetime: one per conversation, kept while the conversation is open and
    dropped with it; a memo passed another conversation's rows stays correct
    but saves nothing. Memory: after each call it holds only what that call's
    rows parsed into (entries for older rows are dropped), so about the
    conversation's parsed size. Not thread-safe: one build at a time per memo.
    """

    __slots__ = ("_spans", "_orphans", "_texts", "_assembly", "_messages", "digest")

    def __init__(self) -> None:
        # (trace, span) -> ((row signatures, log sources), parsed span or None if no row parsed)
        self._spans: dict[tuple[str, str], tuple[Any, _Span | None]] = {}
        # (trace, span of the logs) -> (log signature, (read failed, call read from the logs alone))
        self._orphans: dict[tuple[str, str | None], tuple[Any, tuple[bool, _Span | None]]] = {}
        self._texts: dict[str, Any] = {}  # log record JSON text -> parsed
        # The traces assembled (each with its span objects, in order) and the state they led to.
        self._assembly: tuple[list[tuple[str, tuple[tuple[str, _Span], ...]]], _Assembly] | None = None
        self._messages: list[tuple[_Entry, str | None, TranscriptMessage]] = []  # with their entry and name
        self.digest = DigestMemo()
        """For ``Transcript.content_hash``: this memo's transcripts reuse unchanged message objects."""

    def __len__(self) -> int:
        """Entries held: parsed spans, log-only calls and log texts of the last call."""
        return len(self._spans) + len(self._orphans) + len(self._texts)


# ---------------------------------------------------------------- build


def build_transcript(spans: Sequence[dict[str, Any]], logs: Sequence[dict[str, Any]],
                     memo: ParseMemo | None = None) -> Transcript:
    """Rebuild one conversation from all its stored span and log rows.

    Rows may come in any order and repeat (OTLP retries): spans are
    deduplicated by (trace_id, span_id), logs by ``log_id``. A log row may
    carry ``arrival``, any comparable value that orders rows as received (the
    conversation stage gives (commit, place in it)): log records that share
    their timestamps keep that order, else they are ordered by ``log_id``. Each
    row's JSON columns are parsed once. A row that does not parse is skipped
    and counted in ``unparsed_spans`` / ``unparsed_logs``; it never fails the
    build. A lone UTF-16 surrogate in any text (a JSON ``\\ud800`` escape without
    its pair) becomes U+FFFD.

    ``memo`` (see ``ParseMemo``) carries parsed rows from the previous call for
    the same conversation, so that a rebuild after new rows arrived parses only
    the rows it has not seen; the result is the same without it.
    """
    log_groups, bad_logs, texts = _log_groups(logs, memo._texts if memo is not None else {})
    memo_spans: dict[tuple[str, str], tuple[Any, _Span | None]] = {}
    memo_orphans: dict[tuple[str, str | None], tuple[Any, tuple[bool, _Span | None]]] = {}

    by_id: dict[tuple[str, str], list[dict[str, Any]]] = {}
    bad_spans = 0
    for row in spans:
        tid, sid = row.get("trace_id"), row.get("span_id")
        if not tid or not sid:
            bad_spans += 1
            continue
        by_id.setdefault((str(tid), str(sid)), []).append(row)

    traces: dict[str, dict[str, _Span]] = {}
    # Time order lets consecutive calls share their parsed history (see
    # normalize._messages); the result does not depend on this order.
    for (tid, sid), rows in sorted(by_id.items(), key=lambda kv: (_row_start(kv[1]), kv[0])):
        g = log_groups.pop((tid, sid), None)
        picked = _pick(rows)
        sig: Any = None  # what the parse depends on, if exactly comparable
        if memo is not None and (g is None or g.sources is not None):
            row_sigs = tuple(_row_sig(r) for r in picked)
            if None not in row_sigs:
                sig = (row_sigs, tuple(g.sources) if g is not None and g.sources is not None else ())
        hit = memo._spans.get((tid, sid)) if memo is not None and sig is not None else None
        if hit is not None and hit[0] == sig:
            parsed = hit[1]
        else:
            parsed = None
            for row in picked:
                try:
                    parsed = _parse_span(row, g.events if g else [])
                    break
                except Exception:  # noqa: BLE001 - one bad row is skipped and counted, never fatal
                    continue
        if sig is not None:
            memo_spans[(tid, sid)] = (sig, parsed)
        if parsed is None:
            bad_spans += 1
            continue
        traces.setdefault(tid, {})[sid] = parsed
    for (tid, sid), g in sorted(log_groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
        gsig = None if memo is None or g.sources is None else (tuple(g.sources), g.start, g.end, g.service)
        ohit = memo._orphans.get((tid, sid)) if memo is not None and gsig is not None else None
        if ohit is not None and ohit[0] == gsig:
            failed, orphan = ohit[1]
        else:
            try:
                failed, orphan = False, _orphan_span(tid, sid, g)
            except Exception:  # noqa: BLE001 - as above
                failed, orphan = True, None
        if gsig is not None:
            memo_orphans[(tid, sid)] = (gsig, (failed, orphan))
        if failed:
            bad_logs += len(g.events)
            continue
        if orphan is not None and orphan.span_id not in traces.get(tid, {}):
            traces.setdefault(tid, {})[orphan.span_id] = orphan

    if memo is not None:  # hold only what this call's rows parsed into
        memo._spans, memo._orphans, memo._texts = memo_spans, memo_orphans, texts

    def trace_start(tid: str) -> tuple[int, str]:
        return (min((s.start for s in traces[tid].values() if s.start), default=0), tid)

    order = sorted(traces, key=trace_start)
    # With a memo, traces whose spans are the very objects of the last call, in
    # the same order, resume from the state the last call reached after them.
    done = [(tid, tuple(traces[tid].items())) for tid in order] if memo is not None else []
    state = _Assembly()
    start = 0
    if memo is not None and memo._assembly is not None:
        prev_done, prev_state = memo._assembly
        if done[:len(prev_done)] == prev_done:
            state, start = prev_state.copy(), len(prev_done)
    for tid in order[start:]:
        state.add_trace(traces[tid])
    if memo is not None:
        memo._assembly = (done, state.copy())

    tool_names = dict(state.tool_names)
    for e in state.merged.entries:
        for tc in e.msg.tool_calls:
            if tc.id:
                tool_names.setdefault(tc.id, tc.name)
    messages = _messages(state.merged.entries, tool_names, memo)

    all_spans = [s for t in order for s in traces[t].values()]
    starts = [s.start for s in all_spans if s.start]
    ends = [s.end for s in all_spans if s.end]
    captured = bool(messages)
    return Transcript(
        messages=messages,
        system=_repaired(state.system),
        models=tuple(map(repair_text, state.models)),
        usage=Usage(state.usage_in, state.usage_out) if state.usage_seen else None,
        trace_ids=tuple(order),
        service=_repaired(state.service),
        started_at=from_unix_nano(min(starts)) if starts else None,
        ended_at=from_unix_nano(max(ends)) if ends else None,
        llm_calls=state.n_calls,
        content_captured=captured,
        no_content_reason=None if captured else (NO_CONTENT_REASON if state.genai_seen else NO_GENAI_REASON),
        unparsed_spans=bad_spans,
        unparsed_logs=bad_logs,
        truncated_spans=tuple(state.truncated),
        sources=tuple(sorted({e.source for e in state.merged.entries})),
        opening=state.opening,
    )


# ---------------------------------------------------------------- grouping


def group_traces(traces: Mapping[str, list[dict[str, Any]]],
                 id_attributes: Sequence[str] = DEFAULT_ID_ATTRIBUTES,
                 logs: Mapping[str, list[dict[str, Any]]] | None = None,
                 stitch_kept: int = STITCH_KEPT) -> dict[str, list[str]]:
    """Group whole traces into conversations: ``{conversation id: [trace ids]}``.

    By their ids, else by the previous response their calls continue (``keys.group_keyed``); then,
    in the order they started, a trace with neither continues the conversation whose whole
    transcript its first call was sent (``stitch``; ``logs``: each trace's log rows, where its
    content may be). There are no arrival times here, so no time window: the daemon keeps the same
    map incrementally, on its clock (``stage``). For tests and tools.
    """
    groups = group_keyed(traces, id_attributes)
    logs = logs or {}
    owner = {t: g for g, ts in groups.items() for t in ts}

    def start(t: str) -> tuple[int, str]:
        times = [as_int(r.get("start_time_unix_nano")) or 0 for r in traces[t]]
        times += [as_int(r.get("time_unix_nano")) or 0 for r in logs.get(t, [])]
        return (min((x for x in times if x), default=0), t)

    def transcript(ts: list[str]) -> Transcript:
        return build_transcript([r for t in ts for r in traces[t]], [r for t in ts for r in logs.get(t, [])])

    stitcher = Stitcher(window=float("inf"), kept=stitch_kept)
    placed: dict[str, list[str]] = {}  # conversation -> its traces placed so far
    moved: dict[str, str] = {}  # a group stitched -> the conversation it continues
    for t in sorted((t for t, g in owner.items() if g.startswith("trace:")), key=start):
        group = owner[t]
        if group == f"trace:{t}" and group not in moved:
            op = opening(transcript([t]))
            found = stitcher.find(op, 0.0, exclude=group) if op is not None else None
            if found is not None:
                moved[group] = found
        cid = moved.get(group, group)
        placed.setdefault(cid, []).append(t)
        tr = transcript(placed[cid])  # exact, where the daemon keeps the digest it can be sure of
        digest = answered(tr.messages)
        if digest is None:
            stitcher.drop(cid)
        else:
            stitcher.put(cid, tr.service, digest, start(placed[cid][0])[0], 0.0)
    out: dict[str, list[str]] = {}
    for g, ts in groups.items():
        out.setdefault(moved.get(g, g), []).extend(ts)
    # No conversation from nothing: one without an id exists only if a trace of it holds message content.
    return {g: sorted(ts) for g, ts in sorted(out.items())
            if not g.startswith("trace:") or any(has_messages(traces[t], logs.get(t, ())) for t in ts)}
