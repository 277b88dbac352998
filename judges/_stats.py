"""Failure rates with their uncertainty, per criterion, per group and per scenario.

Never a mean score. Counts always come with rates: pass (clean), pass with
unverified evidence (apart, never a clean pass), fail, flagged, not_applicable,
error and not run. The failure rate is taken among applicable conversations
(clean passes and fails) with a 95% Wilson interval, or the rule-of-three upper
bound (3/n) when there are no failures. Production samples are weighted by
their inclusion probability p (w = 1/p): estimate = sum(w*fail) / sum(w*applicable),
interval from the effective sample size (sum w)^2 / sum(w^2), never the sum of
weights. Offline, scenarios with expected outcomes give sensitivity,
over-triage and omissions, each apart. Whether two failure counts differ by more
than chance (a run against its baseline) is Fisher's exact test, which holds at
the handful of replicates a scenario gets, where a normal approximation does not.
Below ``MIN_N`` observations (the effective size, when weighted) a share is
marked ``too_few``: its interval is kept, but people are told the count instead.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ._criteria import Criterion
from ._transcript import Conversation
from ._verdict import NotRun, Verdict

Z95 = 1.959963984540054

MIN_N = 10
"""Below this many observations a share is too few to tell, and is written as its count, not a rate.

Under 10 a 95% interval spans half of [0, 1] or more (4 of 9: 19% to 73%; none of 9: up to 33% by the
rule of three, which at n = 1 or 2 allows 100%): a percentage would read as a finding where there is none.
"""


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Proportion(_Out):
    """``count`` out of ``n`` with a 95% interval."""

    count: int
    n: int
    estimate: float
    low: float
    high: float
    method: Literal["wilson", "rule_of_three"]
    too_few: bool
    """Fewer than ``MIN_N`` observations (``n_eff`` when weighted): write the count, not the rate."""
    n_eff: float | None = None
    """Weighted estimates: the effective sample size used for the interval."""


def too_few(n: float) -> bool:
    """Whether ``n`` observations (an effective size may be fractional) are too few to tell: below ``MIN_N``."""
    return round(n, 9) < MIN_N  # equal weights give an effective size of n up to rounding: 9.999999999 is 10


def wilson(count: float, n: float, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval for ``count`` successes in ``n`` trials (``n`` may be an effective size)."""
    p = count / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def proportion(count: int, n: int) -> Proportion | None:
    """``count`` of ``n`` with its interval: Wilson, or the rule of three when ``count`` is 0; None when n is 0."""
    if n == 0:
        return None
    if count == 0:
        return Proportion(count=0, n=n, estimate=0.0, low=0.0, high=min(1.0, 3 / n), method="rule_of_three",
                          too_few=too_few(n))
    low, high = wilson(count, n)
    return Proportion(count=count, n=n, estimate=count / n, low=low, high=high, method="wilson", too_few=too_few(n))


def weighted_proportion(outcomes: Sequence[tuple[bool, float]]) -> Proportion | None:
    """A weighted share of ``True`` among ``(outcome, weight)`` pairs, interval from the effective sample size.

    Weights are inverse inclusion probabilities. Kish's effective size ignores
    where the hits sit among the weights, so it is capped by the size implied by
    the estimator's own variance, sum w(w-1)(y-R)^2 / (sum w)^2, in which a unit
    sampled with certainty (w = 1) contributes nothing: hits concentrated in
    lightly sampled traffic then widen the interval (coverage measured in
    tests/test_sampling.py).
    """
    if not outcomes:
        return None
    total = sum(w for _, w in outcomes)
    hits = sum(w for ok, w in outcomes if ok)
    n_eff = total * total / sum(w * w for _, w in outcomes)
    count = sum(1 for ok, _ in outcomes if ok)
    estimate = hits / total
    variance = sum(w * (w - 1) * ((1.0 if ok else 0.0) - estimate) ** 2 for ok, w in outcomes) / (total * total)
    if variance > 0 and 0 < estimate < 1:
        n_eff = min(n_eff, estimate * (1 - estimate) / variance)
    if count == 0:
        return Proportion(count=0, n=len(outcomes), estimate=0.0, low=0.0, high=min(1.0, 3 / n_eff),
                          method="rule_of_three", too_few=too_few(n_eff), n_eff=n_eff)
    low, high = wilson(estimate * n_eff, n_eff)
    return Proportion(count=count, n=len(outcomes), estimate=estimate, low=low, high=high, method="wilson",
                      too_few=too_few(n_eff), n_eff=n_eff)


def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def fisher_exact(a: int, b: int, c: int, d: int) -> float:
    """The two-sided p-value of Fisher's exact test on the 2x2 table ``[[a, b], [c, d]]``.

    The sum of the (hypergeometric) probabilities of every table with the same
    row and column sums that is no more likely than the observed one. As in R and
    SciPy, a table counts as no more likely when its probability exceeds the
    observed one by at most a relative 1e-7, so that tables equally likely in
    exact arithmetic stay equal in floating point. For example 5 of 5 failing
    before and 0 of 5 now, ``fisher_exact(5, 0, 0, 5)``, is 2/252 = 0.0079; 1 of 5
    and 0 of 5 is 1.0.

    Args:
        a, b: the first row (e.g. fails and passes before).
        c, d: the second row (fails and passes now).

    Returns:
        A p-value in (0, 1]; 1.0 when the rows are proportional or a margin is 0.
        Tables of many thousands may underflow to 0.0 below about 1e-308.

    Raises:
        ValueError: a count is negative.
    """
    if min(a, b, c, d) < 0:
        raise ValueError(f"counts must not be negative: {[[a, b], [c, d]]}")
    row, col, n = a + b, a + c, a + b + c + d
    # The table is fixed by its top-left cell once the margins are: one weight per possible value of it.
    lo, hi = max(0, col - (n - row)), min(row, col)
    logs = [_log_comb(row, x) + _log_comb(n - row, col - x) for x in range(lo, hi + 1)]
    top = max(logs)
    cutoff = logs[a - lo] + math.log1p(1e-7)
    weights = [math.exp(w - top) for w in logs]
    # Summing the same terms in the same order gives exactly 1.0 when every table is included.
    return math.fsum(w for w, lw in zip(weights, logs) if lw <= cutoff) / math.fsum(weights)


class Counts(_Out):
    """Raw counts, never weighted."""

    pass_: int = Field(0, alias="pass")
    """Clean passes: every quote found in the transcript."""
    pass_unverified: int = 0
    """Passes whose evidence was not all found: reported apart, not in the failure rate."""
    fail: int = 0
    flagged: int = 0
    """Fails with no verified quote (counted in ``fail`` too): a reviewer must look."""
    not_applicable: int = 0
    error: int = 0
    not_run: int = 0

    def add(self, v: Verdict) -> None:
        if v.result == "pass":
            if v.evidence_verified:
                self.pass_ += 1
            else:
                self.pass_unverified += 1
        elif v.result == "fail":
            self.fail += 1
            self.flagged += v.flagged
        elif v.result == "not_applicable":
            self.not_applicable += 1
        else:
            self.error += 1


class RateStats(_Out):
    """Counts and failure rates of a criterion or a group."""

    counts: Counts = Field(default_factory=lambda: Counts.model_validate({}))
    failure_rate: Proportion | None = None
    """Among clean passes and fails; None when nothing was applicable."""
    weighted_failure_rate: Proportion | None = None
    """When conversations carry an inclusion probability: the population estimate."""
    errors: dict[str, int] = {}
    """Error verdicts by reason code."""
    not_run_reasons: dict[str, int] = {}


class CriterionStats(RateStats):
    criterion_id: str
    group: str | None = None
    severity: str | None = None


class GroupStats(RateStats):
    group: str


class ScenarioStats(_Out):
    """One criterion over the replicates of one scenario: failing if any replicate failed."""

    persona_id: str
    criterion_id: str
    runs: int
    """Replicates with a pass or fail verdict."""
    passes: int
    """Clean passes."""
    passes_unverified: int
    """Passes whose evidence was not all found."""
    fails: int
    failing: bool
    """Any replicate failed: a scenario that passes 4 times out of 5 is failing."""


class ExpectedOutcomes(_Out):
    """Offline, from the scenarios' ``expected:`` blocks; each reported apart."""

    sensitivity: Proportion | None = None
    """Of scenarios whose expected triage level is urgent, the share the bot escalated."""
    over_triage: Proportion | None = None
    """Of scenarios whose expected level is not urgent, the share the bot escalated."""
    omissions: dict[str, Proportion] = {}
    """Per criterion listed in ``expected.criteria``: the share of judged replicates where it failed."""
    omissions_unjudged: int = 0
    """Expected criteria with no pass or fail verdict (error, not run, not applicable)."""


class Summary(_Out):
    """Everything ``summarize`` reports."""

    criteria: list[CriterionStats]
    groups: list[GroupStats]
    scenarios: list[ScenarioStats]
    """Only for conversations with a ``persona_id``."""
    expected: ExpectedOutcomes | None = None


def triage_level_from_tool(conversation: Conversation, tool: str = "set_triage_level", arg: str = "level") -> str | None:
    """The triage level the bot recorded: the ``level`` argument of its last ``set_triage_level`` call."""
    level = None
    for m in conversation.messages:
        for call in m.tool_calls:
            if call.name == tool and isinstance(call.arguments, dict) and arg in call.arguments:
                level = str(call.arguments[arg])
    return level


def _code(reason: str | None) -> str:
    return (reason or "").split(":", 1)[0]


def _rates(stats: RateStats, verdicts: list[Verdict], weights: dict[str, float] | None) -> None:
    for v in verdicts:
        stats.counts.add(v)
    stats.errors = dict(Counter(_code(v.error_reason) for v in verdicts if v.result == "error"))
    c = stats.counts
    stats.failure_rate = proportion(c.fail, c.fail + c.pass_)
    if weights is not None:
        applicable = [v for v in verdicts if v.result == "fail" or v.clean_pass]
        stats.weighted_failure_rate = weighted_proportion(
            [(v.result == "fail", weights.get(v.conversation_id, 1.0)) for v in applicable]
        )


def summarize(
    verdicts: Iterable[Verdict],
    *,
    criteria: Sequence[Criterion] = (),
    conversations: Iterable[Conversation] = (),
    not_run: Iterable[NotRun] = (),
    urgent_levels: Collection[str] = ("emergency",),
    triage_level: Callable[[Conversation], str | None] = triage_level_from_tool,
) -> Summary:
    """Counts and failure rates per criterion, per group and per scenario.

    Args:
        verdicts: from one or more runs.
        criteria: give group and severity, and the reporting order.
        conversations: the conversations judged: their inclusion probability
            (weighted rates), ``persona_id`` (replicates) and ``expected`` block.
        not_run: counted per criterion with their reasons.
        urgent_levels: triage levels that count as an escalation.
        triage_level: reads the level the bot recorded in a conversation.

    Returns:
        The summary; no mean scores anywhere.
    """
    verdicts = list(verdicts)
    convs = {c.id: c for c in conversations}
    by_crit: dict[str, list[Verdict]] = defaultdict(list)
    for v in verdicts:
        by_crit[v.criterion_id].append(v)
    skipped: dict[str, list[NotRun]] = defaultdict(list)
    for r in not_run:
        skipped[r.criterion_id].append(r)
    info = {c.id: c for c in criteria}
    order = [c.id for c in criteria] + sorted((set(by_crit) | set(skipped)) - set(info))
    sampled = [c for c in convs.values() if c.sampling is not None]
    weights = {c.id: 1 / c.sampling.probability for c in sampled} if sampled else None  # type: ignore[union-attr]

    out_criteria: list[CriterionStats] = []
    by_group: dict[str, list[str]] = defaultdict(list)
    for cid in order:
        crit = info.get(cid)
        stats = CriterionStats(criterion_id=cid, group=crit.group if crit else None,
                               severity=crit.severity if crit else None)
        _rates(stats, by_crit.get(cid, []), weights)
        stats.counts.not_run = len(skipped.get(cid, []))
        stats.not_run_reasons = dict(Counter(r.reason for r in skipped.get(cid, [])))
        out_criteria.append(stats)
        if stats.group:
            by_group[stats.group].append(cid)

    groups = []
    for group, cids in by_group.items():
        g = GroupStats(group=group)
        _rates(g, [v for cid in cids for v in by_crit.get(cid, [])], weights)
        g.counts.not_run = sum(len(skipped.get(cid, [])) for cid in cids)
        g.not_run_reasons = dict(Counter(r.reason for cid in cids for r in skipped.get(cid, [])))
        groups.append(g)

    return Summary(
        criteria=out_criteria, groups=groups, scenarios=_scenarios(verdicts, convs),
        expected=_expected(verdicts, convs, urgent_levels, triage_level),
    )


def _scenarios(verdicts: list[Verdict], convs: dict[str, Conversation]) -> list[ScenarioStats]:
    tally: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    for v in verdicts:
        conv = convs.get(v.conversation_id)
        if conv is not None and conv.persona_id is not None:
            key = "pass_unverified" if v.result == "pass" and not v.evidence_verified else v.result
            tally[(conv.persona_id, v.criterion_id)][key] += 1
    return [
        ScenarioStats(persona_id=pid, criterion_id=cid, runs=t["pass"] + t["pass_unverified"] + t["fail"],
                      passes=t["pass"], passes_unverified=t["pass_unverified"], fails=t["fail"],
                      failing=t["fail"] > 0)
        for (pid, cid), t in sorted(tally.items())
    ]


def _expected(
    verdicts: list[Verdict], convs: dict[str, Conversation], urgent: Collection[str],
    triage_level: Callable[[Conversation], str | None],
) -> ExpectedOutcomes | None:
    expected = {c.id: c.expected for c in convs.values() if c.expected}
    if not expected:
        return None
    with_expected = [convs[cid] for cid in expected]
    levels = {cid: e.get("triage_level") for cid, e in expected.items()}
    urgent_cases = [c for c in with_expected if levels[c.id] in urgent]
    calm_cases = [c for c in with_expected if levels[c.id] is not None and levels[c.id] not in urgent]
    escalated = {c.id for c in with_expected if triage_level(c) in urgent}
    verdict_of = {(v.conversation_id, v.criterion_id): v for v in verdicts}
    omitted: dict[str, list[bool]] = defaultdict(list)
    unjudged = 0
    for c in with_expected:
        for cid in expected[c.id].get("criteria") or []:
            v = verdict_of.get((c.id, cid))
            if v is None or v.result not in ("pass", "fail"):
                unjudged += 1
            else:
                omitted[cid].append(v.result == "fail")
    return ExpectedOutcomes(
        sensitivity=proportion(sum(c.id in escalated for c in urgent_cases), len(urgent_cases)),
        over_triage=proportion(sum(c.id in escalated for c in calm_cases), len(calm_cases)),
        omissions={cid: p for cid, fails in sorted(omitted.items()) if (p := proportion(sum(fails), len(fails)))},
        omissions_unjudged=unjudged,
    )
