"""Decode OTLP export requests into column batches the store inserts as they are.

One pass over each span turns protobuf into plain Python values: ids to lowercase
hex, AnyValue trees to JSON-ready values, attribute lists to JSON text. That walk
is the main cost of ingestion, so it is written once, here, with no per-span
helper objects.

Both encodings land in the same protobuf message first: OTLP/JSON needs its hex
ids turned into bytes before ``json_format`` sees them, because ``ParseDict``
silently base64-decodes a 32-character hex id into 24 wrong bytes. Its parser is
made strict where it would store a wrong value silently (a message written as a
string, an enum number beyond int32, a boolean as a double), and a lone UTF-16
surrogate, which a JS exporter sends when it cut a string inside a pair, becomes
U+FFFD as any UTF-8 encoder would make it.

Whatever a request carries must not fail the store's shared commit, so the
walk checks every value against its column: protobuf's types match the
store's except ``kind`` and ``status.code`` (int32 enums, int8 columns), and a
span whose value does not fit is rejected on its own through ``partial_success``.
Strings are valid UTF-8 (protobuf refuses anything else, JSON's lone surrogates
are replaced), and both decoders stop at 100 message levels, well within the
walk's recursion and orjson's 254 levels.

Public functions:
    parse_traces / parse_logs / parse_metrics: body bytes -> protobuf request
    span_batch / log_batch: protobuf request -> (SpanBatch | LogBatch, rejected)
    any_value / attributes_dict: AnyValue / KeyValue list -> Python values
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import math
import re
from typing import Any, Iterable

import orjson
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from .batches import LogBatch, SpanBatch


class DecodeFailure(ValueError):
    """The request body is not a valid OTLP message of the expected kind."""


# ---------------------------------------------------------------- AnyValue walk


def any_value(v: Any) -> Any:
    """Turn an ``AnyValue`` into a JSON-ready Python value (bytes as base64)."""
    kind = v.WhichOneof("value")
    if kind == "string_value":
        return v.string_value
    if kind == "int_value":
        return v.int_value
    if kind == "bool_value":
        return v.bool_value
    if kind == "double_value":
        d = v.double_value
        # JSON has no NaN/Infinity; keep them as the strings OTLP/JSON uses.
        return d if math.isfinite(d) else str(d).replace("inf", "Infinity").replace("nan", "NaN")
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in v.kvlist_value.values}
    if kind == "bytes_value":
        return base64.b64encode(v.bytes_value).decode("ascii")
    return None


def attributes_dict(kvs: Iterable[Any]) -> dict[str, Any]:
    """KeyValue list -> dict. Strings are by far the common case: a non-empty ``string_value`` is
    one, with no ``WhichOneof`` call (a fifth less time on ``bench/ingest.py``'s spans); an empty
    one may be another kind, or the empty string, which ``any_value`` tells apart."""
    out: dict[str, Any] = {}
    for kv in kvs:
        v = kv.value
        s = v.string_value
        out[kv.key] = s if s else any_value(v)
    return out


def to_json(value: Any) -> str:
    """Compact JSON text as stored in the JSON columns (orjson: 6x the stdlib on this walk)."""
    return orjson.dumps(value).decode()


# ---------------------------------------------------------------- request parsing

_HEX_ID_KEYS = ("traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id")


def _fix_hex_ids(obj: dict[str, Any], where: str) -> None:
    for key in _HEX_ID_KEYS:
        val = obj.get(key)
        if isinstance(val, str):
            if val == "":
                del obj[key]
                continue
            try:
                raw = bytes.fromhex(val)
            except ValueError:
                raise DecodeFailure(f"{where}.{key}: {val[:40]!r} is not a hex id") from None
            obj[key] = base64.b64encode(raw).decode("ascii")


def _walk_json_ids(doc: Any, top: str, scopes: str, items: str) -> None:
    """Convert OTLP/JSON hex ids to base64 so json_format decodes the right bytes."""
    if not isinstance(doc, dict):
        raise DecodeFailure("OTLP/JSON body must be a JSON object")
    for i, res in enumerate(_list(doc.get(top) or doc.get(_snake(top)), top)):
        if not isinstance(res, dict):
            raise DecodeFailure(f"{top}[{i}] must be an object")
        sk = res.get(scopes) or res.get(_snake(scopes))
        for j, scope in enumerate(_list(sk, f"{top}[{i}].{scopes}")):
            if not isinstance(scope, dict):
                raise DecodeFailure(f"{top}[{i}].{scopes}[{j}] must be an object")
            its = scope.get(items) or scope.get(_snake(items))
            for k, item in enumerate(_list(its, f"{top}[{i}].{scopes}[{j}].{items}")):
                where = f"{top}[{i}].{scopes}[{j}].{items}[{k}]"
                if not isinstance(item, dict):
                    raise DecodeFailure(f"{where} must be an object")
                _fix_hex_ids(item, where)
                for n, link in enumerate(_list(item.get("links"), f"{where}.links")):
                    if isinstance(link, dict):
                        _fix_hex_ids(link, f"{where}.links[{n}]")


def _list(val: Any, where: str) -> list[Any]:
    if val is None:
        return []
    if not isinstance(val, list):
        raise DecodeFailure(f"{where} must be a list")
    return val


def _snake(camel: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in camel)


class _StrictParser(json_format._Parser):  # type: ignore[misc,name-defined]
    """``json_format``'s parser, refusing what it would otherwise store altered.

    With unknown fields ignored (OTLP/JSON requires it), a message written as a
    string is read as a list of unknown one-letter field names, and so is lost;
    an enum number beyond int32 wraps (2**40 becomes 0), and ``true`` becomes the
    double 1.0. Each is a ``ParseError`` naming the field here.
    """

    def ConvertMessage(self, value: Any, message: Any, path: str) -> None:  # noqa: N802 (json_format's name)
        where = path or message.DESCRIPTOR.name
        if not isinstance(value, dict):
            raise json_format.ParseError(f"{where} must be a JSON object, not {_json_type(value)}")
        for key, is_enum in _checked_fields(message.DESCRIPTOR):
            if key in value:
                _check_scalar(value[key], is_enum, f"{where}.{key}")
        super().ConvertMessage(value, message, path)


@functools.cache
def _checked_fields(descriptor: Any) -> tuple[tuple[str, bool], ...]:
    """JSON keys (both spellings) of the enum and double fields of a message type."""
    return tuple(
        (key, f.enum_type is not None)
        for f in descriptor.fields
        if f.enum_type is not None or f.cpp_type == f.CPPTYPE_DOUBLE
        for key in dict.fromkeys((f.json_name, f.name))
    )


_INT32 = range(-2**31, 2**31)


def _check_scalar(value: Any, is_enum: bool, where: str) -> None:
    if isinstance(value, bool):
        raise json_format.ParseError(f"{where} must be {'an enum name or number' if is_enum else 'a number'}, "
                                     f"not {_json_type(value)}")
    if not is_enum:
        return
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            return  # an enum name: json_format knows it or ignores it as unknown
    if isinstance(value, float):
        if not value.is_integer():
            raise json_format.ParseError(f"{where} must be an enum name or integer, not {value}")
        value = int(value)
    if isinstance(value, int) and value not in _INT32:
        raise json_format.ParseError(f"{where} must be an enum number within int32, not {value}")


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


# After json.loads, escaped surrogate pairs are one character: what is left in
# this range is a lone surrogate, which UTF-8 cannot encode.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _replace_lone_surrogates(doc: Any) -> None:
    """Every string in ``doc`` with a lone surrogate gets U+FFFD in its place (iteratively: docs nest deep).

    Keys too: only unknown field names can hold one, and upb fails on them with a SystemError.
    """
    stack = [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key in [k for k in node if _LONE_SURROGATE.search(k)]:
                node[_LONE_SURROGATE.sub("\ufffd", key)] = node.pop(key)
        for key, val in (node.items() if isinstance(node, dict) else enumerate(node)):
            if isinstance(val, str):
                if _LONE_SURROGATE.search(val):
                    node[key] = _LONE_SURROGATE.sub("\ufffd", val)
            elif isinstance(val, (dict, list)):
                stack.append(val)


def _first_cause(exc: BaseException) -> BaseException:
    """The innermost ParseError: json_format wraps it once per enclosing field ("Failed to parse ... field")."""
    while isinstance(exc.__cause__, json_format.ParseError):
        exc = exc.__cause__
    return exc


def _load_json(body: bytes) -> Any:
    try:
        doc = json.loads(body)
    except RecursionError:
        raise DecodeFailure("body is not valid JSON: nested too deeply") from None
    except ValueError as exc:  # bad syntax or encoding, or an integer of more than 4300 digits
        raise DecodeFailure(f"body is not valid JSON: {exc}") from None
    if _SURROGATE_ESCAPE.search(body):
        _replace_lone_surrogates(doc)
    return doc


def _parse(body: bytes, json_body: bool, message: Any, ids: tuple[str, str, str] | None) -> Any:
    if json_body:
        if not body.strip():
            return message  # an empty request is a valid, empty export
        doc = _load_json(body)
        if ids is not None:
            _walk_json_ids(doc, *ids)
        try:
            _StrictParser(True, None, 100).ConvertMessage(doc, message, "")
        except (json_format.ParseError, TypeError, ValueError, RecursionError) as exc:
            raise DecodeFailure(f"body is not a valid OTLP/JSON {type(message).__name__}: "
                                f"{_first_cause(exc)}") from None
        return message
    try:
        message.ParseFromString(body)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise DecodeFailure(f"body is not a valid protobuf {type(message).__name__}: {exc}") from None
    return message


def parse_traces(body: bytes, json_body: bool = False) -> ExportTraceServiceRequest:
    return _parse(body, json_body, ExportTraceServiceRequest(), ("resourceSpans", "scopeSpans", "spans"))


def parse_logs(body: bytes, json_body: bool = False) -> ExportLogsServiceRequest:
    return _parse(body, json_body, ExportLogsServiceRequest(), ("resourceLogs", "scopeLogs", "logRecords"))


def parse_metrics(body: bytes, json_body: bool = False) -> ExportMetricsServiceRequest:
    return _parse(body, json_body, ExportMetricsServiceRequest(), None)


def count_data_points(req: ExportMetricsServiceRequest) -> int:
    """Metric data points in a request (metrics are counted, then discarded)."""
    n = 0
    for rm in req.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                kind = m.WhichOneof("data")
                if kind:
                    n += len(getattr(m, kind).data_points)
    return n


_ZERO_TRACE = bytes(16)
_ZERO_SPAN = bytes(8)


def _resource_parts(resource: Any) -> tuple[str, str | None]:
    attrs = attributes_dict(resource.attributes)
    service = attrs.get("service.name")
    return to_json(attrs), service if isinstance(service, str) else None


def span_batch(req: ExportTraceServiceRequest) -> tuple[SpanBatch, int, str]:
    """Walk every span once into columns.

    Returns the batch, the number of spans rejected (bad ids, or a kind or status
    code the store's int8 columns cannot hold; reported through ``partial_success``)
    and a message naming the first reason.
    """
    batch = SpanBatch()
    (c_trace, c_span, c_parent, c_state, c_flags, c_name, c_kind, c_start, c_end, c_attrs,
     c_events, c_links, c_scode, c_smsg, c_dropped, c_res, c_res_url, c_scope, c_scope_v,
     c_scope_attrs, c_service) = batch.columns
    rejected = 0
    reason = ""
    for rs in req.resource_spans:
        res_json, service = _resource_parts(rs.resource)
        res_url = rs.schema_url or None
        for ss in rs.scope_spans:
            scope = ss.scope
            scope_name = scope.name or None
            scope_version = scope.version or None
            scope_attrs = to_json(attributes_dict(scope.attributes)) if len(scope.attributes) else None
            for sp in ss.spans:
                tid = sp.trace_id
                sid = sp.span_id
                if len(tid) != 16 or len(sid) != 8 or tid == _ZERO_TRACE or sid == _ZERO_SPAN:
                    rejected += 1
                    if not reason:
                        reason = (f"span {sp.name!r} has an invalid trace_id/span_id "
                                  f"({len(tid)} and {len(sid)} bytes, all-zero not allowed)")
                    continue
                kind = sp.kind
                st = sp.status
                code = st.code
                if not (-128 <= kind <= 127 and -128 <= code <= 127):
                    rejected += 1
                    if not reason:
                        what, value = ("kind", kind) if not -128 <= kind <= 127 else ("status.code", code)
                        reason = f"span {sid.hex()} ({sp.name!r}): {what} {value} is outside -128..127"
                    continue
                c_trace.append(tid.hex())
                c_span.append(sid.hex())
                parent = sp.parent_span_id
                c_parent.append(parent.hex() if parent else None)
                c_state.append(sp.trace_state or None)
                c_flags.append(sp.flags)
                c_name.append(sp.name)
                c_kind.append(kind)
                c_start.append(sp.start_time_unix_nano)
                c_end.append(sp.end_time_unix_nano)
                c_attrs.append(to_json(attributes_dict(sp.attributes)))
                if sp.events:
                    c_events.append(to_json([
                        {"time_unix_nano": e.time_unix_nano, "name": e.name,
                         "attributes": attributes_dict(e.attributes),
                         **({"dropped_attributes_count": e.dropped_attributes_count}
                            if e.dropped_attributes_count else {})}
                        for e in sp.events
                    ]))
                else:
                    c_events.append(None)
                if sp.links:
                    c_links.append(to_json([
                        {"trace_id": ln.trace_id.hex(), "span_id": ln.span_id.hex(),
                         "trace_state": ln.trace_state or None, "flags": ln.flags,
                         "attributes": attributes_dict(ln.attributes)}
                        for ln in sp.links
                    ]))
                else:
                    c_links.append(None)
                c_scode.append(code)
                c_smsg.append(st.message or None)
                if sp.dropped_attributes_count or sp.dropped_events_count or sp.dropped_links_count:
                    c_dropped.append(to_json({
                        "attributes": sp.dropped_attributes_count,
                        "events": sp.dropped_events_count,
                        "links": sp.dropped_links_count,
                    }))
                else:
                    c_dropped.append(None)
                c_res.append(res_json)
                c_res_url.append(res_url)
                c_scope.append(scope_name)
                c_scope_v.append(scope_version)
                c_scope_attrs.append(scope_attrs)
                c_service.append(service)
    return batch, rejected, reason


def log_batch(req: ExportLogsServiceRequest) -> tuple[LogBatch, int, str]:
    """Walk every log record once into columns.

    A record has no id of its own, so ``log_id`` is a digest of its resource and
    its serialized bytes: an OTLP retry of the same record is stored once.
    """
    batch = LogBatch()
    (c_id, c_trace, c_span, c_time, c_obs, c_sev, c_sevtext, c_event, c_body, c_attrs,
     c_flags, c_dropped, c_res, c_scope, c_scope_v, c_service) = batch.columns
    rejected = 0
    reason = ""
    for rl in req.resource_logs:
        res_json, service = _resource_parts(rl.resource)
        res_digest = hashlib.blake2b(res_json.encode(), digest_size=8).digest()
        for sl in rl.scope_logs:
            scope_name = sl.scope.name or None
            scope_version = sl.scope.version or None
            for rec in sl.log_records:
                tid = rec.trace_id
                sid = rec.span_id
                if (tid and len(tid) != 16) or (sid and len(sid) != 8):
                    rejected += 1
                    if not reason:
                        reason = f"log record has an invalid trace_id/span_id ({len(tid)} and {len(sid)} bytes)"
                    continue
                digest = hashlib.blake2b(rec.SerializeToString(deterministic=True),
                                         digest_size=16, key=res_digest).hexdigest()
                attrs = attributes_dict(rec.attributes)
                event_name = rec.event_name or attrs.get("event.name")
                c_id.append(digest)
                c_trace.append(tid.hex() if tid and tid != _ZERO_TRACE else None)
                c_span.append(sid.hex() if sid and sid != _ZERO_SPAN else None)
                c_time.append(rec.time_unix_nano)
                c_obs.append(rec.observed_time_unix_nano)
                c_sev.append(rec.severity_number)
                c_sevtext.append(rec.severity_text or None)
                c_event.append(event_name if isinstance(event_name, str) else None)
                c_body.append(to_json(any_value(rec.body)) if rec.HasField("body") else None)
                c_attrs.append(to_json(attrs))
                c_flags.append(rec.flags)
                c_dropped.append(rec.dropped_attributes_count)
                c_res.append(res_json)
                c_scope.append(scope_name)
                c_scope_v.append(scope_version)
                c_service.append(service)
    return batch, rejected, reason
