"""The runner with a scripted provider: not run, cache, budget, concurrency, honest errors."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from judges import (
    Budget,
    CodeCriterion,
    Conversation,
    DiskCache,
    JudgeRequest,
    LLMCriterion,
    MemoryCache,
    Message,
    NotRun,
    ProviderError,
    ProviderReply,
    RetryPolicy,
    ScriptedProvider,
    Usage,
    Verdict,
    arun_judges,
    load_criteria,
    run_judges,
)

from .conftest import chest_pain, verdict_json

LLM = LLMCriterion(id="asks-red-flags", version=1, prompt="Criterion: the bot asks about red flags.")
LLM2 = LLMCriterion(id="polite", version=1, prompt="Criterion: the bot is polite.\n{transcript}\nBe strict.")


def na(request: JudgeRequest) -> ProviderReply:
    return ProviderReply(text=verdict_json("not_applicable"), usage=Usage(input_tokens=100, output_tokens=10))


def test_no_provider_means_not_run_with_the_reason() -> None:
    code = load_code_criterion()
    run = run_judges([LLM, code], [chest_pain("a"), chest_pain("b")])
    assert [v.criterion_id for v in run.verdicts] == ["escalates", "escalates"]
    assert run.not_run == [
        NotRun(conversation_id="a", criterion_id="asks-red-flags", criterion_version=1, reason="no provider configured"),
        NotRun(conversation_id="b", criterion_id="asks-red-flags", criterion_version=1, reason="no provider configured"),
    ]


def load_code_criterion() -> CodeCriterion:
    from judges._checks import ToolCalled
    return CodeCriterion(id="escalates", version=1, check="tool_called",
                         params=ToolCalled.Params(name="set_triage_level"))


def test_no_content_means_not_run() -> None:
    empty = Conversation(id="e", source="production", ended_by="idle",
                         messages=[Message(role="user", content=""), Message(role="assistant", content="")])
    provider = ScriptedProvider(na)
    run = run_judges([LLM], [empty], provider)
    assert run.verdicts == [] and run.not_run[0].reason == "no content captured"
    assert provider.requests == []


def test_prompt_in_the_frame_with_placeholder_and_without() -> None:
    provider = ScriptedProvider(na)
    run_judges([LLM, LLM2], [chest_pain()], provider, concurrency=1)
    first, second = provider.requests
    assert first.system == second.system and "Read the whole transcript" in first.system
    assert first.prompt.startswith("Criterion: the bot asks about red flags.\n\n<transcript>\nUSER: hey")
    assert second.prompt.startswith("Criterion: the bot is polite.\n<transcript>\nUSER: hey")
    assert "</transcript>\nBe strict." in second.prompt
    assert first.schema["required"] == ["reasoning", "evidence", "result"]


def test_cache_reuses_verdicts_and_never_errors(tmp_path: Path) -> None:
    calls = {"n": 0}

    def script(request: JudgeRequest) -> str:
        calls["n"] += 1
        return "not json" if "ambulance" not in request.prompt else verdict_json("not_applicable")

    convs = [chest_pain("a"), chest_pain("b", escalated=False)]
    cache = DiskCache(tmp_path / "cache.jsonl")
    first = run_judges([LLM], convs, ScriptedProvider(script), cache=cache)
    assert [v.result for v in first.verdicts] == ["not_applicable", "error"] and calls["n"] == 2
    # A new process: the file is read back; the same transcript under another id is a hit too.
    again = DiskCache(tmp_path / "cache.jsonl")
    renamed = [chest_pain("a2"), chest_pain("b", escalated=False)]
    second = run_judges([LLM], renamed, ScriptedProvider(script), cache=again)
    assert calls["n"] == 3 and second.cached == 1
    assert second.verdicts[0].conversation_id == "a2" and second.verdicts[0].result == "not_applicable"
    assert second.verdicts[1].result == "error"
    assert len((tmp_path / "cache.jsonl").read_text().splitlines()) == 1


@pytest.mark.parametrize("change", ["version", "prompt", "model", "transcript"])
def test_cache_key_covers_version_prompt_model_and_transcript(change: str) -> None:
    cache = MemoryCache()
    run_judges([LLM], [chest_pain()], ScriptedProvider(na), cache=cache)
    crit, conv, model = LLM, chest_pain(), "scripted"
    if change == "version":
        crit = LLM.model_copy(update={"version": 2})
    elif change == "prompt":
        crit = LLM.model_copy(update={"prompt": LLM.prompt + " Strictly."})
    elif change == "model":
        model = "other"
    else:
        conv = chest_pain(escalated=False)
    provider = ScriptedProvider(na, model=model)
    run = run_judges([crit], [conv], provider, cache=cache)
    assert run.cached == 0 and len(provider.requests) == 1


def test_torn_cache_lines_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "cache.jsonl"
    run_judges([LLM], [chest_pain()], ScriptedProvider(na), cache=DiskCache(path))
    path.write_text(path.read_text() + '{"key": ["x"], "verdict": {"trunc', encoding="utf-8")
    assert len(DiskCache(path)) == 1


def test_budget_stops_cleanly() -> None:
    convs = [chest_pain(f"c{i}") for i in range(10)]
    provider = ScriptedProvider(na)
    run = run_judges([LLM], convs, provider, concurrency=1, budget=Budget(tokens=300))
    assert len(run.verdicts) == 3 and len(provider.requests) == 3
    assert [r.reason for r in run.not_run] == ["budget spent: 330 tokens of 300"] * 7
    assert run.stopped == "budget spent: 330 tokens of 300" and run.usage.input_tokens == 300


def test_cost_budget() -> None:
    convs = [chest_pain(f"c{i}") for i in range(10)]
    budget = Budget(cost=0.001, input_cost_per_mtok=3.0, output_cost_per_mtok=15.0)  # 0.00045 per call
    run = run_judges([LLM], convs, ScriptedProvider(na), concurrency=1, budget=budget)
    assert len(run.verdicts) == 3 and run.cost == pytest.approx(0.00135)
    assert run.stopped and run.stopped.startswith("budget spent: cost")


def test_concurrency_is_bounded() -> None:
    state = {"now": 0, "peak": 0}

    class Counting:
        name, model = "counting", "m"

        async def send(self, request: JudgeRequest) -> ProviderReply:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
            await asyncio.sleep(0.001)
            state["now"] -= 1
            return na(request)

        async def aclose(self) -> None:
            pass

    run = run_judges([LLM, LLM2], [chest_pain(f"c{i}") for i in range(30)], Counting(), concurrency=5)
    assert len(run.verdicts) == 60 and state["peak"] == 5


def test_results_keep_input_order_whatever_finishes_first() -> None:
    class Slow:
        name, model = "slow", "m"

        async def send(self, request: JudgeRequest) -> ProviderReply:
            await asyncio.sleep(0.02 if "polite" in request.prompt else 0)
            return na(request)

        async def aclose(self) -> None:
            pass

    run = run_judges([LLM2, LLM], [chest_pain("a"), chest_pain("b")], Slow(), concurrency=4)
    assert [(v.conversation_id, v.criterion_id) for v in run.verdicts] == [
        ("a", "polite"), ("a", "asks-red-flags"), ("b", "polite"), ("b", "asks-red-flags")]


def test_a_provider_bug_records_error_never_pass() -> None:
    def broken(request: JudgeRequest) -> str:
        raise KeyError("oops")

    [v] = run_judges([LLM], [chest_pain()], ScriptedProvider(broken)).verdicts
    assert v.result == "error" and v.error_reason == "provider_failed: KeyError: 'oops'"


def test_fenced_json_is_accepted_but_prose_around_it_is_not() -> None:
    fenced = "```json\n" + verdict_json("not_applicable") + "\n```"
    [v] = run_judges([LLM], [chest_pain()], ScriptedProvider(fenced)).verdicts
    assert v.result == "not_applicable"
    [v] = run_judges([LLM], [chest_pain()], ScriptedProvider("Here: " + fenced)).verdicts
    assert v.result == "error"


def test_llm_pass_without_quotes_is_not_verified() -> None:
    [v] = run_judges([LLM], [chest_pain()], ScriptedProvider(verdict_json("pass"))).verdicts
    assert v.result == "pass" and not v.evidence_verified and not v.clean_pass
    [v] = run_judges([LLM], [chest_pain()], ScriptedProvider(verdict_json("fail"))).verdicts
    assert v.result == "fail" and v.flagged


def test_fail_with_one_verified_quote_is_not_flagged() -> None:
    reply = verdict_json("fail", ["BOT: Please call an ambulance now.", "BOT: invented"])
    [v] = run_judges([LLM], [chest_pain()], ScriptedProvider(reply)).verdicts
    assert not v.evidence_verified and not v.flagged


def test_on_result_sees_every_outcome() -> None:
    seen: list[Verdict | NotRun] = []
    run = run_judges([LLM, load_code_criterion()], [chest_pain("a"), chest_pain("b")], on_result=seen.append)
    assert len(seen) == 4 and len(run.verdicts) + len(run.not_run) == 4


def test_async_api_in_a_running_loop_keeps_the_provider_open() -> None:
    closed: list[bool] = []

    class Tracking(ScriptedProvider):
        async def aclose(self) -> None:
            closed.append(True)

    async def main() -> list[str]:
        provider = Tracking(na)
        first = await arun_judges([LLM], [chest_pain()], provider)
        second = await arun_judges([LLM], [chest_pain("b")], provider)
        assert closed == []
        await provider.aclose()
        return [v.result for v in first.verdicts + second.verdicts]

    assert asyncio.run(main()) == ["not_applicable", "not_applicable"]
    provider = Tracking(na)
    run_judges([LLM], [chest_pain()], provider)
    assert closed == [True, True]


def test_retry_policy_delays() -> None:
    policy = RetryPolicy(base_delay=1.0, max_delay=5.0)
    assert policy.delay(1, 3.0) == 3.0
    assert policy.delay(1, 6.0) is None
    assert 2.5 <= (policy.delay(5, None) or 0) <= 5.0


def test_retryable_provider_error_from_a_scripted_provider() -> None:
    replies = [ProviderError("overloaded", "529", retryable=True, retry_after=0.5), verdict_json("not_applicable")]
    waits: list[float] = []

    async def sleep(s: float) -> None:
        waits.append(s)

    [v] = run_judges([LLM], [chest_pain()], ScriptedProvider(lambda r: replies.pop(0)), sleep=sleep).verdicts
    assert v.result == "not_applicable" and waits == [0.5]


def test_verdict_requires_reason_exactly_for_errors() -> None:
    base = dict(conversation_id="c", criterion_id="x", criterion_version=1, transcript_sha256="0",
                judge={"provider": "code", "model": "m"})
    with pytest.raises(ValueError):
        Verdict(result="error", **base)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Verdict(result="pass", error_reason="x", **base)  # type: ignore[arg-type]
    assert json.loads(Verdict(result="pass", **base).model_dump_json())["result"] == "pass"  # type: ignore[arg-type]


def test_criteria_from_file_with_a_scripted_provider(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("criteria:\n  - {id: a, version: 1, kind: llm, prompt: 'Criterion: a'}\n")
    run = run_judges(load_criteria(tmp_path / "c.yaml"), [chest_pain()], ScriptedProvider(na))
    assert run.verdicts[0].judge.provider == "scripted"
