"""What monitors read: the current verdicts judged since a time, counted and weighted as `stats` counts them, and
the newest blind labels of a criterion beside the judge's verdicts."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import duckdb

from collector.review import calibration
from collector.review.stats import window
from judges import Pair, weighted_proportion

from ..support.stored import T0, create_store, label, verdict_row, write

MINUTE = dt.timedelta(minutes=1)
HOUR = dt.timedelta(hours=1)


def test_a_window_counts_the_current_verdicts_judged_since_its_start_each_weighted_by_its_inclusion_probability(
        tmp_path: Path) -> None:
    path = tmp_path / "t.duckdb"
    create_store(path)
    write(path, [], verdicts=[
        verdict_row("c1", "k", "fail", judged_at=T0 + 10 * MINUTE, inclusion_probability=0.5),
        verdict_row("c2", "k", "pass", judged_at=T0 + 20 * MINUTE),
        verdict_row("c3", "k", "error", judged_at=T0 + 30 * MINUTE, error_reason="timeout: no reply"),
        verdict_row("c4", "k", "not_applicable", judged_at=T0 + 40 * MINUTE),
        verdict_row("c5", "k", "pass", judged_at=T0 + 50 * MINUTE, evidence_verified=False),  # kept out of the rate
        verdict_row("c6", "k", "fail", judged_at=T0 - MINUTE),  # before the window
        verdict_row("c8", "k", "fail", judged_at=T0 + MINUTE, superseded=True),  # an older transcript's
        verdict_row("c9", "other", "fail", judged_at=T0 + MINUTE),
    ])
    with duckdb.connect(str(path)) as cur:
        w = window(cur, T0, "k")
        assert (w.judged, w.error) == (5, 1)
        assert w.failure_rate == weighted_proportion([(True, 2.0), (False, 1.0)])
        assert window(cur, T0).judged == 6  # every criterion
        assert window(cur, T0 + HOUR, "k") == (0, 0, None)


def test_the_newest_labels_are_those_of_the_newest_labelled_tasks_each_with_all_its_labels(tmp_path: Path) -> None:
    path = tmp_path / "t.duckdb"
    create_store(path)
    n = calibration.NEWEST_ITEMS + 20
    write(path, [], verdicts=[verdict_row(f"c{i}", "k", "pass") for i in range(n)])
    with duckdb.connect(str(path)) as cur:
        for i in range(n):
            label(cur, f"c{i}", "k", "pass", T0 + i * MINUTE)
        label(cur, "c0", "k", "fail", T0 + n * MINUTE, reviewer="bo")  # a second rater, lately, on the oldest
        label(cur, "c1", "other", "fail", T0 + n * MINUTE)

        newest = calibration.newest_pairs(cur, "k")
        items = {p.item for p in newest}
        assert len(items) == calibration.NEWEST_ITEMS
        assert "c0" in items and "c1" not in items  # by each task's last label
        assert items - {"c0"} == {f"c{i}" for i in range(n - calibration.NEWEST_ITEMS + 1, n)}
        assert [p for p in newest if p.item == "c0"] == [Pair("k", "c0", "ana", "pass", "pass"),
                                                         Pair("k", "c0", "bo", "fail", "pass")]
