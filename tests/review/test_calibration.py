"""Blind calibration through a real daemon: judged conversations become labelling tasks that never show the
verdict, people label them on the API or in a spreadsheet, and `tracejudge calibrate` measures the judge."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from collector.review.calibration import chosen

from ..support.api_http import post_json
from ..support.daemon import DaemonProcess, run_cli, wait_until
from ..support.review import (
    CARRIER,
    CARRIER_ANSWER,
    LOOKUP,
    REFUND,
    carrier_conversation,
    refund_conversation,
    send_conversations,
    start_daemon,
)

CONVERSATIONS = [*(carrier_conversation(f"cal-c{n}") for n in range(1, 5)),
                 *(refund_conversation(f"cal-r{n}") for n in range(1, 5))]
"""The carrier conversations fail CARRIER and pass REFUND; the refund ones the other way round."""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = start_daemon(tmp_path_factory.mktemp("calibration"), review={"calibration_rate": 1.0})
    try:
        send_conversations(d.grpc, CONVERSATIONS)
        wait_until(lambda: len(blind(d, CARRIER)) == len(CONVERSATIONS), "a blind item per conversation")
        yield d
    finally:
        d.end()


def blind(d: DaemonProcess, criterion: str, state: str = "all") -> list[dict[str, Any]]:
    return list(d.get(f"/api/calibration/items?criterion={criterion}&state={state}&limit=1000")[1]["items"])


def test_the_choice_is_deterministic_per_criterion_and_apart_from_the_rate() -> None:
    ids = [f"conv-{n}" for n in range(2000)]
    picked = [c for c in ids if chosen(c, CARRIER, 0.1, 7)]
    assert picked == [c for c in ids if chosen(c, CARRIER, 0.1, 7)]
    assert 140 <= len(picked) <= 260  # about a tenth
    assert picked != [c for c in ids if chosen(c, REFUND, 0.1, 7)]  # another criterion, another draw
    assert picked != [c for c in ids if chosen(c, CARRIER, 0.1, 8)]  # another seed, another draw
    assert not [c for c in ids if chosen(c, CARRIER, 0.0, 7)]


def test_passes_and_not_applicable_become_tasks_too(daemon: DaemonProcess) -> None:
    # CARRIER: 4 fails and 4 passes; LOOKUP does not apply to the refund conversations (no order mentioned).
    assert {i["conversation_id"] for i in blind(daemon, CARRIER)} == {p.conversation_id for p in CONVERSATIONS}
    lookup = {i["conversation_id"] for i in blind(daemon, LOOKUP)}
    assert {f"cal-r{n}" for n in range(1, 5)} <= lookup


def test_a_blind_item_never_shows_the_verdict(daemon: DaemonProcess) -> None:
    item = blind(daemon, CARRIER)[0]
    status, detail = daemon.get(f"/api/calibration/items/{item['id']}?reviewer=Dr.%20Amal")
    assert status == 200
    assert set(detail) == {"item", "criterion", "conversation", "your_label"}
    assert set(detail["item"]) == {"id", "conversation_id", "criterion_id", "created_at", "labels"}
    text = json.dumps(detail)
    for word in ('"result"', '"reasoning"', '"evidence"', '"verdict"', '"judge"', '"flagged"'):
        assert word not in text
    listing = json.dumps(daemon.get("/api/calibration/items?state=all&limit=1000")[1])
    assert '"result"' not in listing and '"reasoning"' not in listing
    assert detail["criterion"]["text"] and detail["conversation"]["id"] == item["conversation_id"]


def test_labels_on_the_api_replace_a_person_s_own_and_stay_hidden_from_others(daemon: DaemonProcess) -> None:
    item = next(i for i in blind(daemon, REFUND) if i["conversation_id"] == "cal-r1")
    path = f"/api/calibration/items/{item['id']}/label"
    assert post_json(daemon.api, path, {"label": "pass", "reviewer": "Ana"}).status == 200
    reply = post_json(daemon.api, path, {"label": "fail", "reviewer": "Ana", "note": "promises a full refund"})
    assert reply.status == 200 and json.loads(reply.body)["labels"] == 1  # replaced, not added
    mine = daemon.get(f"/api/calibration/items/{item['id']}?reviewer=Ana")[1]["your_label"]
    assert mine["label"] == "fail" and mine["note"] == "promises a full refund"
    assert daemon.get(f"/api/calibration/items/{item['id']}?reviewer=Ben")[1]["your_label"] is None
    assert item["id"] not in {i["id"] for i in blind(daemon, REFUND, "unlabelled")}
    bad = post_json(daemon.api, path, {"label": "maybe", "reviewer": "Ana"})
    assert bad.status == 400 and "label must be one of pass, fail, not_applicable" in bad.body
    assert post_json(daemon.api, path, {"label": "pass", "reviewer": " "}).status == 400
    assert post_json(daemon.api, "/api/calibration/items/99999/label",
                     {"label": "pass", "reviewer": "Ana"}).status == 404


def read_csv(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(path.read_text(encoding="utf-8-sig"), newline="")))


def write_csv(path: Path, rows: list[dict[str, str]]) -> None:
    with path.open("w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


@pytest.mark.slow
def test_a_spreadsheet_round_trip_then_calibrate(daemon: DaemonProcess, tmp_path: Path) -> None:
    cfg = str(daemon.config_path)
    out = tmp_path / "labels.csv"
    res = run_cli("labels", "export", "--config", cfg, "--criterion", CARRIER, "--out", str(out))
    assert res.returncode == 0, res.stderr
    rows = read_csv(out)
    assert list(rows[0]) == ["item_id", "conversation_id", "criterion_id", "criterion", "transcript", "label",
                             "reviewer", "note"]
    assert len(rows) == len(CONVERSATIONS) and all(r["label"] == "" for r in rows)
    carrier = next(r for r in rows if r["conversation_id"] == "cal-c1")
    assert CARRIER_ANSWER in carrier["transcript"] and "USER: Where is my order B-1?" in carrier["transcript"]
    text = out.read_text(encoding="utf-8-sig")
    verdicts = daemon.get("/api/verdicts?conversation=cal-c1&limit=100")[1]["verdicts"]
    reasons = [v["reasoning"] for v in verdicts if v["criterion_id"] == CARRIER and v["reasoning"]]
    assert reasons and not any(r in text for r in reasons)  # nothing of the verdict

    # An expert labels: the carrier conversations fail; one pass is mislabelled "fial"; one row is left empty.
    for r in rows:
        r["label"] = "fail" if r["conversation_id"].startswith("cal-c") else "pass"
        r["reviewer"] = "Dr. Amal"
    rows[1]["label"] = "fial"
    item_id, rows[2]["item_id"] = rows[2]["item_id"], "nope"
    rows[3]["label"] = ""
    write_csv(out, rows)
    res = run_cli("labels", "import", "--config", cfg, str(out))
    assert res.returncode == 2
    assert f"{out}:3: label 'fial' is not one of pass, fail, not_applicable (or empty)" in res.stderr
    assert f"{out}:4: item_id 'nope' is not a number" in res.stderr
    assert "2 problem(s)" in res.stderr and "nothing was stored" in res.stderr
    assert len(blind(daemon, CARRIER, "labelled")) == 0  # all or nothing

    rows[1]["label"] = "fail" if rows[1]["conversation_id"].startswith("cal-c") else "pass"
    rows[2]["item_id"] = item_id
    write_csv(out, rows)
    res = run_cli("labels", "import", "--config", cfg, str(out))
    assert res.returncode == 0, res.stderr
    assert "7 label(s) added, 0 changed, 0 unchanged, 1 row(s) without a label left out" in res.stdout
    again = run_cli("labels", "import", "--config", cfg, str(out))
    assert "0 label(s) added, 0 changed, 7 unchanged" in again.stdout  # importing again changes nothing

    res = run_cli("calibrate", "--config", cfg, "--criterion", CARRIER, "--json")
    assert res.returncode == 0, res.stderr
    entry, = json.loads(res.stdout)["criteria"]
    assert entry["criterion_id"] == CARRIER and entry["n"] == 7
    labelled = {r["conversation_id"] for r in rows if r["label"]}
    fails = sum(1 for c in labelled if c.startswith("cal-c"))
    assert entry["confusion"]["fail"]["fail"] == fails and entry["confusion"]["pass"]["pass"] == 7 - fails
    assert entry["agreement"] == 1.0 and entry["kappa"] == 1.0
    assert entry["false_pass"]["rate"] == 0.0 and entry["false_pass"]["n"] == fails
    assert entry["false_pass"]["too_few"] is True and entry["false_pass"]["count"] == 0
    assert entry["calibrated"] is False and entry["reason"] == "too_few_labels"  # 3 or 4 fails tell nothing
    text = run_cli("calibrate", "--config", cfg, "--criterion", CARRIER).stdout
    assert f"{CARRIER}: NOT CALIBRATED: too few labels: people failed {fails} of the 7 items compared" in text
    assert "agreement 100%, kappa 1.00" in text
    assert f"false pass: too few to tell (0 of {fails})   false fail: too few to tell (0 of {7 - fails})" in text
    assert "at most" not in text  # no rule-of-three bound over a handful
    page = daemon.get("/calibration")[1]
    assert f"Not calibrated: too few labels: people failed {fails} of the 7 items compared" in page
    assert f"<strong>too few to tell (0 of {fails})</strong>" in page


def test_the_csv_has_no_byte_order_mark_unless_asked(daemon: DaemonProcess, tmp_path: Path) -> None:
    cfg, plain, excel = str(daemon.config_path), tmp_path / "plain.csv", tmp_path / "excel.csv"
    for out, extra in ((plain, ()), (excel, ("--bom",))):
        res = run_cli("labels", "export", "--config", cfg, "--criterion", LOOKUP, "--out", str(out), *extra)
        assert res.returncode == 0, res.stderr
    with plain.open(encoding="utf-8", newline="") as f:  # as Python's csv reads a file by default
        assert csv.DictReader(f).fieldnames == ["item_id", "conversation_id", "criterion_id", "criterion",
                                                "transcript", "label", "reviewer", "note"]
    assert excel.read_bytes() == b"\xef\xbb\xbf" + plain.read_bytes()  # what Excel needs to read UTF-8
    rows = read_csv(excel)
    for r in rows:
        r["label"], r["reviewer"] = "not_applicable", "Eli"
    with excel.open("w", encoding="utf-8-sig", newline="") as f:  # as Excel saves "CSV UTF-8"
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    res = run_cli("labels", "import", "--config", cfg, str(excel))
    assert res.returncode == 0 and f"{len(rows)} label(s) added" in res.stdout, res.stderr


@pytest.mark.slow
def test_a_second_rater_exports_what_others_labelled_and_never_their_labels(daemon: DaemonProcess,
                                                                            tmp_path: Path) -> None:
    cfg, out = str(daemon.config_path), tmp_path / "second.csv"
    first = next(i for i in blind(daemon, REFUND) if i["conversation_id"] == "cal-r2")
    reply = post_json(daemon.api, f"/api/calibration/items/{first['id']}/label",
                      {"label": "fail", "reviewer": "Cy", "note": "CY-SECRET-NOTE"})
    assert reply.status == 200, reply.body

    def export(*args: str) -> list[dict[str, str]]:
        res = run_cli("labels", "export", "--config", cfg, "--criterion", REFUND, "--out", str(out), *args)
        assert res.returncode == 0, res.stderr
        return read_csv(out)

    nobody = {r["conversation_id"] for r in export()}
    assert "cal-r2" not in nobody  # labelled by someone: left out of the first rater's sheet
    second = export("--for", "Dana")
    assert {r["conversation_id"] for r in second} == {p.conversation_id for p in CONVERSATIONS}
    assert all(r["label"] == "" and r["note"] == "" and r["reviewer"] == "Dana" for r in second)
    text = out.read_text(encoding="utf-8")
    assert "CY-SECRET-NOTE" not in text and "Cy" not in text  # blind: nothing of another's label
    assert "cal-r2" not in {r["conversation_id"] for r in export("--for", "cy")}  # Cy's own, however written
    # Dana labels cal-r2 too: now two people labelled it.
    second = [r for r in export("--for", "Dana") if r["conversation_id"] == "cal-r2"]
    second[0]["label"] = "fail"
    write_csv(out, second)
    res = run_cli("labels", "import", "--config", cfg, str(out))
    assert res.returncode == 0 and "1 label(s) added" in res.stdout, res.stderr
    assert next(i for i in blind(daemon, REFUND) if i["conversation_id"] == "cal-r2")["labels"] == 2
    assert "cal-r2" not in {r["conversation_id"] for r in export("--for", "Dana")}


def test_an_export_of_a_criterion_nobody_judged_says_so(daemon: DaemonProcess, tmp_path: Path) -> None:
    res = run_cli("labels", "export", "--config", str(daemon.config_path), "--criterion", "no-such-thing",
                  "--out", str(tmp_path / "x.csv"))
    assert res.returncode == 2 and "no conversation was judged on criterion 'no-such-thing'" in res.stderr


def test_cells_that_look_like_formulas_stay_text(tmp_path: Path) -> None:
    from collector.cli.labels import _cell, _uncell

    assert _cell("=HYPERLINK(\"http://evil\")") == "'=HYPERLINK(\"http://evil\")"
    assert _uncell(_cell("-1 refund")) == "-1 refund" and _cell("plain") == "plain"


@pytest.mark.slow
def test_without_a_daemon_the_file_is_labelled_and_measured(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, review={"calibration_rate": 0.0})  # no items as it judges: --sample makes them
    try:
        send_conversations(d.grpc, CONVERSATIONS[:2])
        wait_until(lambda: len(d.get(f"/api/verdicts?criterion={CARRIER}")[1]["verdicts"]) == 2, "the verdicts")
        assert not blind(d, CARRIER)
        assert d.stop() == 0
        cfg, out = str(d.config_path), tmp_path / "labels.csv"
        res = run_cli("labels", "export", "--config", cfg, "--criterion", CARRIER, "--sample", "2", "--out", str(out))
        assert res.returncode == 0, res.stderr
        rows = read_csv(out)
        assert sorted(r["conversation_id"] for r in rows) == ["cal-c1", "cal-c2"]
        for r in rows:
            r["label"] = "pass"  # an expert who lets the carrier promise through
        write_csv(out, rows)
        res = run_cli("labels", "import", "--config", cfg, "--reviewer", "Ben", str(out))
        assert res.returncode == 0 and "2 label(s) added" in res.stdout, res.stderr
        entry, = json.loads(run_cli("calibrate", "--config", cfg, "--json").stdout)["criteria"]
        assert entry["confusion"]["pass"]["fail"] == 2 and entry["false_fail"]["rate"] == 1.0
        assert entry["false_pass"]["n"] == 0 and entry["calibrated"] is False
        assert entry["reason"] == "too_few_labels"  # two labels: too few to say people found no failure
    finally:
        d.end()
