"""``replay.simulate``: the simulated user, the goal check, the bot and the run folder, with the real anthropic
client and an OpenAI-compatible client against a loopback model (``tests.support.roleplay``)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from judges import AnthropicProvider, OpenAICompatibleProvider, load_criteria
from replay.simulate import (PROMPT_SHA256, ChatCompletionsBot, FunctionBot, RunFolder, Settings, SimulatedUser,
                             build_report, run)
from replay.suite import SuiteScenario

from ..support.roleplay import CRITERIA, ChatBot, RolePlayModel



@pytest.fixture(scope="module")
def model() -> Iterator[RolePlayModel]:
    m = RolePlayModel()
    yield m
    m.close()


def scenario(sid: str, persona: str = "Writes short messages.", **kw: Any) -> SuiteScenario:
    return SuiteScenario.model_validate({
        "id": sid, "persona": persona,
        "goal": 'Learn when the order arrives; reached when the bot says "delayed at the depot".',
        "facts": {"order_number": "B-1042", "address": "5 rue de la Paix"}, "path": f"{sid}.yaml", **kw})


def user_on(model: RolePlayModel, api: str = "anthropic", temperature: float = 1.0) -> SimulatedUser:
    if api == "anthropic":
        def make() -> Any:
            return AnthropicProvider("claude-sim", base_url=model.url, api_key="k")
        return SimulatedUser(make(), make(), None, timeout=30)
    return SimulatedUser(OpenAICompatibleProvider("local-sim", base_url=model.url + "/v1", temperature=temperature),
                         OpenAICompatibleProvider("local-sim", base_url=model.url + "/v1", temperature=0.0),
                         temperature, timeout=30)


def simulate(tmp_path: Path, model: RolePlayModel, scenarios: list[SuiteScenario], bot: Any, *,
             api: str = "anthropic", judge: Any = None, **settings: Any) -> dict[str, Any]:
    criteria_file = tmp_path / "criteria.yaml"
    criteria_file.write_text(CRITERIA, encoding="utf-8")
    criteria = load_criteria([criteria_file])
    user = user_on(model, api)
    folder = RunFolder.open(tmp_path / "run", bot.name, "run-1")

    async def go() -> None:
        try:
            await run(scenarios, criteria, bot, user, judge, folder, Settings(**settings))
        finally:
            await user.aclose()
            await bot.aclose()

    asyncio.run(go())
    return build_report(RunFolder.open(tmp_path / "run", bot.name, "run-1"), scenarios, criteria, user.identity)


def test_every_way_a_conversation_ends(tmp_path: Path, model: RolePlayModel) -> None:
    scenarios = [scenario("reached"), scenario("done", "gives up"), scenario("limit", "never done", max_turns=3,
                                                                                  goal="A refund today."),
                 scenario("handover", "wants a person"), scenario("crash", "crash the bot"),
                 scenario("silent", "silence the bot"), scenario("down", "provider down")]
    report = simulate(tmp_path, model, scenarios, FunctionBot("tests.support.roleplay:broken"), replicates=1)
    ended = {s["id"]: next(k for k, v in s["ended_by"].items() if v) for s in report["scenarios"]}
    assert ended == {"reached": "goal_reached", "done": "user_done", "limit": "turn_limit", "handover": "handover",
                     "crash": "unanswered", "silent": "unanswered", "down": "error"}
    entries = {s["id"]: s for s in report["scenarios"]}
    # Unanswered is never a pass: its criteria are errors and the scenario is failing.
    assert entries["crash"]["criteria"]["no-carrier-promises"]["error"] == 1 and entries["crash"]["failing"]
    # The user's provider failing is neither a pass nor a bot failure: not judged.
    assert entries["down"]["judged"] == 0 and not entries["down"]["failing"]
    assert report["summary"]["not_evaluated"] == 1
    lines = (tmp_path / "run" / "conversations.jsonl").read_text().splitlines()
    records = {orjson.loads(line)["persona_id"]: orjson.loads(line) for line in lines}
    assert "RuntimeError: the bot crashed" in records["crash"]["attributes"]["bot_error"]
    assert "HTTP 400" in records["down"]["attributes"]["user_error"]
    assert sum(m["role"] == "user" for m in records["limit"]["messages"]) == 3


def test_a_bot_that_times_out_ends_unanswered(tmp_path: Path, model: RolePlayModel) -> None:
    report = simulate(tmp_path, model, [scenario("slow")], FunctionBot("tests.support.roleplay:slow"),
                      replicates=1, bot_timeout=0.5)
    assert report["scenarios"][0]["ended_by"]["unanswered"] == 1 and report["scenarios"][0]["failing"]


def test_facts_are_told_when_asked_and_the_prompt_holds_the_scenario_verbatim(tmp_path: Path,
                                                                              model: RolePlayModel) -> None:
    before = len(model.requests)
    s = scenario("facts", persona="Middle-aged man,\nshort messages with typos.", opening="hey, order late??")
    simulate(tmp_path, model, [s], FunctionBot("tests.support.roleplay:broken"), replicates=1)
    record = orjson.loads((tmp_path / "run" / "conversations.jsonl").read_text().splitlines()[0])
    users = [m["content"] for m in record["messages"] if m["role"] == "user"]
    assert users[0] == "hey, order late??"  # the opening, verbatim, asked of no model
    assert users[1] == "My order number is B-1042." and "5 rue" not in " ".join(users)  # told when asked only
    assert record["ended_by"] == "goal_reached"
    role_play = [r for r in model.requests[before:] if r.kind == "user"]
    assert role_play and all("Middle-aged man,\nshort messages with typos." in r.system and
                             "- order_number: B-1042" in r.system and "only when the assistant asks" in r.system
                             for r in role_play)


@pytest.mark.parametrize("api", ["anthropic", "openai"])
def test_the_goal_check_is_asked_apart_from_the_role_play_at_temperature_zero(tmp_path: Path, model: RolePlayModel,
                                                                              api: str) -> None:
    before = len(model.requests)
    simulate(tmp_path, model, [scenario("apart", persona="Retired teacher, very polite.")],
             FunctionBot("tests.support.roleplay:broken"), api=api, replicates=1)
    goal = [r for r in model.requests[before:] if r.kind == "goal"]
    user = [r for r in model.requests[before:] if r.kind == "user"]
    assert goal and user
    for r in goal:
        assert "Retired teacher" not in r.system + r.prompt and "role-playing" not in r.system + r.prompt
        assert "delayed at the depot" in r.prompt  # the goal, and the conversation
        assert r.body.get("temperature") == (0.0 if api == "openai" else None)
    assert all(r.body.get("temperature") == (1.0 if api == "openai" else None) for r in user)


def test_a_goal_check_that_answers_junk_counts_as_not_reached_and_is_counted(tmp_path: Path,
                                                                            model: RolePlayModel) -> None:
    s = SuiteScenario.model_validate({"id": "junk", "persona": "never done", "goal": "junk check", "max_turns": 2,
                                      "path": "junk.yaml"})
    report = simulate(tmp_path, model, [s], FunctionBot("tests.support.roleplay:broken"), replicates=1)
    record = orjson.loads((tmp_path / "run" / "conversations.jsonl").read_text().splitlines()[0])
    assert record["ended_by"] == "turn_limit" and record["attributes"]["goal_check"]["junk_replies"] == 2
    assert report["scenarios"][0]["ended_by"]["turn_limit"] == 1


def test_one_failing_replicate_of_five_makes_the_scenario_failing(tmp_path: Path, model: RolePlayModel) -> None:
    report = simulate(tmp_path, model, [scenario("flaky")], FunctionBot("tests.support.roleplay:flaky"),
                      replicates=5, concurrency=3)
    s, = report["scenarios"]
    assert s["replicates"] == 5 and s["criteria"]["no-carrier-promises"]["fail"] == 1
    assert s["criteria"]["no-carrier-promises"]["pass"] == 4 and s["failing"]
    rate = report["criteria"]["no-carrier-promises"]
    assert rate["conversations"] == 5 and rate["fail"] == 1 and rate["rate"] == 0.2
    assert rate["interval"][0] < 0.2 < rate["interval"][1]


def test_an_openai_compatible_bot_on_loopback(tmp_path: Path, model: RolePlayModel) -> None:
    bot_server = ChatBot()
    try:
        report = simulate(tmp_path, model, [scenario("url"), scenario("url-handover", "wants a person")],
                          ChatCompletionsBot(bot_server.url + "/v1/chat/completions"), replicates=1)
    finally:
        bot_server.close()
    ended = {s["id"]: s for s in report["scenarios"]}
    assert ended["url"]["ended_by"]["goal_reached"] == 1 and ended["url"]["failing"]
    assert ended["url-handover"]["ended_by"]["handover"] == 1
    assert bot_server.bodies[0]["messages"][0]["role"] == "user" and bot_server.bodies[0]["user"].endswith("/url/1")


def test_the_report_names_the_simulated_user_and_counts_its_tokens_apart(tmp_path: Path,
                                                                        model: RolePlayModel) -> None:
    report = simulate(tmp_path, model, [scenario("tokens")], FunctionBot("tests.support.roleplay:fixed"),
                      replicates=2)
    assert report["simulated_user"] == {"provider": "anthropic", "model": "claude-sim",
                                        "prompt_sha256": PROMPT_SHA256, "temperature": None}
    assert report["tokens"]["simulated_user"]["input"] > 0 and report["tokens"]["judges"]["input"] == 0
    assert report["summary"] == {"scenarios": 1, "failing": 0, "not_evaluated": 0}


def test_a_run_stopped_half_way_resumes_into_the_same_folder(tmp_path: Path, model: RolePlayModel) -> None:
    criteria_file = tmp_path / "criteria.yaml"
    criteria_file.write_text(CRITERIA, encoding="utf-8")
    criteria = load_criteria([criteria_file])
    scenarios = [scenario("a"), scenario("b")]
    bot = FunctionBot("tests.support.roleplay:broken")

    class Stop(Exception):
        pass

    def stop_after_three(c: Any, progress: Any) -> None:
        if progress.done == 3:
            raise Stop

    async def go(on_done: Any) -> Any:
        user = user_on(model)
        folder = RunFolder.open(tmp_path / "run", bot.name, "run-1")
        try:
            return await run(scenarios, criteria, bot, user, None, folder, Settings(replicates=3, concurrency=1),
                             on_done)
        finally:
            await user.aclose()

    with pytest.raises(ExceptionGroup):
        asyncio.run(go(stop_after_three))
    # As a kill in the middle of a write leaves it: half a line more.
    with open(tmp_path / "run" / "conversations.jsonl", "ab") as f:
        f.write(b'{"schema": "conversation/v1", "id": "run-1/b/3", "sou')
    progress = asyncio.run(go(lambda c, p: None))
    assert progress.total == 3 and progress.done == 3
    folder = RunFolder.open(tmp_path / "run", bot.name, "other")
    assert folder.run_id == "run-1" and sorted(folder.done()) == [("a", 1), ("a", 2), ("a", 3), ("b", 1), ("b", 2),
                                                                  ("b", 3)]
    assert len(folder.verdicts) == 6


def test_the_token_budget_stops_new_conversations_once_spent(tmp_path: Path, model: RolePlayModel) -> None:
    criteria_file = tmp_path / "criteria.yaml"
    criteria_file.write_text(CRITERIA, encoding="utf-8")
    bot, user = FunctionBot("tests.support.roleplay:fixed"), user_on(model)
    folder = RunFolder.open(tmp_path / "run", bot.name, "run-1")

    async def go() -> Any:
        try:
            return await run([scenario("budget")], load_criteria([criteria_file]), bot, user, None, folder,
                             Settings(replicates=3, concurrency=1, budget_tokens=1))
        finally:
            await user.aclose()

    progress = asyncio.run(go())
    assert (progress.done, progress.skipped_budget) == (1, 2) and len(folder.conversations) == 1
    assert progress.tokens.input_tokens > 1  # the one conversation under way finished, over the budget
