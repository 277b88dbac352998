"""Reviewer identity over the wire: with ``review.reviewers`` every claim, decision and label records the
reviewer of the token it is made with, never a typed name; without it, names that normalise alike are one
reviewer; and the daemon says at start-up which of the two holds.

Two daemons per module, both on loopback without an API token (the setup where, before, any typed name went
through): one with three reviewer tokens, one with typed names. Both need three reviewers per item and make
every judged conversation a blind labelling task. Each test works on conversations of its own.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from collector.names import clean_name, reviewer_key

from ..support.api_http import Reply, assert_error, call, origin, post_form, post_json
from ..support.daemon import DaemonProcess, base_config, clean_env, run_cli, wait_until
from ..support.review import CARRIER, carrier_conversation, send_conversations, start_daemon, wait_items

TOKENS = {"alice": "alice-token-3f9a1c", "carol": "carol-token-8b27d4", "dave": "dave-token-c05e66"}
NAMED = [f"id-named-{n}" for n in range(1, 7)]
TYPED = [f"id-typed-{n}" for n in range(1, 4)]


def bearer(who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[who]}"}


def start(folder: Path, conversations: list[str], **review: Any) -> tuple[DaemonProcess, dict[str, int]]:
    """A daemon needing three reviewers per item, every judged conversation a blind task; the review item of
    each conversation's carrier failure, by conversation."""
    daemon = start_daemon(folder, review={"reviewers_per_item": 3, "calibration_rate": 1.0, **review})
    try:
        send_conversations(daemon.grpc, [carrier_conversation(c) for c in conversations])
        items = wait_items(daemon, {(c, CARRIER) for c in conversations})
        wait_until(lambda: len(tasks(daemon, conversations)) == len(conversations), "a blind task per conversation")
    except BaseException:
        daemon.end()
        raise
    return daemon, {i["conversation_id"]: i["id"] for i in items}


def tasks(daemon: DaemonProcess, conversations: list[str]) -> dict[str, int]:
    """The blind carrier task of each conversation, by conversation."""
    found = daemon.get(f"/api/calibration/items?criterion={CARRIER}&state=all&limit=1000")[1]["items"]
    return {t["conversation_id"]: t["id"] for t in found if t["conversation_id"] in conversations}


@pytest.fixture(scope="module")
def named(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, dict[str, int]]]:
    daemon, items = start(tmp_path_factory.mktemp("identity-named"), NAMED,
                          reviewers=[{"name": name, "token": token} for name, token in TOKENS.items()])
    yield daemon, items
    daemon.end()


@pytest.fixture(scope="module")
def typed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, dict[str, int]]]:
    daemon, items = start(tmp_path_factory.mktemp("identity-typed"), TYPED)
    yield daemon, items
    daemon.end()


def decide(daemon: DaemonProcess, item_id: int, body: dict[str, Any], who: str | None = None) -> Reply:
    return post_json(daemon.api, f"/api/review/{item_id}/decision", body, bearer(who) if who else None)


# --------------------------------------------------------------- reviewer tokens


def test_a_reviewer_s_token_cannot_decide_as_another_reviewer(named: tuple[DaemonProcess, dict[str, int]]) -> None:
    daemon, items = named
    item_id = items["id-named-1"]
    assert_error(decide(daemon, item_id, {"decision": "confirm", "reviewer": "carol"}), 403,
                 "reviewer_token_required", "review.reviewers")
    assert_error(decide(daemon, item_id, {"decision": "confirm", "reviewer": "carol"}, "alice"), 403,
                 "wrong_reviewer", "alice", "carol")
    assert call(daemon.api, "GET", f"/api/review/{item_id}").json()["decisions"] == 0
    mine = decide(daemon, item_id, {"decision": "confirm"}, "alice")
    assert mine.status == 200 and mine.json()["state"] == "pending", mine.body
    own = call(daemon.api, "GET", f"/api/review/{item_id}", headers=bearer("alice")).json()["history"]
    assert [(h["reviewer"], h["state"]) for h in own] == [("alice", "confirmed")]
    # The token's own name, however it is written, is the token's reviewer.
    assert_error(decide(daemon, item_id, {"decision": "reject", "reviewer": "ALICE\u200b"}, "alice"), 409,
                 "already_decided", "you (alice) decided")


def test_one_token_cannot_settle_an_item_that_needs_three_reviewers(
        named: tuple[DaemonProcess, dict[str, int]]) -> None:
    daemon, items = named
    item_id = items["id-named-2"]
    assert decide(daemon, item_id, {"decision": "confirm", "reviewer": "alice"}, "alice").status == 200
    for other in ("carol", "dave", "Dave", "mallory"):
        assert_error(decide(daemon, item_id, {"decision": "confirm", "reviewer": other}, "alice"), 403,
                     "wrong_reviewer", "alice")
    assert_error(decide(daemon, item_id, {"decision": "confirm"}, "alice"), 409, "already_decided", "2 more")
    detail = call(daemon.api, "GET", f"/api/review/{item_id}").json()
    assert (detail["item"]["state"], detail["decisions"]) == ("pending", 1)
    assert decide(daemon, item_id, {"decision": "confirm"}, "carol").json()["state"] == "pending"
    done = decide(daemon, item_id, {"decision": "reject", "reviewer": "dave"}, "dave").json()
    assert (done["state"], done["reviewer"]) == ("confirmed", "alice, carol, dave")


def test_claims_and_assignments_take_the_claimant_from_the_token(
        named: tuple[DaemonProcess, dict[str, int]]) -> None:
    daemon, items = named
    item_id = items["id-named-3"]
    path = f"/api/review/{item_id}/claim"
    assert_error(post_json(daemon.api, path, {"reviewer": "alice"}), 403, "reviewer_token_required")
    assert_error(post_json(daemon.api, path, {"reviewer": "carol"}, bearer("alice")), 403, "wrong_reviewer")
    claimed = post_json(daemon.api, path, {}, bearer("alice"))
    assert claimed.status == 200 and claimed.json()["claimed_by"] == "alice", claimed.body
    # An assignment names the assignee, one of review.reviewers; who assigns is the token's reviewer.
    assert_error(post_json(daemon.api, path, {"reviewer": "dave", "assigned_by": "carol"}, bearer("alice")), 403,
                 "wrong_reviewer", "alice")
    assert_error(post_json(daemon.api, path, {"reviewer": "mallory", "assigned_by": "alice"}, bearer("alice")), 400,
                 "bad_request", "mallory", "review.reviewers")
    assigned = post_json(daemon.api, path, {"reviewer": "Carol\u200d", "assigned_by": "alice"}, bearer("alice"))
    assert assigned.status == 200 and assigned.json()["claimed_by"] == "carol", assigned.body
    assert_error(decide(daemon, item_id, {"decision": "confirm"}, "alice"), 409, "already_decided",
                 "claimed by carol")
    assert [i["id"] for i in call(daemon.api, "GET", "/api/review?assignee=CAROL").json()["items"]] == [item_id]


def test_blind_labels_and_label_imports_take_the_labeller_from_the_token(
        named: tuple[DaemonProcess, dict[str, int]]) -> None:
    daemon, _ = named
    blind = tasks(daemon, NAMED)
    one, two, three = blind["id-named-4"], blind["id-named-5"], blind["id-named-6"]
    path = f"/api/calibration/items/{one}/label"
    assert_error(post_json(daemon.api, path, {"label": "fail", "reviewer": "alice"}), 403,
                 "reviewer_token_required")
    assert_error(post_json(daemon.api, path, {"label": "fail", "reviewer": "carol"}, bearer("alice")), 403,
                 "wrong_reviewer")
    assert post_json(daemon.api, path, {"label": "fail"}, bearer("alice")).status == 200

    def own_label(item_id: int, who: str) -> Any:
        reply = call(daemon.api, "GET", f"/api/calibration/items/{item_id}", headers=bearer(who))
        assert reply.status == 200, reply.body
        return (reply.json()["your_label"] or {}).get("label")

    assert (own_label(one, "alice"), own_label(one, "carol")) == ("fail", None)
    assert_error(call(daemon.api, "GET", f"/api/calibration/items/{one}?reviewer=carol", headers=bearer("alice")),
                 403, "wrong_reviewer")

    rows = [{"item_id": two, "label": "pass", "reviewer": "carol"}, {"item_id": three, "label": "pass"}]
    assert_error(post_json(daemon.api, "/api/calibration/labels", {"rows": rows}), 403, "reviewer_token_required")
    refused = post_json(daemon.api, "/api/calibration/labels", {"rows": rows}, bearer("alice"))
    assert refused.status == 400 and refused.json()["error"]["problems"] == [
        {"row": 0, "message": "this is alice's token: it acts for alice only, not for 'carol' (leave the reviewer "
                              "out, or name the token's own)"}]
    assert own_label(three, "alice") is None  # all or nothing
    rows[0]["reviewer"] = " Alice "
    stored = post_json(daemon.api, "/api/calibration/labels", {"rows": rows}, bearer("alice"))
    assert stored.status == 200 and stored.json()["added"] == 2, stored.body
    assert (own_label(two, "alice"), own_label(three, "alice"), own_label(two, "carol")) == ("pass", "pass", None)


def test_the_page_records_the_token_s_reviewer_and_refuses_another_name(
        named: tuple[DaemonProcess, dict[str, int]]) -> None:
    daemon, items = named
    item_id, task = items["id-named-5"], tasks(daemon, NAMED)["id-named-1"]
    signed = call(daemon.api, "GET", f"/review?token={TOKENS['dave']}")
    assert signed.status == 303
    cookie = next(h.split(";", 1)[0] for h in signed.headers_named("Set-Cookie") if h.startswith("tracejudge_token="))
    same = {"Origin": origin(daemon.api), "Cookie": cookie}
    page = call(daemon.api, "GET", f"/review/{item_id}", headers={"Cookie": cookie}).body
    assert 'name="reviewer" readonly dir="auto" value="dave"' in page
    forged = post_form(daemon.api, f"/review/{item_id}/decision", {"decision": "reject", "reviewer": "carol"}, same)
    assert forged.status == 403 and "Not saved" in forged.body and "dave" in forged.body
    assert call(daemon.api, "GET", f"/api/review/{item_id}").json()["decisions"] == 0
    saved = post_form(daemon.api, f"/review/{item_id}/decision", {"decision": "reject", "reviewer": "dave"}, same)
    assert saved.status == 303, saved.body
    assert call(daemon.api, "GET", f"/api/review/{item_id}").json()["decisions"] == 1

    label = f"/review/label/{task}"
    assert 'readonly dir="auto" value="dave"' in call(daemon.api, "GET", label, headers={"Cookie": cookie}).body
    assert post_form(daemon.api, label, {"label": "pass", "reviewer": "alice"}, same).status == 403
    assert post_form(daemon.api, label, {"label": "pass", "reviewer": "dave"}, same).status == 303
    mine = call(daemon.api, "GET", f"/api/calibration/items/{task}", headers=bearer("dave")).json()["your_label"]
    assert mine["label"] == "pass"


@pytest.mark.slow
def test_the_cli_decides_with_a_reviewer_token(named: tuple[DaemonProcess, dict[str, int]]) -> None:
    daemon, items = named
    item_id, cfg = str(items["id-named-6"]), str(daemon.config_path)
    without = run_cli("review", "confirm", item_id, "--config", cfg, "--reviewer", "alice")
    assert without.returncode == 2 and "--token or $TRACEJUDGE_REVIEWER_TOKEN" in without.stderr, without.stderr
    forged = run_cli("review", "confirm", item_id, "--config", cfg, "--token", TOKENS["alice"], "--reviewer", "carol")
    assert forged.returncode == 2 and "alice's token" in forged.stderr, forged.stderr
    res = run_cli("review", "confirm", item_id, "--config", cfg, "--token", TOKENS["alice"], "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["state"] == "pending", res.stderr
    res = run_cli("review", "reject", item_id, "--config", cfg, "--json",
                  env=clean_env(TRACEJUDGE_REVIEWER_TOKEN=TOKENS["carol"]))
    assert res.returncode == 0, res.stderr
    own = call(daemon.api, "GET", f"/api/review/{item_id}", headers=bearer("carol")).json()["history"]
    assert [(h["reviewer"], h["state"]) for h in own] == [("carol", "rejected")]


@pytest.mark.slow
def test_without_a_daemon_the_cli_records_the_token_s_reviewer_on_the_file(tmp_path: Path) -> None:
    reviewers = [{"name": name, "token": token} for name, token in TOKENS.items()]
    daemon = start_daemon(tmp_path, review={"reviewers": reviewers})
    try:
        send_conversations(daemon.grpc, [carrier_conversation("id-file")])
        (item,) = wait_items(daemon, {("id-file", CARRIER)})
        assert daemon.stop() == 0
        cfg, item_id = str(daemon.config_path), str(item["id"])
        res = run_cli("review", "confirm", item_id, "--config", cfg, "--reviewer", "dave")
        assert res.returncode == 2 and "--token" in res.stderr, res.stderr
        res = run_cli("review", "confirm", item_id, "--config", cfg, "--token", "not-a-reviewer-token")
        assert res.returncode == 2 and "not the token of any reviewer" in res.stderr, res.stderr
        res = run_cli("review", "confirm", item_id, "--config", cfg, "--token", TOKENS["dave"], "--reviewer", "alice")
        assert res.returncode == 2 and "dave's token" in res.stderr, res.stderr
        res = run_cli("review", "confirm", item_id, "--config", cfg, "--token", TOKENS["dave"], "--reviewer", "Dave")
        assert res.returncode == 0, res.stderr
        assert daemon.query("SELECT state, reviewer FROM review_items WHERE id = ?", [item["id"]]) == [
            ("confirmed", "dave")]
    finally:
        daemon.end()


# --------------------------------------------------------------- typed names


def test_typed_names_that_normalise_alike_are_one_reviewer(typed: tuple[DaemonProcess, dict[str, int]]) -> None:
    daemon, items = typed
    item_id = items["id-typed-1"]
    first = decide(daemon, item_id, {"decision": "confirm", "reviewer": "eve"})
    assert first.status == 200 and first.json()["state"] == "pending", first.body
    for same in ("Eve", "eve\u200b", "\ufeffE\u00adVE ", "\uff45\uff56\uff45", "e\u200cv\u200de"):
        assert_error(decide(daemon, item_id, {"decision": "reject", "reviewer": same}), 409, "already_decided",
                     "you (eve) decided")
    assert decide(daemon, item_id, {"decision": "reject", "reviewer": "Bob"}).json()["state"] == "pending"
    own = call(daemon.api, "GET", f"/api/review/{item_id}?reviewer=EVE").json()
    assert [(h["reviewer"], h["state"]) for h in own["history"]] == [("eve", "confirmed")]  # blind: only one's own
    assert own["decisions"] == 2
    progress = call(daemon.api, "GET", "/api/review/progress").json()["by_reviewer"]
    assert len([name for name in progress if reviewer_key(name) == "eve"]) == 1  # however often eve decided


def test_typed_names_that_normalise_alike_hold_one_claim_and_one_label(
        typed: tuple[DaemonProcess, dict[str, int]]) -> None:
    daemon, items = typed
    item_id, task = items["id-typed-2"], tasks(daemon, TYPED)["id-typed-3"]
    path = f"/api/review/{item_id}/claim"
    assert post_json(daemon.api, path, {"reviewer": "eve"}).json()["claimed_by"] == "eve"
    assert post_json(daemon.api, path, {"reviewer": "Eve\u200b"}).status == 200  # the holder, claiming again
    assert_error(post_json(daemon.api, path, {"reviewer": "bob"}), 409, "already_decided", "claimed by Eve")
    assert [i["id"] for i in call(daemon.api, "GET", "/api/review?assignee=%EF%BB%BFeve").json()["items"]] == [item_id]
    assert decide(daemon, item_id, {"decision": "confirm", "reviewer": " EVE"}).status == 200

    label = f"/api/calibration/items/{task}/label"
    assert post_json(daemon.api, label, {"label": "pass", "reviewer": "eve"}).status == 200
    again = post_json(daemon.api, label, {"label": "fail", "reviewer": "Eve\u200b"})
    assert again.status == 200 and again.json()["labels"] == 1, again.body  # replaced, not a second person's
    mine = call(daemon.api, "GET", f"/api/calibration/items/{task}?reviewer=EVE").json()["your_label"]
    assert mine["label"] == "fail"


@pytest.mark.parametrize("written", [
    "Eve", " eve ", "EVE", "\uff25\uff56\uff45",  # fullwidth (NFKC)
    *(f"e{c}ve" for c in "\u200b\u200c\u200d\u2060\ufeff\u00ad\u180e\u034f\u3164\ufe0f\x1b"),
], ids=lambda w: w.encode("unicode_escape").decode())
def test_a_name_is_one_reviewer_however_it_is_written(written: str) -> None:
    assert reviewer_key(written) == "eve"
    assert clean_name(written) in ("Eve", "eve", "EVE")


def test_names_keep_their_letters_and_one_space_between_words() -> None:
    assert clean_name("  Dr.\u00a0Ana\t\u200b Ruiz\n") == "Dr. Ana Ruiz"
    assert reviewer_key("Dr. Ana  Ruiz") == reviewer_key("dr. ana ruiz") != reviewer_key("dr. ana ruíz")
    assert reviewer_key("Straße") == reviewer_key("STRASSE")  # case folding, not lower()
    assert reviewer_key("\u200b \u00ad") == ""  # nothing visible: no name


# --------------------------------------------------------------- what the daemon says at start-up


@pytest.mark.slow
def test_the_daemon_says_whose_names_decisions_carry(named: tuple[DaemonProcess, dict[str, int]],
                                                     typed: tuple[DaemonProcess, dict[str, int]],
                                                     tmp_path: Path) -> None:
    assert "review: 3 reviewers, each with a token of their own" in named[0].output()
    warned = [line for line in typed[0].output().splitlines() if "review.reviewers is not set" in line]
    assert len(warned) == 1 and " WARNING " in warned[0], typed[0].output()
    assert "one person can settle an item alone by typing review.reviewers_per_item (3) names" in warned[0]

    (tmp_path / "shared").mkdir()
    (tmp_path / "local").mkdir()
    shared = DaemonProcess(tmp_path / "shared", base_config(tmp_path / "shared",
                                                            api={"auth": {"bearer_token": "api-token-5d1e"}}))
    local = DaemonProcess(tmp_path / "local", base_config(tmp_path / "local"))
    try:
        shared.start()
        warned = [line for line in shared.output().splitlines() if "review.reviewers is not set" in line]
        assert len(warned) == 1 and " WARNING " in warned[0], shared.output()
        assert "whoever holds api.auth.bearer_token can decide as anyone" in warned[0]
        local.start()
        (said,) = [line for line in local.output().splitlines() if "review: decisions and labels carry" in line]
        assert " INFO " in said and "the name typed" in said and "loopback" in said
    finally:
        shared.end()
        local.end()


@pytest.mark.parametrize("review, api, problem", [
    ({"reviewers": [{"name": "eve", "token": "eve-token-1"}, {"name": "Eve\u200b", "token": "eve-token-2"}]}, {},
     "review.reviewers[1].name: the same reviewer as review.reviewers[0].name ('eve')"),
    ({"reviewers": [{"name": "eve", "token": "eve-token-1"}], "reviewers_per_item": 2}, {},
     "review.reviewers_per_item: review.reviewers names 1: no item could ever be decided (got 2)"),
    ({"reviewers": [{"name": "eve", "token": "shared-token-1"}]}, {"auth": {"bearer_token": "shared-token-1"}},
     "review.reviewers[0].token: the same as api.auth.bearer_token"),
], ids=["same-name", "too-few", "api-token"])
def test_reviewers_a_token_cannot_tell_apart_stop_the_start(tmp_path: Path, review: dict[str, Any],
                                                           api: dict[str, Any], problem: str) -> None:
    path = tmp_path / "otel-config.yaml"
    path.write_text(yaml.safe_dump(base_config(tmp_path, review=review, api=api)), encoding="utf-8")
    res = run_cli("serve", "--config", str(path), timeout=60)
    assert res.returncode == 2 and problem in res.stderr, res.stderr
    assert "shared-token-1" not in res.stderr  # a token is never repeated
