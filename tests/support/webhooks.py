"""A webhook receiver on loopback for the alert tests: it records every POST and answers from a script.

It speaks HTTP/1.0 (one request per connection), so that once closed it is down for every sender: a
kept-alive connection would still reach a handler thread of a server that stopped listening.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    """By lower-case name."""
    body: bytes


Answer = tuple[int, dict[str, str]]


class Receiver:
    """Answers each POST with the next of ``answers`` (status, headers), then with ``default``, until ``close``.

    Args:
        port: 0 picks a free one; a receiver started again on the port of one closed is the same one back up.
    """

    def __init__(self, answers: Iterable[Answer] = (), default: int = 200, port: int = 0) -> None:
        self.requests: list[Received] = []
        self.answers = list(answers)
        self.default = default
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with receiver._lock:
                    receiver.requests.append(Received(self.path, {k.lower(): v for k, v in self.headers.items()},
                                                      body))
                    status, extra = receiver.answers.pop(0) if receiver.answers else (receiver.default, {})
                self.send_response(status)
                for name, value in extra.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="webhook-receiver", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def received(self) -> list[Received]:
        with self._lock:
            return list(self.requests)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(10)
