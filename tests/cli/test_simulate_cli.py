"""``tracejudge simulate`` and ``scenarios verify`` as a user runs them: the CLI in a subprocess, the simulated
user and the judge on a loopback model, bots from ``tests.support.roleplay``."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ..support.api_http import post_json
from ..support.daemon import REPO, DaemonProcess, base_config, clean_env, run_cli, wait_until
from ..support import roleplay
from ..support.roleplay import RolePlayModel

CRITERIA = roleplay.CRITERIA + """\
  - id: polite
    version: 1
    kind: llm
    prompt: "Fail when the bot is rude."
"""
GOAL = 'Learn when the order arrives; reached when the bot says "delayed at the depot".'


@pytest.fixture(scope="module")
def model() -> Iterator[RolePlayModel]:
    m = RolePlayModel()
    yield m
    m.close()


def write_config(folder: Path, model: RolePlayModel, **sections: Any) -> Path:
    (folder / "criteria.yaml").write_text(CRITERIA, encoding="utf-8")
    cfg = base_config(folder, judges={"criteria": [str(folder / "criteria.yaml")], "timeout": "30s",
                                      "provider": {"type": "anthropic", "model": "judge-sim",
                                                   "base_url": model.url, "api_key": "k"}},
                      simulate={"user": {"provider": {"type": "openai_compatible", "model": "user-sim",
                                                      "base_url": model.url + "/v1"}, "temperature": 0.9},
                                "replicates": 2, "concurrency": 2},
                      scenarios={"out_dir": str(folder / "incoming")}, **sections)
    path = folder / "otel-config.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def write_scenarios(folder: Path, *specs: dict[str, Any]) -> Path:
    suite = folder / "suite"
    suite.mkdir(exist_ok=True)
    for spec in specs:
        data = {"persona": "Writes short messages.", "goal": GOAL, "facts": {"order_number": "B-1042"},
                "expected": {"criteria": ["no-carrier-promises", "polite"]}, **spec}
        (suite / f"{data['id']}.yaml").write_text(yaml.safe_dump(data), encoding="utf-8")
    return suite


def simulate(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli("simulate", *args, "--config", str(config))


@pytest.mark.slow
def test_a_run_judges_every_replicate_and_reports_as_the_contract_says(tmp_path: Path, model: RolePlayModel) -> None:
    config = write_config(tmp_path, model)
    suite = write_scenarios(tmp_path, {"id": "late-order"}, {"id": "asks-a-person", "persona": "wants a person"})
    out = tmp_path / "run"
    done = simulate(config, str(suite), "--bot", "tests.support.roleplay:broken", "--out", str(out), "--json")
    assert done.returncode == 1, done.stderr  # late-order fails no-carrier-promises
    report = json.loads(done.stdout)
    assert json.loads((out / "report.json").read_text()) == report
    person, late = report["scenarios"]  # in file name order
    assert late["id"] == "late-order" and late["replicates"] == 2 and late["failing"]
    assert late["criteria"]["no-carrier-promises"]["fail"] == 2 and late["criteria"]["polite"]["pass"] == 2
    assert late["ended_by"]["goal_reached"] == 2
    assert person["ended_by"]["handover"] == 2 and not person["failing"]
    assert report["criteria"]["no-carrier-promises"] == {"conversations": 4, "fail": 2, "rate": 0.5,
                                                         "interval": report["criteria"]["no-carrier-promises"]
                                                         ["interval"], "too_few": True}
    assert report["simulated_user"]["model"] == "user-sim" and report["simulated_user"]["temperature"] == 0.9
    assert report["simulated_user"]["validated"] is False and report["simulated_user"]["realism"] is None
    assert report["summary"]["scenarios"] == 2 and report["summary"]["failing"] == 1
    assert report["tokens"]["judges"]["input"] > 0 and report["tokens"]["simulated_user"]["input"] > 0
    lines = (out / "conversations.jsonl").read_text().splitlines()
    assert len(lines) == 4 and all(json.loads(x)["source"] == "simulation" for x in lines)
    assert len((out / "verdicts.jsonl").read_text().splitlines()) == 8
    text = simulate(config, str(suite), "--bot", "tests.support.roleplay:broken", "--out", str(out))
    assert "late-order  FAILING  (simulated user not validated)" in text.stdout, text.stdout
    # Four conversations: the count, not a rate of 50% between 15% and 85%.
    assert "  no-carrier-promises: 2 of 4, too few to tell  (simulated user not validated)" in text.stdout


@pytest.mark.slow
def test_a_baseline_says_fixed_broke_and_still_failing(tmp_path: Path, model: RolePlayModel) -> None:
    config = write_config(tmp_path, model)
    suite = write_scenarios(tmp_path, {"id": "late-order"})
    before, after = tmp_path / "before", tmp_path / "after"
    assert simulate(config, str(suite), "--bot", "tests.support.roleplay:broken", "--out", str(before),
                    "--replicates", "5").returncode == 1
    fixed = simulate(config, str(suite), "--bot", "tests.support.roleplay:fixed", "--out", str(after),
                     "--replicates", "5", "--baseline", str(before), "--json")
    assert fixed.returncode == 0, fixed.stderr
    report = json.loads(fixed.stdout)
    block = report["scenarios"][0]["baseline"]
    assert block["status"] == "fixed" and block["criteria"]["no-carrier-promises"]["fail_before"] == 5
    assert block["criteria"]["no-carrier-promises"]["fail_now"] == 0
    assert block["criteria"]["no-carrier-promises"]["p_value"] < 0.01
    assert report["summary"]["fixed"] == 1 and report["summary"]["broke"] == 0
    broke = simulate(config, str(suite), "--bot", "tests.support.roleplay:flaky", "--out", str(tmp_path / "b"),
                     "--replicates", "5", "--baseline", str(after))
    assert broke.returncode == 1 and "broke" in broke.stdout
    assert "0/5 -> 1/5 (p = 1.00: cannot be told from chance with 5 replicates)" in broke.stdout, broke.stdout
    still = simulate(config, str(suite), "--bot", "tests.support.roleplay:broken", "--out", str(tmp_path / "s"),
                     "--replicates", "5", "--baseline", str(before), "--json")
    assert json.loads(still.stdout)["scenarios"][0]["baseline"]["status"] == "still_failing"


def written(out: Path) -> int:
    file = out / "conversations.jsonl"
    return len(file.read_text().splitlines()) if file.exists() else 0


def stop_a_stalled_run(tmp_path: Path, config: Path, sigint: Callable[[subprocess.Popen[str], Path], None], *more: str,
                       python: tuple[str, ...] = ()) -> list[str]:
    """Simulate two scenarios of four replicates, one conversation at a time, against a bot that never answers the
    third; ``sigint(process, out)`` sends its SIGINT. It must exit 130 at once, the two conversations done kept;
    returns its arguments after ``python``."""
    suite = write_scenarios(tmp_path, {"id": "late-order"}, {"id": "other-order"})
    out = tmp_path / "run"
    args = ["-m", "collector", "simulate", str(suite), "--bot", "tests.support.roleplay:stalls", "--out", str(out),
            "--replicates", "4", "--concurrency", "1", "--config", str(config), *more]
    proc = subprocess.Popen([sys.executable, *python, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=clean_env(ROLEPLAY_STALL="1", ROLEPLAY_STALLED=str(tmp_path / "stalled")), text=True)
    try:
        sigint(proc, out)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()  # reaped, its pipes closed: a later test's collection must not meet them
    assert proc.returncode == 130 and "interrupted" in err and f"--out {out}" in err, err
    assert written(out) == 2
    return args


def once_two_are_written(proc: subprocess.Popen[str], out: Path) -> None:
    # The third conversation never gets its answer: Ctrl-C comes while the second is judged, or the third waits.
    wait_until(lambda: written(out) >= 2, "two conversations written")
    proc.send_signal(signal.SIGINT)


@pytest.mark.slow
def test_ctrl_c_keeps_what_was_done_and_the_same_command_resumes(tmp_path: Path, model: RolePlayModel) -> None:
    args = stop_a_stalled_run(tmp_path, write_config(tmp_path, model), once_two_are_written)
    out = tmp_path / "run"
    again = run_cli(*args[2:])
    assert f"resuming {out}: 2 of 8 conversations done before" in again.stderr
    records = [json.loads(x) for x in (out / "conversations.jsonl").read_text().splitlines()]
    assert sorted((r["persona_id"], r["attributes"]["replicate"]) for r in records) == \
        sorted((s, n) for s in ("late-order", "other-order") for n in range(1, 5))
    assert len({r["attributes"]["run"] for r in records}) == 1


IGNORING_SIGINT = ("-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                         "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")
"""Python's arguments that run the rest with SIGINT ignored, as a script's background job (``&`` without job
control) starts: an ignored signal stays ignored across exec, and Python (and asyncio.run) leave it so."""


@pytest.mark.slow
def test_a_run_started_with_sigint_ignored_still_stops_on_sigint(tmp_path: Path, model: RolePlayModel) -> None:
    stop_a_stalled_run(tmp_path, write_config(tmp_path, model), once_two_are_written, python=IGNORING_SIGINT)


def asleep(pid: int) -> bool:
    """Every thread of the process sleeps (waits in a system call): its event loop in its selector, with nothing
    to do."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that has just ended
            pass
    return bool(states) and all(state == "S" for state in states)


def takes_sigint(pid: int, tid: int) -> bool:
    status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
    blocked = int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16)
    return not blocked & (1 << (signal.SIGINT - 1))


LIBC = ctypes.CDLL(None, use_errno=True)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux" or not hasattr(LIBC, "tgkill"),
                    reason="threads are read from /proc and signalled with tgkill(2)")
def test_a_sigint_another_thread_takes_wakes_the_idle_run_at_once(tmp_path: Path, model: RolePlayModel) -> None:
    """The kernel hands a process's signal to any of its threads that does not block it (a judges check thread,
    the default executor's), and Python runs its handler only when the main thread next runs bytecode."""
    config = write_config(tmp_path, model)
    cfg = yaml.safe_load(config.read_text())
    del cfg["simulate"]["user"]  # Anthropic's client plays the user too: no aiohttp keep-alive timer wakes the loop
    config.write_text(yaml.safe_dump(cfg), encoding="utf-8")

    def once_the_loop_sleeps(proc: subprocess.Popen[str], out: Path) -> None:
        stalled = tmp_path / "stalled"
        wait_until(lambda: stalled.exists() and asleep(proc.pid), "the loop asleep, waiting for the stalled bot")
        thread = next(int(t.name) for t in Path(f"/proc/{proc.pid}/task").iterdir()
                      if int(t.name) != proc.pid and takes_sigint(proc.pid, int(t.name)))
        assert LIBC.tgkill(proc.pid, thread, signal.SIGINT) == 0, os.strerror(ctypes.get_errno())

    # With nothing else to wake it, a loop that missed the signal would sleep until the bot's hour is up.
    stop_a_stalled_run(tmp_path, config, once_the_loop_sleeps, "--bot-timeout", "1h")


@pytest.mark.parametrize(("text", "problem"), [
    ("id: x\npersona: p\ngoal: g\nfacts: {a: 1}\nexpected: {criteria: no-carrier-promises}\n",
     "expected: criteria: a list of criterion ids"),
    ("id: x\npersona: p\nfacts: {a: 1}\n", "goal: Field required"),
    ("id: x\npersona: p\ngoal: g\npersonna: typo\n", "personna: unknown key"),
    ("id: x\npersona: p\ngoal: g\nexpected: {criteria: [no-such-criterion]}\n",
     "expected.criteria: 'no-such-criterion' not in the criteria files"),
    ("- not a mapping\n", "not a scenario"),
    ("id: [unclosed\n", "not YAML"),
])
def test_a_bad_scenario_file_is_exit_2_naming_the_file_and_key(tmp_path: Path, model: RolePlayModel, text: str,
                                                               problem: str) -> None:
    config = write_config(tmp_path, model)
    bad = tmp_path / "bad.yaml"
    bad.write_text(text, encoding="utf-8")
    done = simulate(config, str(bad), "--bot", "tests.support.roleplay:broken", "--out", str(tmp_path / "run"))
    assert done.returncode == 2 and done.stderr.startswith(f"tracejudge: error: {bad}"), done.stderr
    assert problem in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(("args", "problem"), [
    (["--bot", "no_such_module:reply"], "cannot import no_such_module"),
    (["--bot", "tests.support.roleplay"], "give MODULE:FUNCTION"),
    (["--bot", "tests.support.roleplay:nothing"], "has no nothing"),
    ([], "give the bot"),
    (["--bot", "tests.support.roleplay:broken", "--bot-url", "http://127.0.0.1:9/v1/chat/completions"],
     "one of them"),
])
def test_a_bad_bot_is_exit_2(tmp_path: Path, model: RolePlayModel, args: list[str], problem: str) -> None:
    config = write_config(tmp_path, model)
    suite = write_scenarios(tmp_path, {"id": "late-order"})
    done = simulate(config, str(suite), *args)
    assert done.returncode == 2 and problem in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.slow
def test_with_a_daemon_running_the_run_is_stored_as_simulations(tmp_path: Path, model: RolePlayModel) -> None:
    config = write_config(tmp_path, model)
    cfg = yaml.safe_load(config.read_text())
    daemon = DaemonProcess(tmp_path, cfg).start()
    try:
        suite = write_scenarios(tmp_path, {"id": "late-order"})
        done = simulate(config, str(suite), "--bot", "tests.support.roleplay:broken", "--out", str(tmp_path / "run"))
        assert done.returncode == 1 and "stored in the daemon: 2 conversations" in done.stderr, done.stderr
        stats = run_cli("stats", "--by", "source", "--json", "--config", str(config))
        assert stats.returncode == 0, stats.stderr
        figures = json.loads(stats.stdout)["by_source"]["simulation"]
        crit = {c["criterion_id"]: c for c in figures["criteria"]}
        assert crit["no-carrier-promises"]["fail"] == 2 and crit["no-carrier-promises"]["judged"] == 2  # simulate's verdicts, not judged again
        assert daemon.stop() == 0
    finally:
        daemon.end()


@pytest.mark.slow
def test_scenarios_verify_records_how_often_the_failure_reproduces(tmp_path: Path, model: RolePlayModel) -> None:
    config = write_config(tmp_path, model)
    incoming = tmp_path / "incoming"
    incoming.mkdir()
    source = {"conversation_id": "c-1", "criterion": "no-carrier-promises", "criterion_version": 1,
              "evidence": ["BOT: the carrier will call you"], "reviewer": "ana", "confirmed_at": "2026-12-01T10:00:00Z",
              "review_item": 1, "judge": "code/regex"}
    for sid, persona in (("prod-no-carrier-promises-aaaaaa", "Writes short messages."),
                         ("prod-no-carrier-promises-bbbbbb", "wants a person")):
        (incoming / f"{sid}.yaml").write_text(yaml.safe_dump({
            "id": sid, "persona": persona, "goal": GOAL, "facts": {"order_number": "B-7781"}, "max_turns": 6,
            "expected": {"criteria": ["no-carrier-promises"]}, "source": source}, sort_keys=False), encoding="utf-8")
    (incoming / "mine.yaml").write_text(yaml.safe_dump({"id": "team-own", "persona": "p", "goal": "g"}))
    done = run_cli("scenarios", "verify", "--bot", "tests.support.roleplay:broken", "--replicates", "3",
                   "--out", str(tmp_path / "verify"), "--config", str(config))
    assert done.returncode == 1, done.stderr  # the second one does not reproduce
    assert "prod-no-carrier-promises-aaaaaa: reproduces: no-carrier-promises failed in 3 of 3" in done.stdout
    assert "prod-no-carrier-promises-bbbbbb: does not reproduce" in done.stdout and "edit the persona" in done.stdout
    written = yaml.safe_load((incoming / "prod-no-carrier-promises-aaaaaa.yaml").read_text())
    found = written["source"]["reproduced"]
    assert {k: found[k] for k in ("failed", "replicates", "criterion", "bot")} == {
        "failed": 3, "replicates": 3, "criterion": "no-carrier-promises", "bot": "tests.support.roleplay:broken"}
    assert written["persona"] == "Writes short messages." and written["source"]["reviewer"] == "ana"
    assert "reproduced" not in yaml.safe_load((incoming / "mine.yaml").read_text())
    again = run_cli("scenarios", "verify", "--bot", "tests.support.roleplay:broken", "--config", str(config))
    assert again.returncode == 0 and "nothing to verify" in again.stdout


@pytest.mark.slow
def test_the_judges_anthropic_provider_plays_the_user_when_simulate_names_none(tmp_path: Path,
                                                                               model: RolePlayModel) -> None:
    config = write_config(tmp_path, model)
    cfg = yaml.safe_load(config.read_text())
    del cfg["simulate"]["user"]
    config.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    suite = write_scenarios(tmp_path, {"id": "late-order"})
    before = len(model.of("user"))
    done = simulate(config, str(suite), "--bot", "tests.support.roleplay:fixed", "--out", str(tmp_path / "r"),
                    "--json")
    assert done.returncode == 0, done.stderr
    who = json.loads(done.stdout)["simulated_user"]
    assert who["provider"] == "anthropic" and who["model"] == "judge-sim" and who["temperature"] is None
    assert all(r.api == "anthropic" and "temperature" not in r.body for r in model.of("user")[before:])
    assert "temperature not sent" in simulate(config, str(suite), "--bot", "tests.support.roleplay:fixed",
                                              "--out", str(tmp_path / "r")).stdout


@pytest.mark.slow
def test_once_people_find_the_simulated_user_realistic_the_report_says_validated(tmp_path: Path,
                                                                                 model: RolePlayModel) -> None:
    config = write_config(tmp_path, model)
    cfg = yaml.safe_load(config.read_text())
    cfg["simulate"].update({"realism_sample_rate": 1.0, "min_realism": 0.5, "replicates": 5})
    config.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    daemon = DaemonProcess(tmp_path, cfg).start()
    try:
        suite = write_scenarios(tmp_path, {"id": "late-order"})
        out = tmp_path / "run"
        first = json.loads(simulate(config, str(suite), "--bot", "tests.support.roleplay:fixed", "--out", str(out),
                                    "--json").stdout)
        assert first["simulated_user"]["validated"] is False and first["simulated_user"]["realism_labels"] == 0
        tasks = daemon.get("/api/calibration/items?criterion=simulated_user_realistic&state=all&limit=100")[1]
        assert len(tasks["items"]) == 5  # every conversation of the run, at a sample rate of 1
        for task in tasks["items"]:
            assert post_json(daemon.api, f"/api/calibration/items/{task['id']}/label",
                             {"label": "pass", "reviewer": "ana"}).status == 200
        again = json.loads(simulate(config, str(suite), "--bot", "tests.support.roleplay:fixed", "--out", str(out),
                                    "--json").stdout)  # nothing left to run: the report is made again
        who = again["simulated_user"]
        assert who["validated"] is True and who["realism_labels"] == 5 and 0.5 < who["realism"] < 1
        text = simulate(config, str(suite), "--bot", "tests.support.roleplay:fixed", "--out", str(out)).stdout
        assert "not validated" not in text and "realistic in at least" in text
        assert daemon.stop() == 0
    finally:
        daemon.end()
