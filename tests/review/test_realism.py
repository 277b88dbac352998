"""Is the simulated user realistic? Through a real daemon: imported simulated conversations that carry
``attributes.simulated_user`` become blind tasks of the built-in criterion ``simulated_user_realistic``, people
label them with their own tokens, and the realism figure counts the labels of one simulated user (provider,
model, prompt and temperature) only, leaving the judges' calibration as it was."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import pytest

from collector.api.client import realism
from collector.config import load_config
from collector.errors import UserError
from collector.review.calibration import REALISM_TEXT, SCHEMA, choose_simulated, chosen
from judges import Conversation

from ..support.api_http import Reply, assert_error, call, post_json
from ..support.daemon import DaemonProcess, base_config, clean_env, run_cli
from ..support.review import CARRIER, carrier_conversation, send_conversations, start_daemon, wait_items

REALISM = "simulated_user_realistic"
TOKENS = {"ana": "ana-token-5d1e8b", "ben": "ben-token-0a7c3f"}
USER_A = {"provider": "anthropic", "model": "claude-x", "prompt_sha256": "a" * 64, "temperature": 1.0}
USER_B = {**USER_A, "temperature": 0.7}  # another temperature: another simulated user
USER_C = {**USER_A, "model": "claude-y"}
SIMULATED = {"sim-a1": USER_A, "sim-a2": USER_A, "sim-a3": USER_A, "sim-b1": USER_B, "sim-c1": USER_C,
             "shared-1": USER_A}  # shared-1 is also a production conversation's id


def bearer(who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[who]}"}


def sim(cid: str, user: dict[str, Any] | None, **attributes: Any) -> dict[str, Any]:
    if user is not None:
        attributes["simulated_user"] = user
    return {"schema": "conversation/v1", "id": cid, "source": "simulation", "persona_id": "late-parcel",
            "ended_by": "goal_reached", "attributes": {"run": "r-1", "replicate": 1, **attributes},
            "messages": [{"role": "user", "content": f"hi, {cid} here, where is my parcel"},
                         {"role": "assistant", "content": "It is at the depot."}]}


def records() -> list[dict[str, Any]]:
    return [*(sim(c, u) for c, u in SIMULATED.items() if c != "sim-a3"),
            sim("sim-plain", None), {**sim("sim-no-user", None), "attributes": {}},
            sim("sim-half-user", {k: v for k, v in USER_A.items() if k != "temperature"})]


def start(folder: Path, **sections: Any) -> DaemonProcess:
    return start_daemon(folder, review={"calibration_rate": 1.0, "reviewers": [
        {"name": n, "token": t} for n, t in TOKENS.items()]},
        simulate={"realism_sample_rate": 1.0, "min_realism": 0.3}, **sections)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    folder = tmp_path_factory.mktemp("realism")
    d = start(folder)
    try:
        send_conversations(d.grpc, [carrier_conversation("shared-1"), carrier_conversation("real-2")])
        wait_items(d, {("shared-1", CARRIER), ("real-2", CARRIER)})
        stored = post_json(d.api, "/api/simulations", {"records": records()})
        assert stored.status == 200 and stored.json() == {"stored": 8, "already_imported": 0}, stored.body
        # The CLI's import goes through the daemon, and its conversations are sampled the same way.
        lines = folder / "sim.jsonl"
        lines.write_text(json.dumps(sim("sim-a3", USER_A)) + "\n", encoding="utf-8")
        res = run_cli("replay", "import", str(lines), "--config", str(d.config_path), "--json")
        assert res.returncode == 0 and json.loads(res.stdout)["stored"] == 1, res.stderr
        yield d
    finally:
        d.end()


def tasks(d: DaemonProcess) -> dict[str, int]:
    found = d.get(f"/api/calibration/items?criterion={REALISM}&state=all&limit=1000")[1]["items"]
    return {t["conversation_id"]: t["id"] for t in found}


def label(d: DaemonProcess, item_id: int, value: str, who: str, **body: Any) -> Reply:
    return post_json(d.api, f"/api/calibration/items/{item_id}/label", {"label": value, **body}, bearer(who))


def figure(d: DaemonProcess, user: dict[str, Any]) -> dict[str, Any]:
    query = "&".join(f"{k}={v}" for k, v in user.items())
    body: dict[str, Any] = d.get(f"/api/simulations/realism?{query}")[1]
    return body


def wilson_low(k: int, n: int, z: float = 1.959963984540054) -> float:
    p = k / n
    return (p + z * z / (2 * n) - z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))) / (1 + z * z / n)


def test_the_realism_sample_is_drawn_from_the_id_the_criterion_and_the_seed() -> None:
    con = duckdb.connect()
    con.execute(SCHEMA)
    convs = [Conversation.model_validate(sim(f"s-{n}", USER_A if n % 10 else None)) for n in range(400)]
    made = choose_simulated(con, convs, 0.25, 7)
    got = {r[0] for r in con.execute("SELECT conversation_id FROM calibration_items").fetchall()}
    assert got == {c.id for c in convs if c.attributes.get("simulated_user") and chosen(c.id, REALISM, 0.25, 7)}
    assert made == len(got) and 50 <= made <= 130  # about a quarter of the 360 with a simulated user
    assert choose_simulated(con, convs, 0.25, 7) == 0  # the same ones, each made once
    assert choose_simulated(con, convs, 0.0, 7) == 0


def test_sampled_simulated_conversations_with_a_simulated_user_become_blind_tasks(daemon: DaemonProcess) -> None:
    assert set(tasks(daemon)) == set(SIMULATED)  # never those without a (whole) simulated user
    again = post_json(daemon.api, "/api/simulations", {"records": records()})
    assert again.json() == {"stored": 0, "already_imported": 8} and set(tasks(daemon)) == set(SIMULATED)

    status, detail = daemon.get(f"/api/calibration/items/{tasks(daemon)['shared-1']}", token=TOKENS["ana"])
    assert status == 200 and detail["criterion"]["id"] == REALISM and detail["criterion"]["text"] == REALISM_TEXT
    # Simulated ids are a space of their own: the task shows the simulated shared-1, not production's.
    conversation = detail["conversation"]
    assert conversation["source"] == "simulation" and conversation["attributes"]["simulated_user"] == USER_A
    assert conversation["messages"][0]["content"] == "hi, shared-1 here, where is my parcel"
    real = daemon.get(f"/api/calibration/items?criterion={CARRIER}&state=all")[1]["items"]
    production = next(t["id"] for t in real if t["conversation_id"] == "shared-1")
    assert daemon.get(f"/api/calibration/items/{production}")[1]["conversation"]["source"] == "production"

    waiting = daemon.get(f"/api/calibration/items?criterion={REALISM}", token=TOKENS["ben"])[1]["items"]
    assert {t["conversation_id"] for t in waiting} == set(SIMULATED)  # unlabelled, though no production twin
    page = call(daemon.api, "GET", f"/review/label/{tasks(daemon)['sim-a1']}", headers=bearer("ben"))
    assert page.status == 200 and "hi, sim-a1 here" in page.body
    assert "Does the simulated user read like a real user" in page.body


def test_labels_make_the_realism_figure_of_one_simulated_user(daemon: DaemonProcess) -> None:
    ids = tasks(daemon)
    assert_error(post_json(daemon.api, f"/api/calibration/items/{ids['sim-a1']}/label",
                           {"label": "pass", "reviewer": "ana"}), 403, "reviewer_token_required")
    assert_error(label(daemon, ids["sim-a1"], "pass", "ana", reviewer="ben"), 403, "wrong_reviewer")
    assert figure(daemon, USER_A)["labelled"] == 0

    for cid in ("sim-a1", "sim-a2", "shared-1"):
        assert label(daemon, ids[cid], "pass", "ana").status == 200
    assert label(daemon, ids["sim-a3"], "fail", "ana", note="tells every fact in the first message").status == 200
    assert label(daemon, ids["sim-a1"], "pass", "ben").status == 200  # two labels, one task
    assert label(daemon, ids["sim-a2"], "fail", "ben").status == 200  # a tie: left out
    assert label(daemon, ids["sim-b1"], "not_applicable", "ana").status == 200

    a = figure(daemon, USER_A)
    assert {k: a[k] for k in ("labelled", "realistic", "not_applicable", "unlabelled")} == {
        "labelled": 3, "realistic": 2, "not_applicable": 0, "unlabelled": 0}
    assert a["simulated_user"] == USER_A and a["min_realism"] == 0.3
    assert a["share"] == pytest.approx(2 / 3) and a["lower"] == pytest.approx(wilson_low(2, 3))
    assert a["lower"] < 0.3 and a["validated"] is False  # two of three is too few to say
    b = figure(daemon, USER_B)
    assert (b["labelled"], b["realistic"], b["share"], b["lower"], b["validated"], b["not_applicable"]) == (
        0, 0, None, None, False, 1)
    other = figure(daemon, {**USER_A, "prompt_sha256": "b" * 64})  # a new prompt needs new labels
    assert (other["labelled"], other["unlabelled"], other["validated"]) == (0, 0, False)

    every = daemon.get("/api/simulations/realism")[1]["simulated_users"]
    assert [f["simulated_user"] for f in every] == [USER_B, USER_A, USER_C]  # by provider, model, prompt, temperature
    assert every[:2] == [b, a]

    # The function `tracejudge simulate` calls finds the daemon through the config.
    cfg, _ = load_config(daemon.config_path, environ={})
    assert realism(cfg, {**USER_A, "extra": "ignored"}) == a
    with pytest.raises(UserError, match="temperature must be a number"):
        realism(cfg, {**USER_A, "temperature": "warm"})
    assert realism(cfg, {**USER_A, "temperature": None})["labelled"] == 0  # none sent (Anthropic): its own user


def test_a_bad_simulated_user_gets_the_error_shape(daemon: DaemonProcess) -> None:
    base = "/api/simulations/realism?provider=anthropic&model=claude-x&prompt_sha256=abc"
    assert_error(call(daemon.api, "GET", base), 400, "bad_parameter", "temperature missing")
    assert_error(call(daemon.api, "GET", base + "&temperature=warm"), 400, "bad_parameter", "'warm'")
    assert_error(call(daemon.api, "GET", base + "&temperature=nan"), 400, "bad_parameter", "temperature")
    assert_error(call(daemon.api, "GET", "/api/simulations/realism?model=claude-x&temperature=1"), 400,
                 "bad_parameter", "provider, prompt_sha256 missing")
    assert_error(call(daemon.api, "GET", base.replace("claude-x", "%20") + "&temperature=1"), 400,
                 "bad_parameter", "model")


def test_realism_labels_leave_the_judges_calibration_alone(daemon: DaemonProcess) -> None:
    real = daemon.get(f"/api/calibration/items?criterion={CARRIER}&state=all")[1]["items"]
    assert label(daemon, real[0]["id"], "fail", "ben").status == 200
    before = (daemon.get("/api/calibration")[1], daemon.get("/api/calibration/set")[1], daemon.get("/api/stats")[1])
    assert before[0]["criteria"] and before[1]["items"]
    assert label(daemon, tasks(daemon)["sim-c1"], "fail", "ben").status == 200
    assert figure(daemon, USER_C)["labelled"] == 1
    after = (daemon.get("/api/calibration")[1], daemon.get("/api/calibration/set")[1], daemon.get("/api/stats")[1])
    assert after == before
    assert REALISM not in json.dumps(after[0]) and REALISM not in json.dumps(after[1])
    assert daemon.get(f"/api/calibration?criterion={REALISM}")[1]["criteria"] == []
    res = run_cli("calibrate", "--config", str(daemon.config_path), "--json")
    assert res.returncode == 0 and json.loads(res.stdout) == before[0], res.stderr

    page = call(daemon.api, "GET", "/calibration", headers=bearer("ana"))
    assert page.status == 200 and "Is the simulated user realistic?" in page.body and "claude-x" in page.body


@pytest.mark.slow
def test_without_a_daemon_the_file_samples_imports_and_gives_the_figure(tmp_path: Path) -> None:
    d = start(tmp_path)
    assert d.stop() == 0
    cfg, _ = load_config(d.config_path, environ={})
    assert realism(cfg, USER_A)["labelled"] == 0  # a file with no task yet
    lines = tmp_path / "sim.jsonl"
    lines.write_text("".join(json.dumps(r) + "\n" for r in records()), encoding="utf-8")
    res = run_cli("replay", "import", str(lines), "--config", str(d.config_path), "--json", env=clean_env())
    assert res.returncode == 0 and json.loads(res.stdout)["stored"] == 8, res.stderr

    out = tmp_path / "labels.csv"
    res = run_cli("labels", "export", "--config", str(d.config_path), "--criterion", REALISM, "--out", str(out))
    assert res.returncode == 0, res.stderr
    rows = list(csv.DictReader(io.StringIO(out.read_text(encoding="utf-8-sig"), newline="")))
    assert {r["conversation_id"] for r in rows} == set(SIMULATED) - {"sim-a3"}
    assert rows[0]["criterion"] == REALISM_TEXT and "USER: hi, " in rows[0]["transcript"]
    with out.open("w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows({**r, "label": "pass"} for r in rows)
    res = run_cli("labels", "import", "--config", str(d.config_path), str(out), "--token", TOKENS["ana"])
    assert res.returncode == 0, res.stdout + res.stderr

    a = realism(cfg, USER_A)
    assert (a["labelled"], a["realistic"], a["lower"]) == (3, 3, pytest.approx(wilson_low(3, 3)))
    assert a["lower"] >= 0.3 and a["validated"] is True
    assert realism(cfg, USER_B)["labelled"] == 1

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "otel-config.yaml").write_text(json.dumps(base_config(elsewhere)), encoding="utf-8")
    none, _ = load_config(elsewhere / "otel-config.yaml", environ={})
    got = realism(none, USER_A)  # no daemon, no file: nothing labelled, and no file made
    assert (got["labelled"], got["share"], got["lower"], got["validated"]) == (0, None, None, False)
    assert not none.storage.duckdb.path.exists()
