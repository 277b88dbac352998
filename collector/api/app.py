"""The JSON API, the review web page and the health endpoints on ``api.endpoint``.

Errors have one shape (``errors``); every request first passes the Host,
Origin and token checks of ``guards``. DuckDB work runs in worker threads, each
on a cursor of its own.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import math
import re
from typing import Any, Callable, Sequence, TypeVar
from pathlib import Path
from urllib.parse import parse_qsl, quote, unquote, urlencode

import duckdb
from aiohttp import web
from pydantic import BaseModel, ValidationError

from judges import Conversation, Verdict

from .. import config, conversations
from ..alerts import store as alerts
from ..errors import StoreUnavailable, UserError
from ..background import Stage
from ..conversations.reindex import AlreadyRunning, Runner
from ..evals import simulations
from ..evals.simulated_user import SimulatedUser
from ..evals.evaluator import Evaluator
from ..evals.verdicts import list_verdicts
from ..forward import Forwarder
from ..words import MAX_LIMIT, iso_utc, parse_since
from ..system.memory import duckdb_memory
from ..metrics import Metrics
from ..names import clean_name
from ..review import calibration
from ..review import page as review_page
from ..review import realism
from ..review.identity import Identity
from ..review import queue as review
from ..review import stats as review_stats
from ..store import Store
from ..store.schema import LOGS, SPANS
from ..store.transactions import Transaction, trace_place
from . import export
from .errors import APIError, error_middleware
from .guards import REVIEWER, HostCheck, host_check, html_response, origin_check, token_check

log = logging.getLogger("tracejudge.api")
T = TypeVar("T")

_HEX_TRACE = re.compile(r"^[0-9a-fA-F]{32}$")


class API:
    """Routes of the JSON API; ``ready`` flips once every receiver listens."""

    def __init__(self, store: Store, metrics: Metrics, settings: config.API,
                 stages: Sequence[Stage] = (), evaluator: Evaluator | None = None,
                 reindexer: Runner | None = None, forwarder: Forwarder | None = None,
                 review_settings: config.Review | None = None, seed: int = 0,
                 simulate_settings: config.Simulate | None = None) -> None:
        self.store = store
        self.review_settings = review_settings or config.Review()
        self.simulate_settings = simulate_settings or config.Simulate()
        """Its realism sample rate and threshold (``review.realism``)."""
        self.identity = Identity(self.review_settings.reviewers)
        self.seed = seed
        """``sampling.seed``: the calibration samples (judged conversations' and imported simulations') are drawn
        with it."""
        self.forwarder = forwarder
        self.reindexer = reindexer
        self.stages = stages
        """The daemon's background stages: how far each has got, and whether it still runs."""
        self.evaluator = evaluator
        self.metrics = metrics
        self.ready = False
        self.app = web.Application(middlewares=[
            error_middleware, host_check(HostCheck(settings.endpoint, settings.allowed_hosts)), origin_check,
            token_check(settings.auth.bearer_token or None, self.identity)])
        r = self.app.router
        r.add_get("/healthz", self.healthz)
        r.add_get("/readyz", self.readyz)
        r.add_get("/metrics", self.prometheus)
        r.add_get("/api/status", self.status)
        r.add_get("/api/spans/count", self.spans_count)
        r.add_get("/api/traces/{trace_id}", self.trace)
        r.add_get("/api/conversations", self.conversations)
        r.add_get("/api/export/conversations", self.export_conversations)
        r.add_get("/api/conversations/{conversation_id}", self.conversation)
        r.add_get("/api/verdicts", self.verdicts)
        r.add_get("/api/stats", self.stats)
        r.add_post("/api/evals", self.eval_start)
        r.add_post("/api/simulations", self.simulations_import)
        r.add_get("/api/simulations/realism", self.simulations_realism)
        r.add_get("/api/evals/{eval_id}", self.eval_progress)
        r.add_post("/api/reindex", self.reindex_start)
        r.add_get("/api/reindex", self.reindex_progress)
        r.add_get("/api/review", self.review_list)
        r.add_get("/api/review/progress", self.review_progress)
        r.add_get("/api/review/{item_id}", self.review_item)
        r.add_post("/api/review/{item_id}/claim", self.review_claim)
        r.add_post("/api/review/{item_id}/decision", self.review_decision)
        r.add_get("/api/calibration", self.calibration_report)
        r.add_get("/api/calibration/items", self.calibration_items)
        r.add_get("/api/calibration/items/{item_id}", self.calibration_item)
        r.add_post("/api/calibration/items/{item_id}/label", self.calibration_label)
        r.add_get("/api/calibration/export", self.calibration_export)
        r.add_post("/api/calibration/labels", self.calibration_import)
        r.add_get("/api/calibration/set", self.calibration_set)
        r.add_get("/api/alerts", self.alerts_list)
        r.add_post("/api/alerts/{alert_id}/ack", self.alert_ack)
        r.add_get("/", self.home)
        r.add_get("/review", self.review_page)
        r.add_route("*", "/review/sign-in", self.signed_in)
        r.add_get("/review/{item_id}", self.review_item_page)
        r.add_post("/review/{item_id}/decision", self.review_form)
        r.add_get(review_page.SCRIPT, self.review_script)
        r.add_get("/review/label", self.label_first)
        r.add_get("/review/label/{item_id}", self.label_page)
        r.add_post("/review/label/{item_id}", self.label_form)
        r.add_get("/calibration", self.calibration_page)
        r.add_post("/review/alerts/{alert_id}/ack", self.alert_form)

    async def read(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(cursor)`` in a worker thread on a cursor of its own (writes too: evals' own transactions)."""
        try:
            return await self._on_cursor(fn)
        except calibration.LabelImportError as exc:
            raise APIError(exc.status, "invalid_labels", str(exc),
                           {"problems": [{"row": n, "message": m} for n, m in exc.problems]}) from None
        except (review.ReviewError, alerts.AlertError) as exc:
            raise APIError(exc.status, exc.code, str(exc)) from None

    def recorder(self, request: web.Request, typed: Any, what: str = "reviewer") -> str:
        """The reviewer a JSON API action records (``identity.Identity.recorder``); ``typed`` is the body's
        ``what``, a string or left out."""
        return _identified(lambda: self.identity.recorder(request.get(REVIEWER), _text(typed, what)))

    def viewer(self, request: web.Request) -> str | None:
        """Whose own decisions and labels a JSON API read shows (``?reviewer=``, or the token's reviewer)."""
        return _identified(lambda: self.identity.viewer(request.get(REVIEWER), request.query.get("reviewer")))

    async def _on_cursor(self, fn: Callable[[Any], Any]) -> Any:

        def run() -> Any:
            cur = self.store.cursor()
            try:
                return fn(cur)
            finally:
                cur.close()

        return await self._in_thread(run)

    async def _in_thread(self, fn: Callable[[], Any]) -> Any:
        try:
            return await asyncio.to_thread(fn)
        except (StoreUnavailable, duckdb.Error) as exc:
            # While the file cannot be written (a full disk) or is being attached again, reads may fail
            # too: that is the store's state, retryable, not a bug in the request.
            failure = self.store.failure
            if isinstance(exc, duckdb.Error) and failure is None:
                raise
            raise APIError(503, "store_unavailable", f"the store cannot be read now: {failure or exc}") from None

    async def healthz(self, request: web.Request) -> web.Response:
        """Alive: 503 only once the store's writer has stopped for good (the daemon is exiting)."""
        if self.store.broken is not None:
            raise APIError(503, "store_broken", self.store.broken)
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        """Ready: every receiver listens, the store commits and every background stage runs."""
        failure = self.store.failure
        if failure is not None:
            raise APIError(503, "store_unavailable", f"the store cannot commit: {failure}; requests are "
                                                     "refused with a retryable status until a commit succeeds")
        if not self.ready:
            raise APIError(503, "not_ready", "the receivers are not listening (starting or stopping)")
        stopped = [f"the {s.name} stage stopped ({s.stopped})" for s in self.stages if s.stopped is not None]
        if stopped:
            raise APIError(503, "stage_stopped", f"{'; '.join(stopped)}: data is still taken and kept, and a "
                                                 "restart of the daemon catches up; the log has the traceback")
        stalled = [f"the {s.name} stage stalled ({s.stalled})" for s in self.stages if s.stalled is not None]
        if stalled:
            raise APIError(503, "stage_stalled", f"{'; '.join(stalled)}: data is still taken and kept, and the "
                                                 "stage catches up once it is started again")
        return web.json_response({"status": "ready", "queue_depth": self.store.queue_depth})

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics.render(), content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})

    async def status(self, request: web.Request) -> web.Response:
        """Progress of each stage: what is committed, how far the stages have got, whether each runs."""
        body: dict[str, Any] = {"queue_depth": self.store.queue_depth, "committed_batch": self.store.batch_id}
        for stage in self.stages:
            body.update(stage.status())
        body["stages"] = {stage.name: stage.state for stage in self.stages}
        if self.forwarder is not None:
            body.update(self.forwarder.status())

        def memory(cur: Any) -> dict[str, int]:
            held = duckdb_memory(cur)
            return {"used_bytes": sum(used for used, _ in held.values()),
                    "index_bytes": held.get("ART_INDEX", (0, 0))[0]}

        try:
            body["duckdb_memory"] = {**await self.read(memory),
                                     "limit_bytes": config.size_bytes(self.store.memory_limit)}
        except (duckdb.Error, APIError):
            pass  # the store cannot be read now: /readyz says why
        return web.json_response(body)

    async def spans_count(self, request: web.Request) -> web.Response:
        with_traces = _flag(request.query, "traces")

        def q(cur: Any) -> dict[str, int]:
            # count(*) is read from DuckDB's row-group counts, in the same time at any size; counting distinct
            # trace ids reads every stored span (a second at ten million) and holds every id: only when asked.
            out = {"spans": cur.execute("SELECT count(*) FROM span_records").fetchall()[0][0]}
            if with_traces:
                out["traces"] = cur.execute("SELECT count(DISTINCT trace_id) FROM span_records").fetchall()[0][0]
            out["log_records"] = cur.execute("SELECT count(*) FROM log_records").fetchall()[0][0]
            return out

        return web.json_response(await self.read(q))

    async def trace(self, request: web.Request) -> web.Response:
        trace_id = request.match_info["trace_id"]
        if not _HEX_TRACE.match(trace_id):
            raise APIError(400, "bad_trace_id", f"{trace_id!r} is not a 32-character hex trace id")
        trace_id = trace_id.lower()

        def q(cur: Any) -> dict[str, Any]:
            # The rows of the views, read from the trace's first commit on with its own map row (a read
            # of the views would read the archive's map and every commit).
            conversation, first = trace_place(cur, trace_id)
            one_trace = "(SELECT ?::VARCHAR AS trace_id, ?::VARCHAR AS conversation_id)"
            where = " WHERE trace_id = ?" + (" AND batch_id >= ?" if first is not None else "")
            params = [trace_id, conversation, trace_id, *([first] if first is not None else [])]
            # The views' timestamps stop at 2262 (TIMESTAMP_NS); OTLP times run to 2554: written from the integers.
            spans = _dicts(cur.execute(
                f"SELECT * EXCLUDE (batch_id, start_time, end_time) FROM ({SPANS.format(map=one_trace)}){where} "
                "ORDER BY start_time_unix_nano, span_id", params))
            for span in spans:
                span["start_time"] = _nano_time(span["start_time_unix_nano"])
                span["end_time"] = _nano_time(span["end_time_unix_nano"])
            logs = _dicts(cur.execute(
                f"SELECT * EXCLUDE (batch_id, time) FROM ({LOGS.format(map=one_trace)}){where} "
                "ORDER BY coalesce(nullif(time_unix_nano, 0), observed_time_unix_nano), log_id", params))
            for record in logs:
                record["time"] = _nano_time(record["time_unix_nano"])
            return {"trace_id": trace_id, "spans": spans, "logs": logs}

        result = await self.read(q)
        if not result["spans"] and not result["logs"]:
            raise APIError(404, "not_found", f"no spans or log records stored for trace {trace_id}")
        return web.json_response(result, dumps=_dumps)


    async def conversations(self, request: web.Request) -> web.Response:
        q = request.query
        limit, since = _int(q, "limit", 50), _since(q)
        state = q.get("state") or None
        if state not in (None, "open", "ended"):
            raise APIError(400, "bad_parameter", f"state must be open or ended, not {state!r}")
        rows = await self.read(lambda cur: conversations.list_conversations(
            cur, since=since, state=state, service=q.get("service") or None, limit=limit))
        return web.json_response({"conversations": rows}, dumps=_dumps)

    async def conversation(self, request: web.Request) -> web.Response:
        cid = request.match_info["conversation_id"]
        record = await self.read(lambda cur: conversations.conversation_record(cur, cid))
        if record is None:
            raise APIError(404, "not_found", f"no conversation {cid!r}")
        return web.json_response(record, dumps=_dumps)


    async def export_conversations(self, request: web.Request) -> web.StreamResponse:
        """``?since=&state=&sampled_only=1&criterion_failed=C``: conversation/v1 JSON lines, streamed a page
        at a time (``export.Walk``), on a cursor of its own held for the walk, each page read in a worker
        thread."""
        q = request.query
        state = q.get("state") or None
        if state not in (None, "open", "ended"):
            raise APIError(400, "bad_parameter", f"state must be open or ended, not {state!r}")
        f = export.ExportFilter(since=_since(q), state=state, sampled_only=_flag(q, "sampled_only"),
                                criterion_failed=q.get("criterion_failed") or None)
        cur = await self._in_thread(self.store.cursor)
        try:
            # The first page before the answer starts: an error there still gets its status and JSON shape.
            walk = await self._in_thread(lambda: export.Walk(cur, f))
            lines = await self._in_thread(walk.page)
            resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson; charset=utf-8",
                                               export.TOTAL_HEADER: str(walk.total)})
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            try:
                while lines is not None:
                    if lines:
                        await resp.write(b"".join(lines))
                    lines = await self._in_thread(walk.page)
            except (ConnectionError, asyncio.CancelledError):
                raise  # the client left
            except Exception:
                # Too late for an error status: the stream is cut without its last chunk, which the client
                # reads as an incomplete answer, never as a whole export.
                log.exception("the conversation export was cut off")
                if request.transport is not None:
                    request.transport.abort()
                raise ConnectionResetError("export cut off") from None
            await resp.write_eof()
            return resp
        finally:
            await asyncio.to_thread(cur.close)  # ends the walk's transaction too

    # ------------------------------------------------------------ evals and review (JSON)

    async def verdicts(self, request: web.Request) -> web.Response:
        """Stored verdicts, the newest first: ``?result=error`` lists judge errors with their reasons,
        ``?conversation=ID`` the verdicts on one conversation, ``?source=simulation`` those on simulated ones."""
        q = request.query
        result = q.get("result") or None
        if result not in (None, "pass", "fail", "not_applicable", "error"):
            raise APIError(400, "bad_parameter", f"result must be pass, fail, not_applicable or error, not {result!r}")
        since, limit, source = _since(q), _int(q, "limit", 100), _source(q)
        rows = await self.read(lambda cur: list_verdicts(
            cur, result=result, criterion=q.get("criterion") or None, since=since,
            conversation=q.get("conversation") or None,
            include_superseded=q.get("include_superseded") in ("1", "true"), limit=limit,
            simulated=source == "simulation"))
        return web.json_response({"verdicts": rows}, dumps=_dumps)

    async def stats(self, request: web.Request) -> web.Response:
        q = request.query
        since, source = _since(q), _source(q)
        # ?rows=1: the rows the figures are computed from, for `stats --db` merging several daemons' stores.
        criterion, limit = q.get("criterion") or None, self.review_settings.max_false_pass
        if q.get("rows") in ("1", "true"):
            body = await self.read(lambda cur: review_stats.stats_rows(cur, since=since, criterion=criterion,
                                                                       source=source))
        else:
            body = await self.read(lambda cur: review_stats.stats(cur, since=since, criterion=criterion,
                                                                  source=source, max_false_pass=limit))
        return web.json_response(body, dumps=_dumps)

    async def simulations_import(self, request: web.Request) -> web.Response:
        """Store simulated conversations: ``{"records": [conversation/v1, ...], "verdicts": [...]}`` (verdicts
        optional: those ``tracejudge simulate`` made); ``{"stored", "already_imported"}``."""
        body = await _json_object(request, {"records", "verdicts"})
        records, given = body.get("records"), body.get("verdicts", [])
        if not isinstance(records, list) or not isinstance(given, list):
            raise APIError(400, "bad_request", "records must be a list of conversation/v1 records (verdicts too, "
                                               "if given, a list of verdicts)")
        convs = _validated("records", Conversation, records)
        judged = _validated("verdicts", Verdict, given)
        rate, seed = self.simulate_settings.realism_sample_rate, self.seed

        def store(cur: Any) -> simulations.Imported:
            with Transaction(cur):  # the conversations and their realism tasks in one commit
                done = simulations.store_simulations(cur, convs, verdicts=judged)
                calibration.choose_simulated(cur, done.new, rate, seed)
            return done

        try:
            done = await self.read(store)
        except simulations.SimulationError as exc:
            raise APIError(400, "bad_request", str(exc)) from None
        return web.json_response(done.to_dict())

    async def simulations_realism(self, request: web.Request) -> web.Response:
        """``?provider=&model=&prompt_sha256=&temperature=``: how realistic people found that simulated user
        (``realism.realism``); with none of the four, ``{"simulated_users": [...]}``: every one's figure."""
        q, min_realism = request.query, self.simulate_settings.min_realism
        if not any(k in q for k in _SIMULATED_USER):
            found = await self.read(lambda cur: realism.realism_by_user(cur, min_realism))
            return web.json_response({"simulated_users": found})
        who = _simulated_user(q)
        return web.json_response(await self.read(lambda cur: realism.realism(cur, who, min_realism)))

    async def eval_start(self, request: web.Request) -> web.Response:
        """Start a ``tracejudge eval`` pass: ``{"since": "7d", "criteria": ["id", ...]}`` (both optional)."""
        if self.evaluator is None:
            raise APIError(503, "not_ready", "the evaluator is not running")
        body = await _json_object(request, {"since", "criteria", "source"})
        since, criteria = body.get("since"), body.get("criteria") or []
        if body.get("source", "production") not in ("production", "simulation"):
            raise APIError(400, "bad_request", "source must be production or simulation")
        if not isinstance(criteria, list) or not all(isinstance(c, str) for c in criteria):
            raise APIError(400, "bad_request", "criteria must be a list of criterion ids")
        if since is not None and not isinstance(since, str):
            raise APIError(400, "bad_request", "since must be a string such as 7d or an ISO 8601 time")
        when = _since({"since": since} if since else {})
        try:
            progress = self.evaluator.start_backfill(when, criteria, simulated=body.get("source") == "simulation")
        except UserError as exc:
            raise APIError(400, "bad_request", str(exc)) from None
        return web.json_response(progress.to_dict(), status=202)

    async def eval_progress(self, request: web.Request) -> web.Response:
        progress = None
        eval_id = request.match_info["eval_id"]
        if self.evaluator is not None and eval_id.isdigit() and len(eval_id) <= 18:
            progress = self.evaluator.backfill(int(eval_id))
        if progress is None:
            raise APIError(404, "not_found", f"no eval pass {request.match_info['eval_id']!r}")
        return web.json_response(progress.to_dict())

    async def reindex_start(self, request: web.Request) -> web.Response:
        """Start a reindex beside the live conversations (or resume one cut off): ``{}``."""
        await _json_object(request, set())
        if self.reindexer is None:
            raise APIError(503, "not_ready", "the conversation stage is not running")
        try:
            progress = self.reindexer.start()
        except AlreadyRunning as exc:
            raise APIError(409, "reindex_running", str(exc)) from None
        return web.json_response(progress.to_dict(), status=202)

    async def reindex_progress(self, request: web.Request) -> web.Response:
        job = self.reindexer.job if self.reindexer is not None else None
        if job is None:
            raise APIError(404, "not_found", "no reindex has run since the daemon started: POST /api/reindex")
        return web.json_response(job.progress.to_dict())

    def _criterion_ids(self) -> list[str]:
        return [c.id for c in self.evaluator.judging.criteria] if self.evaluator is not None else []

    async def review_list(self, request: web.Request) -> web.Response:
        """``?state=&criterion=&severity=&service=&flagged=1|0&since=&assignee=&order=severity|age&limit=``."""
        q = request.query
        limit = _int(q, "limit", 100)
        items = await self.read(lambda cur: review.list_reviews(cur, limit=limit, **_queue_filters(q)))
        return web.json_response({"items": items}, dumps=_dumps)

    async def review_progress(self, request: web.Request) -> web.Response:
        return web.json_response(await self.read(lambda cur: review.progress(cur)), dumps=_dumps)

    async def review_claim(self, request: web.Request) -> web.Response:
        """``{"reviewer": "..."}`` claims the item for ``review.lock_timeout``; ``"assigned_by"`` makes it an
        assignment of ``reviewer``, taken from whoever held it. With reviewer tokens, the claimant (or the one
        who assigns) is the token's reviewer."""
        body = await _json_object(request, {"reviewer", "assigned_by"})
        if body.get("assigned_by") is None:
            reviewer, by = self.recorder(request, body.get("reviewer")), None
        else:
            by = self.recorder(request, body.get("assigned_by"), "assigned_by")
            reviewer = _identified(lambda: self.identity.assignee(_text(body.get("reviewer"), "reviewer")))
        item_id, timeout = request.match_info["item_id"], self.review_settings.lock_timeout
        item = await self.read(lambda cur: review.claim(cur, item_id, reviewer, timeout, assigned_by=by))
        return web.json_response(item, dumps=_dumps)

    async def review_item(self, request: web.Request) -> web.Response:
        item_id = request.match_info["item_id"]
        viewer, n = self.viewer(request), self.review_settings.reviewers_per_item
        return web.json_response(await self.read(lambda cur: review.review_item(
            cur, item_id, viewer=viewer, reviewers_per_item=n)), dumps=_dumps)

    async def review_decision(self, request: web.Request) -> web.Response:
        """``{"decision": "confirm" | "reject", "reviewer": "...", "note": "...", "force": false}``."""
        body = await _json_object(request, {"decision", "reviewer", "note", "force"})
        if not isinstance(body.get("force", False), bool):
            raise APIError(400, "bad_request", "force must be true or false")
        decision, note = body.get("decision"), body.get("note")
        if not isinstance(decision, str) or not isinstance(note, (str, type(None))):
            raise APIError(400, "bad_request", "decision must be a string (note too, if given)")
        reviewer = self.recorder(request, body.get("reviewer"))
        item_id = request.match_info["item_id"]
        n = self.review_settings.reviewers_per_item
        item = await self.read(lambda cur: review.decide(cur, item_id, decision, reviewer, note,
                                                         force=body.get("force", False), reviewers_per_item=n))
        return web.json_response(item, dumps=_dumps)

    # ------------------------------------------------------------ blind calibration

    async def calibration_report(self, request: web.Request) -> web.Response:
        """Judge against people on the blind labels, per criterion (``judges.calibrate``'s JSON)."""
        criterion = request.query.get("criterion") or None
        report = await self.read(lambda cur: calibration.report(
            cur, criterion, self.review_settings.max_false_pass))
        return web.json_response(report, dumps=_dumps)

    async def calibration_items(self, request: web.Request) -> web.Response:
        q = request.query
        limit = _int(q, "limit", 100)
        viewer = self.viewer(request)
        found = await self.read(lambda cur: calibration.items(
            cur, criterion=q.get("criterion") or None, state=q.get("state") or "unlabelled",
            reviewer=viewer, limit=limit))
        return web.json_response({"items": found}, dumps=_dumps)

    async def calibration_item(self, request: web.Request) -> web.Response:
        item_id, reviewer = request.match_info["item_id"], self.viewer(request)
        return web.json_response(await self.read(lambda cur: calibration.item(cur, item_id, reviewer)),
                                 dumps=_dumps)

    async def calibration_label(self, request: web.Request) -> web.Response:
        """``{"label": "pass" | "fail" | "not_applicable", "reviewer": "...", "note": "..."}``."""
        body = await _json_object(request, {"label", "reviewer", "note"})
        label, note = body.get("label"), body.get("note")
        if not isinstance(label, str) or not isinstance(note, (str, type(None))):
            raise APIError(400, "bad_request", "label must be a string (note too, if given)")
        reviewer = self.recorder(request, body.get("reviewer"))
        item_id = request.match_info["item_id"]
        found = await self.read(lambda cur: calibration.label(cur, item_id, label, reviewer, note, source="api"))
        return web.json_response(found, dumps=_dumps)

    async def calibration_export(self, request: web.Request) -> web.Response:
        """``?criterion=C[&sample=N][&reviewer=NAME]``: the rows of ``tracejudge labels export``."""
        q = request.query
        criterion = q.get("criterion")
        if not criterion:
            raise APIError(400, "bad_request", "criterion is required")
        sample = _int(q, "sample", 1) if "sample" in q else None
        reviewer = q.get("reviewer") or None
        rows = await self.read(lambda cur: calibration.export_rows(cur, criterion, sample=sample, seed=self.seed,
                                                                   reviewer=reviewer))
        return web.json_response({"rows": rows}, dumps=_dumps)

    async def calibration_import(self, request: web.Request) -> web.Response:
        """``{"rows": [{item_id, conversation_id, criterion_id, label, reviewer, note}, ...], "reviewer": "..."}``:
        all stored, or none and every problem with its row's index."""
        body = await _json_object(request, {"rows", "reviewer"})
        rows, reviewer = body.get("rows"), _text(body.get("reviewer"), "reviewer")
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise APIError(400, "bad_request", "rows must be a list of objects")
        me = request.get(REVIEWER)
        # Without a reviewer's token the whole import is refused; a row naming another reviewer is that row's problem.
        self.recorder(request, reviewer)
        counts = await self.read(lambda cur: calibration.import_rows(
            cur, rows, reviewer=reviewer, who=lambda name: self.identity.recorder(me, name)))
        return web.json_response(counts)

    async def calibration_set(self, request: web.Request) -> web.Response:
        """``?criterion=C``: the labelled items with their transcripts, labels and current verdicts, for
        ``tracejudge calibrate --freeze`` (``calibration.frozen_items``)."""
        criterion = request.query.get("criterion") or None
        return web.json_response(await self.read(lambda cur: calibration.frozen_items(cur, criterion)),
                                 dumps=_dumps)

    # ------------------------------------------------------------ alerts

    async def alerts_list(self, request: web.Request) -> web.Response:
        """``?state=open|acknowledged|resolved|all&limit=``: alerts, the newest first, each with its deliveries."""
        q = request.query
        state, limit = q.get("state") or "open", _int(q, "limit", 100)
        found = await self.read(lambda cur: alerts.list_alerts(cur, state=state, limit=limit))
        return web.json_response({"alerts": found}, dumps=_dumps)

    async def alert_ack(self, request: web.Request) -> web.Response:
        """``{"by": "..."}``: someone looks at the alert; with reviewer tokens, the token's reviewer (``by`` left
        out or theirs)."""
        body = await _json_object(request, {"by"})
        by, alert_id = self.recorder(request, body.get("by"), "by"), request.match_info["alert_id"]
        return web.json_response(await self.read(lambda cur: alerts.acknowledge(cur, alert_id, by)), dumps=_dumps)

    async def alert_form(self, request: web.Request) -> web.Response:
        """The queue page's Acknowledge button: back to the queue, which says so."""
        form = await request.post()
        typed, alert_id = str(form.get("reviewer", "")), request.match_info["alert_id"]

        def ack(cur: Any) -> dict[str, Any]:
            return alerts.acknowledge(cur, alert_id, self.identity.recorder(request.get(REVIEWER), typed))

        try:
            await self._on_cursor(ack)
        except (review.ReviewError, alerts.AlertError) as exc:
            return html_response(review_page.render_message("Alert", str(exc)), status=exc.status)
        response = web.HTTPSeeOther("/review?" + urlencode({"acknowledged": alert_id}))
        self.remember(response, request, typed)
        raise response

    # ------------------------------------------------------------ the review page (HTML)

    async def home(self, request: web.Request) -> web.Response:
        raise web.HTTPFound("/review")

    async def review_page(self, request: web.Request) -> web.Response:
        q = request.query
        filters = {k: q.get(k, "") for k in review_page.FILTERS}
        try:
            items, progress, services, open_alerts = await self._on_cursor(lambda cur: (
                review.list_reviews(cur, limit=500, **_queue_filters(q)), review.progress(cur), _services(cur),
                alerts.list_alerts(cur, state="open", limit=50)))
        except (review.ReviewError, APIError) as exc:
            status = exc.status
            return html_response(review_page.render_message("Review queue", str(exc)), status=status)
        saved, acknowledged = q.get("saved"), q.get("acknowledged")
        message = (f"Saved #{q.get('item', '')}: {saved}. The queue is done for these filters." if saved else
                   f"Alert {acknowledged} acknowledged." if acknowledged else None)
        return html_response(review_page.render_list(
            items, filters=filters, criteria=self._criterion_ids(), services=services, progress=progress,
            message=message, alerts=open_alerts, **self.looking(request)))

    def looking(self, request: web.Request) -> dict[str, Any]:
        """Who looks at a page, as its templates take it: ``reviewer`` (the reviewer of the token signed in
        with; without reviewer tokens, the name remembered in the cookie), ``signed_in`` (that name is the
        token's, not to be retyped), ``token_needed`` (reviewers have tokens and this one, the API token,
        names nobody: nothing can be decided or labelled with it)."""
        if self.identity.checked:
            name = request.get(REVIEWER)
            return {"reviewer": name or "", "signed_in": name is not None, "token_needed": name is None}
        return {"reviewer": unquote(request.cookies.get(REVIEWER_COOKIE, "")), "signed_in": False,
                "token_needed": False}

    def remember(self, response: web.StreamResponse, request: web.Request, typed: str) -> None:
        """Remember a typed name for the next item: nobody retypes it on every one (a token names them)."""
        if not self.identity.checked:
            response.set_cookie(REVIEWER_COOKIE, quote(clean_name(typed), safe=""), httponly=True,
                                samesite="Strict", path="/", max_age=365 * 86400, secure=request.secure)

    async def review_item_page(self, request: web.Request) -> web.Response:
        item_id, who, n = request.match_info["item_id"], self.looking(request), self.review_settings.reviewers_per_item
        try:
            detail, queue = await self._on_cursor(lambda cur: (
                review.review_item(cur, item_id, viewer=who["reviewer"] or None, reviewers_per_item=n),
                review.list_reviews(cur, limit=1000)))
        except review.ReviewError as exc:
            return html_response(review_page.render_message("Review item", str(exc)), status=exc.status)
        q = request.query
        saved = q.get("saved")
        message = f"Saved #{q.get('item', '')}: {saved}" if saved else (
            f"Skipped #{q.get('skipped')}" if q.get("skipped") else None)
        return html_response(review_page.render_item(detail, message=message, **who,
                                                     **_neighbours(queue, detail["item"]["id"])))

    async def review_form(self, request: web.Request) -> web.Response:
        form = await request.post()
        item_id = request.match_info["item_id"]
        decision = str(form.get("decision", ""))
        typed = str(form.get("reviewer", ""))
        note = str(form.get("note", "")).strip() or None
        n = self.review_settings.reviewers_per_item

        def decide(cur: Any) -> tuple[dict[str, Any], str]:
            # The next item is the one after this in the queue as it was: saving takes this one out.
            after = _neighbours(review.list_reviews(cur, limit=1000), _int_or(item_id))["next_url"] or "/review"
            if decision == "skip":
                return {"id": item_id, "state": "skipped"}, after
            reviewer = self.identity.recorder(request.get(REVIEWER), typed)
            return review.decide(cur, item_id, decision, reviewer, note, force=form.get("force") == "1",
                                 reviewers_per_item=n), after

        try:
            item, after = await self._on_cursor(decide)
        except review.ReviewError as exc:
            who = self.looking(request)
            if not who["signed_in"]:  # the page shows the name it was sent with
                who["reviewer"] = typed
            try:
                detail, queue = await self._on_cursor(lambda cur: (
                    review.review_item(cur, item_id, viewer=who["reviewer"] or None, reviewers_per_item=n),
                    review.list_reviews(cur, limit=1000)))
            except review.ReviewError:
                return html_response(review_page.render_message("Review item", str(exc)), status=exc.status)
            return html_response(review_page.render_item(detail, error=str(exc), **who,
                                                         **_neighbours(queue, detail["item"]["id"])),
                                 status=exc.status)
        if item["state"] == "skipped":
            raise web.HTTPSeeOther(_with_query(after, {"skipped": item_id}))
        response = web.HTTPSeeOther(_with_query(after, {"saved": item["state"], "item": item["id"]}))
        self.remember(response, request, typed)
        raise response

    # ------------------------------------------------------------ blind labelling and calibration (HTML)

    async def label_first(self, request: web.Request) -> web.Response:
        """The first task the remembered reviewer has not labelled."""
        who = self.looking(request)["reviewer"] or None
        tasks = await self._on_cursor(lambda cur: calibration.items(cur, reviewer=who, limit=1))
        if not tasks:
            return html_response(review_page.render_message("Blind labelling", "No blind task is waiting for you."))
        raise web.HTTPSeeOther(f"/review/label/{tasks[0]['id']}")

    async def label_page(self, request: web.Request, error: str | None = None, status: int = 200,
                         typed: str | None = None) -> web.Response:
        item_id, who = request.match_info["item_id"], self.looking(request)
        if typed is not None and not who["signed_in"]:  # a refused form shows the name it was sent with
            who["reviewer"] = typed
        try:
            detail, waiting = await self._on_cursor(lambda cur: (
                calibration.item(cur, item_id, who["reviewer"] or None),
                calibration.items(cur, reviewer=who["reviewer"] or None, limit=1000)))
        except review.ReviewError as exc:
            return html_response(review_page.render_message("Blind labelling", str(exc)), status=exc.status)
        others = [t["id"] for t in waiting if str(t["id"]) != item_id]
        q = request.query
        message = f"Saved #{q.get('item')}: {q.get('saved')}" if q.get("saved") else None
        return html_response(review_page.render_label_task(
            detail, message=message, error=error, position=f"{len(waiting)} waiting for you",
            next_url=f"/review/label/{others[0]}" if others else None, **who), status=status)

    async def label_form(self, request: web.Request) -> web.Response:
        form = await request.post()
        item_id = request.match_info["item_id"]
        label = str(form.get("label", ""))
        typed = str(form.get("reviewer", ""))
        note = str(form.get("note", "")).strip() or None

        def store(cur: Any) -> str | None:
            reviewer = self.identity.recorder(request.get(REVIEWER), typed)
            calibration.label(cur, item_id, label, reviewer, note, source="page")
            after = [t["id"] for t in calibration.items(cur, reviewer=reviewer, limit=1)]
            return f"/review/label/{after[0]}" if after else None

        try:
            after = await self._on_cursor(store)
        except review.ReviewError as exc:
            return await self.label_page(request, error=str(exc), status=exc.status, typed=typed)
        target = _with_query(after or "/calibration", {"saved": label, "item": item_id})
        response = web.HTTPSeeOther(target)
        self.remember(response, request, typed)
        raise response

    async def calibration_page(self, request: web.Request) -> web.Response:
        limit, who = self.review_settings.max_false_pass, self.looking(request)["reviewer"] or None
        min_realism = self.simulate_settings.min_realism
        report, waiting, figures = await self._on_cursor(lambda cur: (
            calibration.report(cur, None, limit), calibration.items(cur, reviewer=who, limit=MAX_LIMIT),
            realism.realism_by_user(cur, min_realism)))
        return html_response(review_page.render_calibration(report, unlabelled=len(waiting), realism=figures))

    async def signed_in(self, request: web.Request) -> web.Response:
        """Reached only when no token is needed or the cookie is already there: on to the queue."""
        raise web.HTTPSeeOther("/review")

    async def review_script(self, request: web.Request) -> web.Response:
        return web.Response(body=_SCRIPT, content_type="text/javascript", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"})


REVIEWER_COOKIE = "tracejudge_reviewer"
_SCRIPT = (Path(review_page.__file__).parent / "static" / "review.js").read_bytes()


def _text(value: Any, what: str) -> str | None:
    """A body's string field, or None when left out (400 for anything else)."""
    if value is not None and not isinstance(value, str):
        raise APIError(400, "bad_request", f"{what} must be a string")
    return value


def _identified(fn: Callable[[], T]) -> T:
    """``fn()``, an ``identity`` refusal answered in the API's error shape."""
    try:
        return fn()
    except review.ReviewError as exc:
        raise APIError(exc.status, exc.code, str(exc)) from None


def _int_or(text: str) -> Any:
    return int(text) if text.isdigit() else text


def _with_query(path: str, params: dict[str, Any]) -> str:
    base, _, query = path.partition("?")
    kept = [(k, v) for k, v in parse_qsl(query) if k not in ("saved", "item", "skipped")]
    return base + "?" + urlencode([*kept, *params.items()])


def _neighbours(queue: Sequence[dict[str, Any]], item_id: Any) -> dict[str, Any]:
    """The items before and after this one in the pending queue (``next_url`` wraps to the first), and its
    place in it."""
    ids = [it["id"] for it in queue]
    url = "/review/{}".format
    if item_id in ids:
        at = ids.index(item_id)
        after = ids[at + 1:] + ids[:at]
        return {"next_url": url(after[0]) if after else None, "prev_url": url(ids[at - 1]) if at else None,
                "position": f"{at + 1} of {len(ids)} pending"}
    return {"next_url": url(ids[0]) if ids else None, "prev_url": None, "position": f"{len(ids)} pending"}


def _services(cur: Any) -> list[str]:
    return [r[0] for r in cur.execute("SELECT DISTINCT c.service FROM review_items r JOIN conversations c "
                                      "ON c.conversation_id = r.conversation_id WHERE c.service IS NOT NULL "
                                      "ORDER BY 1 LIMIT 200").fetchall()]


async def _json_object(request: web.Request, fields: set[str]) -> dict[str, Any]:
    """The request body as a JSON object with only the ``fields`` named (400 otherwise)."""
    if request.content_type != "application/json":
        raise APIError(415, "unsupported_media_type", "send the body as Content-Type: application/json "
                                                      f"(got {request.content_type})")
    expected = ", ".join(sorted(fields))
    try:
        body = await request.json()
    except (ValueError, RecursionError):  # RecursionError: nested too deep for the parser
        raise APIError(400, "bad_request", f"the body must be a JSON object with {expected}") from None
    if not isinstance(body, dict):
        raise APIError(400, "bad_request", f"the body must be a JSON object with {expected}")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise APIError(400, "bad_request", f"unknown field(s) {', '.join(unknown)}; expected {expected}")
    return body


def _queue_filters(q: Any) -> dict[str, Any]:
    """The review queue's filters from a query string (the JSON API's and the page's)."""
    flagged = q.get("flagged")
    if flagged not in (None, "", "1", "0"):
        raise APIError(400, "bad_parameter", f"flagged must be 1 or 0, not {str(flagged)[:40]!r}")
    return {"state": q.get("state") or "pending", "criterion": q.get("criterion") or None,
            "severity": q.get("severity") or None, "service": q.get("service") or None,
            "flagged": None if not flagged else flagged == "1", "since": _since(q),
            "assignee": q.get("assignee") or None, "order": q.get("order") or "severity"}


def _int(q: Any, key: str, default: int) -> int:
    text = str(q.get(key, default))
    if not text.isdigit() or len(text) > 9 or not 1 <= int(text) <= MAX_LIMIT:
        raise APIError(400, "bad_parameter", f"{key} must be an integer from 1 to {MAX_LIMIT}, not {text[:40]!r}")
    return int(text)


def _flag(q: Any, key: str) -> bool:
    """A yes/no parameter: 1 or true, 0 or false, or left out (no)."""
    text = q.get(key, "")
    if text not in ("", "0", "1", "false", "true"):
        raise APIError(400, "bad_parameter", f"{key} must be 1 or 0, not {text[:40]!r}")
    return bool(text in ("1", "true"))


_SIMULATED_USER = ("provider", "model", "prompt_sha256", "temperature")


def _simulated_user(q: Any) -> SimulatedUser:
    """The simulated user named by a query string: all four of ``_SIMULATED_USER`` (400 otherwise)."""
    missing = [k for k in _SIMULATED_USER if not q.get(k)]
    if missing:
        raise APIError(400, "bad_parameter", f"a simulated user is named by {', '.join(_SIMULATED_USER)}: "
                                             f"{', '.join(missing)} missing")
    temperature: float | None = None
    if q["temperature"] != "none":  # none was sent: Anthropic's models take none
        try:
            temperature = float(q["temperature"])
        except ValueError:
            temperature = math.nan
        if not math.isfinite(temperature):
            raise APIError(400, "bad_parameter", f"temperature must be a number or none, not "
                                                 f"{q['temperature'][:40]!r}")
    try:
        return SimulatedUser.of({**{k: q[k] for k in _SIMULATED_USER}, "temperature": temperature})
    except ValueError as exc:
        raise APIError(400, "bad_parameter", str(exc)) from None


def _source(q: Any) -> review_stats.Source:
    source = q.get("source") or "production"
    if source not in review_stats.SOURCES:
        raise APIError(400, "bad_parameter", f"source must be production or simulation, not {source[:40]!r}")
    return "simulation" if source == "simulation" else "production"


def _since(q: Any) -> Any:
    try:
        return parse_since(q["since"]) if q.get("since") else None
    except ValueError as exc:
        raise APIError(400, "bad_parameter", str(exc)) from None


_JSON_COLUMNS = {"attributes", "events", "links", "resource", "scope_attributes", "dropped", "body"}


def _dicts(result: Any) -> list[dict[str, Any]]:
    names = [d[0] for d in result.description]
    out = []
    for row in result.fetchall():
        rec = {}
        for name, value in zip(names, row):
            if name in _JSON_COLUMNS and isinstance(value, str):
                value = json.loads(value)
            rec[name] = value
        out.append(rec)
    return out


def _nano_time(ns: int | None) -> str | None:
    """Nanoseconds since the Unix epoch as RFC 3339 UTC text, every digit kept (OTLP times reach 2554)."""
    if ns is None:
        return None
    seconds, nanos = divmod(ns, 1_000_000_000)
    text = dt.datetime.fromtimestamp(seconds, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    return text + (f".{nanos:09d}".rstrip("0") if nanos else "") + "Z"


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, default=lambda v: str(iso_utc(v)))


M = TypeVar("M", bound=BaseModel)


def _validated(what: str, model: type[M], items: list[Any]) -> list[M]:
    """``items`` as ``model``s; the first problem is a 400 naming where it is."""
    try:
        return [model.model_validate(x) for x in items]
    except ValidationError as exc:
        e = exc.errors()[0]
        raise APIError(400, "bad_request", f"{what}: {'.'.join(str(p) for p in e['loc'])}: {e['msg']}") from None
