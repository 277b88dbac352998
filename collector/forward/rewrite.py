"""What an exporter changes in a request before it leaves, and nothing more.

- LangSmith builds threads from ``langsmith.metadata.thread_id``, not from
  ``gen_ai.conversation.id``: each span that carries a conversation id (one
  of ``conversations.id_attributes``) gets that attribute too, unless it has it.
- ``redact: content`` works by allowlist, not by a list of content keys (one
  would always be a dialect behind). Every string in the request passes through
  ``collector.redact``, one ``Redactor`` per request so that a value gets the
  same placeholder throughout it: attribute values at any depth (a string
  holding JSON is parsed and its strings redacted), span, event and log event
  names, status messages, log bodies. Left as they are: ``KEEP_ATTRIBUTES``
  (structural values: model and system names, operation names, finish
  reasons, ...) and the exporter's ``keep_attributes``; numbers and booleans;
  ids, timestamps and the scope's name and version. A conversation id
  (``conversations.id_attributes`` and ``ID_ATTRIBUTES``) leaves as it is
  unless it is itself personal data: then it leaves as ``pseudonym``, the same
  for the same id in every request, so the backend still groups the
  conversation. Bytes values that are not UTF-8 text cannot be checked, and
  leave empty.

A request that needs none of this is sent as the bytes that came in.

The request is decoded and encoded again whole. Adding the attribute on the
wire instead (copying every span's bytes but those that get it) was measured
and dropped: with the default ``conversations.id_attributes`` it cost as much as
the whole decode when one span in four carries an id, and twice as much when
every span does, as docs/scaling.md advises. The rewrite runs in the exporter's
rewrite process (``send.Rewriter``), never on the receivers' interpreter.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from ..redact import NAME_ATTRIBUTES, Redactor, detect

THREAD_ATTRIBUTE = "langsmith.metadata.thread_id"

KEEP_ATTRIBUTES: tuple[str, ...] = (
    # GenAI conventions: what was called, how, and how it ended
    "gen_ai.operation.name", "gen_ai.system", "gen_ai.provider.name", "gen_ai.request.model",
    "gen_ai.response.model", "gen_ai.response.id", "gen_ai.response.finish_reasons", "gen_ai.output.type",
    "gen_ai.tool.name", "gen_ai.tool.type", "gen_ai.tool.call.id", "gen_ai.agent.id", "gen_ai.agent.name",
    "gen_ai.data_source.id", "gen_ai.evaluation.name", "gen_ai.evaluation.score.label", "error.type",
    # instrumentation libraries' kinds and model names
    "openinference.span.kind", "input.mime_type", "output.mime_type", "llm.model_name", "llm.provider",
    "llm.system", "llm.request.type", "traceloop.span.kind", "traceloop.workflow.name", "traceloop.entity.name",
    "ai.operationId", "ai.model.id", "ai.model.provider", "ai.response.finishReason", "ai.response.id",
    "ai.response.model", "langfuse.observation.type", "langfuse.observation.model.name", "logfire.span_type",
    "logfire.msg_template",
    # HTTP and the service, as the SDKs set them
    "http.request.method", "http.method", "server.address", "url.scheme", "service.*", "telemetry.*",
    "deployment.environment*", "process.runtime.*", "os.type", "host.arch",
    # tracejudge's own, on verdict events
    "tracejudge.criterion.version", "tracejudge.judge.model", "tracejudge.review.state",
)
"""Attributes (``*`` ends a prefix) whose string values leave unredacted: names of things, never text."""

ID_ATTRIBUTES: tuple[str, ...] = ("gen_ai.conversation.id", "session.id", "tracejudge.conversation.id",
                                  THREAD_ATTRIBUTE)
"""Conversation ids beside ``conversations.id_attributes``: kept unless personal data, then pseudonymised."""


@dataclass(frozen=True)
class Redaction:
    """How an exporter with ``redact: content`` redacts (picklable: it goes to the rewrite process)."""

    keep: tuple[str, ...] = ()
    """``keep_attributes``: kept beside ``KEEP_ATTRIBUTES``."""
    ids: tuple[str, ...] = ()
    """``conversations.id_attributes``."""
    patterns: Mapping[str, str] = field(default_factory=dict)
    """Extra detectors, name -> regular expression."""
    key: bytes = b""
    """The secret ``pseudonym`` is keyed with."""


def pseudonym(value: str, key: bytes) -> str:
    """A stable stand-in for an id that is personal data; without ``key``, its hash cannot be reversed by
    hashing guesses (every e-mail address of a domain, say)."""
    return "pseudonym-" + hashlib.blake2b(value.encode("utf-8", "surrogatepass"), key=key, digest_size=12).hexdigest()


def _matcher(patterns: Iterable[str]) -> Callable[[str], bool]:
    patterns = list(patterns)
    exact = frozenset(p for p in patterns if not p.endswith("*"))
    prefixes = tuple(p[:-1] for p in patterns if p.endswith("*"))
    return lambda key: key in exact or key.startswith(prefixes)


class _Masker:
    """Collects every string of a request first (the redactor learns names from all of them), then redacts."""

    def __init__(self, redaction: Redaction) -> None:
        self.redaction = redaction
        self.keep = _matcher((*KEEP_ATTRIBUTES, *redaction.keep))
        self.is_id = _matcher((*ID_ATTRIBUTES, *redaction.ids))
        self.names: list[str] = []
        self.texts: list[str] = []
        self.jobs: list[Callable[[Redactor], bool]] = []
        self.changed = False  # by what needs no redactor: a pseudonymised id, bytes that are not text
        self._patterns = tuple(sorted(redaction.patterns.items()))
        self._done: dict[str, str] = {}  # a text as it leaves, by text: LLM calls resend the history

    def attributes(self, attributes: Iterable[KeyValue]) -> None:
        for kv in attributes:
            if self.is_id(kv.key):
                self._id(kv.value)
            elif not self.keep(kv.key):
                if kv.key in NAME_ATTRIBUTES and kv.value.WhichOneof("value") == "string_value":
                    self.names.append(kv.value.string_value)
                self.value(kv.value)

    def value(self, value: AnyValue) -> None:
        kind = value.WhichOneof("value")
        if kind == "string_value":
            self.text(value.string_value, _setter(value, "string_value"))
        elif kind == "bytes_value":
            try:
                text = value.bytes_value.decode("utf-8")
            except UnicodeDecodeError:
                value.bytes_value, self.changed = b"", True  # cannot be checked
                return
            self.text(text, lambda s: setattr(value, "bytes_value", s.encode("utf-8", "surrogatepass")))
        elif kind == "array_value":
            for v in value.array_value.values:
                self.value(v)
        elif kind == "kvlist_value":
            self.attributes(value.kvlist_value.values)

    def text(self, text: str, put: Callable[[str], Any]) -> None:
        """Redact ``text`` (JSON: its strings) and ``put`` it back when it changed."""
        if not text:
            return
        parsed = _json(text)
        if parsed is None:
            self.texts.append(text)

            def job(r: Redactor) -> bool:
                out = self._done.get(text)
                if out is None:
                    out = self._done[text] = r.text(text)
                return out != text and put(out) is None
        else:
            self.texts += _json_strings(parsed)

            def job(r: Redactor) -> bool:
                out = _json_map(parsed, lambda t: self._done.get(t) or self._done.setdefault(t, r.text(t)))
                return out != parsed and put(orjson.dumps(out).decode()) is None
        self.jobs.append(job)

    def _id(self, value: AnyValue) -> None:
        if value.WhichOneof("value") != "string_value":
            return
        text = value.string_value
        key = (text, self.redaction.key, self._patterns)
        out = _IDS.get(key)
        if out is None:
            if len(_IDS) >= _IDS_KEPT:
                _IDS.clear()
            out = _IDS[key] = pseudonym(text, self.redaction.key) if detect(text, self.redaction.patterns) else text
        if out != text:
            value.string_value, self.changed = out, True

    def run(self) -> bool:
        """Redact everything collected; whether anything changed."""
        if not self.jobs:
            return self.changed
        redactor = Redactor(self.redaction.patterns, names=self.names)
        redactor.learn(self.texts)
        return sum(job(redactor) for job in self.jobs) > 0 or self.changed


# An id as it leaves, by (id, key, patterns): a conversation's spans come in many requests, and reading an id
# costs the detectors' time (the phone library's, mostly).
_IDS: dict[tuple[str, bytes, tuple[tuple[str, str], ...]], str] = {}
_IDS_KEPT = 65_536


def _json(text: str) -> Any:
    """``text`` parsed, when it is a JSON object or array; else None."""
    head = text.lstrip()[:1]
    if head not in ("{", "["):
        return None
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return None


def _json_strings(v: Any) -> Iterable[str]:
    if isinstance(v, str):
        yield v
    elif isinstance(v, dict):
        for x in v.values():
            yield from _json_strings(x)
    elif isinstance(v, list):
        for x in v:
            yield from _json_strings(x)


def _json_map(v: Any, f: Callable[[str], str]) -> Any:
    if isinstance(v, str):
        return f(v)
    if isinstance(v, dict):
        return {k: _json_map(x, f) for k, x in v.items()}
    if isinstance(v, list):
        return [_json_map(x, f) for x in v]
    return v


def _setter(message: Any, name: str) -> Callable[[str], None]:
    return lambda s: setattr(message, name, s)


def rewrite(signal: str, body: bytes, *, thread_from: Sequence[str] = (), redact: Redaction | None = None) -> bytes:
    """``body`` (an OTLP protobuf export request of ``signal``) as this exporter sends it.

    Args:
        thread_from: add ``THREAD_ATTRIBUTE`` from the first of these attributes a span carries
            (LangSmith); empty: add nothing.
        redact: redact (see the module docstring); None: send content as it is.
    """
    if not thread_from and redact is None:
        return body
    rank = {key: n for n, key in enumerate(thread_from) if "*" not in key}
    masker = _Masker(redact) if redact is not None else None
    added = 0
    if signal == "traces":
        out: Any = ExportTraceServiceRequest.FromString(body)
        for rs in out.resource_spans:
            if masker:
                masker.attributes(rs.resource.attributes)
            for ss in rs.scope_spans:
                if masker:
                    masker.attributes(ss.scope.attributes)
                for span in ss.spans:
                    if thread_from:
                        added += _add_thread(span.attributes, rank)
                    if masker:
                        masker.text(span.name, _setter(span, "name"))
                        masker.text(span.status.message, _setter(span.status, "message"))
                        masker.attributes(span.attributes)
                        for event in span.events:
                            masker.text(event.name, _setter(event, "name"))
                            masker.attributes(event.attributes)
                        for link in span.links:
                            masker.attributes(link.attributes)
    else:
        out = ExportLogsServiceRequest.FromString(body)
        for rl in out.resource_logs:
            if masker:
                masker.attributes(rl.resource.attributes)
            for sl in rl.scope_logs:
                if masker:
                    masker.attributes(sl.scope.attributes)
                for record in sl.log_records:
                    if masker:
                        masker.text(record.event_name, _setter(record, "event_name"))
                        masker.value(record.body)
                        masker.attributes(record.attributes)
    changed = masker.run() if masker else False
    if not added and not changed:
        return body
    return out.SerializeToString()  # type: ignore[no-any-return]


def rewrite_all(signal: str, bodies: Sequence[bytes], thread_from: Sequence[str],
                redact: Redaction | None) -> bytes:
    """``rewrite`` of each of ``bodies``, concatenated (what a sender sends); runs in the rewrite process."""
    return b"".join(rewrite(signal, b, thread_from=thread_from, redact=redact) for b in bodies)


def _add_thread(attributes: Any, rank: Mapping[str, int]) -> int:
    # One pass over the span's attributes (this runs for every span forwarded to LangSmith): the id
    # attribute that comes first in ``conversations.id_attributes`` wins.
    best, value = len(rank), None
    for kv in attributes:
        key = kv.key
        if key == THREAD_ATTRIBUTE:
            return 0
        r = rank.get(key, best)
        if r < best:
            best, value = r, kv.value
    if value is None:
        return 0
    kind = value.WhichOneof("value")
    text = value.string_value if kind == "string_value" else str(value.int_value) if kind == "int_value" else ""
    if not text:
        return 0
    attributes.add(key=THREAD_ATTRIBUTE, value=AnyValue(string_value=text))
    return 1
