"""A judge regression set: blind-labelled transcripts frozen with `tracejudge calibrate --freeze`, judged again
with `--rerun` after the criteria change; and the NOT CALIBRATED mark of `tracejudge stats` and `judge`."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from collector.review.regression import KEY
from collector.review.stats import stats_of
from judges import Conversation, Message, Pair, calibrate

from ..support.api_http import post_json
from ..support.daemon import DaemonProcess, clean_env, run_cli, wait_until
from ..support.judge_server import FAIL_WORD, RuleJudge
from ..support.review import (
    CARRIER,
    CRITERIA,
    LOOKUP,
    REFUND,
    carrier_conversation,
    refund_conversation,
    send_conversations,
    start_daemon,
)

CONVERSATIONS = [*(carrier_conversation(f"rg-c{n}") for n in range(1, 5)),
                 *(refund_conversation(f"rg-r{n}") for n in range(1, 5))]
"""The judge fails the carrier ones on CARRIER and the refund ones on REFUND."""

# (conversation, criterion) -> labels by reviewer. rg-r3 ties on CARRIER; on rg-r4 people see a carrier
# promise the judge missed (a false pass).
LABELS: dict[tuple[str, str], dict[str, str]] = {
    **{(f"rg-c{n}", CARRIER): {"Ana": "fail"} for n in range(1, 5)},
    ("rg-r1", CARRIER): {"Ana": "pass"}, ("rg-r2", CARRIER): {"Ana": "pass"},
    ("rg-r3", CARRIER): {"Ana": "pass", "Ben": "fail"},
    ("rg-r4", CARRIER): {"Ana": "fail", "Ben": "fail"},
    ("rg-r1", REFUND): {"Ana": "fail"}, ("rg-c1", REFUND): {"Ana": "pass"},
}
NOTE = "promises a call from the carrier"


@dataclass
class World:
    daemon: DaemonProcess
    cfg: str
    live: Any
    """`calibrate --freeze live --json` run while the daemon ran (through its API)."""
    folder: Path
    api_set: Any
    """``GET /api/calibration/set?criterion=REFUND`` while the daemon ran."""
    api_stats: Any
    """``GET /api/stats`` while the daemon ran."""

    def set_path(self, name: str) -> Path:
        return Path(str(self.daemon.duckdb) + ".calibration") / f"{name}.jsonl"


def blind(d: DaemonProcess, criterion: str) -> list[dict[str, Any]]:
    return list(d.get(f"/api/calibration/items?criterion={criterion}&state=all&limit=1000")[1]["items"])


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    folder = tmp_path_factory.mktemp("regression")
    d = start_daemon(folder, review={"calibration_rate": 1.0})
    try:
        send_conversations(d.grpc, CONVERSATIONS)
        wait_until(lambda: len(blind(d, CARRIER)) == len(blind(d, REFUND)) == len(CONVERSATIONS),
                   "a blind item per conversation and criterion", timeout=90)
        ids = {(i["conversation_id"], c): i["id"] for c in (CARRIER, REFUND) for i in blind(d, c)}
        for key, by in LABELS.items():
            for reviewer, label in by.items():
                reply = post_json(d.api, f"/api/calibration/items/{ids[key]}/label",
                                  {"label": label, "reviewer": reviewer, "note": NOTE if key[0] == "rg-r4" else None})
                assert reply.status == 200, reply.body
        live = run_cli("calibrate", "--config", str(d.config_path), "--freeze", "live", "--json")
        api_set = d.get(f"/api/calibration/set?criterion={REFUND}")[1]
        api_stats = d.get("/api/stats")[1]
        assert d.stop() == 0
        yield World(d, str(d.config_path), live, folder, api_set, api_stats)
    finally:
        d.end()


def cli(w: World, *args: str) -> Any:
    return run_cli(*args, "--config", w.cfg)


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_freeze_through_the_running_daemon_writes_the_labelled_transcripts(world: World) -> None:
    assert world.live.returncode == 0, world.live.stderr
    out = json.loads(world.live.stdout)
    path = world.set_path("live")
    assert out == {"frozen": 9, "path": str(path), "left_out": {"ties": 1, "no_transcript": 0}}
    items = {(r["id"], r[KEY]["criterion_id"]): r for r in lines(path)}
    assert set(items) == set(LABELS) - {("rg-r3", CARRIER)}  # the tie is left out
    r4 = items[("rg-r4", CARRIER)]
    meta = r4[KEY]
    assert meta["label"] == "fail" and meta["criterion_version"] == 1
    assert meta["labels"] == [{"reviewer": "Ana", "label": "fail", "note": NOTE},
                              {"reviewer": "Ben", "label": "fail", "note": NOTE}]
    assert meta["judge"] == {"result": "pass", "model": "regex", "provider": "code"}
    assert items[("rg-c1", REFUND)][KEY]["judge"]["result"] == "pass"
    conv = Conversation.model_validate(r4)  # a conversation/v1 record; the key is not part of it
    assert conv.id == "rg-r4" and conv.messages[0].content == "Can I send a damaged book back?"
    assert KEY not in conv.model_dump()
    assert sorted(i["id"] for i in world.api_set["items"]) == ["rg-c1", "rg-r1"]
    assert {i[KEY]["criterion_id"] for i in world.api_set["items"]} == {REFUND}


def test_freeze_from_the_file_without_a_daemon_and_a_criterion(world: World) -> None:
    res = cli(world, "calibrate", "--freeze", "carrier-only", "--criterion", CARRIER)
    assert res.returncode == 0, res.stderr
    path = world.set_path("carrier-only")
    assert f"froze 7 items of 1 criterion to {path}" in res.stdout
    assert "1 item left out: the labels tie" in res.stdout
    assert {r[KEY]["criterion_id"] for r in lines(path)} == {CARRIER}
    # Frozen from the file or through the daemon: the same lines.
    live = [r for r in lines(world.set_path("live")) if r[KEY]["criterion_id"] == CARRIER]
    assert sorted(lines(path), key=lambda r: r["id"]) == sorted(live, key=lambda r: r["id"])


@pytest.mark.parametrize("name", ["../evil", ".hidden", "a/b", "", "spaced name", "x" * 200])
def test_a_bad_name_is_refused(world: World, name: str) -> None:
    res = cli(world, "calibrate", "--freeze", name)
    assert res.returncode == 2
    assert "use letters, digits, '-', '_' and '.' (not first)" in res.stderr
    assert not list(world.set_path("x").parent.glob("*evil*"))


def test_an_existing_name_is_refused_without_force(world: World) -> None:
    assert cli(world, "calibrate", "--freeze", "twice").returncode == 0
    path = world.set_path("twice")
    path.write_text("kept\n", encoding="utf-8")
    res = cli(world, "calibrate", "--freeze", "twice")
    assert res.returncode == 2 and f"{path} exists: give another name, or --force to replace it" in res.stderr
    assert path.read_text(encoding="utf-8") == "kept\n"
    res = cli(world, "calibrate", "--freeze", "twice", "--force")
    assert res.returncode == 0, res.stderr
    assert len(lines(path)) == 9


def test_nothing_labelled_of_a_criterion_is_not_frozen(world: World) -> None:
    res = cli(world, "calibrate", "--freeze", "empty", "--criterion", LOOKUP)
    assert res.returncode == 2 and f"no labelled calibration item of criterion {LOOKUP!r} to freeze" in res.stderr
    assert not world.set_path("empty").exists()


@pytest.mark.slow
def test_a_rerun_with_the_same_criteria_changes_nothing(world: World) -> None:
    res = cli(world, "calibrate", "--rerun", "live", "--json")
    assert res.returncode == 0, res.stderr
    diff = json.loads(res.stdout)
    assert diff["counts"] == {"fixed": 0, "broken": 0, "same": 9, "missing": 0}
    carrier = next(c for c in diff["criteria"] if c["criterion_id"] == CARRIER)
    assert carrier["false_pass_before"] == carrier["false_pass_after"]
    assert carrier["false_pass_before"]["rate"] == pytest.approx(1 / 5)  # rg-r4 of five people's fails
    text = cli(world, "calibrate", "--rerun", "live")
    assert text.returncode == 0 and "no regression: 0 fixed, 0 broken, 9 same, 0 missing" in text.stdout
    only = json.loads(cli(world, "calibrate", "--rerun", "live", "--criterion", REFUND, "--json").stdout)
    assert [c["criterion_id"] for c in only["criteria"]] == [REFUND] and only["counts"]["same"] == 2


def test_a_rerun_after_the_criteria_changed_lists_what_broke_and_exits_1(world: World) -> None:
    criteria = world.folder / "criteria.yaml"
    before = criteria.read_text(encoding="utf-8")
    doc = yaml.safe_load(before)
    carrier = next(c for c in doc["criteria"] if c["id"] == CARRIER)
    carrier["pattern"] = "(?i)refund you in full"  # no longer catches the carrier promise
    doc["criteria"] = [c for c in doc["criteria"] if c["id"] != REFUND]  # and REFUND is gone
    criteria.write_text(yaml.safe_dump(doc), encoding="utf-8")
    try:
        res = cli(world, "calibrate", "--rerun", "live", "--json")
        text = cli(world, "calibrate", "--rerun", "live")
    finally:
        criteria.write_text(before, encoding="utf-8")
    assert res.returncode == 1, res.stderr
    diff = json.loads(res.stdout)
    assert diff["counts"] == {"fixed": 1, "broken": 6, "same": 0, "missing": 2}
    by = {c["criterion_id"]: c for c in diff["criteria"]}
    # The carrier fails now pass; the refund conversations labelled pass now fail; rg-r4 (fail) is caught.
    assert by[CARRIER]["broken"] == ["rg-c1", "rg-c2", "rg-c3", "rg-c4", "rg-r1", "rg-r2"]
    assert by[CARRIER]["fixed"] == ["rg-r4"]
    assert by[CARRIER]["false_pass_before"]["rate"] == pytest.approx(1 / 5)
    assert by[CARRIER]["false_pass_after"]["rate"] == pytest.approx(4 / 5)
    assert by[REFUND]["current_version"] is None and by[REFUND]["missing"] == ["rg-c1", "rg-r1"]
    assert text.returncode == 1
    assert f"{CARRIER} (frozen v1, now v1): 1 fixed, 6 broken, 0 same, 0 missing" in text.stdout
    assert f"{REFUND} (frozen v2, no longer in judges.criteria): 0 fixed, 0 broken, 0 same, 2 missing" in text.stdout
    assert "broken: rg-c1, rg-c2, rg-c3, rg-c4, rg-r1, rg-r2" in text.stdout
    assert "false pass before: too few to tell (1 of 5)   after: too few to tell (4 of 5)" in text.stdout
    assert "REGRESSION: 1 fixed, 6 broken, 0 same, 2 missing" in text.stdout


def test_rerun_of_an_unknown_set_names_the_ones_there(world: World) -> None:
    res = cli(world, "calibrate", "--rerun", "nope")
    assert res.returncode == 2 and "no regression set 'nope'" in res.stderr and "live" in res.stderr
    assert "Exit codes of --rerun" in cli(world, "calibrate", "--help").stdout


@pytest.mark.slow
def test_an_llm_rerun_through_the_anthropic_client_never_shows_the_labels(tmp_path: Path) -> None:
    """Offline: no daemon ever ran here and there is no DuckDB file, only the frozen set."""
    judge = RuleJudge()
    try:
        (tmp_path / "criteria.yaml").write_text(
            "criteria:\n  - id: no-refund-guarantees\n    version: 3\n    kind: llm\n"
            "    prompt: 'Criterion: the bot never guarantees a refund.'\n", encoding="utf-8")
        db = tmp_path / "tracejudge.duckdb"
        cfg = tmp_path / "otel-config.yaml"
        cfg.write_text(yaml.safe_dump({
            "storage": {"duckdb": {"path": str(db)}},
            "judges": {"criteria": [str(tmp_path / "criteria.yaml")], "timeout": "30s",
                       "provider": {"type": "anthropic", "model": "judge-test", "base_url": judge.url,
                                    "api_key": "test-key"}}}), encoding="utf-8")
        frozen = [("llm-1", f"Sure, a {FAIL_WORD} for you.", "fail", "pass"),  # the judge missed it: fixed
                  ("llm-2", "Let me look the order up.", "pass", "pass"),  # same
                  ("llm-3", "I will check with the shop.", "fail", "fail")]  # the new judge passes it: broken
        set_dir = Path(str(db) + ".calibration")
        set_dir.mkdir()
        with (set_dir / "llm.jsonl").open("w", encoding="utf-8") as f:
            for cid, answer, label, was in frozen:
                conv = Conversation(id=cid, source="production", ended_by="idle", messages=[
                    Message(role="user", content="Can I get my money back?"),
                    Message(role="assistant", content=answer)])
                f.write(json.dumps({**json.loads(conv.to_json()), KEY: {
                    "criterion_id": "no-refund-guarantees", "criterion_version": 2, "label": label,
                    "labels": [{"reviewer": "Ana", "label": label, "note": "SECRET-NOTE"}],
                    "judge": {"result": was, "model": "judge-old", "provider": "anthropic"}}}) + "\n")
        res = run_cli("calibrate", "--config", str(cfg), "--rerun", "llm", "--json", env=clean_env())
        assert res.returncode == 1, res.stderr
        entry, = json.loads(res.stdout)["criteria"]
        assert entry["counts"] == {"fixed": 1, "broken": 1, "same": 1, "missing": 0}
        assert entry["fixed"] == ["llm-1"] and entry["broken"] == ["llm-3"]
        assert entry["frozen_versions"] == [2] and entry["current_version"] == 3
        assert len(judge.requests) == 3 and not db.exists()
        sent = json.dumps(judge.requests)
        assert "SECRET-NOTE" not in sent and KEY not in sent and "Ana" not in sent
        # The flags choose another model, as for `tracejudge judge`.
        res = run_cli("calibrate", "--config", str(cfg), "--rerun", "llm", "--model", "judge-new", env=clean_env())
        assert res.returncode == 1 and judge.requests[-1]["model"] == "judge-new"
    finally:
        judge.close()


# --------------------------------------------------------------- the NOT CALIBRATED mark


def test_stats_marks_each_criterion_calibrated_or_not(world: World, tmp_path: Path) -> None:
    res = cli(world, "stats", "--json")
    assert res.returncode == 0, res.stderr
    entries = json.loads(res.stdout)["criteria"]
    marks = {e["criterion_id"]: (e["calibrated"], e["calibration_reason"]) for e in entries}
    assert marks == {e["criterion_id"]: (e["calibrated"], e["calibration_reason"])
                     for e in world.api_stats["criteria"]}  # the daemon's too
    # Five people's fails and a single one: too few to tell a false-pass rate; LOOKUP has no labels.
    assert marks[CARRIER] == marks[REFUND] == (False, "too_few_labels") and marks[LOOKUP] == (None, None)
    text = cli(world, "stats").stdout
    rows = {line.split()[0]: line for line in text.splitlines() if line.startswith(("no-", "looks-"))}
    assert rows[CARRIER].endswith("too few to tell (4 of 8)  n_eff 8.0  NOT CALIBRATED (too few labels)")
    assert rows[REFUND].endswith("NOT CALIBRATED (too few labels)")
    assert "NOT CALIBRATED" not in rows[LOOKUP]
    assert "NOT CALIBRATED = the blind labels do not show the judge right enough" in text
    # However loose review.max_false_pass is, five fails do not make a judge calibrated (1 of 5 passed: at
    # most ~62%, under 70%).
    loose = tmp_path / "loose.yaml"
    doc = yaml.safe_load(Path(world.cfg).read_text(encoding="utf-8"))
    doc["review"]["max_false_pass"] = 0.7
    loose.write_text(yaml.safe_dump(doc), encoding="utf-8")
    entries = json.loads(run_cli("stats", "--config", str(loose), "--json").stdout)["criteria"]
    marks = {e["criterion_id"]: (e["calibrated"], e["calibration_reason"]) for e in entries}
    assert marks[CARRIER] == (False, "too_few_labels")


def test_merged_stats_mark_on_the_labels_of_every_store(world: World, tmp_path: Path) -> None:
    copy = tmp_path / "other.duckdb"
    shutil.copy(world.daemon.duckdb, copy)
    res = cli(world, "stats", "--db", str(world.daemon.duckdb), "--db", str(copy), "--json")
    assert res.returncode == 0, res.stderr
    marks = {e["criterion_id"]: e["calibrated"] for e in json.loads(res.stdout)["criteria"]}
    assert marks[CARRIER] is False and marks[LOOKUP] is None


def _part(pairs: list[list[Any]] | None) -> dict[str, Any]:
    part: dict[str, Any] = {"verdicts": [[CARRIER, 1, "fail", True, False, None, 1.0, None, 1]], "not_run": [],
                            "criteria": [], "judged": 1, "conversations": {"ended": 1},
                            "tokens": {"input_tokens": 0, "output_tokens": 0}}
    if pairs is not None:
        part["calibration"] = pairs
    return part


def test_merged_calibration_is_of_the_union_of_the_labels() -> None:
    # Store a: 1 false pass in 6 fails; store b: 1 in 6; together 2 in 12, at most 45%: enough to tell.
    a = [[CARRIER, f"a{n}", "Ana", "fail", "pass" if n == 0 else "fail"] for n in range(6)]
    b = [[CARRIER, f"b{n}", "Ben", "fail", "pass" if n == 0 else "fail"] for n in range(6)]
    limit = 0.6
    alone = [calibrate([Pair(*p) for p in x], limit).criteria[0].calibrated for x in (a, b)]
    union = calibrate([Pair(*p) for p in a + b], limit).criteria[0].calibrated
    assert alone == [False, False] and union is True
    assert stats_of([_part(a), _part(b)], limit)["criteria"][0]["calibrated"] is True
    assert stats_of([_part(a)], limit)["criteria"][0]["calibrated"] is False
    # A store that sent no labels (an older daemon): no mark rather than one on part of the labels.
    assert stats_of([_part(a), _part(None)], limit)["criteria"][0]["calibrated"] is None


@pytest.mark.slow
def test_judge_marks_the_criteria_of_a_calibration_file(world: World, tmp_path: Path) -> None:
    report = cli(world, "calibrate", "--json")
    assert report.returncode == 0, report.stderr
    cal = tmp_path / "calibration.json"
    cal.write_text(report.stdout, encoding="utf-8")
    (tmp_path / "criteria.yaml").write_text(CRITERIA, encoding="utf-8")
    convs = str(world.set_path("live"))  # a frozen set is conversation/v1 lines too
    args = ("judge", "--criteria", str(tmp_path / "criteria.yaml"), "--no-cache", "--calibration", str(cal), convs)
    res = run_cli(*args, "--json")
    assert res.returncode == 0, res.stderr
    marks = {c["criterion_id"]: c["calibrated"] for c in json.loads(res.stdout)["summary"]["criteria"]}
    assert marks[CARRIER] is False and marks[REFUND] is False and marks[LOOKUP] is None
    text = run_cli(*args).stdout
    rows = {line.split()[0]: line for line in text.splitlines() if line.startswith(("no-", "looks-"))}
    assert rows[CARRIER].endswith("NOT CALIBRATED (too few labels)") and "NOT CALIBRATED" not in rows[LOOKUP]
    plain = json.loads(run_cli(*args[:4], convs, "--json").stdout)  # without --calibration: no mark
    assert all("calibrated" not in c for c in plain["summary"]["criteria"])
    (tmp_path / "bad.json").write_text("{\"criteria\": 3}", encoding="utf-8")
    bad = run_cli("judge", "--criteria", str(tmp_path / "criteria.yaml"), "--calibration", str(tmp_path / "bad.json"),
                  convs)
    assert bad.returncode == 2 and "not the JSON of `tracejudge calibrate --json`" in bad.stderr
