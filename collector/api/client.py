"""How subcommands reach the data: through a running daemon's API, else the DuckDB file.

The daemon holds the DuckDB write lock, so while it runs every other process
goes through its JSON API (found through the runtime file). With no daemon
the file is opened directly (``file_client``) with the same functions the API
calls: read-only to read, read-write only to record a review decision.

This module loads neither DuckDB nor the stages: a command answered by the
daemon (``tracejudge status``) starts in the time it takes to read the config.
"""

from __future__ import annotations

import http.client
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import UserError
from ..system.runtime import DEMO_DIR, running_daemon

if TYPE_CHECKING:
    from ..config import Config
    from ..evals.simulated_user import SimulatedUser
    from .export import Export



class Client(Protocol):
    def list_conversations(self, *, since: str | None, state: str | None, service: str | None,
                           limit: int) -> list[dict[str, Any]]: ...

    def conversation(self, conversation_id: str) -> dict[str, Any] | None: ...

    def list_reviews(self, *, state: str, criterion: str | None, limit: int,
                     **filters: Any) -> list[dict[str, Any]]: ...

    def review_item(self, item_id: str) -> dict[str, Any]: ...

    def decide(self, item_id: str, decision: str, reviewer: str | None, note: str | None,
               force: bool) -> dict[str, Any]: ...

    def verdicts(self, *, result: str | None, criterion: str | None, conversation: str | None,
                 since: str | None, limit: int, source: str = "production") -> list[dict[str, Any]]: ...

    def calibration(self, *, criterion: str | None, max_false_pass: float) -> dict[str, Any]: ...

    def export_labels(self, *, criterion: str, sample: int | None, seed: int,
                      reviewer: str | None = None) -> list[dict[str, Any]]: ...

    def import_labels(self, rows: list[dict[str, Any]], reviewer: str | None) -> dict[str, int]: ...

    def calibration_set(self, *, criterion: str | None) -> dict[str, Any]: ...

    def stats(self, *, since: str | None, criterion: str | None, source: str = "production",
              max_false_pass: float | None = None) -> dict[str, Any]: ...

    def stats_rows(self, *, since: str | None, criterion: str | None,
                   source: str = "production") -> dict[str, Any]: ...

    def import_simulations(self, records: list[dict[str, Any]],
                           verdicts: list[dict[str, Any]] | None = None) -> dict[str, int]: ...

    def realism(self, who: SimulatedUser) -> dict[str, Any]: ...

    def status(self) -> dict[str, Any]: ...

    def alerts(self, *, state: str, limit: int) -> list[dict[str, Any]]: ...

    def ack_alert(self, alert_id: str, by: str | None) -> dict[str, Any]: ...

    def export_conversations(self, *, since: str | None, state: str | None, sampled_only: bool,
                             criterion_failed: str | None) -> Export: ...

    def close(self) -> None: ...


def _query(**params: Any) -> str:
    given = {k: str(v) for k, v in params.items() if v is not None and v != ""}
    return "?" + urllib.parse.urlencode(given) if given else ""


class APIClient:
    """Talks to a running daemon's JSON API with ``token``: the API token, or a reviewer's (``review.reviewers``),
    which also names who the decisions and labels sent with it are recorded for."""

    def __init__(self, base: str, token: str | None) -> None:
        self.base = base.rstrip("/")
        self.token = token

    def request(self, path: str, body: Any = None, *, missing_ok: bool = True) -> Any:
        """GET (or POST ``body`` as JSON) an API path; None for 404 when ``missing_ok``.

        Raises:
            UserError: the daemon answered with an error (its message), or did not answer.
        """
        data = None if body is None else json.dumps(body).encode()
        try:
            with self._open(path, data) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            if exc.code == 404 and missing_ok:
                return None
            raise self._answered(exc) from None
        except (urllib.error.URLError, OSError) as exc:
            raise UserError(f"cannot reach the daemon at {self.base}: {exc}") from None

    def _open(self, path: str, data: bytes | None = None) -> Any:
        req = urllib.request.Request(self.base + path, data=data, method="GET" if data is None else "POST")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        return urllib.request.urlopen(req, timeout=60)  # noqa: S310 (the daemon's API)

    def _answered(self, exc: urllib.error.HTTPError) -> UserError:
        """The error the daemon answered, as the one line to print."""
        try:
            err = json.loads(exc.read())["error"]
        except (ValueError, KeyError, TypeError):
            err = {"code": str(exc.code), "message": exc.reason}
        if exc.code in (400, 403, 404, 409):  # the request was wrong: the daemon's words are the message
            return UserError(err["message"])
        return UserError(f"the daemon at {self.base} answered {exc.code}: {err['message']}")

    def get(self, path: str) -> Any:
        return self.request(path)

    def list_conversations(self, *, since: str | None, state: str | None, service: str | None,
                           limit: int) -> list[dict[str, Any]]:
        body = self.get("/api/conversations" + _query(since=since, state=state, service=service, limit=limit))
        return list(body["conversations"])

    def conversation(self, conversation_id: str) -> dict[str, Any] | None:
        record = self.get("/api/conversations/" + urllib.parse.quote(conversation_id, safe=""))
        return record if isinstance(record, dict) else None

    def list_reviews(self, *, state: str, criterion: str | None, limit: int,
                     **filters: Any) -> list[dict[str, Any]]:
        """``filters``: severity, service, flagged (bool), since (text such as 7d), assignee, order."""
        if isinstance(filters.get("flagged"), bool):
            filters["flagged"] = int(filters["flagged"])
        body = self.get("/api/review" + _query(state=state, criterion=criterion, limit=limit, **filters))
        return list(body["items"])

    def review_item(self, item_id: str) -> dict[str, Any]:
        detail: dict[str, Any] = self.request("/api/review/" + urllib.parse.quote(item_id, safe=""),
                                              missing_ok=False)
        return detail

    def decide(self, item_id: str, decision: str, reviewer: str | None, note: str | None,
               force: bool) -> dict[str, Any]:
        item: dict[str, Any] = self.request(
            f"/api/review/{urllib.parse.quote(item_id, safe='')}/decision",
            {"decision": decision, "reviewer": reviewer, "note": note, "force": force}, missing_ok=False)
        return item

    def verdicts(self, *, result: str | None, criterion: str | None, conversation: str | None,
                 since: str | None, limit: int, source: str = "production") -> list[dict[str, Any]]:
        body = self.get("/api/verdicts" + _query(result=result, criterion=criterion, conversation=conversation,
                                                 since=since, limit=limit,
                                                 source=None if source == "production" else source))
        return list(body["verdicts"])

    def calibration(self, *, criterion: str | None, max_false_pass: float) -> dict[str, Any]:
        # The daemon's own review.max_false_pass applies: it serves this config.
        body: dict[str, Any] = self.get("/api/calibration" + _query(criterion=criterion))
        return body

    def export_labels(self, *, criterion: str, sample: int | None, seed: int,
                      reviewer: str | None = None) -> list[dict[str, Any]]:
        body = self.request("/api/calibration/export" + _query(criterion=criterion, sample=sample, reviewer=reviewer),
                            missing_ok=False)
        return list(body["rows"])

    def import_labels(self, rows: list[dict[str, Any]], reviewer: str | None) -> dict[str, int]:
        """``POST /api/calibration/labels``.

        Raises:
            LabelImportError: the daemon refused the rows; every problem, by row index.
        """
        data = json.dumps({"rows": rows, "reviewer": reviewer}).encode()
        try:
            with self._open("/api/calibration/labels", data) as resp:
                counts: dict[str, int] = json.loads(resp.read())
                return counts
        except urllib.error.HTTPError as exc:
            if exc.code == 400:
                err = json.loads(exc.read()).get("error") or {}
                if err.get("problems"):
                    from ..review.calibration import LabelImportError

                    raise LabelImportError([(p["row"], p["message"]) for p in err["problems"]]) from None
                raise UserError(err.get("message") or str(exc)) from None
            raise self._answered(exc) from None
        except (urllib.error.URLError, OSError) as exc:
            raise UserError(f"cannot reach the daemon at {self.base}: {exc}") from None

    def calibration_set(self, *, criterion: str | None) -> dict[str, Any]:
        body: dict[str, Any] = self.request("/api/calibration/set" + _query(criterion=criterion), missing_ok=False)
        return body

    def stats(self, *, since: str | None, criterion: str | None, source: str = "production",
              max_false_pass: float | None = None) -> dict[str, Any]:
        # The daemon computes ``calibrated``.
        body: dict[str, Any] = self.get("/api/stats" + _query(since=since, criterion=criterion,
                                                               source=None if source == "production" else source))
        return body

    def stats_rows(self, *, since: str | None, criterion: str | None, source: str = "production") -> dict[str, Any]:
        body: dict[str, Any] = self.get("/api/stats" + _query(since=since, criterion=criterion, rows=1,
                                                               source=None if source == "production" else source))
        if "verdicts" not in body:
            raise UserError(f"the daemon at {self.base} runs an older tracejudge that cannot give the rows "
                            "its stats are computed from: upgrade it to merge its figures with other stores'")
        return body

    def import_simulations(self, records: list[dict[str, Any]],
                           verdicts: list[dict[str, Any]] | None = None) -> dict[str, int]:
        done: dict[str, int] = self.request("/api/simulations", {"records": records, "verdicts": verdicts or []},
                                            missing_ok=False)
        return done

    def realism(self, who: SimulatedUser) -> dict[str, Any]:
        # The daemon's own simulate.min_realism applies: it serves this config.
        body: dict[str, Any] = self.request("/api/simulations/realism" + _query(
            provider=who.provider, model=who.model, prompt_sha256=who.prompt_sha256,
            temperature="none" if who.temperature is None else repr(who.temperature)), missing_ok=False)
        return body

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = self.get("/api/status")
        body["daemon"] = self.base
        return body

    def alerts(self, *, state: str, limit: int) -> list[dict[str, Any]]:
        return list(self.get("/api/alerts" + _query(state=state, limit=limit))["alerts"])

    def ack_alert(self, alert_id: str, by: str | None) -> dict[str, Any]:
        found: dict[str, Any] = self.request(f"/api/alerts/{urllib.parse.quote(alert_id, safe='')}/ack", {"by": by},
                                             missing_ok=False)
        return found

    def export_conversations(self, *, since: str | None, state: str | None, sampled_only: bool,
                             criterion_failed: str | None) -> Export:
        """``GET /api/export/conversations``: the lines as the daemon streams them.

        Raises:
            UserError: the daemon refused the request, could not be reached, or the stream was cut
                off (the daemon's log says why); raised while iterating for a cut.
        """
        path = "/api/export/conversations" + _query(
            since=since, state=state, sampled_only=1 if sampled_only else None, criterion_failed=criterion_failed)
        try:
            resp = self._open(path)
        except urllib.error.HTTPError as exc:
            raise self._answered(exc) from None
        except (urllib.error.URLError, OSError) as exc:
            raise UserError(f"cannot reach the daemon at {self.base}: {exc}") from None
        from .export import TOTAL_HEADER, Export

        return Export(int(resp.headers.get(TOTAL_HEADER) or 0), self._stream(resp), resp.close)

    def _stream(self, resp: Any) -> Iterator[bytes]:
        # Read in blocks, never line by line: http.client's readline takes a chunked answer cut short
        # (the daemon failed mid-way) for its end, where read raises IncompleteRead.
        parts: list[bytes] = []  # of the line not ended yet
        try:
            with resp:
                while block := resp.read(1 << 16):
                    start = 0
                    while (end := block.find(b"\n", start)) != -1:
                        parts.append(block[start:end + 1])
                        yield b"".join(parts)
                        parts, start = [], end + 1
                    if start < len(block):
                        parts.append(block[start:])
        except (http.client.HTTPException, OSError) as exc:
            raise UserError(f"the export from the daemon at {self.base} was cut off ({type(exc).__name__}); "
                            "its log says why") from None
        if parts:  # the daemon ends every line; a last one without its newline is a cut too
            raise UserError(f"the export from the daemon at {self.base} ended inside a line")

    def close(self) -> None:
        return None


def client(cfg: Config, db: Path | None = None, reviewer_token: str | None = None) -> Client:
    """The daemon's API when one serves this config's database (or ``db``, given by ``--db``), else the file.

    ``reviewer_token`` (a reviewer's own, ``review.reviewers``) is sent in place of the API token, and names
    who the decisions and labels made through the client are recorded for.

    Raises:
        UserError: neither is there; the message names the file looked for and how to read another.
    """
    if db is not None:
        if not db.is_file():
            raise UserError(f"--db {db}: no such database file")
        runtime = Path(str(db) + ".daemon.json")  # where a daemon on that file says where it listens
    else:
        runtime = cfg.runtime_file
    info = running_daemon(runtime)
    if info is not None:
        return APIClient(info.api, reviewer_token or cfg.api.auth.bearer_token)
    if db is None and not cfg.storage.duckdb.path.exists():
        raise UserError(_nothing_found(cfg))
    from .file_client import FileClient  # only now: it loads DuckDB and the stages

    return FileClient(db or cfg.storage.duckdb.path, cfg.storage.retention, cfg.review, reviewer_token,
                      cfg.simulate, cfg.sampling.seed)


def realism(cfg: Config, identity: Mapping[str, Any]) -> dict[str, Any]:
    """How realistic people found the simulated user ``identity``: the running daemon's figure when one serves
    this config's database, else the file's (read-only), else nothing labelled.

    Args:
        identity: ``attributes.simulated_user`` of the conversations it played: ``provider``, ``model``,
            ``prompt_sha256`` and ``temperature``, all four (other keys are ignored).

    Returns:
        ``{"simulated_user", "labelled", "realistic", "share", "lower", "validated", "min_realism",
        "not_applicable", "unlabelled"}`` (``review.realism.figure``): ``validated`` is true once ``lower``, the
        Wilson 95% lower bound of the share labelled realistic, reaches ``simulate.min_realism``.

    Raises:
        UserError: ``identity`` lacks one of the four, the daemon refused or cannot be reached, or the file
            cannot be read.
    """
    from ..evals.simulated_user import SimulatedUser
    from ..review.realism import figure

    try:
        who = SimulatedUser.of(dict(identity))
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if running_daemon(cfg.runtime_file) is None and not cfg.storage.duckdb.path.exists():
        return figure(who, [], cfg.simulate.min_realism)  # nothing stored, nothing labelled
    c = client(cfg)
    try:
        return c.realism(who)
    finally:
        c.close()


def _nothing_found(cfg: Config) -> str:
    if cfg.source == "<defaults>":
        where = "the built-in default: no --config given and no ./otel-config.yaml here"
    else:
        where = f"storage.duckdb.path of {cfg.source}"
    hint = "pass --config FILE to read another config's data"
    demo = Path(os.environ.get("TRACEJUDGE_DEMO_DIR") or DEMO_DIR) / "otel-config.yaml"
    if demo.is_file() and (cfg.source == "<defaults>" or not demo.samefile(cfg.source)):
        hint += f", e.g. --config {demo} for the demo's"
    return f"no daemon is running and there is no database at {cfg.storage.duckdb.path} ({where}); {hint}"
