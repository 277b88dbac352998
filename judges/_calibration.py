"""Blind calibration: how well a judge agrees with human labels, per criterion.

Humans label a sample of conversations per criterion with pass / fail /
not_applicable without seeing the judge's verdict; ``calibrate`` compares.

Rules, all per criterion:

* One human label per item: the majority of its reviewers' labels. A tie
  leaves the item out of judge-vs-human (counted in ``ties``). A reviewer who
  labels the same item twice: the last label wins.
* Items the judge did not judge (``None``, counted in ``unjudged``) or judged
  ``error`` (``judge_error``) are not in the confusion matrix. Every item lands
  in exactly one of ``n``, ``judge_error``, ``unjudged`` and ``ties``, checked
  in that order.
* ``kappa`` is Cohen's kappa over the 3x3 matrix; None when there is nothing to
  compare or when chance agreement is 1 (both sides used one and the same
  label everywhere), where it is undefined.
  ``kappa_interval`` gives it a 95% interval by a seeded percentile bootstrap
  over the items.
* ``false_pass``: of the human fails, the share the judge passed;
  ``false_fail``: of the human passes, the share the judge failed. 95% Wilson
  interval, or the rule of three (3/n) when the count is 0.
* ``calibrated``: there are ``MIN_N`` human fails or more, and the upper bound
  of the false-pass interval is at most ``max_false_pass``. Otherwise
  ``reason`` says why, checked in this order: ``no_failures_found`` (``MIN_N``
  or more items compared and not one human fail: nothing shows the judge
  catches a failure), ``too_few_labels`` (fewer human fails than ``MIN_N``:
  the false-pass rate cannot be told), ``false_pass_too_high``; ``reason_text``
  says it in words, with the figures.
* A rate over fewer than ``MIN_N`` items is ``too_few``: people are told the
  count, not the rate.
* ``reviewers``: agreement between humans over items with two or more
  reviewers, with Fleiss' kappa generalised to a varying number of raters per
  item (each item's P_i uses its own n_i).
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict

from ._errors import InputError
from ._stats import MIN_N, proportion, too_few

LABELS = ("pass", "fail", "not_applicable")
_JUDGE = (*LABELS, "error", None)


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Pair(NamedTuple):
    """One human label of one item for one criterion, with the judge's result for that item."""

    criterion_id: str
    item: str
    """The labelled thing (a conversation id); several reviewers may label the same item."""
    reviewer: str
    human: str
    """One of ``LABELS``."""
    judge: str | None
    """pass / fail / not_applicable / error, or None when the item was not judged."""


class RateInterval(_Out):
    """A share with its 95% interval; all None (and ``n`` 0) when there is nothing to count."""

    rate: float | None = None
    low: float | None = None
    high: float | None = None
    n: int = 0
    """The denominator: human fails for a false-pass rate, human passes for a false-fail rate."""
    count: int = 0
    """The numerator: human fails the judge passed, or human passes it failed."""
    too_few: bool = True
    """``n`` is below ``MIN_N``: write the count, not the rate."""


class ReviewerAgreement(_Out):
    """Agreement between humans over the items labelled by two or more reviewers."""

    items: int = 0
    agreement: float | None = None
    """Share of agreeing reviewer pairs, pairs taken within an item; None when ``items`` is 0."""
    kappa: float | None = None
    """Fleiss' kappa (P_i with each item's own number of raters); None when undefined or ``items`` is 0."""


Reason = Literal["too_few_labels", "no_failures_found", "false_pass_too_high"]


class CriterionCalibration(_Out):
    """Judge versus humans on one criterion; see the module docstring for the rules."""

    criterion_id: str
    n: int
    """Items in the confusion matrix."""
    confusion: dict[str, dict[str, int]]
    """``confusion[human][judge]``: all nine cells, zeros included."""
    agreement: float | None
    kappa: float | None
    false_pass: RateInterval
    false_fail: RateInterval
    calibrated: bool
    reason: Reason | None
    """Why it is not calibrated (see the module docstring); None when it is."""
    reason_text: str | None
    """``reason`` in words, with the figures behind it."""
    items: int
    """Every item labelled for this criterion: ``n + judge_error + unjudged + ties``."""
    ties: int
    judge_error: int
    unjudged: int
    reviewers: ReviewerAgreement


class CalibrationReport(_Out):
    """What ``calibrate`` returns: one entry per criterion, sorted by criterion id."""

    criteria: list[CriterionCalibration]

    def to_json(self) -> dict[str, Any]:
        """The report as plain JSON-ready data."""
        return self.model_dump(mode="json")


class RerunCounts(_Out):
    """Counts behind ``RerunDiff``."""

    fixed: int
    broken: int
    same: int
    missing: int


class RerunDiff(_Out):
    """A frozen labelled set judged before and after a change; item ids sorted."""

    counts: RerunCounts
    fixed: list[str]
    """Before disagreed with the human, after agrees."""
    broken: list[str]
    """Before agreed with the human, after disagrees."""
    missing: list[str]
    """Labelled items absent from ``after``."""
    false_pass_before: RateInterval
    false_pass_after: RateInterval

    def to_json(self) -> dict[str, Any]:
        """The diff as plain JSON-ready data."""
        return self.model_dump(mode="json")


def _rate(count: int, n: int) -> RateInterval:
    p = proportion(count, n)
    return RateInterval() if p is None else RateInterval(rate=p.estimate, low=p.low, high=p.high, n=n, count=count,
                                                          too_few=p.too_few)


def _cohen(confusion: dict[str, dict[str, int]]) -> tuple[float | None, float | None]:
    """Observed agreement and Cohen's kappa; integer sums so that "chance agreement is 1" is exact."""
    n = sum(sum(row.values()) for row in confusion.values())
    if n == 0:
        return None, None
    diag = sum(confusion[k][k] for k in LABELS)
    rows = {k: sum(confusion[k].values()) for k in LABELS}
    cols = {k: sum(confusion[h][k] for h in LABELS) for k in LABELS}
    chance = sum(rows[k] * cols[k] for k in LABELS)  # pe * n^2
    if chance == n * n:
        return diag / n, None
    return diag / n, (diag * n - chance) / (n * n - chance)


KAPPA_RESAMPLES = 2000
"""Bootstrap resamples behind ``kappa_interval``: over ten seeds, its lower bound of 100 items (kappa 0.73) stayed
within 0.022; each interval takes about 0.06 s at 100 items, 0.4 s at 1,000."""


def kappa_interval(confusion: Mapping[str, Mapping[str, int]], *, resamples: int = KAPPA_RESAMPLES,
                   seed: int = 0) -> tuple[float, float] | None:
    """A 95% percentile-bootstrap interval of Cohen's kappa over a confusion matrix (``confusion[human][judge]``).

    The items are drawn again with replacement ``resamples`` times, by a generator seeded with ``seed`` (the
    same matrix gives the same interval); the bounds are the 2.5th and 97.5th percentiles of the kappas
    (nearest rank). A resample where kappa is undefined (one and the same label on both sides) is left
    out. None when the matrix is empty or no resample gives a kappa.
    """
    cells = [(h, j) for h in LABELS for j in LABELS]
    cum = list(itertools.accumulate(confusion.get(h, {}).get(j, 0) for h, j in cells))
    n = cum[-1]
    if n == 0:
        return None
    rng = random.Random(seed)
    kappas = []
    for _ in range(resamples):
        drawn = Counter(rng.choices(cells, cum_weights=cum, k=n))
        matrix = {h: {j: drawn[(h, j)] for j in LABELS} for h in LABELS}
        kappa = _cohen(matrix)[1]
        if kappa is not None:
            kappas.append(kappa)
    if not kappas:
        return None
    kappas.sort()

    def rank(q: float) -> float:
        return kappas[max(0, math.ceil(q * len(kappas)) - 1)]

    return rank(0.025), rank(0.975)


def _reviewers(votes: list[Counter[str]]) -> ReviewerAgreement:
    """Pair agreement and generalised Fleiss' kappa over items with two or more raters."""
    votes = [v for v in votes if v.total() >= 2]
    if not votes:
        return ReviewerAgreement()
    agree = sum(c * (c - 1) for v in votes for c in v.values())  # ordered agreeing pairs, summed over items
    pairs = sum(v.total() * (v.total() - 1) for v in votes)
    p_bar = sum(sum(c * (c - 1) for c in v.values()) / (v.total() * (v.total() - 1)) for v in votes) / len(votes)
    totals: Counter[str] = Counter()
    for v in votes:
        totals.update(v)
    pe = sum((c / totals.total()) ** 2 for c in totals.values())
    kappa = None if len(totals) == 1 else (p_bar - pe) / (1 - pe)  # one label everywhere: Pe = 1
    return ReviewerAgreement(items=len(votes), agreement=agree / pairs, kappa=kappa)


def _majority(votes: Counter[str]) -> str | None:
    (top, count), *rest = votes.most_common()
    return None if rest and rest[0][1] == count else top


def _why_not(n: int, false_pass: RateInterval, max_false_pass: float) -> tuple[Reason | None, str | None]:
    """Why a judge with this false-pass interval over ``n`` compared items is not calibrated, in a code and in
    words; (None, None) when it is."""
    fails = false_pass.n
    if fails == 0 and not too_few(n):
        return "no_failures_found", (f"people found no failure among the {n} items compared: nothing shows yet "
                                     "that the judge catches one")
    if false_pass.too_few:
        return "too_few_labels", (f"too few labels: people failed {fails} of the {n} items compared; telling the "
                                  f"false-pass rate takes at least {MIN_N} of their fails")
    assert false_pass.high is not None
    if false_pass.high > max_false_pass:
        return "false_pass_too_high", (f"the judge passed {false_pass.count} of the {fails} items people failed: "
                                       f"its false-pass rate may be up to {false_pass.high:.1%}, above the "
                                       f"{max_false_pass:.1%} allowed")
    return None, None


def _criterion(cid: str, labels: dict[str, dict[str, str]], judged: dict[str, str | None],
               max_false_pass: float) -> CriterionCalibration:
    confusion = {h: dict.fromkeys(LABELS, 0) for h in LABELS}
    tally: Counter[str] = Counter()
    votes = {item: Counter(by_reviewer.values()) for item, by_reviewer in labels.items()}
    for item, v in votes.items():
        human, judge = _majority(v), judged[item]
        if judge == "error":
            tally["judge_error"] += 1
        elif judge is None:
            tally["unjudged"] += 1
        elif human is None:
            tally["ties"] += 1
        else:
            confusion[human][judge] += 1
    agreement, kappa = _cohen(confusion)
    n = sum(sum(r.values()) for r in confusion.values())
    false_pass = _rate(confusion["fail"]["pass"], sum(confusion["fail"].values()))
    reason, words = _why_not(n, false_pass, max_false_pass)
    return CriterionCalibration(
        criterion_id=cid, n=n, confusion=confusion, agreement=agreement, kappa=kappa, false_pass=false_pass,
        false_fail=_rate(confusion["pass"]["fail"], sum(confusion["pass"].values())),
        calibrated=reason is None, reason=reason, reason_text=words,
        items=len(votes), ties=tally["ties"], judge_error=tally["judge_error"], unjudged=tally["unjudged"],
        reviewers=_reviewers(list(votes.values())),
    )


def calibrate(pairs: Iterable[Pair], max_false_pass: float = 0.05) -> CalibrationReport:
    """Agreement between the judge and human labels, per criterion.

    Args:
        pairs: human labels with the judge's result for the same item.
        max_false_pass: the highest acceptable upper bound of the false-pass interval.

    Returns:
        One entry per criterion, sorted by id; the rules are in the module docstring.

    Raises:
        InputError: a human label not in ``LABELS``, a judge result that is not
            pass / fail / not_applicable / error / None, or pairs of one item
            carrying different judge results (the judge's result is per item).
    """
    labels: dict[str, dict[str, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))
    judged: dict[str, dict[str, str | None]] = defaultdict(dict)
    for p in pairs:
        where = f"criterion {p.criterion_id!r}, item {p.item!r}, reviewer {p.reviewer!r}"
        if p.human not in LABELS:
            raise InputError(f"{where}: human label {p.human!r} is not one of {', '.join(LABELS)}")
        if p.judge not in _JUDGE:
            raise InputError(f"{where}: judge result {p.judge!r} is not pass, fail, not_applicable, error or None")
        seen = judged[p.criterion_id]
        if p.item in seen and seen[p.item] != p.judge:
            raise InputError(f"{where}: judge result {p.judge!r} differs from {seen[p.item]!r} "
                             "given for the same item")
        seen[p.item] = p.judge
        labels[p.criterion_id][p.item][p.reviewer] = p.human  # the same reviewer again: last wins
    return CalibrationReport(criteria=[
        _criterion(cid, labels[cid], judged[cid], max_false_pass) for cid in sorted(labels)
    ])


def _false_pass(labels: Mapping[str, str], results: Mapping[str, str | None]) -> RateInterval:
    # Like the confusion matrix: only human fails the judge answered (no error, None or missing).
    answered = [results[i] for i, h in labels.items() if h == "fail" and results.get(i) in LABELS]
    return _rate(answered.count("pass"), len(answered))


def compare_reruns(labels: Mapping[str, str], before: Mapping[str, str | None],
                   after: Mapping[str, str | None]) -> RerunDiff:
    """What changed when a frozen labelled set was judged again.

    Only items with a human label count. An item agrees when the judge's result
    equals the human label (error and None never agree). An item missing from
    ``before`` counts as not agreeing before; one missing from ``after`` is
    listed in ``missing`` and not compared.

    Args:
        labels: item -> human label, one per item (already combined).
        before: item -> judge result on the first run.
        after: item -> judge result on the rerun.

    Raises:
        InputError: a label not in ``LABELS`` or a result that is not
            pass / fail / not_applicable / error / None, naming the item.
    """
    for item, human in labels.items():
        if human not in LABELS:
            raise InputError(f"item {item!r}: human label {human!r} is not one of {', '.join(LABELS)}")
    for side, results in (("before", before), ("after", after)):
        for item, result in results.items():
            if result not in _JUDGE:
                raise InputError(f"item {item!r}: {side} result {result!r} is not pass, fail, "
                                 "not_applicable, error or None")
    fixed, broken, missing, same = [], [], [], 0
    for item in sorted(labels):
        if item not in after:
            missing.append(item)
            continue
        was, now = before.get(item) == labels[item], after[item] == labels[item]
        if now and not was:
            fixed.append(item)
        elif was and not now:
            broken.append(item)
        else:
            same += 1
    return RerunDiff(
        counts=RerunCounts(fixed=len(fixed), broken=len(broken), same=same, missing=len(missing)),
        fixed=fixed, broken=broken, missing=missing,
        false_pass_before=_false_pass(labels, before), false_pass_after=_false_pass(labels, after),
    )
