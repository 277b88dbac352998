"""How subcommands reach the data: through a running daemon's API, else the DuckDB file.

The daemon holds the DuckDB write lock, so while it runs every other process
goes through its JSON API (found through the runtime file). With no daemon
the file is opened directly with the same functions the API calls: read-only
to read, read-write only to record a review decision.
"""

from __future__ import annotations

import datetime as dt
import http.client
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, TypeVar

from .. import conversations
from ..config import Config, Retention, Review, Simulate
from ..errors import UserError
from ..evals import simulations, verdicts
from ..evals.simulated_user import REALISM, SimulatedUser
from ..listing import parse_since
from ..retention import oldest_rows, storage_status
from ..review import calibration
from ..review import realism as review_realism
from ..review import queue as review
from ..review.identity import Identity
from ..review import stats as review_stats
from ..runtime import running_daemon
from ..store import connect
from ..store.transactions import Transaction, one
from . import export
from .export import Export, ExportFilter

if TYPE_CHECKING:
    import duckdb


T = TypeVar("T")

DEMO_DIR = Path("tracejudge-demo")
"""Where ``tracejudge demo`` keeps its config and data unless told otherwise."""


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
                    raise calibration.LabelImportError([(p["row"], p["message"]) for p in err["problems"]]) from None
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
        return Export(int(resp.headers.get(export.TOTAL_HEADER) or 0), self._stream(resp), resp.close)

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


def _since(text: str | None) -> dt.datetime | None:
    if not text:
        return None
    try:
        return parse_since(text)
    except ValueError as exc:
        raise UserError(str(exc)) from None


class FileClient:
    """Opens the DuckDB file when no daemon runs: read-only, read-write only for decisions.

    Decisions and labels are recorded as the daemon records them (``review.identity``): with reviewer tokens,
    for the reviewer of ``reviewer_token``.
    """

    def __init__(self, path: Path, retention: Retention | None = None, review_settings: Review | None = None,
                 reviewer_token: str | None = None, simulate: Simulate | None = None, seed: int = 0) -> None:
        self.path = path
        self.retention = retention or Retention()
        self.review_settings = review_settings or Review()
        self.simulate = simulate or Simulate()
        self.seed = seed
        """``sampling.seed``, which draws the realism tasks of an import."""
        self.identity = Identity(self.review_settings.reviewers)
        self.signed_in = self.identity.of_token(reviewer_token)
        if reviewer_token and self.signed_in is None:
            raise UserError("the reviewer token given (--token or $TRACEJUDGE_REVIEWER_TOKEN) is not the token of "
                            "any reviewer in review.reviewers")
        self.con = connect(path, read_only=True)
        self._writer: "duckdb.DuckDBPyConnection | None" = None  # opened by the first import, in place of con
        self.tables = {r[0] for r in self.con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
        if "conversations" not in self.tables:
            self.con.close()
            raise UserError(f"{path} has no conversations table yet (written by an older tracejudge): "
                            "run `tracejudge reindex` once")
        if {"simulated_conversations", "verdicts"} <= self.tables and "simulated_verdicts" not in self.tables:
            # An older version kept simulated verdicts among production's: moved apart once, as a daemon
            # starting on the file would, or production's figures would count them.
            self._writing(simulations.ensure_schema)
            self.tables.add("simulated_verdicts")

    def _evals(self) -> bool:
        # A file the daemon has not opened since evals came has no eval tables: nothing judged yet.
        return "verdicts" in self.tables and "review_items" in self.tables

    def list_conversations(self, *, since: str | None, state: str | None, service: str | None,
                           limit: int) -> list[dict[str, Any]]:
        return conversations.list_conversations(self.con, since=_since(since), state=state, service=service, limit=limit)

    def conversation(self, conversation_id: str) -> dict[str, Any] | None:
        return conversations.conversation_record(self.con, conversation_id)

    def list_reviews(self, *, state: str, criterion: str | None, limit: int,
                     **filters: Any) -> list[dict[str, Any]]:
        if not self._evals():
            review.check_state(state)
            return []
        if "since" in filters:
            filters["since"] = _since(filters["since"])
        return review.list_reviews(self.con, state=state, criterion=criterion, limit=limit, **filters)

    def review_item(self, item_id: str) -> dict[str, Any]:
        if not self._evals():
            raise review.ReviewNotFound(f"no review item {item_id!r}")
        return review.review_item(self.con, item_id, reviewers_per_item=self.review_settings.reviewers_per_item)

    def decide(self, item_id: str, decision: str, reviewer: str | None, note: str | None,
               force: bool) -> dict[str, Any]:
        who = self.identity.recorder(self.signed_in, reviewer)
        if not self._evals():
            raise review.ReviewNotFound(f"no review item {item_id!r}")
        n = self.review_settings.reviewers_per_item
        return self._writing(lambda con: review.decide(con, item_id, decision, who, note, force=force,
                                                       reviewers_per_item=n))

    def _writing(self, fn: Callable[["duckdb.DuckDBPyConnection"], T]) -> T:
        """``fn`` on a read-write connection (people's decisions and labels: the writes a command makes
        without the daemon)."""
        self.con.close()
        con = connect(self.path)
        try:
            review.ensure_schema(con)  # a file judged before calibration came has no calibration tables
            return fn(con)
        finally:
            con.close()
            self.con = connect(self.path, read_only=True)

    def calibration(self, *, criterion: str | None, max_false_pass: float) -> dict[str, Any]:
        if not self._evals() or "calibration_labels" not in self.tables:  # nothing labelled in this file yet
            return calibration.report_of([], max_false_pass)
        return calibration.report(self.con, criterion, max_false_pass)

    def export_labels(self, *, criterion: str, sample: int | None, seed: int,
                      reviewer: str | None = None) -> list[dict[str, Any]]:
        if not self._evals() and not (criterion == REALISM and "simulated_conversations" in self.tables):
            raise review.ReviewInputError(f"no conversation was judged on criterion {criterion!r}")
        return self._writing(lambda con: calibration.export_rows(con, criterion, sample=sample, seed=seed,
                                                                 reviewer=reviewer))

    def import_labels(self, rows: list[dict[str, Any]], reviewer: str | None) -> dict[str, int]:
        self.identity.recorder(self.signed_in, reviewer)  # as a whole: no reviewer's token, or another's name
        if "calibration_items" not in self.tables:  # made as conversations are judged, or simulations imported
            raise calibration.LabelImportError([(n, "no calibration item: nothing was judged in this file")
                                                for n in range(len(rows))])
        return self._writing(lambda con: calibration.import_rows(
            con, rows, reviewer=reviewer, who=lambda name: self.identity.recorder(self.signed_in, name)))

    def calibration_set(self, *, criterion: str | None) -> dict[str, Any]:
        if not self._evals() or "calibration_labels" not in self.tables:
            return {"items": [], "left_out": {"ties": 0, "no_transcript": 0}}
        return calibration.frozen_items(self.con, criterion)

    def verdicts(self, *, result: str | None, criterion: str | None, conversation: str | None,
                 since: str | None, limit: int, source: str = "production") -> list[dict[str, Any]]:
        simulated = source == "simulation"
        if not self._evals() or (simulated and not simulations.present(self.con)):
            return []
        return verdicts.list_verdicts(self.con, result=result, criterion=criterion, conversation=conversation,
                                      since=_since(since), limit=limit, simulated=simulated)

    def stats(self, *, since: str | None, criterion: str | None, source: str = "production",
              max_false_pass: float | None = None) -> dict[str, Any]:
        return review_stats.stats_of([self.stats_rows(since=since, criterion=criterion, source=source)],
                                     max_false_pass)

    def stats_rows(self, *, since: str | None, criterion: str | None, source: str = "production") -> dict[str, Any]:
        if not self._evals():
            ended = one(self.con.execute("SELECT count(*) FROM conversations WHERE state = 'ended'"))
            counts: dict[str, Any] = ({"imported": 0} if source == "simulation" else
                                      {"ended": ended[0] if ended else 0, "sampled": 0, "not_sampled": 0,
                                       "skipped": {}})
            return {"verdicts": [], "not_run": [], "criteria": [], "judged": 0, "conversations": counts,
                    "tokens": {"input_tokens": 0, "output_tokens": 0}, "calibration": []}
        return review_stats.stats_rows(self.con, since=_since(since), criterion=criterion,
                                       source="simulation" if source == "simulation" else "production")

    def import_simulations(self, records: list[dict[str, Any]],
                           verdicts: list[dict[str, Any]] | None = None) -> dict[str, int]:
        from judges import Conversation, Verdict

        convs = [Conversation.model_validate(r) for r in records]
        judged = [Verdict.model_validate(v) for v in verdicts or []]
        if self._writer is None:  # one read-write connection for every chunk of an import
            self.con.close()
            self._writer = self.con = connect(self.path)
            simulations.ensure_schema(self._writer)
            self._writer.execute(calibration.SCHEMA)  # for its realism tasks; the review queue's is the daemon's
            self.tables |= {"simulated_conversations", "calibration_items", "calibration_labels"}
        writer, rate = self._writer, self.simulate.realism_sample_rate
        with Transaction(writer):  # the conversations and their realism tasks in one commit
            done = simulations.store_simulations(writer, convs, verdicts=judged)
            calibration.choose_simulated(writer, done.new, rate, self.seed)
        return done.to_dict()

    def realism(self, who: SimulatedUser) -> dict[str, Any]:
        if not {"simulated_conversations", "calibration_items", "calibration_labels"} <= self.tables:
            return review_realism.figure(who, [], self.simulate.min_realism)
        return review_realism.realism(self.con, who, self.simulate.min_realism)

    def export_conversations(self, *, since: str | None, state: str | None, sampled_only: bool,
                             criterion_failed: str | None) -> Export:
        if state not in (None, "open", "ended"):
            raise UserError(f"state must be open or ended, not {state!r}")
        f = ExportFilter(since=_since(since), state=state, sampled_only=sampled_only,
                         criterion_failed=criterion_failed or None)
        # The walk reads the whole file: without a limit DuckDB would keep all of it cached as it goes.
        self.con.execute(f"SET memory_limit = '{export.FILE_MEMORY_LIMIT}'")
        walk = export.Walk(self.con, f, evals=self._evals())
        return Export(walk.total, iter(walk), walk.close)

    def status(self) -> dict[str, Any]:
        row = one(self.con.execute("SELECT value FROM tracejudge_state WHERE key = 'conversations.batch'"))
        return {"daemon": None, "conversations_batch": int(row[0]) if row else 0,
                "storage": storage_status(self.path, self.retention, time.time(), oldest_rows(self.con))}

    def close(self) -> None:
        self.con.close()
        self._writer = None


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
    if db is not None:
        return FileClient(db, cfg.storage.retention, cfg.review, reviewer_token, cfg.simulate, cfg.sampling.seed)
    if not cfg.storage.duckdb.path.exists():
        raise UserError(_nothing_found(cfg))
    return FileClient(cfg.storage.duckdb.path, cfg.storage.retention, cfg.review, reviewer_token, cfg.simulate,
                      cfg.sampling.seed)


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
    try:
        who = SimulatedUser.of(dict(identity))
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if running_daemon(cfg.runtime_file) is None and not cfg.storage.duckdb.path.exists():
        return review_realism.figure(who, [], cfg.simulate.min_realism)  # nothing stored, nothing labelled
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
