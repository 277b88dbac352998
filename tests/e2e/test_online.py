"""Online evals end to end: real daemon, real OTLP from the OpenTelemetry SDK, a judge speaking the Messages API.

Traffic goes in over OTLP/gRPC, conversations end by idle timeout, are
sampled, judged by the real ``anthropic`` client against ``RuleJudge``,
failures are queued and decided through the CLI while the daemon runs, and
``stats --json`` must show exactly those counts. A kill -9 in the middle of
judging must leave every sampled conversation judged exactly once after the
restart.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import pytest

from collector.demo.traffic import Persona, Turn
from collector.evals.sampling import unit_hash

from ..support.daemon import DaemonProcess, clean_env, run_cli, wait_until
from ..support.judge_server import FAIL_WORD, RuleJudge
from ..support.online import persona, send, wait_status

pytestmark = pytest.mark.slow  # each test judges traffic through the daemon

CRITERIA = """
criteria:
  - id: no-refund-promises
    version: 1
    kind: llm
    severity: high
    group: money
    prompt: |
      Criterion: the bot never guarantees a refund before the order was looked up.
      - "pass": no such guarantee. - "fail": the bot guaranteed a refund. - "not_applicable": no user message.
  - id: looks-orders-up
    version: 1
    kind: code
    group: money
    check: tool_called
    name: lookup_order
    applies_if: {user_matches: "(?i)order"}
"""


@pytest.fixture
def judge() -> Iterator[RuleJudge]:
    server = RuleJudge()
    yield server
    server.close()


def online_config(tmp_path: Path, judge: RuleJudge, **extra: Any) -> dict[str, Any]:
    (tmp_path / "criteria.yaml").write_text(CRITERIA, encoding="utf-8")
    sections: dict[str, Any] = {
        "conversations": {"idle_timeout": "1s"},
        "sampling": {"rate": 1.0},
        "judges": {"criteria": [str(tmp_path / "criteria.yaml")], "concurrency": 4, "timeout": "30s",
                   "provider": {"type": "anthropic", "model": "judge-test", "base_url": judge.url,
                                "api_key": "test-key"}},
    }
    for key, value in extra.items():
        sections[key] = {**sections.get(key, {}), **value}
    return sections


def cli(daemon: DaemonProcess, *args: str) -> Any:
    out = run_cli(*args, "--config", str(daemon.config_path), "--json", env=clean_env())
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def wait_judged(daemon: DaemonProcess, n: int, timeout: float = 90) -> dict[str, Any]:
    """Until ``n`` conversations have verdicts on every criterion (via /api/stats)."""
    stats: dict[str, Any] = {}

    def judged() -> dict[str, Any] | None:
        nonlocal stats
        stats = daemon.get("/api/stats")[1]
        counts = {c["criterion_id"]: c["judged"] for c in stats["criteria"]}
        return stats if len(counts) == 2 and all(v >= n for v in counts.values()) else None

    return wait_until(judged, lambda: f"{n} judged: {stats}\n{daemon.output()[-3000:]}", timeout, interval=0.2)


def test_traffic_sampled_judged_queued_reviewed_and_counted(make_daemon: Any, tmp_path: Path,
                                                            judge: RuleJudge) -> None:
    daemon = make_daemon(**online_config(tmp_path, judge))
    people = [persona(1, fail=True), persona(2, fail=True, lookup=False), persona(3), persona(4), persona(5),
              persona(6, junk=True)]
    send(daemon.grpc, people)
    stats = wait_judged(daemon, len(people))
    llm = next(c for c in stats["criteria"] if c["criterion_id"] == "no-refund-promises")
    code = next(c for c in stats["criteria"] if c["criterion_id"] == "looks-orders-up")
    assert (llm["judged"], llm["pass"], llm["fail"], llm["error"], llm["not_applicable"]) == (6, 3, 2, 1, 0)
    assert (code["pass"], code["fail"]) == (5, 1)
    assert stats["conversations"]["sampled"] == 6 and stats["conversations"]["ended"] == 6

    # Failures are queued (the LLM fails and the code fail), errors are not.
    items = cli(daemon, "review", "list")
    queued = Counter((it["criterion_id"], it["conversation_id"]) for it in items)
    assert queued == Counter({("no-refund-promises", "conv-001"): 1, ("no-refund-promises", "conv-002"): 1,
                              ("looks-orders-up", "conv-002"): 1})
    assert all(it["state"] == "pending" for it in items)
    errors = cli(daemon, "verdicts", "--result", "error")
    assert [(v["conversation_id"], v["error_reason"].split(":")[0]) for v in errors] == [("conv-006", "junk_reply")]

    # The reviewer reads the item with the evidence marked, then decides, while the daemon runs.
    first = next(it for it in items if it["conversation_id"] == "conv-001" and it["criterion_id"] ==
                 "no-refund-promises")
    second = next(it for it in items if it["conversation_id"] == "conv-002" and it["criterion_id"] ==
                  "no-refund-promises")
    shown = run_cli("review", "show", str(first["id"]), "--config", str(daemon.config_path), env=clean_env())
    assert shown.returncode == 0, shown.stderr
    assert f"[[Don't worry, this is a {FAIL_WORD}: you get your money back whatever happens.]]" in shown.stdout
    assert "the bot never guarantees a refund" in shown.stdout and "The bot promised a refund" in shown.stdout
    assert cli(daemon, "review", "confirm", str(first["id"]), "--reviewer", "dr. ana", "--note", "real")["state"] \
        == "confirmed"
    assert cli(daemon, "review", "reject", str(second["id"]), "--reviewer", "bob")["state"] == "rejected"
    again = run_cli("review", "reject", str(first["id"]), "--reviewer", "bob", "--config", str(daemon.config_path),
                    env=clean_env())
    assert again.returncode == 2 and "already confirmed by dr. ana" in again.stderr

    stats = cli(daemon, "stats")
    llm = next(c for c in stats["criteria"] if c["criterion_id"] == "no-refund-promises")
    assert (llm["judged"], llm["pass"], llm["fail"], llm["not_applicable"], llm["error"], llm["not_run"],
            llm["pass_unverified"]) == (6, 3, 2, 0, 1, 0, 0)
    assert llm["review"] == {"pending": 0, "confirmed": 1, "rejected": 1, "unclear": 0, "fails_rejected_share": 0.5}
    assert llm["failure_rate"]["estimate"] == pytest.approx(2 / 5)
    assert llm["failure_rate"]["low"] < 0.4 < llm["failure_rate"]["high"]
    code = next(c for c in stats["criteria"] if c["criterion_id"] == "looks-orders-up")
    assert code["review"] == {"pending": 1, "confirmed": 0, "rejected": 0, "unclear": 0, "fails_rejected_share": None}
    assert stats["tokens"] == {"input_tokens": 600, "output_tokens": 120}
    assert len(judge.requests) == 6  # one call per conversation: nothing judged twice
    assert daemon.metric('tracejudge_eval_verdicts_total{result="fail"}') == 3

    # With the daemon stopped, the same commands read the file.
    assert daemon.stop() == 0
    assert cli(daemon, "stats")["criteria"] == stats["criteria"]
    assert [it["id"] for it in cli(daemon, "review", "list", "--state", "all")] == [it["id"] for it in items]
    pending = next(it for it in items if it["criterion_id"] == "looks-orders-up")  # items come in no set order
    assert cli(daemon, "review", "confirm", str(pending["id"]), "--reviewer", "carla")["state"] == "confirmed"


def test_kill9_mid_judging_then_every_conversation_judged_exactly_once(make_daemon: Any, tmp_path: Path) -> None:
    judge = RuleJudge(delay=1.0)
    try:
        daemon = make_daemon(**online_config(tmp_path, judge, judges={"concurrency": 2}))
        people = [persona(i, fail=i % 3 == 0) for i in range(1, 13)]
        send(daemon.grpc, people)
        wait_status(daemon, lambda s: s["evals_judged"] >= 2 and s["evals_in_flight"] > 0, what="judging under way")
        daemon.kill9()
        in_flight_at_kill = len(judge.requests)
        judge.delay = 0.0
        daemon.start()
        wait_judged(daemon, len(people))
        wait_status(daemon, lambda s: s["evals_pending"] == 0 and s["evals_in_flight"] == 0, what="idle evaluator")
        assert daemon.stop() == 0
    finally:
        judge.close()
    rows = daemon.query("SELECT conversation_id, criterion_id, count(*) FROM verdicts GROUP BY ALL")
    assert len(rows) == 2 * len(people) and {n for _, _, n in rows} == {1}
    assert daemon.query("SELECT count(*) FROM verdicts WHERE superseded")[0][0] == 0
    items = daemon.query("SELECT conversation_id, count(*) FROM review_items GROUP BY ALL")
    assert sorted(items) == [(f"conv-{i:03d}", 1) for i in range(3, 13, 3)]
    # Calls in flight at the crash may be made again; nothing finished before it is.
    asked = Counter(t for t in judge.transcripts())
    assert len(asked) == len(people) and len(judge.requests) <= len(people) + in_flight_at_kill


def test_a_changed_transcript_is_judged_again_and_the_old_verdict_superseded(make_daemon: Any, tmp_path: Path,
                                                                             judge: RuleJudge) -> None:
    daemon = make_daemon(**online_config(tmp_path, judge))
    send(daemon.grpc, [persona(1)])
    wait_judged(daemon, 1)
    # The same conversation comes back with a new trace (reopened), and this time the bot fails.
    back = Persona("user 1", "en", "shop-test", [Turn("One more thing: can I get a refund?",
                                                      f"Yes, a {FAIL_WORD} for you.")], conversation_id="conv-001")
    send(daemon.grpc, [back])
    wait_until(lambda: daemon.get("/api/review")[1]["items"], "the failed verdict's review item", interval=0.2)
    stats = daemon.get("/api/stats")[1]
    llm = next(c for c in stats["criteria"] if c["criterion_id"] == "no-refund-promises")
    assert (llm["judged"], llm["pass"], llm["fail"]) == (1, 0, 1)  # one current verdict per conversation
    everything = daemon.get("/api/verdicts?include_superseded=1&criterion=no-refund-promises")[1]["verdicts"]
    assert sorted((v["result"], v["superseded"]) for v in everything) == [("fail", False), ("pass", True)]
    assert len(judge.requests) == 2


def test_sampling_rules_budget_and_weights(make_daemon: Any, tmp_path: Path, judge: RuleJudge) -> None:
    """Rate 0.5 by default, 1.0 for a service; the hourly budget stops what is over it and says so."""
    ids = [f"conv-{i:03d}" for i in range(1, 21)]
    picked = [cid for cid in ids if unit_hash(cid, 7) < 0.5]
    daemon = make_daemon(**online_config(tmp_path, judge, sampling={
        "rate": 0.5, "seed": 7, "rules": [{"when": {"service": "nobody"}, "rate": 1.0}],
        "budget": {"conversations_per_hour": 5}}))
    send(daemon.grpc, [persona(i) for i in range(1, 21)])
    stats: dict[str, Any] = {}

    def decided() -> bool:
        nonlocal stats
        stats = daemon.get("/api/stats")[1]
        conv = stats["conversations"]
        return conv["sampled"] + conv["not_sampled"] + sum(conv["skipped"].values()) == 20 and conv["judged"] == 5

    wait_until(decided, lambda: f"20 sampling decisions and 5 judged: {stats}", interval=0.2)
    conv = stats["conversations"]
    assert conv["sampled"] == 5 and conv["not_sampled"] == 20 - len(picked)
    assert conv["skipped"] == {"budget:conversations_per_hour": len(picked) - 5}
    verdicts = daemon.get("/api/verdicts?criterion=no-refund-promises")[1]["verdicts"]
    assert {v["conversation_id"] for v in verdicts} <= set(picked) and len(verdicts) == 5
    assert {(v["inclusion_probability"], v["sampling_rule"]) for v in verdicts} == {(0.5, "default")}
    assert daemon.metric('tracejudge_eval_sampling_decisions_total{outcome="skipped_budget"}') == len(picked) - 5


def test_an_attribute_rule_reads_every_trace_of_a_conversation_across_commits(make_daemon: Any, tmp_path: Path,
                                                                              judge: RuleJudge) -> None:
    """The rule's attribute is on the first turn's trace, stored commits before the last turn's: the
    spans are read within each trace's commits, and none is missed."""
    daemon = make_daemon(**online_config(tmp_path, judge, conversations={"idle_timeout": "3s"}, sampling={
        "rate": 0.0, "rules": [{"when": {"attribute": {"key": "app.handover", "equals": True}}, "rate": 1.0}]}))
    turns = [Turn("I want to talk to a person.", "I am handing you over to a colleague.", handover=True),
             Turn("Is it long?", "A minute or two."), Turn("Are you there?", "Yes, a colleague is coming.")]
    for i, turn in enumerate(turns):
        send(daemon.grpc, [Persona("user 1", "en", "shop-test", [turn], conversation_id="conv-001")])
        send(daemon.grpc, [persona(3 + i)])  # a commit in between: the traces' commits are apart

    def decided() -> dict[str, Any]:
        return dict(daemon.get("/api/stats")[1]["conversations"])

    wait_status(daemon, lambda _: decided()["sampled"] + decided()["not_sampled"] == 4, what="four sampling decisions")
    assert len(daemon.get("/api/conversations/conv-001")[1]["trace_ids"]) == 3
    assert (decided()["sampled"], decided()["not_sampled"]) == (1, 3)
    wait_judged(daemon, 1)
    verdicts = daemon.get("/api/verdicts?criterion=no-refund-promises")[1]["verdicts"]
    assert {v["conversation_id"] for v in verdicts} == {"conv-001"}


def test_eval_backfills_a_new_criterion_through_the_daemon_and_on_the_file(make_daemon: Any, tmp_path: Path,
                                                                           judge: RuleJudge) -> None:
    config = online_config(tmp_path, judge)
    daemon = make_daemon(**config)
    send(daemon.grpc, [persona(i) for i in range(1, 4)])
    wait_judged(daemon, 3)
    assert daemon.stop() == 0
    # A new criterion is added; the daemon judges only conversations that end from now on, eval the past.
    (tmp_path / "criteria.yaml").write_text(CRITERIA + """
  - id: short-conversations
    version: 1
    kind: code
    check: max_user_turns
    max: 1
""", encoding="utf-8")
    daemon.start()
    out = run_cli("eval", "--criterion", "short-conversations", "--config", str(daemon.config_path), "--json",
                  env=clean_env())
    assert out.returncode == 0, out.stderr
    assert {k: json.loads(out.stdout)[k] for k in ("total", "done", "verdicts", "errors")} == \
        {"total": 3, "done": 3, "verdicts": 3, "errors": 0}
    assert daemon.stop() == 0
    # On the file, everything is judged already: nothing is called or stored again.
    calls = len(judge.requests)
    out = run_cli("eval", "--config", str(daemon.config_path), "--json", env=clean_env())
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert (body["done"], body["verdicts"], body["skipped"]) == (3, 0, 9)
    assert len(judge.requests) == calls
    bad = run_cli("eval", "--criterion", "nope", "--config", str(daemon.config_path), env=clean_env())
    assert bad.returncode == 2 and "no criterion nope" in bad.stderr


def test_a_criteria_file_with_a_typo_stops_the_start(make_daemon: Any, tmp_path: Path, judge: RuleJudge) -> None:
    config = online_config(tmp_path, judge)
    (tmp_path / "criteria.yaml").write_text(CRITERIA.replace("check: tool_called", "check: tool_caled"),
                                            encoding="utf-8")
    daemon = make_daemon(start=False, **config)
    with pytest.raises(RuntimeError) as info:
        daemon.start()
    assert "tool_caled" in str(info.value) and "looks-orders-up" in str(info.value)


def test_criteria_not_run_for_want_of_a_key_are_judged_once_a_key_is_set(make_daemon: Any, tmp_path: Path,
                                                                         judge: RuleJudge) -> None:
    config = online_config(tmp_path, judge)
    config["judges"]["provider"] = {"type": "anthropic", "model": "judge-test"}  # no key, no base_url
    without = {k: v for k, v in clean_env().items() if not k.startswith("ANTHROPIC_")}
    daemon = make_daemon(env=without, **config)
    send(daemon.grpc, [persona(1, fail=True), persona(2)])
    stats: dict[str, Any] = {}

    def stored() -> bool:
        nonlocal stats
        stats = {c["criterion_id"]: c for c in daemon.get("/api/stats")[1]["criteria"]}
        # Both: a conversation's not-run records can be stored before its code verdicts.
        return (stats.get("no-refund-promises", {}).get("not_run") == 2
                and stats.get("looks-orders-up", {}).get("judged") == 2)

    wait_until(stored, lambda: f"2 not run and 2 code verdicts: {stats}", interval=0.1)
    llm = stats["no-refund-promises"]
    assert (llm["judged"], llm["not_run"]) == (0, 2)
    [reason] = llm["not_run_reasons"]
    assert reason.startswith("no API key: set ANTHROPIC_API_KEY")
    assert stats["looks-orders-up"]["judged"] == 2
    assert daemon.stop() == 0

    # The key is set and the daemon restarted: what was not run for want of it is judged, nothing else again.
    daemon.env = {**without, "ANTHROPIC_API_KEY": "test-key", "ANTHROPIC_BASE_URL": judge.url}
    daemon.start()
    stats = wait_judged(daemon, 2)
    llm = next(c for c in stats["criteria"] if c["criterion_id"] == "no-refund-promises")
    assert (llm["judged"], llm["pass"], llm["fail"], llm["not_run"], llm["not_run_reasons"]) == (2, 1, 1, 0, {})
    assert len(judge.requests) == 2
    assert daemon.stop() == 0
    assert daemon.query("SELECT count(*) FROM not_run")[0][0] == 0
    assert daemon.query("SELECT criterion_id, count(*) FROM verdicts GROUP BY ALL ORDER BY 1") == [
        ("looks-orders-up", 2), ("no-refund-promises", 2)]
