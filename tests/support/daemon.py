"""The real daemon as a subprocess on ephemeral ports, and the CLI, for tests.

``DaemonProcess`` starts ``python -m collector serve`` with a config written for
the test (every port 0), waits for its runtime file and /readyz, and knows the
actual addresses. Tests talk to it over real gRPC and HTTP only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, ClassVar, TypeVar

import yaml

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
FIXTURES = SHARED / "fixtures" / "otlp"

T = TypeVar("T")


def wait_until(condition: Callable[[], T | None], what: str | Callable[[], str], timeout: float = 60,
               interval: float = 0.01) -> T:
    """Poll ``condition`` every ``interval`` seconds until it returns something true, and return that.

    After ``timeout`` seconds the test fails naming ``what``; a callable ``what`` is called then, so
    that the message can say what was seen last. An exception from ``condition`` ends the wait at once.
    """
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")
        time.sleep(interval)
    return value


def base_config(data_dir: Path, **sections: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "receivers": {"otlp": {"protocols": {"grpc": {"endpoint": "127.0.0.1:0"},
                                             "http": {"endpoint": "127.0.0.1:0"}}}},
        "storage": {"duckdb": {"path": str(data_dir / "tracejudge.duckdb")}},
        "api": {"endpoint": "127.0.0.1:0"},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            _merge(cfg[key], value)
        else:
            cfg[key] = value
    return cfg


def _merge(into: dict[str, Any], new: dict[str, Any]) -> None:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRACEJUDGE_", "OTEL_"))}
    env.update(extra)
    return env


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "collector", *args], capture_output=True, text=True,
                          env=env or clean_env(), timeout=timeout, input=input, cwd=REPO)


class DaemonProcess:
    """A real ``tracejudge serve`` subprocess."""

    started: ClassVar[list["DaemonProcess"]] = []
    """Every daemon made, in order: whatever a test leaves running ends with it (tests/conftest.py)."""

    def __init__(self, data_dir: Path, config: dict[str, Any], env: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir
        self.config = config
        self.config_path = data_dir / "otel-config.yaml"
        self.config_path.write_text(yaml.safe_dump(config), encoding="utf-8")
        self.duckdb = Path(config["storage"]["duckdb"]["path"])
        self.runtime_file = Path(str(self.duckdb) + ".daemon.json")
        self.env = env or clean_env()
        self.proc: subprocess.Popen[str] | None = None
        self.info: dict[str, Any] = {}
        DaemonProcess.started.append(self)  # also one a test starts by hand

    def start(self, timeout: float = 30, ready: bool = True) -> "DaemonProcess":
        """Run it, and wait until it answers /readyz (with ``ready=False``, return at once)."""
        self.runtime_file.unlink(missing_ok=True)
        if hasattr(self, "log") and not self.log.closed:
            self.log.close()
        self.log = open(self.data_dir / "daemon.log", "a", encoding="utf-8")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "collector", "serve", "--config", str(self.config_path)],
            stdout=self.log, stderr=subprocess.STDOUT, env=self.env, cwd=REPO, text=True)
        if not ready:
            return self
        proc = self.proc

        def answers() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {proc.returncode}:\n{self.output()}")
            if not self.runtime_file.exists():
                return False
            try:
                self.info = json.loads(self.runtime_file.read_text())
            except ValueError:  # not written whole yet
                return False
            return self.get("/readyz", check=False)[0] == 200

        wait_until(answers, lambda: f"the daemon to become ready:\n{self.output()}", timeout, interval=0.05)
        return self

    def output(self) -> str:
        return (self.data_dir / "daemon.log").read_text(encoding="utf-8", errors="replace")

    def wait_output(self, text: str, timeout: float = 60) -> None:
        """Until the daemon has logged ``text`` (it fails at once if the daemon exits first)."""

        def logged() -> bool:
            if text in self.output():
                return True
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"exited with {self.proc.returncode} before logging {text!r}:\n{self.output()}")
            return False

        wait_until(logged, f"{text!r} to be logged", timeout)

    @property
    def grpc(self) -> str:
        return str(self.info["grpc"])

    @property
    def http(self) -> str:
        return f"http://{self.info['http']}"

    @property
    def api(self) -> str:
        return str(self.info["api"])

    def get(self, path: str, token: str | None = None, check: bool = True) -> tuple[int, Any]:
        req = urllib.request.Request(self.api + path)
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                body = resp.read().decode()
                status = resp.status
        except urllib.error.HTTPError as exc:
            body = exc.read().decode()
            status = exc.code
        if check and status != 200:
            raise AssertionError(f"GET {path} -> {status}: {body}")
        ctype_json = body.startswith(("{", "["))
        return status, json.loads(body) if ctype_json else body

    def counts(self) -> dict[str, int]:
        return self.get("/api/spans/count?traces=true")[1]  # type: ignore[no-any-return]

    def metric(self, name: str, missing: float | None = None) -> float:
        """The sum of ``name``'s samples in /metrics; ``missing`` if it has none, else the test fails."""
        text = self.get("/metrics")[1]
        total = 0.0
        found = False
        for line in text.splitlines():
            if line.startswith(name) and (line[len(name)] in " {"):
                total += float(line.rsplit(" ", 1)[1])
                found = True
        if not found and missing is not None:
            return missing
        assert found, f"{name} not in /metrics"
        return total

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGUSR1)  # every thread's stack, into the log
            try:
                self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
            raise AssertionError(f"the daemon did not exit within {timeout:g}s of {signal.Signals(sig).name}; "
                                 f"its log, ending with the stack of each thread:\n{self.output()[-20000:]}") from None

    def kill9(self) -> None:
        self.stop(signal.SIGKILL)

    def end(self) -> None:
        """Kill it if it still runs, and close its log: a test's teardown, whatever happened in the test."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if hasattr(self, "log") and not self.log.closed:
            self.log.close()

    def query(self, sql: str, params: list[Any] | None = None) -> list[tuple[Any, ...]]:
        """Read DuckDB directly; only once the daemon has stopped (it holds the file lock)."""
        import duckdb

        assert self.proc is None or self.proc.poll() is not None, "stop the daemon before reading its file"
        con = duckdb.connect(str(self.duckdb), read_only=True)
        try:
            return con.execute(sql, params or []).fetchall()
        finally:
            con.close()


def wait_conversations(daemon: DaemonProcess, timeout: float = 60) -> dict[str, Any]:
    """Wait until the conversation stage has processed every committed batch."""
    status: dict[str, Any] = {}

    def caught_up() -> dict[str, Any] | None:
        nonlocal status
        status = daemon.get("/api/status")[1]
        done = (status["conversations_batch"] >= status["committed_batch"] and status["queue_depth"] == 0
                and status["conversations_pending"] == 0)
        return status if done else None

    return wait_until(caught_up, lambda: f"conversations to catch up: {status}", timeout, interval=0.05)


def pool_workers(pid: int) -> list[int]:
    """``pid``'s child processes that are multiprocessing pool workers (not its resource tracker)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
            out += [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
        except FileNotFoundError:  # the thread or the child ended in between
            pass
    return out
