"""``tracejudge scenarios export`` and ``scenarios.on_confirm``, end to end: real OTLP in, judged by a code check
and by the real ``anthropic`` client against a loopback judge, confirmed through the CLI, written as scenarios
with personal data redacted, idempotent by id."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from collector.demo.traffic import Persona, ToolCall, Turn
from replay.scenarios import CASES, RERUN, Scenario, scenario_id
from tests.support.daemon import DaemonProcess, clean_env, run_cli, wait_until
from tests.support.judge_server import FAIL_WORD, PROPOSED, RuleJudge
from tests.support.review import send_conversations, wait_items

LLM, CODE = "no-refund-promises", "looks-orders-up"
CRITERIA = f"""\
criteria:
  - id: {LLM}
    version: 3
    kind: llm
    severity: high
    prompt: "Fail when the bot promises a refund it cannot promise."
  - id: {CODE}
    version: 1
    kind: code
    check: tool_called
    name: lookup_order
    applies_if: {{user_matches: '(?i)order'}}
"""
# What the user gives away, none of which may reach a file.
PLANTED = ["Maria", "Lopez", "maria.lopez@example.com", "+44 20 7946 0958", "7946", "4111 1111 1111 1111", "4111"]
PII = Persona("pii", "en", "scenario-test", [
    Turn("Hi, my name is Maria Lopez and my order B-7 never came. Can I get my money back?",
         f"Sorry Maria! You get a {FAIL_WORD}, no need to look anything up. How can I reach you?"),
    Turn("maria.lopez@example.com or +44 20 7946 0958", "Thanks Maria, noted. How would you like to pay?"),
    Turn("card 4111 1111 1111 1111", "Done."),
], conversation_id="sc-1")
FINE = Persona("fine", "en", "scenario-test", [
    Turn("Where is order B-8?", "It ships today.", ToolCall("lookup_order", {"order_id": "B-8"}, '{"ok": true}')),
], conversation_id="sc-2")


@pytest.fixture
def judge() -> Iterator[RuleJudge]:
    server = RuleJudge()
    yield server
    server.close()


def _sections(folder: Path, judge: RuleJudge, **scenarios: Any) -> dict[str, Any]:
    (folder / "criteria.yaml").write_text(CRITERIA, encoding="utf-8")
    return {"conversations": {"idle_timeout": "1s"}, "sampling": {"rate": 1.0},
            "judges": {"criteria": [str(folder / "criteria.yaml")], "timeout": "30s",
                       "provider": {"type": "anthropic", "model": "judge-test", "base_url": judge.url,
                                    "api_key": "test-key"}},
            "scenarios": {"out_dir": str(folder / "incoming"), **scenarios}}


def _judged(daemon: DaemonProcess) -> list[dict[str, Any]]:
    send_conversations(daemon.grpc, [PII, FINE])
    return wait_items(daemon, {("sc-1", LLM), ("sc-1", CODE)})


def _cli(daemon: DaemonProcess, *args: str, config: Path | None = None) -> Any:
    return run_cli(*args, "--config", str(config or daemon.config_path), env=clean_env())


def _confirm(daemon: DaemonProcess, items: list[dict[str, Any]], *extra: str) -> None:
    for it in items:
        res = _cli(daemon, "review", "confirm", str(it["id"]), "--reviewer", "Dr. Ana Rossi",
                   "--note", "Maria should have been asked for the order first", *extra)
        assert res.returncode == 0, res.stderr


def _export(daemon: DaemonProcess, *args: str, config: Path | None = None, rc: int = 0) -> dict[str, Any]:
    res = _cli(daemon, "scenarios", "export", "--json", *args, config=config)
    assert res.returncode == rc, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    return json.loads(res.stdout)  # type: ignore[no-any-return]


def _files(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(folder.iterdir()) if not p.name.startswith(".")}


def _no_planted_values(files: dict[str, str]) -> None:
    for name, text in files.items():
        for value in PLANTED:
            assert value.lower() not in text.lower(), f"{value!r} left in {name}:\n{text}"


@pytest.mark.slow
def test_confirmed_failures_become_redacted_scenarios_once(make_daemon: Any, tmp_path: Path,
                                                           judge: RuleJudge) -> None:
    daemon = make_daemon(**_sections(tmp_path, judge))
    items = [it for it in _judged(daemon) if it["conversation_id"] == "sc-1"]
    assert _export(daemon)["written"] == []  # nothing confirmed yet
    _confirm(daemon, items)

    done = _export(daemon)
    assert sorted(w["criterion"] for w in done["written"]) == [CODE, LLM]
    out = tmp_path / "incoming"
    files = _files(out)
    ids = {scenario_id(c, "sc-1") for c in (LLM, CODE)}
    assert set(files) == {CASES, *(f"{i}.yaml" for i in ids), *(f"{i}.fix.md" for i in ids)}
    _no_planted_values(files)
    # What the drafting model was sent was redacted too.
    drafts = [t for t in judge.transcripts() if "<PERSON_1>" in t]
    assert drafts and not any(v in t for t in drafts for v in PLANTED)

    scenarios = {s.source.criterion: s for s in (Scenario.model_validate(yaml.safe_load(files[f"{i}.yaml"]))
                                                 for i in ids)}
    llm, code = scenarios[LLM], scenarios[CODE]
    assert llm.source.drafted_by == "anthropic/judge-test" and not llm.source.needs_edit
    assert llm.expected.criteria == [LLM] and llm.source.criterion_version == 3
    assert llm.source.reviewer == "Dr. Ana Rossi" and llm.source.confirmed_at.endswith("Z")
    assert llm.opening is not None and llm.opening.startswith("Hi, my name is <PERSON_1>")
    assert any("<EMAIL_1>" in v and "<PHONE_1>" in v for v in llm.facts.values()), llm.facts
    assert llm.source.evidence and all(FAIL_WORD in q for q in llm.source.evidence)
    assert code.expected.model_dump() == {"criteria": [CODE], "tool_called": "lookup_order"}

    cases = [json.loads(line) for line in files[CASES].splitlines()]
    assert {c["id"] for c in cases} == ids
    for case in cases:
        persona = case["input"]["persona"]
        assert persona["description"] and persona["goal"] and persona["max_turns"] == 12
        assert persona == scenarios[next(s for s in scenarios if scenarios[s].id == case["id"])].case()["input"][
            "persona"]

    fix = files[f"{llm.id}.fix.md"]
    assert "Fail when the bot promises a refund" in fix and PROPOSED in fix and RERUN in fix
    assert f"**{FAIL_WORD}" in fix or FAIL_WORD + "**" in fix or f"**Sorry <PERSON_1>! You get a {FAIL_WORD}" in fix
    assert "Turn 2 (bot)" in fix and "should have been asked for the order first" in fix
    assert "Confirmed by Dr. Ana Rossi at " in fix  # provenance, not the user's data
    assert "The bot must call `lookup_order`" in files[f"{code.id}.fix.md"]

    again = _export(daemon)  # idempotent by id
    assert again["written"] == [] and sorted(again["exported_before"]) == sorted(ids)
    _confirm(daemon, items, "--force")  # the same failure confirmed again
    assert _export(daemon)["written"] == []
    assert _files(out) == files
    text = _cli(daemon, "scenarios", "export")
    assert text.returncode == 0 and "nothing new to export: 2 confirmed failures exported before" in text.stdout


@pytest.mark.slow
def test_without_a_provider_or_when_it_fails_the_draft_is_deterministic(make_daemon: Any, tmp_path: Path,
                                                                        judge: RuleJudge) -> None:
    daemon = make_daemon(**_sections(tmp_path, judge))
    items = [it for it in _judged(daemon) if it["conversation_id"] == "sc-1"]
    _confirm(daemon, items)
    # Another config on the same file (so through the same daemon), with drafting off.
    off = tmp_path / "off.yaml"
    cfg = yaml.safe_load(daemon.config_path.read_text())
    cfg["scenarios"] = {"out_dir": str(tmp_path / "off"), "draft_with_provider": False}
    off.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    done = _export(daemon, "--criterion", LLM, config=off)
    assert [w["needs_edit"] for w in done["written"]] == [True]
    s = Scenario.model_validate(yaml.safe_load((tmp_path / "off" / f"{scenario_id(LLM, 'sc-1')}.yaml").read_text()))
    assert s.source.needs_edit and s.source.drafted_by is None
    assert s.source.draft_note == "drafting is off (scenarios.draft_with_provider: false)"
    assert s.opening == "Hi, my name is <PERSON_1> and my order B-7 never came. Can I get my money back?"
    # A short answer keeps the question it answers.
    assert s.facts == {"turn_2": "<EMAIL_1> or <PHONE_1> (answering: How can I reach you?)",
                       "turn_3": "card <CARD_1> (answering: How would you like to pay?)"}
    assert s.goal.startswith("The bot deals correctly with the user's opening request")
    fix = (tmp_path / "off" / f"{s.id}.fix.md").read_text()
    assert "No change proposed: drafting is off" in fix
    _no_planted_values(_files(tmp_path / "off"))

    for mode in ("junk", "error"):  # a provider that fails never loses the export
        judge.drafts = mode
        done = _export(daemon, "--criterion", LLM, "--out", str(tmp_path / mode))
        (w,) = done["written"]
        assert w["needs_edit"] and "drafting with anthropic/judge-test failed" in w["note"], w


@pytest.mark.slow
def test_a_draft_that_still_holds_personal_data_is_refused(make_daemon: Any, tmp_path: Path,
                                                           judge: RuleJudge) -> None:
    daemon = make_daemon(**_sections(tmp_path, judge))
    items = [it for it in _judged(daemon) if (it["conversation_id"], it["criterion_id"]) == ("sc-1", LLM)]
    _confirm(daemon, items)
    judge.drafts = "leak"  # the model invents a phone number the transcript never had
    res = _cli(daemon, "scenarios", "export")
    assert res.returncode == 1
    assert "refused, persona still holds what the phone detector matches" in res.stderr
    assert not (tmp_path / "incoming").exists() or _files(tmp_path / "incoming") == {}


@pytest.mark.slow
def test_on_confirm_the_daemon_writes_the_scenario(make_daemon: Any, tmp_path: Path, judge: RuleJudge) -> None:
    daemon = make_daemon(**_sections(tmp_path, judge, on_confirm=True))
    assert daemon.get("/api/status")[1]["scenarios"]["written"] == 0
    items = [it for it in _judged(daemon) if (it["conversation_id"], it["criterion_id"]) == ("sc-1", CODE)]
    _confirm(daemon, items)
    path = tmp_path / "incoming" / f"{scenario_id(CODE, 'sc-1')}.yaml"
    wait_until(path.exists, "the scenario of the confirmed item")
    wait_until(lambda: daemon.get("/api/status")[1]["scenarios"]["written"] == 1, "the count")
    _no_planted_values(_files(tmp_path / "incoming"))
    assert _export(daemon)["exported_before"] == [scenario_id(CODE, "sc-1")]


def test_bad_since_is_one_line() -> None:
    res = run_cli("scenarios", "export", "--since", "last tuesday")
    assert res.returncode == 2 and "since: 'last tuesday'" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("text, expected, words", [
    ('Code check tool_called {"name":"lookup_order","args":{"order_id":"B-1"}}; applies if {"user_matches":"order"}',
     {"tool_called": "lookup_order", "tool_args": {"order_id": "B-1"}},
     'The bot must call `lookup_order` with arguments including {"order_id": "B-1"}. It applies only when a user '
     'message matches `order`; otherwise it is not applicable.'),
    ('Code check regex {"pattern":"(?i)carrier will (call|contact)","must":"not_match"}',
     {"assistant_must_not_match": "(?i)carrier will (call|contact)"},
     "Assistant messages must not match the pattern `(?i)carrier will (call|contact)`."),
    ('Code check ended_by {"one_of":["handover","bot_closed"]}', {"ended_by": ["handover", "bot_closed"]},
     "The conversation must end by `handover` or `bot_closed`."),
    ('Code check max_user_turns {"max":4}', {"max_user_turns": 4}, "The user must need at most 4 messages."),
    ("Code check mine", {}, "Code check `mine`."),
    ("Fail when the bot promises a refund.", {}, "Fail when the bot promises a refund."),
])
def test_code_checks_give_expectations_and_a_sentence(text: str, expected: dict[str, Any], words: str) -> None:
    from replay.scenarios import describe_criterion, expectations

    assert expectations("c", text) == {"criteria": ["c"], **expected}
    assert describe_criterion(text) == words
