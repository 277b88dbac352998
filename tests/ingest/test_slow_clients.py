"""Slow, idle and vanishing clients: every listener closes what does not finish in time,
and a client that goes away is logged at debug and counted, never as an ERROR traceback."""

from __future__ import annotations

import socket
from typing import Any
from urllib.parse import urlsplit

import grpc
import pytest

from ..support.daemon import clean_env, wait_until
from ..support.wire import GRPC_METHODS, span_request_bytes

pytestmark = pytest.mark.slow  # each test waits for the daemon's timeouts

TIMEOUTS = {"idle_timeout": "1s", "read_timeout": "1s"}
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + empty SETTINGS
H2_SETTINGS_ACK = b"\x00\x00\x00\x04\x01\x00\x00\x00\x00"  # for the daemon's SETTINGS: the handshake is done


@pytest.fixture
def daemon(make_daemon: Any) -> Any:
    listener = {"endpoint": "127.0.0.1:0", **TIMEOUTS}
    return make_daemon(env=clean_env(TRACEJUDGE_LOG_LEVEL="debug"),
                       receivers={"otlp": {"protocols": {"grpc": listener, "http": listener}}}, api=TIMEOUTS)


def _connect(base: str) -> socket.socket:
    url = urlsplit(base if "//" in base else f"//{base}")
    sock = socket.create_connection((url.hostname, url.port))
    # Far beyond the 1 s timeouts, and within grpc's own 60 s bound for a handshake never acknowledged.
    sock.settimeout(30)
    return sock


def _closed_by_daemon(sock: socket.socket) -> bool:
    """Read (and drop) whatever the daemon answers until it closes the connection."""
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    finally:
        sock.close()


def _http_openings(host: str, path: str) -> dict[str, bytes]:
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    return {
        "nothing": b"",
        "half the headers": head.encode(),
        "headers and half the body": f"{head}Content-Length: 1000\r\n\r\n{{\"since\": ".encode(),
        "a chunked body never ended": f"{head}Transfer-Encoding: chunked\r\n\r\n10\r\n{{\"since\": ".encode(),
        "a whole request, then nothing": f"GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n".encode(),
    }


@pytest.mark.parametrize("listener", ["http", "api"])
def test_http_listeners_close_idle_and_unfinished_requests(daemon: Any, listener: str) -> None:
    base = daemon.http if listener == "http" else daemon.api
    host = urlsplit(base).netloc
    path = "/v1/traces" if listener == "http" else "/api/evals"
    socks = {}
    for case, opening in _http_openings(host, path).items():
        socks[case] = sock = _connect(base)
        sock.sendall(opening)
    for case, sock in socks.items():
        assert _closed_by_daemon(sock), f"{listener}: {case}: still open"
    assert daemon.get("/healthz")[0] == 200
    assert " ERROR " not in daemon.output()


def test_grpc_closes_idle_connections(daemon: Any) -> None:
    silent = _connect(daemon.grpc)
    handshaken = _connect(daemon.grpc)
    handshaken.sendall(H2_PREFACE + H2_SETTINGS_ACK)
    assert _closed_by_daemon(silent)
    assert _closed_by_daemon(handshaken)
    # An exporter's channel between two exports: the daemon closes the idle connection
    # (GOAWAY), and the next export opens a new one.
    states: list[grpc.ChannelConnectivity] = []
    with grpc.insecure_channel(daemon.grpc) as channel:
        channel.subscribe(states.append)
        export = channel.unary_unary(GRPC_METHODS["traces"][0])
        export(span_request_bytes(1, trace_seed=1)[0], timeout=60)
        wait_until(lambda: grpc.ChannelConnectivity.READY in states, "the channel to connect")
        wait_until(lambda: states[-1] == grpc.ChannelConnectivity.IDLE, "the daemon to close the idle connection")
        export(span_request_bytes(1, trace_seed=2)[0], timeout=60)
    assert daemon.counts()["spans"] == 2
    assert " ERROR " not in daemon.output()


def _start_request(base: str, path: str, ctype: str, length: int, part: bytes) -> socket.socket:
    """Send headers and part of the body, once the daemon has routed the request to its handler
    (``100 Continue`` is sent just before the handler runs)."""
    sock = _connect(base)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {urlsplit(base).netloc}\r\nContent-Type: {ctype}\r\n"
                 f"Content-Length: {length}\r\nExpect: 100-continue\r\n\r\n".encode())
    reply = b""
    while b"\r\n\r\n" not in reply:
        reply += sock.recv(1024)
    assert reply.startswith(b"HTTP/1.1 100"), reply
    sock.sendall(part)
    return sock


def test_client_gone_mid_request_is_counted_not_an_error(daemon: Any) -> None:
    body, _ = span_request_bytes(50)
    otlp = _start_request(daemon.http, "/v1/traces", "application/x-protobuf", len(body), body[:1000])
    api = _start_request(daemon.api, "/api/evals", "application/json", 100, b'{"since": ')
    otlp.close()
    api.close()
    wait_until(lambda: 'outcome="incomplete"' in daemon.get("/metrics")[1], "the OTLP request to be counted")
    wait_until(lambda: "went away during POST /api/evals" in daemon.output(), "the API request to be logged")
    assert daemon.metric('tracejudge_requests_total{outcome="incomplete",signal="traces",transport="http"}') == 1
    assert " ERROR " not in daemon.output() and "Traceback" not in daemon.output()
    assert daemon.counts()["spans"] == 0


MALFORMED = [
    b"GET /healthz HTTP/1.1\r\nBad Header\r\n\r\n",
    b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 50,  # TLS to a plain-HTTP port
]


@pytest.mark.parametrize("listener", ["http", "api"])
def test_malformed_http_is_400_not_an_error(daemon: Any, listener: str) -> None:
    base = daemon.http if listener == "http" else daemon.api
    for request in MALFORMED:
        sock = _connect(base)
        sock.sendall(request)
        assert sock.recv(1024).startswith(b"HTTP/1.0 400"), request
        sock.close()
    assert daemon.get("/healthz")[0] == 200
    wait_until(lambda: daemon.output().count("Error handling request") >= len(MALFORMED), "the 400s to be logged")
    assert " ERROR " not in daemon.output()  # (aiohttp gives TLS on a plain port a debug traceback itself)
