"""Two daemons behind a router that splits traffic as the Collector's load_balancing exporter does.

The router in this test applies the contract the README ("Scaling out behind the OpenTelemetry
Collector") describes: each trace export request is split into one batch per trace, and each batch
is routed by ``gen_ai.conversation.id`` looked up on the resource, then the first scope, then the
first span of that scope (an empty key when it is found nowhere). The bot side tags every span with
the conversation id, as the README tells bots to. A third daemon gets the same conversations
directly. Every conversation must then live whole on exactly one shard, and ``stats`` over the two
shards' files must print what it prints over the reference's file.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import zlib
from collections.abc import Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans

from collector.demo.traffic import Persona

from ..support.daemon import DaemonProcess, clean_env, wait_conversations, wait_until
from ..support.online import send
from ..support.review import carrier_conversation, refund_conversation, start_daemon

pytestmark = pytest.mark.slow  # it starts a daemon per shard

ROUTING_ATTRIBUTE = "gen_ai.conversation.id"
TRACES = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
LOGS = "/opentelemetry.proto.collector.logs.v1.LogsService/Export"
SHARDS = 2


def _attribute(attributes: Any) -> str | None:
    for kv in attributes:
        if kv.key == ROUTING_ATTRIBUTE:
            return str(kv.value.string_value)
    return None


def split_per_trace(request: ExportTraceServiceRequest) -> list[ExportTraceServiceRequest]:
    """One request per trace id, each span kept under a copy of its resource and scope, in order."""
    batches: dict[bytes, ExportTraceServiceRequest] = {}
    for rs in request.resource_spans:
        for ss in rs.scope_spans:
            for span in ss.spans:
                batch = batches.setdefault(span.trace_id, ExportTraceServiceRequest())
                last_rs = batch.resource_spans[-1] if batch.resource_spans else None
                if last_rs is None or last_rs.resource != rs.resource or last_rs.schema_url != rs.schema_url:
                    last_rs = batch.resource_spans.add()
                    last_rs.CopyFrom(ResourceSpans(resource=rs.resource, schema_url=rs.schema_url))
                last_ss = last_rs.scope_spans[-1] if last_rs.scope_spans else None
                if last_ss is None or last_ss.scope != ss.scope or last_ss.schema_url != ss.schema_url:
                    last_ss = last_rs.scope_spans.add()
                    last_ss.CopyFrom(ScopeSpans(scope=ss.scope, schema_url=ss.schema_url))
                last_ss.spans.append(span)
    return list(batches.values())


def routing_key(batch: ExportTraceServiceRequest) -> str:
    """Resource, then the first scope, then the first span of that scope; nowhere else."""
    rs = batch.resource_spans[0]
    key = _attribute(rs.resource.attributes)
    if key is None and rs.scope_spans:
        ss = rs.scope_spans[0]
        key = _attribute(ss.scope.attributes)
        if key is None and ss.spans:
            key = _attribute(ss.spans[0].attributes)
    return key or ""


def shard_of(key: str) -> int:
    return zlib.crc32(key.encode()) % SHARDS


class Router:
    """A loopback OTLP/gRPC endpoint that forwards raw bytes to the shard daemons."""

    def __init__(self, backends: Sequence[str]) -> None:
        self.channels = [grpc.insecure_channel(b) for b in backends]
        self.traces = [ch.unary_unary(TRACES, request_serializer=None, response_deserializer=None)
                       for ch in self.channels]
        self.logs = [ch.unary_unary(LOGS, request_serializer=None, response_deserializer=None)
                     for ch in self.channels]
        self.keys: set[str] = set()
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers([
            grpc.method_handlers_generic_handler("opentelemetry.proto.collector.trace.v1.TraceService", {
                "Export": grpc.unary_unary_rpc_method_handler(
                    self._export_traces, request_deserializer=None, response_serializer=None)}),
            grpc.method_handlers_generic_handler("opentelemetry.proto.collector.logs.v1.LogsService", {
                "Export": grpc.unary_unary_rpc_method_handler(
                    self._export_logs, request_deserializer=None, response_serializer=None)}),
        ])
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"127.0.0.1:{port}"
        self.server.start()

    def _export_traces(self, body: bytes, context: grpc.ServicerContext) -> bytes:
        request = ExportTraceServiceRequest.FromString(body)
        try:
            for batch in split_per_trace(request):
                key = routing_key(batch)
                with self.lock:
                    self.keys.add(key)
                self.traces[shard_of(key)](batch.SerializeToString(), timeout=60)
        except grpc.RpcError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"forward failed: {exc}")
        return b""  # an empty ExportTraceServiceResponse: everything accepted

    def _export_logs(self, body: bytes, context: grpc.ServicerContext) -> bytes:
        # collector.demo sends no log records; should any come, they go whole to shard 0.
        try:
            self.logs[0](body, timeout=60)
        except grpc.RpcError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"forward failed: {exc}")
        return b""

    def close(self) -> None:
        self.server.stop(grace=5).wait()
        for ch in self.channels:
            ch.close()


def two_turns(cid: str) -> Persona:
    """A carrier promise, then a full refund: two traces of one conversation."""
    first, second = carrier_conversation(cid).turns[0], refund_conversation(cid).turns[0]
    return Persona(cid, "en", "review-test", [first, second], conversation_id=cid)


PERSONAS = [
    *(carrier_conversation(f"sh-carrier-{n}") for n in range(1, 5)),
    *(refund_conversation(f"sh-refund-{n}") for n in range(1, 5)),
    *(two_turns(f"sh-both-{n}") for n in range(1, 5)),
]
IDS = {p.conversation_id for p in PERSONAS}


def conversations(daemon: DaemonProcess) -> dict[str, dict[str, Any]]:
    rows = daemon.get("/api/conversations?limit=1000")[1]["conversations"]
    return {r["conversation_id"]: r for r in rows}


def wait_judged(daemon: DaemonProcess, expected: set[str], timeout: float = 180) -> None:
    """Until ``expected`` are exactly its conversations, all ended, decided, and nothing left to judge."""

    def done() -> bool:
        wait_conversations(daemon, timeout=timeout)
        listed = conversations(daemon)
        if set(listed) != expected or any(r["state"] != "ended" for r in listed.values()):
            return False
        stats = daemon.get("/api/stats")[1]["conversations"]
        status = daemon.get("/api/status")[1]
        return bool(stats["sampled"] + stats["not_sampled"] >= len(expected) and stats["judged"] == stats["sampled"]
                    and status["evals_pending"] == 0 and status["evals_in_flight"] == 0)

    wait_until(done, f"{sorted(expected)} judged on {daemon.data_dir.name}", timeout)


def stats_json(folder: Path, *dbs: Path) -> Any:
    args = [a for db in dbs for a in ("--db", str(db))]
    res = subprocess.run([sys.executable, "-m", "collector", "stats", *args, "--json"], capture_output=True,
                         text=True, env=clean_env(), timeout=180, cwd=folder)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_a_router_with_the_load_balancing_contract_keeps_each_conversation_whole_on_one_shard(
        tmp_path: Path) -> None:
    assert {shard_of(cid) for cid in IDS} == set(range(SHARDS)), "the ids must hash onto both shards"
    folders = {name: tmp_path / name for name in ("shard0", "shard1", "reference")}
    for folder in folders.values():
        folder.mkdir()
    daemons: dict[str, DaemonProcess] = {}
    router: Router | None = None
    try:
        for name, folder in folders.items():
            daemons[name] = start_daemon(folder)
        shards = [daemons["shard0"], daemons["shard1"]]
        router = Router([d.grpc for d in shards])

        send(router.endpoint, PERSONAS, "review-test", every_span=True)
        send(daemons["reference"].grpc, PERSONAS, "review-test", every_span=True)

        # Every batch carried its conversation id on its first span: no trace went by the empty key.
        assert router.keys == IDS
        for i, daemon in enumerate(shards):
            wait_judged(daemon, {cid for cid in IDS if shard_of(cid) == i})
        wait_judged(daemons["reference"], IDS)

        reference = conversations(daemons["reference"])
        on_shards = [conversations(d) for d in shards]
        assert all(on_shards), "both shards hold conversations"
        for cid in IDS:
            holders = [i for i, listed in enumerate(on_shards) if cid in listed]
            assert holders == [shard_of(cid)], cid
            row = on_shards[holders[0]][cid]
            assert row["message_count"] == reference[cid]["message_count"], cid
            assert row["user_turns"] == reference[cid]["user_turns"], cid
        assert {reference[p.conversation_id]["user_turns"] for p in PERSONAS} == {1, 2}

        for daemon in daemons.values():
            assert daemon.stop() == 0
    finally:
        if router is not None:
            router.close()
        for daemon in daemons.values():
            daemon.end()

    # stats --json has no time-dependent field (no generated-at stamp, no ages): counts, rates and
    # review states only, so the two outputs are compared whole.
    merged = stats_json(tmp_path, daemons["shard0"].duckdb, daemons["shard1"].duckdb)
    whole = stats_json(tmp_path, daemons["reference"].duckdb)
    assert whole["conversations"]["judged"] == len(IDS) and len(whole["criteria"]) == 4
    assert merged == whole
