"""The daemon's ``scenarios`` stage: with ``scenarios.on_confirm``, each confirmed review item becomes a scenario.

It looks for confirmed items whose scenario is not in ``cases.jsonl`` every
``INTERVAL`` seconds, so an item confirmed through the page, the API or the CLI
(through the API, or on the file while no daemon ran) is exported, also after
a restart. Writing is ``ScenarioWriter.write``: a failure to write (a full disk,
a folder it may not write) is a failed cycle, tried again; a refused scenario is
logged once, counted and left, since it would be refused again.

Registered by ``tracejudge serve`` (``collector`` never imports ``replay``).
"""

from __future__ import annotations

import logging
from typing import Any

from collector.background import Stage
from collector.config import Config
from collector.evals.setup import daemon_provider
from collector.metrics import Counter, Metrics
from collector.review import queue as review
from collector.store import Store

from .scenarios import ScenarioRefused, ScenarioWriter, scenario_id

log = logging.getLogger("tracejudge.scenarios")

INTERVAL = 2.0  # seconds between two looks for newly confirmed items


class ScenarioStage(Stage):
    """Exports confirmed items as they are confirmed (see the module docstring)."""

    name = "scenarios"

    def __init__(self, store: Store, config: Config, metrics: Metrics, *, interval: float = INTERVAL) -> None:
        super().__init__(store, metrics)
        settings = config.scenarios
        provider, no_provider = (daemon_provider(config) if settings.draft_with_provider
                                 else (None, "drafting is off (scenarios.draft_with_provider: false)"))
        self.writer = ScenarioWriter(settings.out_dir, max_turns=settings.max_turns,
                                     patterns=settings.redact.patterns, provider=provider,
                                     timeout=config.judges.timeout, no_provider=no_provider)
        self.interval = interval
        self.refused: set[str] = set()
        self.counts = {"written": 0, "refused": 0}
        self.exported = Counter("tracejudge_scenarios_total",
                                "Confirmed review items the daemon exported as scenarios, by outcome.", ("outcome",))
        for outcome in self.counts:
            self.exported.declare(outcome=outcome)
        metrics.add_instruments(self.exported)

    def status(self) -> dict[str, Any]:
        return {"scenarios": {**self.counts, "out_dir": str(self.writer.out_dir)}}

    def _open(self) -> None:
        assert self.cur is not None
        review.ensure_schema(self.cur)

    def _run(self) -> None:
        try:  # a folder it cannot write, for now: the next cycle tries again
            self.run_cycles(self._look, "writing scenarios failed", self.interval)
        finally:
            self.writer.close()

    def _look(self) -> bool:
        self.cycle()
        return False  # the next look waits ``interval``, however many were written

    def cycle(self) -> int:
        """Export every confirmed item not exported yet; how many were written."""
        assert self.cur is not None
        done = self.writer.exported() | self.refused
        todo = [it for it in review.list_reviews(self.cur, state="confirmed", limit=100_000)
                if scenario_id(it["criterion_id"], it["conversation_id"]) not in done]
        written = 0
        for it in todo:
            if self.stopping.is_set():
                break
            try:
                w = self.writer.write(review.review_item(self.cur, it["id"]))
            except ScenarioRefused as exc:
                self.refused.add(scenario_id(it["criterion_id"], it["conversation_id"]))
                self._count("refused")
                log.warning("review item %s not exported: %s", it["id"], exc)
                continue
            if w.outcome == "written":
                written += 1
                self._count("written")
        return written

    def _count(self, outcome: str) -> None:
        self.counts[outcome] += 1
        self.exported.inc(outcome=outcome)
