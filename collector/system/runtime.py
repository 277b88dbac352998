"""The runtime file ``<duckdb path>.daemon.json``: how other processes find the daemon.

The daemon writes it once it listens (the actual addresses matter when a port
is 0) and removes it on a clean exit; a file left by a killed daemon names a
pid that no longer runs and is ignored.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

DEMO_DIR = Path("tracejudge-demo")
"""Where ``tracejudge demo`` keeps its config and data (its daemon's runtime file among them) unless told
otherwise."""


@dataclass(frozen=True)
class RuntimeInfo:
    pid: int
    version: str
    duckdb: str
    grpc: str | None
    http: str | None
    api: str
    started_at: str

    def write(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)

    @classmethod
    def read(cls, path: Path) -> "RuntimeInfo | None":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return cls(**{k: data.get(k) for k in cls.__dataclass_fields__})
        except (OSError, ValueError, TypeError):
            return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def healthy(api: str, token: str | None = None, timeout: float = 2.0) -> bool:
    """True when the API at ``api`` answers /healthz."""
    import urllib.error  # here: every subcommand's help loads this module, urllib.request takes a while to load
    import urllib.request

    req = urllib.request.Request(api.rstrip("/") + "/healthz")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (our own loopback API)
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def running_daemon(path: Path) -> RuntimeInfo | None:
    """The daemon named by the runtime file, if its process is alive and answers."""
    info = RuntimeInfo.read(path)
    if info is None or not pid_alive(info.pid):
        return None
    return info if healthy(info.api) else None
