"""Reading the DuckDB file when no daemon runs: the ``Client`` of ``client.client`` then.

Read-only to read; read-write only for what people record without the daemon (review decisions,
labels) and for an import of simulated conversations.
"""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from .. import conversations
from ..alerts import store as alerts_store
from ..config import Retention, Review, Simulate
from ..errors import UserError
from ..evals import simulations, verdicts
from ..evals.simulated_user import REALISM, SimulatedUser
from ..words import parse_since
from ..retention import behind_seconds, oldest_rows, storage_status, unswept
from ..review import calibration
from ..review import realism as review_realism
from ..review import queue as review
from ..review import stats as review_stats
from ..review.identity import Identity
from ..store import connect
from ..store.transactions import Transaction, one
from . import export
from .export import Export, ExportFilter

if TYPE_CHECKING:
    import duckdb

T = TypeVar("T")


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
        if "verdicts" in self.tables and not self.con.execute(
                "SELECT 1 FROM information_schema.columns WHERE table_name = 'verdicts' AND column_name = 'live'"
        ).fetchall():
            # Verdicts of a version before live criteria, all made at the end, are marked so once (review
            # items too, by ``_writing``), as a daemon starting on the file would: reads leave live ones out.
            self._writing(self._add_live_columns)

    def _add_live_columns(self, con: "duckdb.DuckDBPyConnection") -> None:
        for table in ("verdicts", "simulated_verdicts"):
            if table in self.tables:
                verdicts.add_live_column(con, table)

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

    def alerts(self, *, state: str, limit: int) -> list[dict[str, Any]]:
        alerts_store.check_state(state)
        if "alerts" not in self.tables:  # no daemon has opened this file since alerts came
            return []
        return alerts_store.list_alerts(self.con, state=state, limit=limit)

    def ack_alert(self, alert_id: str, by: str | None) -> dict[str, Any]:
        who = self.identity.recorder(self.signed_in, by)
        if "alerts" not in self.tables:
            raise alerts_store.AlertNotFound(f"no alert {alert_id!r}")
        return self._writing(lambda con: alerts_store.acknowledge(con, alert_id, who))

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
                "storage": storage_status(self.path, self.retention, now := time.time(), oldest_rows(self.con),
                                          behind=behind_seconds(self.retention, now, unswept(self.con)))}

    def close(self) -> None:
        self.con.close()
        self._writer = None
