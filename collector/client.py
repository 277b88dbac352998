"""How subcommands read data: through a running daemon's API, else from the DuckDB file.

The daemon holds the DuckDB write lock, so while it runs every other process
goes through its JSON API (found through the runtime file); with no daemon the
file is opened read-only with the same queries the API uses.
"""

from __future__ import annotations

import datetime as dt
import json
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Protocol

from . import queries
from .config import Config
from .errors import UserError
from .runtime import running_daemon
from .store import connect


class Reader(Protocol):
    def list_conversations(self, *, since: str | None, state: str | None, service: str | None,
                           limit: int) -> list[dict[str, Any]]: ...

    def conversation(self, conversation_id: str) -> dict[str, Any] | None: ...

    def close(self) -> None: ...


class APIReader:
    """Reads through a running daemon's JSON API."""

    def __init__(self, base: str, token: str | None) -> None:
        self.base = base.rstrip("/")
        self.token = token

    def get(self, path: str) -> Any:
        """GET a JSON API path; None for 404, UserError for other errors or no answer."""
        req = urllib.request.Request(self.base + path)
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:  # noqa: S310 (the daemon's API)
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            try:
                err = json.loads(exc.read())["error"]
            except (ValueError, KeyError, TypeError):
                err = {"code": str(exc.code), "message": exc.reason}
            if exc.code == 404:
                return None
            raise UserError(f"the daemon at {self.base} answered {exc.code}: {err['message']}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise UserError(f"cannot reach the daemon at {self.base}: {exc}") from None

    def list_conversations(self, *, since: str | None, state: str | None, service: str | None,
                           limit: int) -> list[dict[str, Any]]:
        params = {k: v for k, v in {"since": since, "state": state, "service": service,
                                    "limit": str(limit)}.items() if v}
        body = self.get("/api/conversations?" + urllib.parse.urlencode(params))
        return list(body["conversations"])

    def conversation(self, conversation_id: str) -> dict[str, Any] | None:
        record = self.get("/api/conversations/" + urllib.parse.quote(conversation_id, safe=""))
        return record if isinstance(record, dict) else None

    def close(self) -> None:
        return None


class FileReader:
    """Reads the DuckDB file directly (read-only) when no daemon runs."""

    def __init__(self, path: Path) -> None:
        if not path.exists():
            raise UserError(f"no database at {path}: start the daemon (tracejudge serve) with this config first")
        self.path = path
        self.con = connect(path, read_only=True)
        tables = {r[0] for r in self.con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
        if "conversations" not in tables:
            self.con.close()
            raise UserError(f"{path} has no conversations table yet (written by an older tracejudge): "
                            "run `tracejudge reindex` once")

    def list_conversations(self, *, since: str | None, state: str | None, service: str | None,
                           limit: int) -> list[dict[str, Any]]:
        when: dt.datetime | None = None
        if since:
            try:
                when = queries.parse_since(since)
            except ValueError as exc:
                raise UserError(str(exc)) from None
        return queries.list_conversations(self.con, since=when, state=state, service=service, limit=limit)

    def conversation(self, conversation_id: str) -> dict[str, Any] | None:
        return queries.conversation_record(self.con, conversation_id)

    def close(self) -> None:
        self.con.close()


def reader(cfg: Config) -> Reader:
    """The daemon's API when one serves this config's database, else the file."""
    info = running_daemon(cfg.runtime_file)
    if info is not None:
        return APIReader(info.api, cfg.api.auth.bearer_token)
    return FileReader(cfg.storage.duckdb.path)
