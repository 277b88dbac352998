"""The API as a browser elsewhere, a rebinding name or a careless client meets it, against the real daemon.

- Host: only this API's own address (with its actual port), a loopback name or
  a name of ``api.allowed_hosts`` is answered (421 otherwise), so a page whose
  name was rebound to 127.0.0.1 reads nothing; the health endpoints answer any
  Host (probes send the pod IP).
- The token settings take ``$TRACEJUDGE_API_TOKEN`` / ``$TRACEJUDGE_INGEST_TOKEN``
  when the config file does not set them.
- Bad input is a 4xx in the one error shape, never a 500 with a traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.parse
from pathlib import Path
from typing import Any

import grpc
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from collector.api.errors import error_middleware

from ..support.api_http import assert_error, call
from ..support.daemon import DaemonProcess, base_config, clean_env, run_cli
from ..support.wire import grpc_export, post, span_request_bytes

ALLOWED = ["tracejudge.internal", "Review.Example:8443"]


@pytest.fixture(scope="module")
def hosted(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp("hosts")
    daemon = DaemonProcess(folder, base_config(folder, api={"allowed_hosts": ALLOWED})).start()
    try:
        yield daemon
    finally:
        daemon.stop()
        daemon.log.close()


def port_of(daemon: DaemonProcess) -> int:
    port = urllib.parse.urlsplit(daemon.api).port
    assert port is not None
    return port


@pytest.mark.parametrize("host", [
    "attacker.example", "attacker.example:{port}", "127.evil.example:{port}", "localhost.attacker.example:{port}",
    "127.0.0.1:{other}", "localhost:{other}", "localhost", "127.0.0.1", "10.1.2.3:{port}",
    "review.example", "review.example:{port}", "tracejudge.internal.attacker.example", "[::1]:{other}",
    "127.0.0.1:{port}:1", "[::1", "",
])
def test_other_host_headers_are_refused_with_421(hosted: DaemonProcess, host: str) -> None:
    port = port_of(hosted)
    header = host.format(port=port, other=port + 1)
    for method, path, body in (("GET", "/api/status", None), ("GET", "/review", None), ("GET", "/metrics", None),
                               ("GET", "/api/conversations", None), ("POST", "/api/evals", b"{}")):
        reply = call(hosted.api, method, path, body, {"Host": header, "Content-Type": "application/json"})
        assert_error(reply, 421, "host_not_allowed", "api.allowed_hosts")
    assert "Traceback" not in hosted.output()


@pytest.mark.parametrize("host", [
    "127.0.0.1:{port}", "localhost:{port}", "LocalHost:{port}", "[::1]:{port}", "localhost.:{port}",
    "tracejudge.internal", "tracejudge.internal:{port}", "TRACEJUDGE.internal:9", "review.example:8443",
])
def test_own_address_loopback_names_and_allowed_hosts_are_answered(hosted: DaemonProcess, host: str) -> None:
    reply = call(hosted.api, "GET", "/api/status", headers={"Host": host.format(port=port_of(hosted))})
    assert reply.status == 200, reply.body
    assert "queue_depth" in reply.json()


def test_health_endpoints_answer_any_host(hosted: DaemonProcess) -> None:
    """Probes name the pod IP (or anything their orchestrator chose); health says nothing worth a rebinding."""
    for host in ("attacker.example", "10.42.0.17:8318", ""):
        assert call(hosted.api, "GET", "/healthz", headers={"Host": host}).json() == {"status": "ok"}
        assert call(hosted.api, "GET", "/readyz", headers={"Host": host}).json()["status"] == "ready"


@pytest.mark.slow
def test_a_listener_on_every_interface_answers_its_local_address(tmp_path: Path) -> None:
    """On 0.0.0.0 the address a client connected to is this API's own (a probe's pod IP); other IPs are not."""
    token = "wildcard-secret"
    daemon = DaemonProcess(tmp_path, base_config(tmp_path, api={"endpoint": "0.0.0.0:0",
                                                                "auth": {"bearer_token": token}})).start()
    try:
        port = port_of(daemon)
        via = f"http://127.0.0.2:{port}"  # any 127/8 address reaches the loopback interface
        auth = {"Authorization": f"Bearer {token}"}
        assert call(via, "GET", "/api/status", headers={"Host": f"127.0.0.2:{port}", **auth}).status == 200
        assert call(via, "GET", "/api/status", headers={"Host": f"0.0.0.0:{port}", **auth}).status == 200
        assert_error(call(via, "GET", "/api/status", headers={"Host": f"10.9.8.7:{port}", **auth}), 421,
                     "host_not_allowed")
        assert call(via, "GET", "/healthz", headers={"Host": f"10.9.8.7:{port}"}).status == 200
        assert daemon.get("/api/status", token=token)[0] == 200  # the CLI's way in: the runtime file's address
    finally:
        assert daemon.stop() == 0
        daemon.log.close()


def test_a_listener_beyond_loopback_needs_a_token(tmp_path: Path) -> None:
    """Without one, anyone who reaches the port reads production conversations: refused at start-up."""
    cfg = tmp_path / "otel-config.yaml"
    cfg.write_text(json.dumps(base_config(tmp_path, api={"endpoint": "0.0.0.0:0", "allowed_hosts": ["a.b"]})))
    res = run_cli("serve", "--config", str(cfg))
    assert res.returncode == 2, res.stderr
    assert "api.auth.bearer_token" in res.stderr and "TRACEJUDGE_API_TOKEN" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr


# --------------------------------------------------------------- tokens from the environment


@pytest.mark.slow
def test_token_env_vars_apply_when_the_config_has_no_auth_key(tmp_path: Path) -> None:
    """The configuration reference: the token settings default to $TRACEJUDGE_API_TOKEN and $TRACEJUDGE_INGEST_TOKEN."""
    api_token, ingest_token = "api-from-env", "ingest-from-env"
    config = base_config(tmp_path)
    assert "auth" not in config["api"] and "auth" not in config["receivers"]["otlp"]
    daemon = DaemonProcess(tmp_path, config, env=clean_env(TRACEJUDGE_API_TOKEN=api_token,
                                                           TRACEJUDGE_INGEST_TOKEN=ingest_token)).start()
    try:
        assert_error(call(daemon.api, "GET", "/api/spans/count"), 401, "unauthorized")
        assert_error(call(daemon.api, "GET", "/api/spans/count", headers={"Authorization": "Bearer wrong"}), 401,
                     "unauthorized")
        body, _ = span_request_bytes(4, trace_seed=7)
        assert post(daemon.http, "/v1/traces", body)[0] == 401
        assert post(daemon.http, "/v1/traces", body, headers={"Authorization": f"Bearer {api_token}"})[0] == 401
        with pytest.raises(grpc.RpcError) as err:
            grpc_export(daemon.grpc, "traces", body)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert daemon.get("/api/spans/count", token=api_token)[1]["spans"] == 0

        assert post(daemon.http, "/v1/traces", body, headers={"Authorization": f"Bearer {ingest_token}"})[0] == 200
        other, _ = span_request_bytes(4, trace_seed=8)
        grpc_export(daemon.grpc, "traces", other, metadata=(("authorization", f"Bearer {ingest_token}"),))
        assert daemon.get("/api/spans/count", token=api_token)[1]["spans"] == 8
    finally:
        assert daemon.stop() == 0
        daemon.log.close()


# --------------------------------------------------------------- bad input: 4xx, never 500


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp("plain")
    daemon = DaemonProcess(folder, base_config(folder)).start()
    try:
        yield daemon
    finally:
        daemon.stop()
        daemon.log.close()


def test_trace_with_the_largest_start_time_is_shown(plain: DaemonProcess) -> None:
    """2^64-1 ns is a valid OTLP time (the year 2554): shown to the nanosecond, not a 500."""
    trace_id, last = "5e" * 16, 2**64 - 1
    span = {"traceId": trace_id, "spanId": "5e" * 8, "name": "far future",
            "startTimeUnixNano": str(last), "endTimeUnixNano": str(last)}
    body = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}).encode()
    status, _, answer = post(plain.http, "/v1/traces", body, "application/json")
    assert status == 200, answer
    reply = call(plain.api, "GET", f"/api/traces/{trace_id}")
    assert reply.status == 200, reply.body
    (stored,) = reply.json()["spans"]
    assert stored["start_time_unix_nano"] == stored["end_time_unix_nano"] == last
    assert stored["start_time"] == stored["end_time"] == "2554-07-21T23:34:33.709551615Z"
    assert "Traceback" not in plain.output()


def test_ordinary_trace_times_keep_their_nanoseconds(plain: DaemonProcess) -> None:
    body, ids = span_request_bytes(2, trace_seed=11)
    assert post(plain.http, "/v1/traces", body)[0] == 200
    spans = call(plain.api, "GET", f"/api/traces/{ids[0][0]}").json()["spans"]
    assert [s["start_time"] for s in spans] == ["2025-11-30T05:00:00Z", "2025-11-30T05:00:00.000000001Z"]


TOO_BIG = str(2**63)


@pytest.mark.parametrize("path, words", [
    ("/api/conversations?since=99999999999d", ("since", "99999999999d")),
    ("/api/verdicts?since=99999999999d", ("since",)),
    ("/api/stats?since=99999999999d", ("since",)),
    ("/api/conversations?since=9999999999999999999999h", ("since",)),
    ("/api/conversations?since=0001-01-01T00:00:00%2B01:00", ("since",)),
    (f"/api/conversations?limit={TOO_BIG}", ("limit", "100000")),
    (f"/api/verdicts?limit={TOO_BIG}", ("limit",)),
    (f"/api/review?limit={TOO_BIG}", ("limit",)),
    ("/api/review?limit=100001", ("limit",)),
    ("/api/conversations?limit=" + "9" * 5000, ("limit",)),
    ("/api/conversations?limit=-5", ("limit",)),
    ("/api/conversations?limit=1.5", ("limit",)),
])
def test_out_of_range_parameters_are_400(plain: DaemonProcess, path: str, words: tuple[str, ...]) -> None:
    assert_error(call(plain.api, "GET", path), 400, "bad_parameter", *words)


@pytest.mark.parametrize("path", [
    "/api/review/" + "9" * 30, "/api/review/" + "9" * 5000, "/api/evals/" + "9" * 30, "/api/evals/" + "9" * 5000,
    "/review/" + "9" * 30,
])
def test_out_of_range_ids_are_404(plain: DaemonProcess, path: str) -> None:
    reply = call(plain.api, "GET", path)
    assert reply.status == 404, reply.body
    if path.startswith("/api/"):
        assert_error(reply, 404, "not_found")


@pytest.mark.parametrize("body", [
    b'{"since": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"criteria": [' + b'{"a":' * 20_000 + b"1" + b"}" * 20_000 + b"]}",
    b'{"since": ' + b"9" * 5000 + b"}",
])
def test_deep_or_huge_eval_bodies_are_400(plain: DaemonProcess, body: bytes) -> None:
    assert_error(call(plain.api, "POST", "/api/evals", body, {"Content-Type": "application/json"}), 400,
                 "bad_request", "JSON")
    assert plain.get("/healthz")[0] == 200
    assert "Traceback" not in plain.output()


def test_a_body_over_the_size_limit_is_413_in_the_error_shape(plain: DaemonProcess) -> None:
    body = b'{"since": "' + b"x" * (2 * 1024 * 1024) + b'"}'
    assert_error(call(plain.api, "POST", "/api/evals", body, {"Content-Type": "application/json"}), 413,
                 "too_large")


# --------------------------------------------------------------- the last resort


def test_an_unexpected_error_is_a_500_in_the_error_shape_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    async def broken(request: web.Request) -> web.Response:
        raise KeyError("boom")

    async def run() -> tuple[int, Any]:
        app = web.Application(middlewares=[error_middleware])
        app.router.add_get("/broken", broken)
        async with TestClient(TestServer(app)) as client:
            resp = await client.get("/broken")
            return resp.status, await resp.json()

    with caplog.at_level(logging.ERROR):
        status, body = asyncio.run(run())
    assert status == 500
    assert body == {"error": {"code": "internal_error",
                              "message": "unexpected error (GET /broken); the daemon's log has the details"}}
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None and "boom" in repr(errors[0].exc_info[1])


def test_every_secret_is_compared_by_the_one_check() -> None:
    """Receivers, API and review page compare tokens only through collector.auth (constant time, one rule); alert
    webhooks are signed there too."""
    import re

    import collector
    root = Path(collector.__file__).parent
    secret = r"(?:\w+\.)*(?:\w*_)?(?:token|secret|authorization)\b"  # token, bearer_token, self.secret; not input_tokens
    # hmac used in code, not the word (docstrings say how webhooks are signed: HMAC-SHA256).
    compares = re.compile(rf"compare_digest|\bhmac\.|import hmac\b|\b{secret}\s*[!=]=|[!=]=\s*{secret}",
                          re.IGNORECASE)
    offenders = [f"{path.relative_to(root)}:{n}" for path in sorted(root.rglob("*.py")) if path.name != "auth.py"
                 for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if compares.search(line)]
    assert offenders == []
    users = {path.relative_to(root).as_posix() for path in root.rglob("*.py")
             if re.search(r"^from \.\.auth import", path.read_text(encoding="utf-8"), re.MULTILINE)}
    assert users == {"api/guards.py", "ingest/receiver.py", "review/identity.py", "alerts/webhooks.py"}
