"""Monitors: the stored verdicts and blind labels watched every minute, one alert per episode.

The ``monitors`` stage reads each of ``alerts.monitors`` once a minute by the
daemon's clock (UTC), with the statistics ``tracejudge stats`` and
``tracejudge calibrate`` use, so that noise does not page:

- ``failure_rate``: the criterion's failure rate over the last ``window``
  (``stats.window``: the current production verdicts judged in it, clean passes
  and fails, each weighing 1 / its inclusion probability, with the 95% Wilson
  interval of the effective sample size; never live verdicts, which ``stats``
  leaves out). It fires when the interval's low end is above ``above`` and
  resolves once its high end is below it; in between it stays as it was, so a
  rate hovering at the threshold pages once.
- ``judge_errors``: the share of ``error`` among the current verdicts judged in
  the window (of the criterion, or of all); fires above ``above``, resolves at
  or below it.
- ``judge_agreement``: on the criterion's newest 100 labelled blind tasks
  (``calibration.newest_pairs``), compared as ``judges.calibrate`` compares
  them: the false-pass rate's upper bound (Wilson, or the rule of three with no
  false pass) and Cohen's kappa's lower bound (``judges.kappa_interval``: a
  percentile bootstrap of 2,000 resamples with a fixed seed, so the same labels
  always give the same bound). It fires when the false-pass upper bound is above
  ``max_false_pass`` or kappa's lower bound below ``min_kappa``, and resolves
  once each bound it has is within.

Below ``judges.MIN_N`` (verdicts of effective size, verdicts, human fails for
the false-pass rate, compared items for kappa) a value is reported but decides
nothing: a quiet monitor stays quiet and a firing one stays firing.

An episode is the time from firing to resolving. Its alert (type: the kind) has
the key ``monitor:<name>:<when it fired>``, so a later episode alerts again, and
the firing and the episode's state (``monitor_state``) are committed together:
a restart never fires an open episode again. A monitor removed from the config
has its open episode resolved at the next start (the stage runs without any
monitor for that).

/metrics: ``tracejudge_monitor_value{monitor,measure,bound}`` (``estimate``,
``low``, ``high``), ``tracejudge_monitor_threshold{monitor,measure}`` and
``tracejudge_monitor_firing{monitor}``.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import duckdb

from judges import MIN_N, calibrate, kappa_interval

from ..background import Stage
from ..config import Monitor
from ..evals.judging import utc
from ..words import iso_utc
from ..metrics import Gauge, Metrics
from ..review import calibration
from ..review.stats import window
from ..store import Store, Transaction
from ..words import duration_text, percent, rate_text
from . import store as alerts

log = logging.getLogger("tracejudge.alerts")

INTERVAL = 60.0  # seconds between two readings of every monitor

SCHEMA = """CREATE TABLE IF NOT EXISTS monitor_state (
    name VARCHAR PRIMARY KEY,
    alert_key VARCHAR,
    since TIMESTAMPTZ
)"""
# A row per monitor whose episode is open: the key of its alert and when it fired.

Decision = Literal["fire", "resolve"] | None
MEASURES = ("failure_rate", "error_share", "false_pass", "kappa")


class Measure(NamedTuple):
    """One value a monitor compares with its threshold."""

    estimate: float
    low: float | None
    high: float | None
    threshold: float
    text: str
    """The value as people read it, with its interval or its count."""


class Reading(NamedTuple):
    """What a monitor saw: its measures, the counts behind them, and what it decides."""

    measures: dict[str, Measure]
    counts: dict[str, float]
    decision: Decision
    """fire (out of bounds), resolve (back within) or None (too few to tell, or between the two bounds)."""


# ------------------------------------------------------------------ readings


def read(cur: duckdb.DuckDBPyConnection, monitor: Monitor, now: dt.datetime) -> Reading:
    """What ``monitor`` sees at ``now``."""
    if monitor.kind == "judge_agreement":
        return _agreement(cur, monitor)
    assert monitor.window is not None and monitor.above is not None  # the config requires them for these kinds
    w = window(cur, now - dt.timedelta(seconds=monitor.window), monitor.criterion)
    if monitor.kind == "failure_rate":
        rate = w.failure_rate
        if rate is None:
            return Reading({}, {"judged": w.judged}, None)
        text = rate_text(rate.estimate, rate.low, rate.high, count=rate.count, n=rate.n, too_few=rate.too_few)
        measure = Measure(rate.estimate, rate.low, rate.high, monitor.above, text)
        decision: Decision = (None if rate.too_few else "fire" if rate.low > monitor.above
                              else "resolve" if rate.high < monitor.above else None)
        counts = {"judged": w.judged, "applicable": rate.n, "fail": rate.count, "n_eff": rate.n_eff or 0}
        return Reading({"failure_rate": measure}, counts, decision)
    if w.judged == 0:
        return Reading({}, {"judged": 0, "error": 0}, None)
    share = w.error / w.judged
    few = w.judged < MIN_N
    text = f"too few to tell ({w.error} of {w.judged})" if few else f"{percent(share)} ({w.error} of {w.judged})"
    return Reading({"error_share": Measure(share, None, None, monitor.above, text)},
                   {"judged": w.judged, "error": w.error},
                   None if few else "fire" if share > monitor.above else "resolve")


def _agreement(cur: duckdb.DuckDBPyConnection, monitor: Monitor) -> Reading:
    assert monitor.criterion is not None
    found = calibrate(calibration.newest_pairs(cur, monitor.criterion)).criteria
    if not found:
        return Reading({}, {"items": 0}, None)
    c = found[0]
    measures: dict[str, Measure] = {}
    out: list[bool] = []  # per bound that can tell: out of bounds
    fp = c.false_pass
    if monitor.max_false_pass is not None and fp.rate is not None:
        assert fp.low is not None and fp.high is not None
        measures["false_pass"] = Measure(fp.rate, fp.low, fp.high, monitor.max_false_pass, rate_text(
            fp.rate, fp.low, fp.high, count=fp.count, n=fp.n, too_few=fp.too_few))
        if not fp.too_few:
            out.append(fp.high > monitor.max_false_pass)
    interval = kappa_interval(c.confusion) if monitor.min_kappa is not None and c.kappa is not None else None
    if interval is not None:
        assert monitor.min_kappa is not None and c.kappa is not None
        few = c.n < MIN_N
        text = (f"too few to tell ({c.n} items compared)" if few
                else f"{c.kappa:.2f} ({interval[0]:.2f} to {interval[1]:.2f}, {c.n} items compared)")
        measures["kappa"] = Measure(c.kappa, interval[0], interval[1], monitor.min_kappa, text)
        if not few:
            out.append(interval[0] < monitor.min_kappa)
    wanted = (monitor.max_false_pass is not None) + (monitor.min_kappa is not None)
    decision: Decision = "fire" if any(out) else "resolve" if len(out) == wanted else None
    return Reading(measures, {"items": c.items, "compared": c.n, "human_fails": fp.n, "false_passes": fp.count},
                   decision)


def summary(monitor: Monitor, reading: Reading) -> str:
    """The reading in one line, for the alert and the log."""
    what = dict(zip(MEASURES, ("failure rate", "judge errors", "false passes", "Cohen's kappa")))
    over = (f" over {duration_text(monitor.window)}" if monitor.window is not None
            else f" on the newest {calibration.NEWEST_ITEMS} labelled tasks")
    subject = monitor.criterion or "every criterion"
    parts = [f"{what[k]} {m.text}, threshold {f'{m.threshold:.2f}' if k == 'kappa' else percent(m.threshold)}"
             for k, m in reading.measures.items()]
    return f"{monitor.name}: {subject}{over}: " + ("; ".join(parts) if parts else "nothing to measure")


def payload(monitor: Monitor, reading: Reading) -> dict[str, Any]:
    """What an alert of ``monitor`` carries: the summary first (a Slack message shows the first keys), the
    monitor and its settings, the values with their intervals and thresholds, and the counts behind them."""
    return {
        "summary": summary(monitor, reading), "monitor": monitor.name, "kind": monitor.kind,
        "criterion": monitor.criterion, "window_seconds": monitor.window,
        "measures": {k: {"estimate": m.estimate, "low": m.low, "high": m.high, "threshold": m.threshold}
                     for k, m in reading.measures.items()},
        "counts": reading.counts,
    }


# ------------------------------------------------------------------ the stage


class MonitorMetrics:
    def __init__(self, metrics: Metrics) -> None:
        self.value = Gauge("tracejudge_monitor_value",
                           "A monitor's current value by measure (failure_rate, error_share, false_pass, kappa) and "
                           "bound (estimate, and the 95% interval's low and high).", ("monitor", "measure", "bound"))
        self.threshold = Gauge("tracejudge_monitor_threshold", "The threshold a monitor compares a measure with.",
                               ("monitor", "measure"))
        self.firing = Gauge("tracejudge_monitor_firing",
                            "1 while a monitor's episode is open (its alert fired and has not resolved).", ("monitor",))
        metrics.add_instruments(self.value, self.threshold, self.firing)

    def show(self, name: str, reading: Reading) -> None:
        """Set a monitor's values from its reading; those it could not read now are dropped."""
        for measure in MEASURES:
            m = reading.measures.get(measure)
            bounds = {"estimate": m.estimate, "low": m.low, "high": m.high} if m else {}
            for bound in ("estimate", "low", "high"):
                value = bounds.get(bound)
                if value is not None:
                    self.value.set(value, monitor=name, measure=measure, bound=bound)
                else:
                    self.value.remove(monitor=name, measure=measure, bound=bound)
            if m is not None:
                self.threshold.set(m.threshold, monitor=name, measure=measure)


class Monitors(Stage):
    """Reads every monitor each minute, fires and resolves their alerts (see the module docstring).

    Lifecycle: as every ``Stage``; ``evaluate`` is one round, which tests call with a clock of theirs.
    """

    name = "monitors"

    def __init__(self, store: Store, monitors: Sequence[Monitor], metrics: Metrics, *,
                 clock: Callable[[], float] = time.time, interval: float = INTERVAL) -> None:
        super().__init__(store, metrics)
        self.monitors = list(monitors)
        self.clock = clock
        self.interval = interval
        self.m = MonitorMetrics(metrics)
        self.episodes: dict[str, str] = {}  # monitor name -> the alert key of its open episode

    def _open(self) -> None:
        assert self.cur is not None
        cur = self.cur
        alerts.ensure_schema(cur)
        cur.execute(SCHEMA)
        names = {str(m.name) for m in self.monitors}
        now = utc(self.clock())
        for name, key in cur.execute("SELECT name, alert_key FROM monitor_state").fetchall():
            if name in names:
                self.episodes[name] = key
                continue
            with Transaction(cur):  # its monitor was removed: nothing will ever resolve it otherwise
                alerts.resolve(cur, key=key, payload={"summary": f"{name}: the monitor was removed from "
                                                                 "alerts.monitors"}, now=now)
                cur.execute("DELETE FROM monitor_state WHERE name = ?", [name])
            log.info("monitor %s is no longer configured: its open alert is resolved", name)
        for name in names:
            self.m.firing.set(1 if name in self.episodes else 0, monitor=name)
        if names:
            log.info("monitors read every %s: %s%s", duration_text(self.interval), ", ".join(sorted(names)),
                     f"; firing since before this start: {', '.join(sorted(self.episodes))}" if self.episodes else "")

    def _run(self) -> None:
        self.run_cycles(self._cycle, "reading the monitors failed", self.interval)

    def _cycle(self) -> bool:
        self.evaluate()
        return False

    def evaluate(self) -> dict[str, Reading]:
        """Read every monitor now (by the stage's clock), fire or resolve each as its reading decides; the readings.

        A monitor that cannot be read is logged and counted on ``tracejudge_stage_errors_total``; the others
        are read all the same.
        """
        assert self.cur is not None
        now = utc(self.clock())
        out: dict[str, Reading] = {}
        for monitor in self.monitors:
            name = str(monitor.name)
            try:
                out[name] = reading = read(self.cur, monitor, now)
                self._decide(monitor, reading, now)
            except Exception:  # noqa: BLE001 - logged and counted; the other monitors are read all the same
                self.error(f"monitor {name} could not be read")
                continue
            self.m.show(name, reading)
        return out

    def _decide(self, monitor: Monitor, reading: Reading, now: dt.datetime) -> None:
        cur, name = self.cur, str(monitor.name)
        assert cur is not None
        open_episode = self.episodes.get(name)
        if reading.decision == "fire" and open_episode is None:
            key = f"monitor:{name}:{iso_utc(now)}"
            with Transaction(cur):  # the alert and the episode together: a restart never fires it again
                alerts.fire(cur, type=monitor.kind, key=key, payload=payload(monitor, reading), now=now)
                cur.execute("INSERT OR REPLACE INTO monitor_state VALUES (?, ?, ?)", [name, key, now])
            self.episodes[name] = key
            self.m.firing.set(1, monitor=name)
            log.warning("monitor fired: %s", summary(monitor, reading))
        elif reading.decision == "resolve" and open_episode is not None:
            with Transaction(cur):
                alerts.resolve(cur, key=open_episode, payload=payload(monitor, reading), now=now)
                cur.execute("DELETE FROM monitor_state WHERE name = ?", [name])
            del self.episodes[name]
            self.m.firing.set(0, monitor=name)
            log.info("monitor resolved: %s", summary(monitor, reading))
