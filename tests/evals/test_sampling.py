"""Sampling: config, rules, deterministic draws, budgets on an injected clock, and honest rates.

The clock is always injected; no test reads or asserts on wall-clock time.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from collector.config import _problem
from collector.evals.sampling import ConversationFacts, Decision, Sampler, SamplingSettings, unit_hash
from judges import Conversation, JudgeInfo, Verdict, summarize

ISSUE_EXAMPLE = """
sampling:
  rate: 0.1
  seed: 0
  rules:
    - when: {ended_by: handover}
      rate: 1.0
    - when: {attribute: {key: gen_ai.request.model, equals: gpt-4o-mini}}
      rate: 0.5
  budget:
    conversations_per_hour: 1000
    judge_tokens_per_day: 5000000
"""


class _Clock:
    """A settable clock in epoch seconds (UTC)."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def settings(**raw: Any) -> SamplingSettings:
    return SamplingSettings.model_validate(raw)


def facts(cid: str = "c1", **kw: Any) -> ConversationFacts:
    return ConversationFacts(conversation_id=cid, **kw)


def always(*rules: dict[str, Any], **raw: Any) -> Sampler:
    """Rules at rate 1.0 each (0.0 for the default), so ``decide(...).rule`` shows which matched."""
    return Sampler(settings(rate=0.0, rules=[{"when": w, "rate": 1.0} for w in rules], **raw))


# --------------------------------------------------------------- config


class _Config(BaseModel):
    """The section as ``Config`` will hold it once wired in, to see the key paths users see."""

    model_config = ConfigDict(extra="forbid")
    sampling: SamplingSettings = SamplingSettings()


def problems(text: str) -> list[str]:
    with pytest.raises(ValidationError) as err:
        _Config.model_validate(yaml.safe_load(text))
    return [_problem(e) for e in err.value.errors()]


def test_issue_example_loads() -> None:
    s = _Config.model_validate(yaml.safe_load(ISSUE_EXAMPLE)).sampling
    assert (s.rate, s.seed, len(s.rules)) == (0.1, 0, 2)
    assert s.rules[0].when.ended_by == "handover" and s.rules[0].rate == 1.0
    attr = s.rules[1].when.attribute
    assert attr is not None and (attr.key, attr.equals, attr.matches) == ("gen_ai.request.model", "gpt-4o-mini", None)
    assert s.budget.conversations_per_hour == 1000 and s.budget.judge_tokens_per_day == 5_000_000


def test_defaults() -> None:
    s = SamplingSettings()
    assert (s.rate, s.seed, s.rules) == (0.1, 0, [])
    assert s.budget.conversations_per_hour is None and s.budget.judge_tokens_per_day is None
    assert _Config.model_validate({"sampling": {}}).sampling == s


@pytest.mark.parametrize("text, expected", [
    ("sampling: {rate: 10}", "sampling.rate: a rate is a probability from 0 to 1 (10% is 0.1) (got 10)"),
    ("sampling: {rules: [{when: {ended_by: handover}, rate: -0.5}]}",
     "sampling.rules[0].rate: a rate is a probability"),
    ("sampling: {rules: [{when: {}, rate: 1}]}", "sampling.rules[0].when: an empty when matches everything"),
    ("sampling: {rules: [{rate: 1}]}", "sampling.rules[0].when: Field required"),
    ("sampling: {rules: [{when: {ended_by: handoff}, rate: 1}]}", "sampling.rules[0].when.ended_by: Input should be"),
    ("sampling: {rules: [{when: {mdoel: gpt-4o}, rate: 1}]}", "sampling.rules[0].when.mdoel: unknown key"),
    ("sampling: {rules: [{when: {attribute: {key: a, matches: '(x'}}, rate: 1}]}",
     "sampling.rules[0].when.attribute.matches: not a valid regular expression: missing ) at position 2"),
    ("sampling: {rules: [{when: {attribute: {key: a}}, rate: 1}]}",
     "sampling.rules[0].when.attribute: give exactly one of equals or matches"),
    ("sampling: {rules: [{when: {attribute: {key: a, equals: x, matches: x}}, rate: 1}]}",
     "sampling.rules[0].when.attribute: give exactly one of equals or matches"),
    ("sampling: {rules: [{when: {min_user_turns: 5, max_user_turns: 2}, rate: 1}]}",
     "sampling.rules[0].when: min_user_turns (5) is above max_user_turns (2)"),
    ("sampling: {rules: [{when: {status: ok}, rate: 1}]}", "sampling.rules[0].when.status: Input should be 'error'"),
    ("sampling: {rules: [{when: {max_user_turns: -1}, rate: 1}]}", "sampling.rules[0].when.max_user_turns:"),
    ("sampling: {budget: {conversations_per_hour: -1}}", "sampling.budget.conversations_per_hour:"),
    ("sampling: {budget: {judge_tokens_per_hour: 5}}", "sampling.budget.judge_tokens_per_hour: unknown key"),
    ("sampling: {sead: 1}", "sampling.sead: unknown key"),
])
def test_config_errors_name_the_key(text: str, expected: str) -> None:
    found = problems(text)
    assert any(p.startswith(expected) for p in found), found


def test_every_config_error_at_once() -> None:
    found = problems("""
sampling:
  rate: 2
  rules:
    - when: {}
      rate: 1
    - when: {attribute: {key: a, matches: '[z'}}
      rate: 0.5
  budget: {conversations_per_hour: -3}
""")
    assert [p.split(":")[0] for p in found] == [
        "sampling.rate", "sampling.rules[0].when", "sampling.rules[1].when.attribute.matches",
        "sampling.budget.conversations_per_hour",
    ]


# --------------------------------------------------------------- deterministic draws


def test_unit_hash_is_stable_and_in_range() -> None:
    draws = [unit_hash(f"c{i}", 7) for i in range(2000)]
    assert all(0.0 <= d < 1.0 for d in draws)
    assert len(set(draws)) == len(draws)
    assert unit_hash("conv-1", 0) != unit_hash("conv-1", 1)


def test_hash_value_is_pinned() -> None:
    # blake2b-64 of "0\x00conv-1", big-endian, over 2**64. A change here moves every stored decision
    # and makes replicas disagree, so the number itself is pinned.
    expected = int.from_bytes(hashlib.blake2b(b"0\x00conv-1", digest_size=8).digest(), "big") / 2**64
    assert unit_hash("conv-1", 0) == expected == 0.028897195324137856


def test_same_decisions_across_runs_and_instances() -> None:
    raw = yaml.safe_load(ISSUE_EXAMPLE)["sampling"]
    ids = [f"conv-{i}" for i in range(3000)]
    first = [Sampler(SamplingSettings.model_validate(raw)).decide(facts(c)) for c in ids]
    a, b = Sampler(SamplingSettings.model_validate(raw)), Sampler(SamplingSettings.model_validate(raw))
    assert [a.decide(facts(c)) for c in ids] == first
    assert [b.decide(facts(c)) for c in reversed(ids)] == first[::-1]  # order does not matter


def test_a_different_seed_changes_the_decisions() -> None:
    ids = [f"conv-{i}" for i in range(3000)]
    picked0 = {c for c in ids if Sampler(settings(rate=0.1, seed=0)).decide(facts(c)).sampled}
    picked1 = {c for c in ids if Sampler(settings(rate=0.1, seed=1)).decide(facts(c)).sampled}
    assert picked0 != picked1
    assert len(picked0 & picked1) < 0.3 * len(picked0)  # independent draws overlap about 10%


def test_ten_percent_of_ten_thousand() -> None:
    sampler = Sampler(settings(rate=0.1))
    decisions = [sampler.decide(facts(f"conversation-{i:05d}")) for i in range(10_000)]
    picked = sum(d.sampled for d in decisions)
    assert 900 <= picked <= 1100, picked
    assert all(d.probability == 0.1 and d.rule == "default" and d.skipped is None for d in decisions)


def test_rate_zero_never_and_rate_one_always() -> None:
    ids = [f"c{i}" for i in range(500)]
    assert not any(Sampler(settings(rate=0.0)).decide(facts(c)).sampled for c in ids)
    assert all(Sampler(settings(rate=1.0)).decide(facts(c)).sampled for c in ids)


def test_a_higher_rate_keeps_what_a_lower_rate_picked() -> None:
    # One draw per conversation, compared with the rate: raising the rate only adds conversations.
    ids = [f"c{i}" for i in range(2000)]
    low = {c for c in ids if Sampler(settings(rate=0.1)).decide(facts(c)).sampled}
    high = {c for c in ids if Sampler(settings(rate=0.3)).decide(facts(c)).sampled}
    assert low < high


# --------------------------------------------------------------- rules


def test_first_matching_rule_wins() -> None:
    s = Sampler(settings(rate=0.1, rules=[
        {"when": {"ended_by": "handover"}, "rate": 1.0},
        {"when": {"service": "triage"}, "rate": 0.5},
        {"when": {"ended_by": "handover", "service": "triage"}, "rate": 0.0},  # shadowed
    ]))
    assert s.rule_for(facts(ended_by="handover", service="triage")) == ("rules[0]", 1.0)
    assert s.rule_for(facts(ended_by="idle", service="triage")) == ("rules[1]", 0.5)
    assert s.rule_for(facts(ended_by="idle", service="billing")) == ("default", 0.1)
    d = s.decide(facts(ended_by="handover", service="triage"))
    assert d == Decision(sampled=True, probability=1.0, rule="rules[0]", skipped=None)


@pytest.mark.parametrize("when, yes, no", [
    ({"ended_by": "handover"}, {"ended_by": "handover"}, {"ended_by": "idle"}),
    ({"ended_by": "idle"}, {"ended_by": "idle"}, {"ended_by": None}),
    ({"service": "triage"}, {"service": "triage"}, {"service": "triage-v2"}),
    ({"model": "gpt-4o-mini"}, {"models": ("gpt-4o", "gpt-4o-mini")}, {"models": ("gpt-4o",)}),
    ({"model": "gpt-4o-mini"}, {"models": ["gpt-4o-mini"]}, {}),
    ({"min_user_turns": 3}, {"user_turns": 3}, {"user_turns": 2}),
    ({"max_user_turns": 3}, {"user_turns": 3}, {"user_turns": 4}),
    ({"min_user_turns": 2, "max_user_turns": 4}, {"user_turns": 4}, {"user_turns": 5}),
    ({"min_user_turns": 2, "max_user_turns": 4}, {"user_turns": 2}, {"user_turns": 1}),
    ({"status": "error"}, {"has_error": True}, {"has_error": False}),
    ({"attribute": {"key": "gen_ai.request.model", "equals": "gpt-4o-mini"}},
     {"attributes": {"gen_ai.request.model": "gpt-4o-mini"}}, {"attributes": {"gen_ai.request.model": "gpt-4o"}}),
    ({"attribute": {"key": "tenant", "equals": "acme"}}, {"attributes": {"tenant": "acme"}}, {"attributes": {}}),
    ({"attribute": {"key": "tenant", "equals": "acme"}}, {"attributes": {"tenant": "acme"}},
     {"attributes": {"tenant": "ACME"}}),
    ({"attribute": {"key": "tenant", "equals": "acme"}}, {"attributes": {"tenant": "acme"}},
     {"attributes": {"tenant": None}}),
    # Several values across spans: any of them.
    ({"attribute": {"key": "gen_ai.request.model", "equals": "gpt-4o-mini"}},
     {"attributes": {"gen_ai.request.model": frozenset({"gpt-4o", "gpt-4o-mini"})}},
     {"attributes": {"gen_ai.request.model": ("gpt-4o", "o3")}}),
    # The same value written in another type.
    ({"attribute": {"key": "app.priority", "equals": 5}}, {"attributes": {"app.priority": "5"}},
     {"attributes": {"app.priority": 6}}),
    ({"attribute": {"key": "app.priority", "equals": 5}}, {"attributes": {"app.priority": 5.0}},
     {"attributes": {"app.priority": "5.0"}}),
    ({"attribute": {"key": "app.vip", "equals": True}}, {"attributes": {"app.vip": "true"}},
     {"attributes": {"app.vip": 1}}),
    ({"attribute": {"key": "app.vip", "equals": True}}, {"attributes": {"app.vip": True}},
     {"attributes": {"app.vip": False}}),
    # Regular expressions search anywhere; anchors make them whole-value.
    ({"attribute": {"key": "gen_ai.request.model", "matches": "mini"}},
     {"attributes": {"gen_ai.request.model": "gpt-4o-mini-2024-07-18"}},
     {"attributes": {"gen_ai.request.model": "gpt-4o"}}),
    ({"attribute": {"key": "gen_ai.request.model", "matches": "^claude-(opus|sonnet)-"}},
     {"attributes": {"gen_ai.request.model": "claude-opus-5"}},
     {"attributes": {"gen_ai.request.model": "my-claude-opus-5"}}),
    ({"attribute": {"key": "http.status_code", "matches": "^5\\d\\d$"}},
     {"attributes": {"http.status_code": 503}}, {"attributes": {"http.status_code": 200}}),
])
def test_each_when_key(when: dict[str, Any], yes: dict[str, Any], no: dict[str, Any]) -> None:
    s = always(when)
    assert s.decide(facts(**yes)).rule == "rules[0]"
    assert s.decide(facts(**no)).rule == "default"


def test_keys_in_one_when_must_all_hold() -> None:
    s = always({"ended_by": "handover", "service": "triage", "min_user_turns": 2, "status": "error",
                "attribute": {"key": "deployment.environment", "matches": "^prod"}})
    full: dict[str, Any] = {"ended_by": "handover", "service": "triage", "user_turns": 2, "has_error": True,
                            "attributes": {"deployment.environment": "production"}}
    assert s.decide(facts(**full)).rule == "rules[0]"
    wrongs: list[tuple[str, Any]] = [
        ("ended_by", "idle"), ("service", "billing"), ("user_turns", 1), ("has_error", False),
        ("attributes", {"deployment.environment": "staging"}),
    ]
    for key, wrong in wrongs:
        assert s.decide(facts(**{**full, key: wrong})).rule == "default", key


def test_a_rule_at_rate_zero_excludes_what_it_matches() -> None:
    s = Sampler(settings(rate=1.0, rules=[{"when": {"service": "loadtest"}, "rate": 0.0}]))
    d = s.decide(facts(service="loadtest"))
    assert d == Decision(sampled=False, probability=0.0, rule="rules[0]", skipped=None)


def test_facts_are_frozen() -> None:
    f = facts(models=["a"], attributes={"k": "v"})
    assert f.models == ("a",)
    with pytest.raises(TypeError):
        f.attributes["k"] = "w"  # type: ignore[index]
    with pytest.raises(AttributeError):
        f.user_turns = 3  # type: ignore[misc]


# --------------------------------------------------------------- budgets


def test_conversations_per_hour_stops_the_next_and_frees_up_after_the_window() -> None:
    clock = _Clock()
    s = Sampler(settings(rate=1.0, budget={"conversations_per_hour": 3}), clock=clock)
    first = [s.decide(facts(f"a{i}")) for i in range(3)]
    assert all(d.sampled and d.skipped is None for d in first)
    clock.now += 1800
    stopped = s.decide(facts("a3"))
    assert stopped == Decision(sampled=False, probability=1.0, rule="default",
                               skipped="budget:conversations_per_hour")
    assert s.usage().conversations_last_hour == 3
    clock.now += 1800  # the first three were admitted exactly an hour ago: the window has passed them
    assert s.decide(facts("a4")).sampled
    assert s.decide(facts("a5")).sampled
    assert s.decide(facts("a6")).sampled
    assert s.decide(facts("a7")).skipped == "budget:conversations_per_hour"


def test_the_hourly_window_slides() -> None:
    clock = _Clock()
    s = Sampler(settings(rate=1.0, budget={"conversations_per_hour": 2}), clock=clock)
    assert s.decide(facts("a")).sampled
    clock.now += 600
    assert s.decide(facts("b")).sampled
    clock.now += 2999  # 3599 s after "a": both still in the window
    assert s.decide(facts("c")).skipped == "budget:conversations_per_hour"
    clock.now += 1  # "a" leaves the window, "b" stays
    assert s.decide(facts("d")).sampled
    assert s.decide(facts("e")).skipped == "budget:conversations_per_hour"


def test_conversations_the_rate_passed_over_use_no_budget() -> None:
    s = Sampler(settings(rate=0.1, budget={"conversations_per_hour": 5}), clock=_Clock())
    decisions = [s.decide(facts(f"c{i}")) for i in range(200)]
    picked = [d for d in decisions if d.sampled]
    skipped = [d for d in decisions if d.skipped]
    assert len(picked) == 5
    passed_over = [d for d in decisions if not d.sampled and not d.skipped]
    # Only conversations the rate picked are ever reported as skipped for budget.
    assert len(skipped) == sum(unit_hash(f"c{i}", 0) < 0.1 for i in range(200)) - 5
    assert len(passed_over) == 200 - 5 - len(skipped)
    assert all(d.probability == 0.1 for d in skipped)


def test_judge_tokens_per_day_stops_until_the_next_utc_day() -> None:
    day = 86400.0
    clock = _Clock(now=19_700 * day + 3600)  # 01:00 UTC
    s = Sampler(settings(rate=1.0, budget={"judge_tokens_per_day": 1000}), clock=clock)
    assert s.decide(facts("a")).sampled
    s.record_tokens(600)
    assert s.decide(facts("b")).sampled  # 600 < 1000
    s.record_tokens(500)  # the call already admitted may overshoot
    assert s.usage().judge_tokens_today == 1100
    clock.now = 19_700 * day + day - 1  # 23:59:59 UTC, same day
    assert s.decide(facts("c")) == Decision(sampled=False, probability=1.0, rule="default",
                                            skipped="budget:judge_tokens_per_day")
    clock.now = 19_701 * day  # 00:00 UTC: a new day
    assert s.usage().judge_tokens_today == 0
    assert s.decide(facts("d")).sampled


def test_record_tokens_rejects_negative() -> None:
    with pytest.raises(ValueError, match="negative"):
        Sampler(settings()).record_tokens(-1)


def test_both_budgets_and_the_rule_are_reported() -> None:
    clock = _Clock()
    s = Sampler(settings(rate=0.0, rules=[{"when": {"ended_by": "handover"}, "rate": 1.0}],
                         budget={"conversations_per_hour": 1, "judge_tokens_per_day": 10}), clock=clock)
    assert s.decide(facts("a", ended_by="handover")).sampled
    assert s.decide(facts("b", ended_by="handover")) == Decision(
        sampled=False, probability=1.0, rule="rules[0]", skipped="budget:conversations_per_hour")
    s.record_tokens(10)
    clock.now += 3600
    assert s.decide(facts("c", ended_by="handover")).skipped == "budget:judge_tokens_per_day"


def test_unlimited_budgets_never_skip() -> None:
    s = Sampler(settings(rate=1.0), clock=_Clock())
    for i in range(2000):
        s.record_tokens(10**6)
        assert s.decide(facts(f"c{i}")).sampled


def test_restore_refills_the_windows_after_a_restart() -> None:
    day = 86400.0
    clock = _Clock(now=19_700 * day + 7200)  # 02:00 UTC
    s = Sampler(settings(rate=1.0, budget={"conversations_per_hour": 3, "judge_tokens_per_day": 100}),
                clock=clock)
    s.restore(admitted_at=[clock.now - 4000, clock.now - 3000, clock.now - 10],
              tokens=[(19_699 * day + 80000, 500), (19_700 * day + 10, 40), (clock.now - 5, 20)])
    assert s.usage().conversations_last_hour == 2 and s.usage().judge_tokens_today == 60
    assert s.decide(facts("a")).sampled
    assert s.decide(facts("b")).skipped == "budget:conversations_per_hour"
    s.record_tokens(40)
    clock.now += 3600
    assert s.decide(facts("c")).skipped == "budget:judge_tokens_per_day"


# --------------------------------------------------------------- honest rates


@dataclass(frozen=True)
class Segment:
    name: str
    share: float
    """Of all traffic."""
    failure_rate: float
    """Among applicable conversations."""
    not_applicable: float
    """Share of the segment where the criterion does not apply."""


def _population(segments: Sequence[Segment], n: int, rng: random.Random) -> list[tuple[ConversationFacts, Segment]]:
    total = sum(s.share for s in segments)
    out = []
    for i in range(n):
        u, acc = rng.random() * total, 0.0
        for seg in segments:
            acc += seg.share
            if u < acc:
                break
        out.append((ConversationFacts(
            conversation_id=f"{seg.name}-{i:05d}",
            ended_by="handover" if seg.name == "handover" else "idle",
            service="support",
            models=("gpt-4o-mini",) if seg.name == "mini" else ("gpt-4o",),
            user_turns=3,
            attributes={"gen_ai.request.model": "gpt-4o-mini" if seg.name == "mini" else "gpt-4o"},
        ), seg))
    return out


def coverage(segments: Sequence[Segment], *, n: int = 1000, trials: int = 1000, seed: int = 20240605) -> float:
    """The share of trials whose weighted 95% interval covers the true failure rate of all traffic.

    The population (who is in which segment) is fixed; each trial draws every
    conversation's outcome afresh from its segment's rates and samples with a new
    ``sampling.seed`` through ``Sampler.decide``, the way the daemon does. The
    sampled conversations go to ``judges.summarize`` with their inclusion
    probability in ``Conversation.sampling``, the way the daemon reports them.
    The truth is the failure rate among the applicable conversations of all the
    trial's traffic, sampled or not.
    """
    rng = random.Random(seed)
    population = _population(segments, n, rng)
    raw = yaml.safe_load(ISSUE_EXAMPLE)["sampling"]
    del raw["budget"]
    judge = JudgeInfo(provider="code", model="check")
    # Validated records, built once per conversation and outcome (the rule, hence p, is fixed per conversation).
    rule_of = Sampler(SamplingSettings.model_validate(raw))
    records: dict[str, tuple[Conversation, dict[str, Verdict]]] = {}
    for f, _ in population:
        name, rate = rule_of.rule_for(f)
        conv = Conversation.model_validate({
            "id": f.conversation_id, "source": "production", "ended_by": f.ended_by, "messages": [],
            "sampling": {"probability": rate, "rule": name}})
        records[f.conversation_id] = (conv, {r: Verdict(
            conversation_id=f.conversation_id, criterion_id="resolves-issue", criterion_version=1, result=r,
            judge=judge, transcript_sha256="0" * 64) for r in ("pass", "fail", "not_applicable")})
    covered = 0
    for trial in range(trials):
        sampler = Sampler(SamplingSettings.model_validate({**raw, "seed": trial}))
        fails = applicable = 0
        convs: list[Conversation] = []
        verdicts: list[Verdict] = []
        for f, seg in population:
            if rng.random() < seg.not_applicable:
                result = "not_applicable"
            else:
                result = "fail" if rng.random() < seg.failure_rate else "pass"
                applicable += 1
                fails += result == "fail"
            decision = sampler.decide(f)
            if decision.sampled:
                conv, by_result = records[f.conversation_id]
                assert conv.sampling is not None and conv.sampling.probability == decision.probability
                convs.append(conv)
                verdicts.append(by_result[result])
        weighted = summarize(verdicts, conversations=convs).criteria[0].weighted_failure_rate
        assert weighted is not None and weighted.n_eff is not None
        covered += weighted.low <= fails / applicable <= weighted.high
    return covered / trials


HANDOVERS_FAIL_MOST = [
    Segment("handover", 0.05, 0.40, 0.10),
    Segment("mini", 0.30, 0.15, 0.20),
    Segment("other", 0.65, 0.04, 0.30),
]
"""Failures concentrated where the rules sample most (handovers at 1.0, gpt-4o-mini at 0.5)."""

FAILURES_IN_DEFAULT_TRAFFIC = [
    Segment("handover", 0.20, 0.00, 0.10),
    Segment("mini", 0.30, 0.05, 0.20),
    Segment("other", 0.50, 0.25, 0.30),
]
"""Failures concentrated in the traffic sampled at the default 0.1, where weights are largest."""


@pytest.mark.slow
def test_weighted_interval_covers_the_truth_when_failures_are_oversampled() -> None:
    assert coverage(HANDOVERS_FAIL_MOST) >= 0.93


@pytest.mark.slow
def test_weighted_interval_covers_the_truth_when_failures_sit_in_default_traffic() -> None:
    assert coverage(FAILURES_IN_DEFAULT_TRAFFIC) >= 0.93


@pytest.mark.slow
def test_a_rule_whose_regex_runs_out_of_time_does_not_match_and_lets_other_threads_run(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A pattern that backtracks on a long attribute value (traffic writes the values) gives up, and while
    it searches the interpreter lock is free: a thread of pure Python gets on with its work meanwhile."""
    import threading

    from collector.evals import sampling

    monkeypatch.setattr(sampling, "MATCH_TIMEOUT", 5.0)
    s = Sampler(settings(rate=0.0, rules=[{"when": {"attribute": {"key": "a", "matches": "(?i)refund.*guarantee"}},
                                           "rate": 1.0}]))
    slow = facts(attributes={"a": "refund " * 60_000})
    searching, decided = threading.Event(), threading.Event()
    out: list[Decision] = []

    def decide() -> None:
        searching.set()
        out.append(s.decide(slow))
        decided.set()

    thread = threading.Thread(target=decide)
    thread.start()
    searching.wait()
    # About 0.1 s of pure Python in slices: within one switch interval the search has the lock if it wants
    # it, and a search that held it would keep these slices waiting until it ended.
    for _ in range(50):
        sum(range(100_000))
    assert not decided.is_set()
    thread.join()
    assert (out[0].sampled, out[0].rule) == (False, "default")
    assert "ran out of time" in caplog.text
    assert s.decide(facts(attributes={"a": "refunds come with a guarantee"})).rule == "rules[0]"
