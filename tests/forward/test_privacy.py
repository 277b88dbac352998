"""Privacy, end to end: personal data planted in every field a bot's spans and logs can carry, in every dialect
the normalizer reads, reaches no sink and no file with ``redact: content``, ``scenarios export`` and
``replay export --redact``.

The planted text goes wherever each dialect puts message content (the normalizer's own dialect table, each
case checked to be read as content), and into log bodies, span names, status and exception messages,
``user.*`` attributes and a conversation id; a regex check quotes it as evidence, so it is in the verdict
events too. Every string that leaves is collected (protobuf decoded, JSON inside strings parsed) and
searched for each planted value, its digits without separators and each part of a name.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from collector.normalize import read_span

from ..normalize.test_normalize import EVENT_TABLE, SPAN_TABLE
from ..support.api_http import post_json
from ..support.daemon import DaemonProcess, base_config, run_cli, wait_until
from ..support.wire import add_attributes, post
from .test_forward import sink

# (kind, value as written in the text, the sentence that carries it)
PLANTED: list[tuple[str, str, str]] = [
    *(("email", v, f"My e-mail is {v} today.") for v in (
        "anna.rossi@example.com", "j.smith+triage@mail.example.co.uk", "lucia.fernandez@correo.example.es",
        "camille_dubois@example.fr", "jonas.becker@example.de", "priya.n@example.in", "user@[192.168.10.20]",
        "alice.smith@example.com")),
    *(("phone_us", v, f"Call me on {v} please.") for v in ("+1 415 867 5309", "(212) 736-5000", "+1-617-253-1000")),
    *(("phone_gb", v, f"Call me on {v} please.") for v in ("+44 20 7946 0958", "020 7946 0018", "+44 7700 900123")),
    *(("phone_fr", v, f"Mon numéro est le {v}.") for v in ("+33 1 42 68 53 00", "06 12 34 56 78",
                                                          "01 42 68 53 01")),
    *(("phone_de", v, f"Meine Nummer ist {v}.") for v in ("+49 30 901820", "030 22732152")),
    *(("phone_it", v, f"Il mio numero è {v}.") for v in ("+39 06 6982 1234", "333 123 4567")),
    *(("phone_es", v, f"Mi número es {v}.") for v in ("+34 912 345 678", "612 345 678")),
    *(("card", v, f"My card is {v} thanks.") for v in (
        "4111 1111 1111 1111", "5500-0000-0000-0004", "378282246310005", "6011 0000 0000 0004",
        "4012\u00a08888\u00a08888\u00a01881", "5105.1051.0510.5100")),
    *(("iban", v, f"My IBAN is {v} now.") for v in (
        "GB82 WEST 1234 5698 7654 32", "DE89 3704 0044 0532 0130 00", "FR14 2004 1010 0505 0001 3M02 606",
        "ES91 2100 0418 4502 0005 1332", "NL91-ABNA-0417-1643-00")),
    *(("ssn_us", v, f"SSN {v} on file.") for v in ("078-05-1120", "219-09-9999", "123-45-6789")),
    *(("nino_uk", v, f"NI number {v} on file.") for v in ("AB123456C", "JG 10 37 59 A")),
    *(("codice_fiscale", v, f"Codice fiscale {v} registrato.") for v in ("RSSMRA85T10A562S", "BNCGNN80A01H501U")),
    *(("nir_fr", v, f"Numéro de sécurité sociale {v} noté.") for v in ("1 85 05 78 006 084 91",
                                                                        "2 92 01 75 123 456 04")),
    *(("dni_nie_es", v, f"Mi DNI es {v} vale.") for v in ("12345678Z", "X1234567L", "Y-7654321-G")),
    *(("address", v, f"I live at {v} now.") for v in ("12 Baker Street", "221B Baker St", "5 rue de la Paix",
                                                       "via Roma 12", "calle Mayor 7", "Hauptstraße 3")),
    ("name", "Anna Rossi", "Hello, my name is Anna Rossi."),
    ("name", "Camille Dubois", "Bonjour, je m'appelle Camille Dubois."),
    ("name", "Giulia Bianchi", "Salve, mi chiamo Giulia Bianchi."),
    ("name", "Lucía Fernández", "Hola, me llamo Lucía Fernández."),
    ("name", "Jonas Becker", "Hallo, ich heiße Jonas Becker."),
    ("name", "Whitfield", "Dear Mr Whitfield, thanks."),
    ("name", "Olumide Adeyemi", "Hi, this is Olumide Adeyemi."),
    ("name", "Priya Natarajan", "Thanks, Priya Natarajan."),
]
TEXT = "\n".join(sentence for _, _, sentence in PLANTED)
EVIDENCE = "quotes-personal-data"
CRITERIA = f"""\
criteria:
  - id: {EVIDENCE}
    version: 1
    kind: code
    severity: high
    check: regex
    role: assistant
    pattern: "(?s)My e-mail is .{{0,600}}"
    must: not_match
"""


def test_the_planted_text_is_large_enough() -> None:
    assert len(PLANTED) >= 60 and len({kind for kind, _, _ in PLANTED}) >= 11


# ---------------------------------------------------------------- planting

def _plant(value: Any, texts: set[str]) -> Any:
    """``value`` with every string in ``texts`` (also inside JSON strings) replaced by the planted text."""
    if isinstance(value, str):
        if value in texts:
            return TEXT
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        return json.dumps(_plant(parsed, texts)) if isinstance(parsed, (dict, list)) else value
    if isinstance(value, dict):
        return {k: _plant(v, texts) for k, v in value.items()}
    if isinstance(value, list):
        return [_plant(v, texts) for v in value]
    return value


def _texts(*messages: Any) -> set[str]:
    return {m.content for ms in messages if isinstance(ms, list) for m in ms if m.content} | \
        {s for s in messages if isinstance(s, str)}


def planted_dialects() -> list[tuple[str, dict[str, Any]]]:
    """Each span dialect of the normalizer's table with its message texts replaced by the planted text,
    checked to be read back as content."""
    out = []
    for case_id, attrs, want_in, want_out, system, _ in SPAN_TABLE:
        planted = _plant(attrs, _texts(want_in, want_out, system))
        _, content = read_span(planted)
        assert content is not None and any(
            TEXT in (m.content or "") for m in [*(content.input or []), *(content.output or [])]) or \
            content.system == TEXT, case_id
        out.append((case_id, planted))
    logfire = {"events": json.dumps([{"event.name": "gen_ai.user.message", "content": TEXT},
                                     {"event.name": "gen_ai.choice", "index": 0,
                                      "message": {"role": "assistant", "content": TEXT}}])}
    _, content = read_span(logfire)
    assert content is not None and content.output and content.output[0].content == TEXT
    return [*out, ("logfire events", logfire)]


def traces_request(cases: list[tuple[str, dict[str, Any]]]) -> bytes:
    """One trace per case, a conversation each (one of them with a conversation id that is an e-mail),
    every span also carrying the planted text in its name, status, an exception and ``user.*``."""
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    add_attributes(rs.resource.attributes, {"service.name": "privacy-bot", "deployment.environment": "prod"})
    ss = rs.scope_spans.add()
    ss.scope.name = "privacy-test"
    for n, (case_id, attrs) in enumerate(cases, 1):
        span = ss.spans.add(trace_id=n.to_bytes(16, "big"), span_id=n.to_bytes(8, "big"),
                            start_time_unix_nano=1_764_478_800_000_000_000 + n,
                            end_time_unix_nano=1_764_478_801_000_000_000 + n)
        span.name = f"chat for {TEXT[:200]}"
        span.status.code = 2
        span.status.message = TEXT
        ev = span.events.add(name="exception", time_unix_nano=span.start_time_unix_nano)
        add_attributes(ev.attributes, {"exception.type": "KeyError", "exception.message": TEXT})
        conversation = "alice.smith@example.com" if n == 1 else f"privacy-{n}"
        _attributes(span.attributes, {**attrs, "gen_ai.conversation.id": conversation,
                                         "user.email": "anna.rossi@example.com", "user.name": "Anna Rossi",
                                         "gen_ai.request.model": "test-model"})
    return req.SerializeToString()


def logs_request() -> bytes:
    """The event dialects' records as log records, their bodies and attributes planted, and a plain log line."""
    req = ExportLogsServiceRequest()
    sl = req.resource_logs.add().scope_logs.add()
    for n, (_, events, want_in, want_out, system) in enumerate(EVENT_TABLE, 1):
        texts = _texts(want_in, want_out, system)
        for event in events:
            rec = sl.log_records.add(time_unix_nano=1_764_478_800_000_000_000, event_name=event.name,
                                     trace_id=(100 + n).to_bytes(16, "big"))
            _attributes(rec.attributes, _plant(dict(event.attributes), texts))
            if event.body is not None:
                _set(rec.body, _plant(event.body, texts))
    rec = sl.log_records.add(time_unix_nano=1_764_478_800_000_000_000)
    rec.body.string_value = f"user said: {TEXT}"
    return req.SerializeToString()


def _attributes(kvs: Any, values: dict[str, Any]) -> None:
    for key, value in values.items():
        _set(kvs.add(key=key).value, value)


def _set(target: AnyValue, value: Any) -> None:
    if isinstance(value, dict):
        target.kvlist_value.SetInParent()
        for k, v in value.items():
            _set(target.kvlist_value.values.add(key=k).value, v)
    elif isinstance(value, list):
        target.array_value.SetInParent()
        for v in value:
            _set(target.array_value.values.add(), v)
    elif isinstance(value, bool):
        target.bool_value = value
    elif isinstance(value, int):
        target.int_value = value
    else:
        target.string_value = str(value)


# ---------------------------------------------------------------- finding leaks

def _strings_of(value: Any) -> list[str]:
    """Every string in a decoded protobuf message, and in JSON inside those strings."""
    out: list[str] = []
    if hasattr(value, "ListFields"):
        for _, v in value.ListFields():
            repeated = hasattr(v, "__iter__") and not isinstance(v, (str, bytes)) and not hasattr(v, "ListFields")
            for item in v if repeated else [v]:
                out += _strings_of(item)
    elif isinstance(value, bytes):
        out.append(value.decode("utf-8", "replace"))
    elif isinstance(value, str):
        out.append(value)
        try:
            out += _json_strings(orjson.loads(value))
        except orjson.JSONDecodeError:
            pass
    return out


def _json_strings(v: Any) -> list[str]:
    if isinstance(v, str):
        return [v]
    if isinstance(v, dict):
        return [s for k, x in v.items() for s in (k, *_json_strings(x))]
    if isinstance(v, list):
        return [s for x in v for s in _json_strings(x)]
    return []


def _digits(text: str) -> str:
    # Separators between digits gone, so "4111 1111-1111.1111" is found as 4111111111111111.
    return re.sub(r"(?<=\d)[\s\u00a0\u2009\u202f./_()-]+(?=\d)", "", text)


def leaks(text: str) -> dict[str, list[str]]:
    """kind -> the planted values found in ``text``."""
    found: dict[str, list[str]] = {}
    folded, digits = text.casefold(), _digits(text).upper()
    for kind, value, _ in PLANTED:
        if kind == "name":
            hit = any(re.search(rf"(?<!\w){re.escape(part.casefold())}(?!\w)", folded) for part in value.split())
        elif kind in ("email", "address"):
            hit = value.casefold() in folded
        else:
            hit = re.sub(r"[^0-9A-Z]", "", value.upper()) in re.sub(r"[^0-9A-Z]", "", digits) if \
                kind not in ("nino_uk", "codice_fiscale") else value.replace(" ", "") in text.replace(" ", "")
        if hit:
            found.setdefault(kind, []).append(value)
    return found


def test_the_leak_finder_finds_each_planted_value_in_the_planted_text() -> None:
    found = leaks(TEXT)
    assert sum(len(v) for v in found.values()) == len(PLANTED)


# ---------------------------------------------------------------- the daemon

@pytest.mark.slow
def test_no_planted_value_reaches_a_sink_or_a_file(tmp_path: Path) -> None:
    criteria = tmp_path / "criteria.yaml"
    criteria.write_text(CRITERIA, encoding="utf-8")
    out_dir = tmp_path / "scenarios"
    with sink() as s:
        redact = {"mode": "content"}
        cfg = base_config(tmp_path, conversations={"idle_timeout": "1s"}, sampling={"rate": 1.0},
                          judges={"criteria": [str(criteria)]}, scenarios={"out_dir": str(out_dir)},
                          exporters={
                              "raw": {"type": "otlphttp", "endpoint": f"{s.base}/raw/v1/traces", "redact": redact},
                              "ls": {"type": "langsmith", "endpoint": f"{s.base}/ls/otel/v1/traces",
                                     "api_key": "k", "redact": "content", "signals": ["traces", "logs"]}})
        daemon = DaemonProcess(tmp_path, cfg).start()
        try:
            cases = planted_dialects()
            assert post(daemon.http, "/v1/traces", traces_request(cases))[0] == 200
            assert post(daemon.http, "/v1/logs", logs_request())[0] == 200
            items = _wait_items(daemon, len(cases))
            reply = post_json(daemon.api, f"/api/review/{items[0]['id']}/decision",
                              {"decision": "confirm", "reviewer": "Dr. Amal"})
            assert reply.status == 200, reply.body
            wait_until(lambda: _evaluation_events(s) >= len(cases), "every verdict out as an event, to both")
            wait_until(lambda: all(daemon.get("/api/status")[1]["exporters"][e]["queued_requests"] == 0
                                   for e in ("raw", "ls")), "both queues emptied")
            exported = run_cli("scenarios", "export", "--config", str(daemon.config_path))
            assert exported.returncode in (0, 1), exported.stderr
            export = tmp_path / "real.jsonl"
            done = run_cli("replay", "export", "--redact", "--out", str(export), "--config", str(daemon.config_path))
            assert done.returncode == 0, done.stderr
            assert daemon.stop() == 0
        finally:
            daemon.end()

    table: dict[str, dict[str, list[str]]] = {}
    sent = [r for r in s.received if r.status == 200]
    assert {r.path for r in sent} >= {"/raw/v1/traces", "/raw/v1/logs", "/ls/otel/v1/traces", "/ls/otel/v1/logs"}
    for r in sent:
        decoded = (ExportTraceServiceRequest if r.path.endswith("/traces") else ExportLogsServiceRequest
                   ).FromString(r.body)
        text = "\n".join(_strings_of(decoded)) + "\n" + r.body.decode("utf-8", "replace")
        table[r.path] = _merge(table.get(r.path, {}), leaks(text))
    scenario_files = [p for p in out_dir.rglob("*") if p.is_file()]
    assert any(p.suffix == ".yaml" for p in scenario_files), "the confirmed failure was written as a scenario"
    for p in scenario_files:
        table[f"scenario {p.name}"] = leaks(p.read_text(encoding="utf-8"))
    lines = export.read_text(encoding="utf-8").splitlines()
    assert len(lines) >= len(cases)
    table["replay export --redact"] = leaks("\n".join(json.dumps(orjson.loads(line), ensure_ascii=False) +
                                                      line for line in lines))
    # Still useful: the placeholders are there, and the structure (models, roles) is intact.
    assert any(b"<EMAIL_1>" in r.body for r in sent) and any(b"test-model" in r.body for r in sent)
    leaked = {where: found for where, found in table.items() if found}
    assert not leaked, yaml.safe_dump(leaked, allow_unicode=True)


def _merge(a: dict[str, list[str]], b: dict[str, list[str]]) -> dict[str, list[str]]:
    return {k: sorted(set(a.get(k, [])) | set(b.get(k, []))) for k in a.keys() | b.keys()}


def _wait_items(daemon: DaemonProcess, n: int) -> list[dict[str, Any]]:
    def items() -> list[dict[str, Any]]:
        got: list[dict[str, Any]] = daemon.get("/api/review?state=all&limit=1000")[1]["items"]
        return [i for i in got if i["criterion_id"] == EVIDENCE]

    wait_until(lambda: len(items()) >= n, f"{n} review items", timeout=120)
    return items()


def _evaluation_events(s: Any) -> int:
    n = 0
    for r in s.received:
        if r.path == "/raw/v1/logs" and r.status == 200:
            req = ExportLogsServiceRequest.FromString(r.body)
            n += sum(rec.event_name == "gen_ai.evaluation.result"
                     for rl in req.resource_logs for sl in rl.scope_logs for rec in sl.log_records)
    return n
