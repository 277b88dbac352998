"""Forwarding: the real daemon, real OTLP in, and local HTTP servers standing in for each backend type."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from collector.config import DEFAULT_ID_ATTRIBUTES, validate_config
from collector.errors import ConfigError
from collector.forward.rewrite import THREAD_ATTRIBUTE, Redaction, rewrite, rewrite_all

from ..support.daemon import DaemonProcess, base_config, pool_workers, wait_until
from ..support.wire import add_attributes, post, span_request_bytes

pytestmark = pytest.mark.slow  # its tests, but for the config checks, forward through the daemon


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    status: int = 0
    """What the sink answered."""


@dataclass
class Sink:
    """A backend on loopback: records each request, answers what ``answer`` says (200 by default)."""

    answer: Callable[[Received], tuple[int, dict[str, str]]] = lambda r: (200, {})
    received: list[Received] = field(default_factory=list)
    base: str = ""

    def at(self, path: str) -> list[Received]:
        return [r for r in self.received if r.path == path]

    def delivered(self, path: str | None = None) -> list[bytes]:
        """The bodies answered 200 (at ``path``, or anywhere), in arrival order."""
        return [r.body for r in self.received if r.status == 200 and path in (None, r.path)]


@contextmanager
def sink() -> Iterator[Sink]:
    s = Sink()
    loop = asyncio.new_event_loop()

    async def handle(request: web.Request) -> web.Response:
        r = Received(request.path, {k.lower(): v for k, v in request.headers.items()}, await request.read())
        s.received.append(r)
        status, headers = s.answer(r)
        r.status = status
        return web.Response(status=status, headers=headers)

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("POST", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    s.base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield s
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.run_until_complete(runner.cleanup())
        loop.close()


def traces(seed: int, n: int = 4, conversation: str | None = "conv-1") -> bytes:
    """A protobuf traces request of ``n`` spans, each carrying ``conversation`` as gen_ai.conversation.id."""
    body, _ = span_request_bytes(n, trace_seed=seed, attr_bytes=200)
    if conversation is None:
        return body
    req = ExportTraceServiceRequest.FromString(body)
    for span in req.resource_spans[0].scope_spans[0].spans:
        add_attributes(span.attributes, {"gen_ai.conversation.id": conversation})
    return req.SerializeToString()


def logs_request(text: str) -> bytes:
    req = ExportLogsServiceRequest()
    rec = req.resource_logs.add().scope_logs.add().log_records.add()
    rec.time_unix_nano = 1_764_478_800_000_000_000
    rec.body.string_value = text
    return req.SerializeToString()


def send(daemon: DaemonProcess, body: bytes, signal: str = "traces") -> int:
    status, _, _ = post(daemon.http, f"/v1/{signal}", body)
    return status


def forwarded(daemon: DaemonProcess, exporter: str) -> dict[str, Any]:
    return daemon.get("/api/status")[1]["exporters"][exporter]


def test_each_backend_type_gets_its_path_headers_and_the_request(tmp_path: Path) -> None:
    with sink() as s:
        exporters = {
            "raw": {"type": "otlphttp", "endpoint": f"{s.base}/raw/v1/traces", "headers": {"X-Team": "support"}},
            "ls": {"type": "langsmith", "endpoint": f"{s.base}/ls/otel/v1/traces", "api_key": "ls-key",
                   "project": "support-bot"},
            "opik": {"type": "opik", "endpoint": f"{s.base}/opik/api/v1/private/otel/v1/traces", "api_key": "op-key",
                     "workspace": "acme", "project": "bot"},
            "lw": {"type": "langwatch", "endpoint": f"{s.base}/lw/api/otel/v1/traces", "api_key": "lw-key"},
        }
        daemon = DaemonProcess(tmp_path, base_config(tmp_path, exporters=exporters)).start()
        try:
            body = traces(1)
            assert send(daemon, body) == 200
            assert send(daemon, logs_request("a log line"), "logs") == 200
            wait_until(lambda: len(s.received) >= 6, "4 traces and 2 logs requests forwarded")
            raw, = s.at("/raw/v1/traces")
            assert raw.body == body and raw.headers["x-team"] == "support"
            assert raw.headers["content-type"] == "application/x-protobuf"
            assert s.at("/raw/v1/logs")[0].body == logs_request("a log line")
            ls, = s.at("/ls/otel/v1/traces")
            assert ls.headers["x-api-key"] == "ls-key" and ls.headers["langsmith-project"] == "support-bot"
            got = ExportTraceServiceRequest.FromString(ls.body)
            for span in got.resource_spans[0].scope_spans[0].spans:  # the thread id, and nothing else
                assert span.attributes[-1].key == THREAD_ATTRIBUTE
                assert span.attributes[-1].value.string_value == "conv-1"
                del span.attributes[-1]
            assert got == ExportTraceServiceRequest.FromString(body)
            op, = s.at("/opik/api/v1/private/otel/v1/traces")
            assert op.body == body and op.headers["authorization"] == "op-key"
            assert op.headers["comet-workspace"] == "acme" and op.headers["projectname"] == "bot"
            lw, = s.at("/lw/api/otel/v1/traces")
            assert lw.body == body and lw.headers["authorization"] == "Bearer lw-key"
            assert len(s.at("/lw/api/otel/v1/logs")) == 1
            assert not s.at("/ls/otel/v1/logs") and not s.at("/opik/api/v1/private/otel/v1/logs")
            # Counted before the queue shrinks: wait on the emptied queue, which implies the count.
            wait_until(lambda: forwarded(daemon, "ls")["queued_requests"] == 0, "LangSmith's queue emptied")
            assert forwarded(daemon, "ls")["sent"] == 1
            wait_until(lambda: daemon.metric("tracejudge_forward_sent_total") == 6, "6 sends counted")
            assert daemon.stop() == 0
        finally:
            daemon.end()


def test_a_backend_down_across_a_restart_gets_everything_in_order_once(tmp_path: Path) -> None:
    with sink() as s:
        down = True
        s.answer = lambda r: (503, {"Retry-After": "1"}) if down else (200, {})
        cfg = base_config(tmp_path, exporters={"raw": {"type": "otlphttp", "endpoint": f"{s.base}/v1/traces"}})
        daemon = DaemonProcess(tmp_path, cfg).start()
        sent = [traces(seed) for seed in range(1, 11)]
        for body in sent[:5]:
            assert send(daemon, body) == 200
        wait_until(lambda: forwarded(daemon, "raw")["retried"] >= 2, "the sender retrying")
        assert forwarded(daemon, "raw")["state"] == "retrying"
        assert daemon.stop() == 0  # SIGTERM while the backend is down
        daemon.start()
        try:
            assert forwarded(daemon, "raw")["queued_requests"] >= 5
            for body in sent[5:]:
                assert send(daemon, body) == 200
            down = False
            wait_until(lambda: forwarded(daemon, "raw")["queued_requests"] == 0, "the queue emptied")
            # Queued requests go out together (concatenated protobuf is the request holding both), in order.
            assert b"".join(s.delivered()) == b"".join(sent), "every request once, in order"
            assert sum(r.status == 503 for r in s.received) >= 2 and s.received[-1].status == 200
            assert daemon.stop() == 0
        finally:
            daemon.end()


def test_kill9_while_requests_are_queued_loses_nothing_acknowledged(tmp_path: Path) -> None:
    with sink() as s:
        down = True
        s.answer = lambda r: (503, {"Retry-After": "1"}) if down else (200, {})
        cfg = base_config(tmp_path, exporters={
            "raw": {"type": "otlphttp", "endpoint": f"{s.base}/v1/traces"},
            "ls": {"type": "langsmith", "endpoint": f"{s.base}/ls/otel/v1/traces", "api_key": "k"}})
        daemon = DaemonProcess(tmp_path, cfg).start()
        sent = [traces(seed) for seed in range(1, 9)]
        for body in sent:
            assert send(daemon, body) == 200
        assert daemon.proc is not None
        wait_until(lambda: s.at("/ls/otel/v1/traces"), "a LangSmith send, through the rewrite process")
        stage = daemon.get("/api/status")[1]["conversations_process"]["pid"]
        rewriter, = (pid for pid in pool_workers(daemon.proc.pid) if pid != stage)
        daemon.kill9()
        for pid, what in ((rewriter, "the rewrite process"), (stage, "the conversation stage's process")):
            wait_until(lambda pid=pid: not Path(f"/proc/{pid}").exists() or
                       Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z",
                       f"{what} to end with the daemon")
        down = False
        daemon.start()
        try:
            wait_until(lambda: forwarded(daemon, "raw")["queued_requests"] == 0, "the queue emptied")
            wait_until(lambda: forwarded(daemon, "ls")["queued_requests"] == 0, "LangSmith's queue emptied")
            # Nothing was delivered before the kill: after it, each request once, in order.
            assert b"".join(s.delivered("/v1/traces")) == b"".join(sent)
            assert b"".join(s.delivered("/ls/otel/v1/traces")) == rewrite_all(
                "traces", sent, DEFAULT_ID_ATTRIBUTES, None)
            # The requests tried before the kill are counted as sent again (duplicates, had a try got through).
            assert 1 <= forwarded(daemon, "raw")["resent_after_restart"] <= len(sent)
            assert daemon.stop() == 0
        finally:
            daemon.end()


def test_a_permanent_400_is_dropped_counted_and_never_retried(tmp_path: Path) -> None:
    bad = traces(1)
    with sink() as s:
        s.answer = lambda r: (400, {}) if r.body == bad else (200, {})
        cfg = base_config(tmp_path, exporters={"lw": {"type": "langwatch", "endpoint": f"{s.base}/api/otel/v1/traces",
                                                      "api_key": "k"}})
        daemon = DaemonProcess(tmp_path, cfg).start()
        try:
            good = traces(2)
            assert send(daemon, bad) == 200 and send(daemon, good) == 200
            wait_until(lambda: forwarded(daemon, "lw")["queued_requests"] == 0, "the queue emptied")
            assert [r.body for r in s.received].count(bad) == 1
            assert good in [r.body for r in s.received]
            st = forwarded(daemon, "lw")
            assert st["dropped"] == 1 and st["retried"] == 0 and st["sent"] == 1
            assert "answered 400 for a traces request" in daemon.output()
            assert daemon.metric('tracejudge_forward_dropped_total{exporter="lw",reason="http_400"}') == 1
            assert daemon.stop() == 0
        finally:
            daemon.end()


def test_a_full_queue_pushes_back_with_503_and_loses_nothing(tmp_path: Path) -> None:
    with sink() as s:
        down = True
        s.answer = lambda r: (503, {"Retry-After": "1"}) if down else (200, {})
        cfg = base_config(tmp_path, exporters={"raw": {"type": "otlphttp", "endpoint": f"{s.base}/v1/traces",
                                                       "queue": {"max_size": "20KB"}}})
        daemon = DaemonProcess(tmp_path, cfg).start()
        try:
            accepted, refused = [], 0
            for seed in range(1, 40):
                body = traces(seed)
                status, headers, _ = post(daemon.http, "/v1/traces", body)
                if status == 200:
                    accepted.append(body)
                else:
                    assert status == 503 and int(headers["retry-after"]) >= 1
                    refused += 1
            assert accepted and refused
            assert daemon.metric('tracejudge_spans_rejected_total{reason="backpressure"}') == refused * 4
            down = False
            wait_until(lambda: forwarded(daemon, "raw")["queued_requests"] == 0, "the queue emptied")
            assert b"".join(s.delivered()) == b"".join(accepted)
            assert daemon.stop() == 0
        finally:
            daemon.end()
        assert daemon.query("SELECT count(*) FROM span_records")[0][0] == 4 * len(accepted)


@pytest.mark.parametrize(("exporter", "problem"), [
    ({"type": "langsmith", "api_key": ""}, "exporters.x: api_key is missing"),
    ({"type": "otlphttp"}, "needs its endpoint"),
    ({"type": "otlphttp", "endpoint": "localhost:4318"}, "exporters.x.endpoint"),
    ({"type": "otlphttp", "endpoint": "http://h/v1/logs"}, "not a traces URL"),
    ({"type": "langwatch", "api_key": "k", "signal": ["logs"]}, "exporters.x.signal: unknown key"),
    ({"type": "opik", "api_key": "k"}, "Comet-Workspace"),
    ({"type": "opik", "workspace": "w"}, "exporters.x: api_key is missing"),
    ({"type": "datadog"}, "exporters.x.type"),
    ({"type": "otlphttp", "endpoint": "http://h/v1/traces", "queue": {"max_size": "lots"}}, "max_size"),
])
def test_a_bad_exporter_is_an_error_naming_its_key(exporter: dict[str, Any], problem: str) -> None:
    with pytest.raises(ConfigError, match=problem.replace(".", r"\.")):
        validate_config({"exporters": {"x": exporter}}, Path("."), "otel-config.yaml")


def test_each_backend_type_has_its_default_endpoint_and_signals() -> None:
    cfg, _ = validate_config({"exporters": {
        "opik": {"type": "opik", "api_key": "k", "workspace": "w"},
        "opik-self-hosted": {"type": "opik", "endpoint": "http://opik.internal/api/v1/private/otel/v1/traces"},
        "ls": {"type": "langsmith", "api_key": "k"},
        "lw": {"type": "langwatch", "api_key": "k"},
        "raw": {"type": "otlphttp", "endpoint": "http://collector.internal/v1/traces", "signals": ["traces"]},
    }}, Path("."), "otel-config.yaml")
    assert {name: (e.url, e.sends) for name, e in cfg.exporters.items()} == {
        "opik": ("https://www.comet.com/opik/api/v1/private/otel/v1/traces", ("traces",)),
        "opik-self-hosted": ("http://opik.internal/api/v1/private/otel/v1/traces", ("traces",)),
        "ls": ("https://api.smith.langchain.com/otel/v1/traces", ("traces",)),
        "lw": ("https://app.langwatch.ai/api/otel/v1/traces", ("traces", "logs")),
        "raw": ("http://collector.internal/v1/traces", ("traces",)),
    }


def test_rewrite_redacts_content_and_leaves_ids_alone() -> None:
    req = ExportTraceServiceRequest.FromString(traces(1, n=1))
    span = req.resource_spans[0].scope_spans[0].spans[0]
    add_attributes(span.attributes, {"gen_ai.output.messages": "Call Anna Rossi on +44 20 7946 0958, anna@example.com"})
    out = ExportTraceServiceRequest.FromString(rewrite("traces", req.SerializeToString(), redact=Redaction()))
    got = {kv.key: kv.value.string_value for kv in out.resource_spans[0].scope_spans[0].spans[0].attributes}
    assert "+44 20 7946 0958" not in got["gen_ai.output.messages"] and "<PHONE_1>" in got["gen_ai.output.messages"]
    assert "<EMAIL_1>" in got["gen_ai.output.messages"]
    assert got["gen_ai.conversation.id"] == "conv-1"
    assert out.resource_spans[0].scope_spans[0].spans[0].span_id == span.span_id
    plain = traces(2, conversation=None)
    assert rewrite("traces", plain, thread_from=("gen_ai.conversation.id",)) == plain  # nothing to add: the bytes


def _events(s: Sink) -> list[tuple[bytes, bytes, dict[str, Any]]]:
    """Every gen_ai.evaluation.result event the sink was sent: (trace id, span id, attributes)."""
    out = []
    for r in s.received:
        if not r.path.endswith("/v1/logs") or r.status != 200:
            continue
        req = ExportLogsServiceRequest.FromString(r.body)
        for rl in req.resource_logs:
            for sl in rl.scope_logs:
                for rec in sl.log_records:
                    if rec.event_name == "gen_ai.evaluation.result":
                        attrs = {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in rec.attributes}
                        out.append((rec.trace_id, rec.span_id, attrs))
    return out


def test_verdicts_and_review_decisions_go_out_as_evaluation_events(tmp_path: Path) -> None:
    from ..support.api_http import post_json
    from ..support.review import CARRIER, carrier_conversation, send_conversations, start_daemon, wait_items

    with sink() as s:
        daemon = start_daemon(tmp_path, exporters={
            "lw": {"type": "langwatch", "endpoint": f"{s.base}/api/otel/v1/traces", "api_key": "k"},
            "ls": {"type": "langsmith", "endpoint": f"{s.base}/ls/otel/v1/traces", "api_key": "k"}})
        try:
            send_conversations(daemon.grpc, [carrier_conversation("ev-1")])
            item, = [i for i in wait_items(daemon, {("ev-1", CARRIER)}) if i["criterion_id"] == CARRIER]

            def carrier_events() -> list[dict[str, Any]]:
                return [a for _, _, a in _events(s) if a["gen_ai.evaluation.name"] == CARRIER]

            wait_until(lambda: carrier_events(), "the carrier verdict as an event")
            trace_id, span_id, attrs = next(e for e in _events(s) if e[2]["gen_ai.evaluation.name"] == CARRIER)
            assert attrs["gen_ai.evaluation.score.label"] == "fail" and attrs["gen_ai.evaluation.score.value"] == 0.0
            assert attrs["tracejudge.conversation.id"] == "ev-1" and attrs["tracejudge.criterion.version"] == 1
            assert attrs["tracejudge.review.state"] == "pending" and attrs["tracejudge.evidence_verified"] is True
            assert "carrier will call" in attrs["gen_ai.evaluation.explanation"]
            # Parented to the conversation's last LLM call: a trace and a span the bot sent.
            assert len(trace_id) == 16 and len(span_id) == 8 and any(
                sp.span_id == span_id for r in s.at("/api/otel/v1/traces")
                for rs in ExportTraceServiceRequest.FromString(r.body).resource_spans
                for ss in rs.scope_spans for sp in ss.spans)
            assert not s.at("/ls/otel/v1/logs")  # LangSmith: traces only, by default
            reply = post_json(daemon.api, f"/api/review/{item['id']}/decision",
                              {"decision": "confirm", "reviewer": "Dr. Amal"})
            assert reply.status == 200, reply.body
            wait_until(lambda: any(a["tracejudge.review.state"] == "confirmed" for a in carrier_events()),
                       "the decision as an event")
            assert daemon.stop() == 0
            daemon.start()  # a restart goes on from where it got: nothing is sent again
            before = len(_events(s))
            send_conversations(daemon.grpc, [carrier_conversation("ev-2")])
            wait_until(lambda: any(a["tracejudge.conversation.id"] == "ev-2" for _, _, a in _events(s)),
                       "the next conversation's events")
            assert all(a["tracejudge.conversation.id"] == "ev-2" for _, _, a in _events(s)[before:])
            assert daemon.stop() == 0
        finally:
            daemon.end()


def test_verdicts_on_simulated_conversations_are_never_sent(tmp_path: Path) -> None:
    import json

    from ..support.daemon import clean_env, run_cli
    from ..support.review import CARRIER_ANSWER, carrier_conversation, send_conversations, start_daemon

    with sink() as s:
        daemon = start_daemon(tmp_path, exporters={
            "lw": {"type": "langwatch", "endpoint": f"{s.base}/api/otel/v1/traces", "api_key": "k"}})
        try:
            def sent_for(cid: str) -> list[tuple[bytes, bytes, dict[str, Any]]]:
                return [e for e in _events(s) if e[2]["tracejudge.conversation.id"] == cid]

            def cli(*args: str) -> Any:
                res = run_cli(*args, "--config", str(daemon.config_path), "--json", env=clean_env())
                assert res.returncode == 0, res.stderr
                return json.loads(res.stdout)

            # Production, then a judged simulation, then production again: the simulated verdicts come
            # between the two in the order the stage follows.
            send_conversations(daemon.grpc, [carrier_conversation("ev-1")])
            wait_until(lambda: len(sent_for("ev-1")) == 4, "ev-1's four verdicts as events")
            sims = tmp_path / "sim.jsonl"
            sims.write_text("".join(json.dumps({
                "schema": "conversation/v1", "id": f"sim-{n}", "source": "simulation", "ended_by": "goal_reached",
                "messages": [{"role": "user", "content": "Where is my order B-1?"},
                             {"role": "assistant", "content": CARRIER_ANSWER}]}) + "\n" for n in range(3)))
            assert cli("replay", "import", str(sims)) == {"stored": 3, "already_imported": 0}
            assert cli("eval", "--source", "simulation")["verdicts"] == 3 * 4
            send_conversations(daemon.grpc, [carrier_conversation("ev-2")])
            wait_until(lambda: len(sent_for("ev-2")) == 4 and forwarded(daemon, "lw")["queued_requests"] == 0,
                       "ev-2's four verdicts as events, and nothing left queued")
            events = _events(s)
            assert sorted(a["tracejudge.conversation.id"] for _, _, a in events) == ["ev-1"] * 4 + ["ev-2"] * 4
            assert all(len(trace_id) == 16 for trace_id, _, _ in events)  # each beside the bot's own trace
            position = daemon.get("/api/status")[1]["verdict_events_seq"]
            assert daemon.stop() == 0
        finally:
            daemon.end()
        # The stage went past the simulated verdicts (they share the verdicts' sequence) and sent none of them.
        (simulated,), = daemon.query("SELECT max(seq) FROM simulated_verdicts")
        assert position > simulated
