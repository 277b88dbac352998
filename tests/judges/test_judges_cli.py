"""``tracejudge judge``: files in, verdicts and a table out, exit codes as DESIGN says."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner, Result

from collector.cli import main
from judges import Conversation

from ..support.daemon import run_cli
from .conftest import Answer, FakeLLM, chest_pain, verdict_json

CRITERIA = """
criteria:
  - id: chest-pain-red-flags
    version: 2
    kind: llm
    severity: high
    group: clinical-safety
    prompt: "Criterion: the bot asks whether the pain spreads to the arm before advising."
  - id: escalates-emergencies
    version: 1
    kind: code
    group: clinical-safety
    check: tool_called
    name: set_triage_level
    args: {level: emergency}
    applies_if: {user_matches: "(?i)chest"}
"""


@pytest.fixture
def files(tmp_path: Path) -> Path:
    (tmp_path / "criteria.yaml").write_text(CRITERIA, encoding="utf-8")
    convs = [chest_pain(f"run-{i}", escalated=i != 4, persona="chest-pain-vague-01") for i in range(5)]
    write_convs(tmp_path / "convs.jsonl", convs)
    return tmp_path


def write_convs(path: Path, convs: list[Conversation]) -> None:
    path.write_text("".join(c.to_json() + "\n" for c in convs), encoding="utf-8")


def invoke(folder: Path, *args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, ["judge", *args], catch_exceptions=False,
                              env={"TRACEJUDGE_CONFIG": None, **(env or {})})


def write_config(folder: Path, provider: dict[str, object]) -> Path:
    path = folder / "otel-config.yaml"
    path.write_text(yaml.safe_dump({"judges": {"criteria": ["criteria.yaml"], "provider": provider,
                                               "concurrency": 4, "timeout": "30s"}}), encoding="utf-8")
    return path


def test_code_criteria_without_provider(files: Path) -> None:
    out = files / "verdicts.jsonl"
    r = invoke(files, "--criteria", str(files / "criteria.yaml"), "--out", str(out), str(files / "convs.jsonl"))
    assert r.exit_code == 0, r.output
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [v["result"] for v in lines] == ["pass"] * 4 + ["fail"]
    assert all(v["criterion_id"] == "escalates-emergencies" for v in lines)
    assert "chest-pain-red-flags: 5 not run: no provider configured" in r.output
    assert "escalates-emergencies" in r.output and "too few to tell (1 of 5)" in r.output
    assert "chest-pain-vague-01  escalates-emergencies: FAILING, passed 4 of 5" in r.output


@pytest.mark.parametrize(("escalated", "rate"), [
    ([True, True], "too few to tell (0 of 2)"),  # not "0% (at most 100.0%, rule of three)"
    ([True] * 9 + [False], "10.0% (1.8% to 40.4%)"),
    ([True] * 10, "0% (at most 30.0%, rule of three)"),
])
def test_a_rate_over_fewer_than_min_n_is_too_few_to_tell(files: Path, escalated: list[bool], rate: str) -> None:
    write_convs(files / "few.jsonl", [chest_pain(f"few-{i}", escalated=e) for i, e in enumerate(escalated)])
    r = invoke(files, "--criteria", str(files / "criteria.yaml"), str(files / "few.jsonl"))
    row = next(line for line in r.output.splitlines() if line.startswith("escalates-emergencies"))
    assert row.endswith(rate), r.output
    doc = json.loads(invoke(files, "--criteria", str(files / "criteria.yaml"), "--json",
                            str(files / "few.jsonl")).stdout)
    crit = {c["criterion_id"]: c for c in doc["summary"]["criteria"]}
    assert crit["escalates-emergencies"]["failure_rate"]["too_few"] is (len(escalated) < 10)


def test_fail_on(files: Path) -> None:
    args = ["--criteria", str(files / "criteria.yaml"), str(files / "convs.jsonl")]
    assert invoke(files, *args, "--fail-on", "fail").exit_code == 1
    assert invoke(files, *args, "--fail-on", "error").exit_code == 0
    assert invoke(files, *args, "--fail-on", "error", "--fail-on", "not_run").exit_code == 1


def test_json_output(files: Path) -> None:
    r = invoke(files, "--criteria", str(files / "criteria.yaml"), "--json", str(files / "convs.jsonl"))
    doc = json.loads(r.stdout)
    crit = {c["criterion_id"]: c for c in doc["summary"]["criteria"]}
    assert crit["escalates-emergencies"]["counts"]["pass"] == 4
    assert crit["escalates-emergencies"]["failure_rate"]["method"] == "wilson"
    assert crit["chest-pain-red-flags"]["counts"]["not_run"] == 5
    assert doc["summary"]["scenarios"][0]["failing"] is True
    assert len(doc["not_run"]) == 5 and doc["stopped"] is None


def test_provider_from_config_and_the_cache(files: Path, fake_llm: FakeLLM) -> None:
    config = write_config(files, {"type": "anthropic", "model": "claude-test", "base_url": fake_llm.url,
                                  "api_key": "test-key"})
    fake_llm.reset(*[Answer(verdict_json("pass", ["Does the pain spread to your arm, jaw or back?"]))] * 5)
    out = files / "v.jsonl"
    r = invoke(files, "--config", str(config), "--out", str(out), str(files / "convs.jsonl"))
    assert r.exit_code == 0, r.output
    llm = [json.loads(x) for x in out.read_text().splitlines() if "chest-pain-red-flags" in x]
    assert [v["result"] for v in llm] == ["pass"] * 5 and llm[0]["judge"] == {"provider": "anthropic",
                                                                             "model": "claude-test"}
    # The five replicates share one transcript per outcome: a second run costs nothing.
    n = len(fake_llm.requests)
    r = invoke(files, "--config", str(config), "--out", str(out), str(files / "convs.jsonl"))
    assert len(fake_llm.requests) == n and "verdicts from cache" in r.output
    assert (files / ".tracejudge-cache.jsonl").exists()


def test_flags_override_the_config(files: Path, fake_llm: FakeLLM) -> None:
    config = write_config(files, {"type": "anthropic", "model": "claude-test", "base_url": "http://127.0.0.1:9"})
    fake_llm.reset(*[Answer(verdict_json("not_applicable"))] * 5)
    r = invoke(files, "--config", str(config), "--provider", "openai_compatible", "--model", "small",
               "--base-url", fake_llm.url + "/v1", "--no-cache", "--json", str(files / "convs.jsonl"))
    assert r.exit_code == 0, r.output
    assert {p for p, _, _ in fake_llm.requests} == {"/v1/chat/completions"}
    assert fake_llm.requests[0][1]["model"] == "small"


# The variables the library's providers read (AnthropicProvider(), OpenAICompatibleProvider()) for a server at a
# URL, and the path each posts to.
FROM_ENV = {
    "anthropic": (lambda url: {"ANTHROPIC_API_KEY": "env-key", "ANTHROPIC_BASE_URL": url,
                               "ANTHROPIC_MODEL": "env-model"}, "/v1/messages"),
    "openai_compatible": (lambda url: {"OPENAI_API_KEY": "env-key", "OPENAI_BASE_URL": url + "/v1",
                                       "OPENAI_MODEL": "env-model"}, "/v1/chat/completions"),
}


@pytest.mark.parametrize("kind", sorted(FROM_ENV))
def test_without_provider_or_config_the_provider_comes_from_the_environment(files: Path, fake_llm: FakeLLM,
                                                                          kind: str) -> None:
    env, path = FROM_ENV[kind]
    fake_llm.reset(*[Answer(verdict_json("pass", ["Does the pain spread to your arm, jaw or back?"]))] * 5)
    out = files / "v.jsonl"
    r = invoke(files, "--criteria", str(files / "criteria.yaml"), "--no-cache", "--out", str(out), "--fail-on",
               "not_run", str(files / "convs.jsonl"), env=env(fake_llm.url))
    assert r.exit_code == 0, r.output
    llm = [json.loads(x) for x in out.read_text().splitlines() if "chest-pain-red-flags" in x]
    assert [v["result"] for v in llm] == ["pass"] * 5
    assert llm[0]["judge"] == {"provider": kind, "model": "env-model"}
    assert [(p, h["Authorization"]) for p, _, h in fake_llm.requests] == [(path, "Bearer env-key")] * 5
    assert r.stderr == "" and "NOT RUN" not in r.stdout


def test_with_no_provider_anywhere_it_says_how_to_set_one(files: Path) -> None:
    args = ["--criteria", str(files / "criteria.yaml"), str(files / "convs.jsonl")]
    r = invoke(files, *args)
    assert r.exit_code == 0  # the code criterion's fail is not asked about
    assert r.stderr == ("tracejudge: warning: no judge provider, so the LLM criteria do not run: set "
                        "ANTHROPIC_API_KEY and ANTHROPIC_MODEL (or OPENAI_BASE_URL and OPENAI_MODEL), pass --provider, "
                        "or set judges.provider in the config\n")
    assert r.stdout.rstrip().endswith("NOT RUN: 1 of 1 LLM criterion (5 judgements): no provider configured")
    assert invoke(files, *args, "--fail-on", "not_run").exit_code == 1


def test_two_providers_in_the_environment_is_a_usage_error(files: Path) -> None:
    r = invoke(files, "--criteria", str(files / "criteria.yaml"), str(files / "convs.jsonl"),
               env={"ANTHROPIC_API_KEY": "k", "OPENAI_BASE_URL": "http://127.0.0.1:9/v1"})
    assert r.exit_code == 2
    assert r.stderr == ("tracejudge: error: $ANTHROPIC_API_KEY and $OPENAI_BASE_URL are both set: pass --provider "
                        "anthropic or --provider openai_compatible\n")


@pytest.mark.slow
def test_the_summary_names_the_cause_of_errors(files: Path) -> None:
    # Port 9 (discard) on loopback: nothing listens there.
    config = write_config(files, {"type": "anthropic", "model": "claude-test", "base_url": "http://127.0.0.1:9",
                                  "api_key": "k"})
    write_convs(files / "one.jsonl", [chest_pain("c-1")])
    r = invoke(files, "--config", str(config), "--no-cache", str(files / "one.jsonl"))
    assert r.exit_code == 0, r.output
    assert ("chest-pain-red-flags: 1 error: retries_exhausted: 4 attempts; last: connection: cannot connect to "
            "http://127.0.0.1:9/v1/messages: connection refused") in r.output


def test_temperature_is_not_sent_to_anthropic_and_says_so(files: Path, fake_llm: FakeLLM) -> None:
    config = write_config(files, {"type": "anthropic", "model": "claude-test", "base_url": fake_llm.url,
                                  "api_key": "k", "temperature": 0.0})
    fake_llm.reset(*[Answer(verdict_json("not_applicable"))] * 5)
    r = invoke(files, "--config", str(config), "--no-cache", str(files / "convs.jsonl"))
    assert r.exit_code == 0
    assert "warning: judges.provider.temperature is not used by the anthropic provider" in r.stderr


def test_budget_flags(files: Path, fake_llm: FakeLLM) -> None:
    config = write_config(files, {"type": "anthropic", "model": "claude-test", "base_url": fake_llm.url,
                                  "api_key": "k"})
    write_convs(files / "convs.jsonl", [chest_pain(f"c{i}", escalated=i % 2 == 0) for i in range(6)])
    fake_llm.reset(*[Answer(verdict_json("not_applicable"), input_tokens=100, output_tokens=0)] * 6)
    r = invoke(files, "--config", str(config), "--no-cache", "--concurrency", "1", "--budget-tokens", "150",
               str(files / "convs.jsonl"))
    assert "stopped early: budget spent: 200 tokens of 150" in r.output
    assert "4 not run: budget spent" in r.output


def test_a_misspelt_key_in_a_criteria_file_is_named_on_one_line(files: Path) -> None:
    typo = Path(__file__).parents[1] / "testdata" / "criteria" / "typo_check.yaml"
    r = run_cli("judge", "--criteria", str(typo), str(files / "convs.jsonl"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "criterion 'order-looked-up': chek: unknown key (did you mean check?)" in r.stderr
    assert r.stderr.count("check: missing") == 1


@pytest.mark.parametrize(("args", "message"), [
    (["--criteria", "criteria.yaml", "missing.jsonl"], "missing.jsonl: cannot read"),
    (["--criteria", "nope.yaml", "convs.jsonl"], "nope.yaml: cannot read"),
    (["convs.jsonl"], "no criteria: pass --criteria FILE or set judges.criteria in the config"),
    (["--criteria", "bad.yaml", "convs.jsonl"], "bad.yaml: criterion 'x': check: unknown check 'nope'"),
    (["--criteria", "criteria.yaml", "--provider", "anthropic", "convs.jsonl"],
     "anthropic: no model: pass --model, or set judges.provider.model or $ANTHROPIC_MODEL"),
    (["--criteria", "criteria.yaml", "--provider", "openai_compatible", "--model", "m", "convs.jsonl"],
     "openai_compatible: no base_url: pass --base-url, or set judges.provider.base_url or $OPENAI_BASE_URL"),
    (["--criteria", "criteria.yaml", "--provider", "gemini", "--model", "m", "convs.jsonl"],
     "unknown provider type 'gemini'"),
    (["--criteria", "criteria.yaml", "--timeout", "5", "convs.jsonl"], "--timeout: '5' is not a duration"),
    (["--criteria", "criteria.yaml", "--budget-cost", "1", "convs.jsonl"], "--budget-cost needs --price-input"),
    (["--criteria", "criteria.yaml", "bad.jsonl"], "bad.jsonl:1: schema is 'conversation/v0'"),
])
def test_bad_input_is_one_line_and_exit_2(files: Path, args: list[str], message: str) -> None:
    (files / "bad.yaml").write_text("criteria:\n  - {id: x, version: 1, kind: code, check: nope}\n")
    (files / "bad.jsonl").write_text('{"schema": "conversation/v0"}\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRACEJUDGE_", "ANTHROPIC_"))}
    r = subprocess.run([sys.executable, "-m", "collector", "judge", *args], cwd=files, capture_output=True,
                       text=True, env=env, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("tracejudge: error: ") and message in r.stderr


def test_help_lists_the_options() -> None:
    r = CliRunner().invoke(main, ["judge", "--help"])
    for option in ("--criteria", "--out", "--fail-on", "--provider", "--model", "--base-url", "--config", "--json"):
        assert option in r.output
