"""The review API and the review web page, against the real daemon over real OTLP.

Conversations are sent through the OpenTelemetry SDK and its OTLP/gRPC
exporter; the daemon ends them after a short idle time, samples every one,
judges them on code criteria (no API key needed) and queues the fails for
review. The tests then read and decide those items over HTTP only.

Two daemons per module: one open (JSON API and page), one with an API token;
the CLI test starts one of its own, to read it through its API and then on
its file. Each test decides items of conversations of its own, so the order
of the tests does not matter.
"""

from __future__ import annotations

import json
import threading
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from collector.review.page import render_item

from ..support.api_http import Reply, assert_error, call, origin, post_form, post_json
from ..support.daemon import DaemonProcess, run_cli, wait_until
from ..support.review import (
    CARRIER,
    CARRIER_ANSWER,
    EXPECTED_ITEMS,
    LOOKUP,
    MARKUP,
    OPEN_CONVERSATIONS,
    REFUND,
    SCRIPT,
    TOKEN,
    carrier_conversation,
    refund_conversation,
    send_conversations,
    start_daemon,
    wait_items,
)


@pytest.fixture(scope="module")
def judged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, dict[tuple[str, str], int]]]:
    """An open daemon whose queue holds the items of ``EXPECTED_ITEMS``; with their ids."""
    daemon = start_daemon(tmp_path_factory.mktemp("review-open"))
    try:
        send_conversations(daemon.grpc, OPEN_CONVERSATIONS)
        items = wait_items(daemon, EXPECTED_ITEMS)
        yield daemon, {(i["conversation_id"], i["criterion_id"]): i["id"] for i in items}
    finally:
        daemon.end()


@pytest.fixture(scope="module")
def api(judged: tuple[DaemonProcess, dict[tuple[str, str], int]]) -> str:
    return judged[0].api


@pytest.fixture(scope="module")
def ids(judged: tuple[DaemonProcess, dict[tuple[str, str], int]]) -> dict[tuple[str, str], int]:
    return judged[1]


# --------------------------------------------------------------- JSON API


def test_queue_lists_exactly_the_fails(api: str, ids: dict[tuple[str, str], int]) -> None:
    reply = call(api, "GET", "/api/review?state=all&limit=1000")
    assert reply.status == 200
    items = reply.json()["items"]
    # Passes and not-applicable verdicts are not queued: the items are exactly the expected fails.
    assert {(i["conversation_id"], i["criterion_id"]) for i in items} == EXPECTED_ITEMS
    for item in items:
        assert {"id", "conversation_id", "criterion_id", "state", "result", "verdict_id"} <= set(item)
        assert item["result"] == "fail"
    pending = call(api, "GET", "/api/review?limit=1000").json()["items"]  # the default: the pending queue
    assert {i["state"] for i in pending} == {"pending"}
    assert ids[("rv-json-3", CARRIER)] in [i["id"] for i in pending]  # no test decides this one
    only = call(api, "GET", f"/api/review?state=all&criterion={REFUND}").json()["items"]
    assert sorted(i["conversation_id"] for i in only) == ["rv-stats-1", "rv-stats-2", "rv-stats-3"]
    assert {i["criterion_version"] for i in only} == {2}
    two = call(api, "GET", "/api/review?state=all&limit=2").json()["items"]
    assert len(two) == 2


def test_item_detail_has_verdict_criterion_and_transcript(api: str, ids: dict[tuple[str, str], int]) -> None:
    item_id = ids[("rv-json-3", CARRIER)]
    reply = call(api, "GET", f"/api/review/{item_id}")
    assert reply.status == 200, reply.body
    detail = reply.json()
    assert detail["item"]["id"] == item_id and detail["item"]["state"] == "pending"
    assert detail["item"]["conversation_id"] == "rv-json-3"
    verdict = detail["verdict"]
    assert verdict["result"] == "fail" and verdict["criterion_id"] == CARRIER
    assert verdict["evidence"] == ["carrier will call"]
    assert "carrier will (call|contact)" in verdict["reasoning"]
    assert verdict["judge"] == {"provider": "code", "model": "regex"}
    assert detail["criterion"]["id"] == CARRIER and detail["criterion"]["version"] == 1
    assert detail["criterion"]["text"].startswith('Code check regex')  # stored as the evals stage writes it
    assert (detail["criterion"]["group"], detail["criterion"]["severity"]) == ("accuracy", "medium")
    conversation = detail["conversation"]
    assert conversation["id"] == "rv-json-3"
    said = [(m["role"], m.get("content")) for m in conversation["messages"] if m.get("content")]
    assert ("user", "Where is my order B-1?") in said and ("assistant", CARRIER_ANSWER) in said
    assert any(c["name"] == "lookup_order" for m in conversation["messages"] for c in m.get("tool_calls") or [])
    assert detail["history"] == []


def test_decide_conflict_and_forced_history(api: str, ids: dict[tuple[str, str], int]) -> None:
    item_id = ids[("rv-json-1", CARRIER)]
    path = f"/api/review/{item_id}/decision"
    first = post_json(api, path, {"decision": "confirm", "reviewer": "Dr. Amal", "note": "real promise"})
    assert first.status == 200, first.body
    done = first.json()
    assert (done["id"], done["state"], done["reviewer"], done["note"]) == (item_id, "confirmed", "Dr. Amal",
                                                                          "real promise")
    assert done["decided_at"]
    assert call(api, "GET", f"/api/review/{item_id}").json()["item"]["state"] == "confirmed"

    again = post_json(api, path, {"decision": "reject", "reviewer": "Sam"})
    assert_error(again, 409, "already_decided", "confirmed", "force")
    assert call(api, "GET", f"/api/review/{item_id}").json()["item"]["state"] == "confirmed"  # nothing changed

    forced = post_json(api, path, {"decision": "reject", "reviewer": "Sam", "note": "quoted policy", "force": True})
    assert forced.status == 200, forced.body
    assert (forced.json()["state"], forced.json()["reviewer"]) == ("rejected", "Sam")
    history = call(api, "GET", f"/api/review/{item_id}").json()["history"]
    assert [(h["previous_state"], h["state"], h["reviewer"], h["forced"]) for h in history] == [
        ("pending", "confirmed", "Dr. Amal", False), ("confirmed", "rejected", "Sam", True)]
    assert history[0]["note"] == "real promise" and history[1]["previous_reviewer"] == "Dr. Amal"

    listed = call(api, "GET", "/api/review?state=rejected&limit=1000").json()["items"]
    assert item_id in [i["id"] for i in listed]
    assert item_id not in [i["id"] for i in call(api, "GET", "/api/review?limit=1000").json()["items"]]


@pytest.mark.parametrize("headers", [
    {"Origin": "https://evil.example", "Content-Type": "text/plain"},
    {"Origin": "https://evil.example", "Content-Type": "application/json"},
    {"Origin": "null", "Content-Type": "application/json"},
    {"Origin": "http://127.0.0.1:1", "Content-Type": "application/json"},
], ids=["text-plain", "json", "null", "other-port"])
def test_json_api_refuses_posts_from_other_origins(api: str, ids: dict[tuple[str, str], int],
                                                    headers: dict[str, str]) -> None:
    """CSRF: a page elsewhere posting through a reviewer's browser decides nothing and starts nothing."""
    item_id = ids[("rv-csrf-1", CARRIER)]
    body = json.dumps({"decision": "reject", "reviewer": "Mallory"}).encode()
    assert_error(call(api, "POST", f"/api/review/{item_id}/decision", body, headers), 403, "cross_origin",
                 "Origin")
    assert_error(call(api, "POST", "/api/evals", b"{}", headers), 403, "cross_origin")
    detail = call(api, "GET", f"/api/review/{item_id}").json()
    assert detail["item"]["state"] == "pending" and detail["history"] == []


def test_json_api_posts_without_origin_need_a_json_content_type(api: str, ids: dict[tuple[str, str], int]) -> None:
    """A browser sends a cross-site ``text/plain`` or form body without a preflight: only JSON is taken."""
    item_id = ids[("rv-csrf-1", CARRIER)]
    body = json.dumps({"decision": "reject", "reviewer": "Mallory"}).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {"Content-Type": ctype} if ctype else {}
        assert_error(call(api, "POST", f"/api/review/{item_id}/decision", body, headers), 415,
                     "unsupported_media_type", "application/json")
        assert_error(call(api, "POST", "/api/evals", b"{}", headers), 415, "unsupported_media_type")
    assert call(api, "GET", f"/api/review/{item_id}").json()["item"]["state"] == "pending"
    # The API's own clients (the CLI) send JSON, with or without an Origin of the API itself.
    other = ids[("rv-csrf-2", CARRIER)]
    ok = post_json(api, f"/api/review/{other}/decision", {"decision": "confirm", "reviewer": "Ana"},
                   {"Origin": origin(api)})
    assert ok.status == 200, ok.body
    charset = call(api, "POST", f"/api/review/{other}/decision",
                   json.dumps({"decision": "reject", "reviewer": "Ben", "force": True}).encode(),
                   {"Content-Type": "application/json; charset=utf-8"})
    assert charset.status == 200, charset.body


def test_racing_reviewers_one_wins_and_the_others_get_409(api: str, ids: dict[tuple[str, str], int]) -> None:
    """Forty reviewers decide each of four items at the same moment: one decision per item, the rest 409."""
    items = [ids[(f"rv-race-{n}", CARRIER)] for n in range(1, 5)]
    per_item = 40
    start = threading.Barrier(per_item * len(items))

    def decide(item_id: int, n: int) -> Reply:
        start.wait()
        return post_json(api, f"/api/review/{item_id}/decision",
                         {"decision": "confirm" if n % 2 else "reject", "reviewer": f"reviewer-{n}"})

    with ThreadPoolExecutor(per_item * len(items)) as pool:
        futures = {pool.submit(decide, item_id, n): item_id for item_id in items for n in range(per_item)}
        replies = [(futures[f], f.result()) for f in futures]
    for item_id in items:
        mine = [r for i, r in replies if i == item_id]
        assert sorted({r.status for r in mine}) == [200, 409], [(r.status, r.body) for r in mine if r.status != 409]
        (won,) = [r for r in mine if r.status == 200]
        for lost in (r for r in mine if r.status == 409):
            assert_error(lost, 409, "already_decided", "already")
        detail = call(api, "GET", f"/api/review/{item_id}").json()
        assert [h["reviewer"] for h in detail["history"]] == [won.json()["reviewer"]]
        assert detail["item"]["state"] == won.json()["state"]


def test_a_claimed_item_is_refused_to_a_second_reviewer(api: str, ids: dict[tuple[str, str], int]) -> None:
    item_id = ids[("rv-lock-1", CARRIER)]
    claimed = post_json(api, f"/api/review/{item_id}/claim", {"reviewer": "Ana"})
    assert claimed.status == 200 and claimed.json()["claimed_by"] == "Ana"
    assert item_id in [i["id"] for i in call(api, "GET", "/api/review?assignee=Ana").json()["items"]]
    assert_error(post_json(api, f"/api/review/{item_id}/claim", {"reviewer": "Ben"}), 409, "already_decided",
                 "claimed by Ana")
    assert_error(post_json(api, f"/api/review/{item_id}/decision", {"decision": "reject", "reviewer": "Ben"}),
                 409, "already_decided", "claimed by Ana")
    assert call(api, "GET", f"/api/review/{item_id}").json()["item"]["state"] == "pending"
    mine = post_json(api, f"/api/review/{item_id}/decision", {"decision": "confirm", "reviewer": "Ana"})
    assert mine.status == 200 and mine.json()["state"] == "confirmed" and mine.json()["claimed_by"] is None


@pytest.mark.slow
def test_the_cli_lists_the_queue_with_the_page_s_filters(judged: tuple[DaemonProcess, dict[tuple[str, str], int]],
                                                         ids: dict[tuple[str, str], int]) -> None:
    daemon = judged[0]
    res = run_cli("review", "list", "--config", str(daemon.config_path), "--state", "all", "--severity", "high",
                  "--json", "--limit", "1000")
    assert res.returncode == 0, res.stderr
    assert {i["criterion_id"] for i in json.loads(res.stdout)} == {REFUND}
    assert sorted(i["id"] for i in json.loads(res.stdout)) == sorted(v for (_, c), v in ids.items() if c == REFUND)
    everything = json.loads(run_cli("review", "list", "--config", str(daemon.config_path), "--state", "all",
                                    "--json", "--limit", "1000").stdout)
    assert everything[0]["severity"] == "high"  # high severity first
    bad = run_cli("review", "list", "--config", str(daemon.config_path), "--since", "last tuesday")
    assert bad.returncode == 2 and "since" in bad.stderr


def test_unknown_items_are_404(api: str) -> None:
    assert_error(call(api, "GET", "/api/review/999999"), 404, "not_found", "999999")
    assert_error(call(api, "GET", "/api/review/abc"), 404, "not_found", "abc")
    assert_error(post_json(api, "/api/review/999999/decision", {"decision": "confirm", "reviewer": "Sam"}),
                 404, "not_found", "999999")
    assert_error(call(api, "GET", "/api/review/1/decision"), 405, "method_not_allowed")


@pytest.mark.parametrize("body, words", [
    (b"{not json", ("JSON object",)),
    (b"", ("JSON object",)),
    ([{"decision": "confirm", "reviewer": "Sam"}], ("JSON object",)),
    ({"decision": "confirm", "reviewer": "Sam", "verdict": "fail"}, ("unknown field", "verdict")),
    ({"decision": "maybe", "reviewer": "Sam"}, ("confirm, reject or unclear", "maybe")),
    ({"decision": "confirm"}, ("reviewer",)),
    ({"decision": "confirm", "reviewer": ""}, ("reviewer",)),
    ({"decision": "confirm", "reviewer": "   "}, ("reviewer",)),
    ({"decision": "confirm", "reviewer": 7}, ("reviewer",)),
    ({"decision": "confirm", "reviewer": "Sam", "note": ["a"]}, ("note",)),
    ({"decision": "confirm", "reviewer": "Sam", "force": "false"}, ("force",)),
], ids=["not-json", "empty", "list", "unknown-field", "maybe", "no-reviewer", "empty-reviewer",
        "blank-reviewer", "number-reviewer", "list-note", "string-force"])
def test_bad_decision_bodies_are_400_and_change_nothing(api: str, ids: dict[tuple[str, str], int], body: Any,
                                                        words: tuple[str, ...]) -> None:
    item_id = ids[("rv-json-2", CARRIER)]
    reply = post_json(api, f"/api/review/{item_id}/decision", body)
    assert_error(reply, 400, "bad_request", *words)
    assert call(api, "GET", f"/api/review/{item_id}").json()["item"]["state"] == "pending"


@pytest.mark.parametrize("path, words", [
    ("/api/review?state=bogus", ("state", "bogus")),
    ("/api/review?limit=abc", ("limit", "abc")),
    ("/api/review?limit=0", ("limit",)),
    ("/api/verdicts?result=maybe", ("result", "maybe")),
    ("/api/verdicts?limit=x", ("limit",)),
    ("/api/stats?since=yesterday-ish", ()),
])
def test_bad_query_parameters_are_400(api: str, path: str, words: tuple[str, ...]) -> None:
    reply = call(api, "GET", path)
    assert reply.status == 400, reply.body
    assert reply.json()["error"]["code"] in ("bad_parameter", "bad_request")
    for word in words:
        assert word in reply.json()["error"]["message"]


def test_verdicts_filtered_by_result(api: str, ids: dict[tuple[str, str], int]) -> None:
    fails = call(api, "GET", "/api/verdicts?result=fail&limit=1000").json()["verdicts"]
    assert {(v["conversation_id"], v["criterion_id"]) for v in fails} == EXPECTED_ITEMS
    assert {v["result"] for v in fails} == {"fail"}
    passes = call(api, "GET", "/api/verdicts?result=pass&limit=1000").json()["verdicts"]
    # The carrier conversations looked their order up; nobody else promised the carrier would call.
    assert ("rv-json-1", LOOKUP) in {(v["conversation_id"], v["criterion_id"]) for v in passes}
    assert ("rv-stats-1", CARRIER) in {(v["conversation_id"], v["criterion_id"]) for v in passes}
    assert {v["result"] for v in passes} == {"pass"}
    na = call(api, "GET", f"/api/verdicts?result=not_applicable&criterion={LOOKUP}&limit=1000").json()["verdicts"]
    assert {v["conversation_id"] for v in na} == {"rv-stats-1", "rv-stats-2", "rv-stats-3"}
    assert call(api, "GET", "/api/verdicts?result=error").json()["verdicts"] == []


def test_stats_count_the_decisions(api: str, ids: dict[tuple[str, str], int]) -> None:
    def refund_stats() -> dict[str, Any]:
        reply = call(api, "GET", f"/api/stats?criterion={REFUND}")
        assert reply.status == 200, reply.body
        (entry,) = reply.json()["criteria"]
        assert entry["criterion_id"] == REFUND and entry["criterion_version"] == 2
        return entry  # type: ignore[no-any-return]

    before = refund_stats()
    everyone = len(OPEN_CONVERSATIONS)  # judged on every conversation: three promised a full refund
    assert (before["judged"], before["fail"], before["pass"]) == (everyone, 3, everyone - 3)
    assert {k: before["review"][k] for k in ("pending", "confirmed", "rejected")} == {
        "pending": 3, "confirmed": 0, "rejected": 0}
    assert before["failure_rate"]["estimate"] == pytest.approx(3 / everyone)  # every one sampled: weight 1

    assert post_json(api, f"/api/review/{ids[('rv-stats-1', REFUND)]}/decision",
                     {"decision": "confirm", "reviewer": "Dr. Amal"}).status == 200
    assert post_json(api, f"/api/review/{ids[('rv-stats-2', REFUND)]}/decision",
                     {"decision": "reject", "reviewer": "Sam", "note": "policy allows it"}).status == 200
    after = refund_stats()
    assert {k: after["review"][k] for k in ("pending", "confirmed", "rejected")} == {
        "pending": 1, "confirmed": 1, "rejected": 1}
    assert after["review"]["fails_rejected_share"] == pytest.approx(0.5)

    everything = call(api, "GET", "/api/stats").json()
    assert REFUND in [c["criterion_id"] for c in everything["criteria"]]
    (accuracy,) = [g for g in everything["groups"] if g["group"] == "accuracy"]
    assert accuracy["fail"] >= 3
    assert everything["conversations"]["sampled"] == len(OPEN_CONVERSATIONS)
    assert everything["conversations"]["not_sampled"] == 0


# --------------------------------------------------------------- the review page


def assert_page(reply: Reply, status: int = 200) -> str:
    """An HTML page with the security headers; returns its text."""
    assert reply.status == status, (reply.status, reply.body[:2000])
    assert reply.header("Content-Type").startswith("text/html")  # type: ignore[union-attr]
    csp = reply.header("Content-Security-Policy") or ""
    assert "default-src 'none'" in csp and "frame-ancestors 'none'" in csp and "form-action 'self'" in csp
    assert reply.header("X-Frame-Options") == "DENY"
    assert reply.header("X-Content-Type-Options") == "nosniff"
    assert reply.body.startswith("<!doctype html>")
    return reply.body


def only_our_script(page: str) -> bool:
    """The page's one script element is the same-origin keyboard script."""
    return page.lower().count("<script") == 1 and '<script src="/review/static/review.js" defer></script>' in page


def test_list_page(api: str, ids: dict[tuple[str, str], int]) -> None:
    page = assert_page(call(api, "GET", "/review?state=all"))
    for key, item_id in ids.items():
        assert f'href="/review/{item_id}"' in page, key
    assert "rv-script" in page and CARRIER in page
    hostile = assert_page(call(api, "GET", "/review?criterion=" + urllib.parse.quote('"><script>x()</script>')))
    assert only_our_script(hostile) and "&#34;&gt;&lt;script&gt;" in hostile
    bad = assert_page(call(api, "GET", "/review?state=bogus"), 400)
    assert "bogus" in bad
    assert call(api, "GET", "/").status == 302


def test_item_page_shows_criterion_transcript_and_marked_evidence(api: str, ids: dict[tuple[str, str], int]) -> None:
    item_id = ids[("rv-html-1", CARRIER)]
    page = assert_page(call(api, "GET", f"/review/{item_id}"))
    assert f"#{item_id} " in page and CARRIER in page
    assert "Assistant messages must not match the pattern" in page  # the criterion, in words
    assert "Where is my order B-1?" in page  # the user's turn
    assert "the <mark>carrier will call</mark> you tomorrow" in page
    # The quote links to the message it quotes (the bot's answer, after the tool call and its result).
    assert '<a class="quote text" href="#m4" dir="auto">&ldquo;carrier will call&rdquo;</a>' in page
    assert '<li class="msg assistant" id="m4"' in page
    assert f'action="/review/{item_id}/decision"' in page and 'name="reviewer"' in page
    assert 'name="force"' not in page
    missing = assert_page(call(api, "GET", "/review/999999"), 404)
    assert "999999" in missing


def test_item_page_says_a_conversation_is_still_open() -> None:
    conversation = {"id": "c-1", "ended_by": "open", "messages": []}
    assert "still open" in render_item({"item": {"id": 1}, "conversation": conversation})
    assert "ended by open" not in render_item({"item": {"id": 1}, "conversation": conversation})
    assert "ended by handover" in render_item({"item": {"id": 1}, "conversation": {**conversation,
                                                                                     "ended_by": "handover"}})


def test_production_markup_is_never_served_unescaped(api: str, ids: dict[tuple[str, str], int]) -> None:
    markup = assert_page(call(api, "GET", f"/review/{ids[('rv-script', MARKUP)]}"))
    lookup = assert_page(call(api, "GET", f"/review/{ids[('rv-script', LOOKUP)]}"))
    listing = assert_page(call(api, "GET", "/review?state=all"))
    for page in (markup, lookup, listing):
        assert only_our_script(page) and "<b>tomorrow" not in page
    # The user's words are shown, escaped; the quoted markup is highlighted where the user wrote it.
    assert "<mark>&lt;script&gt;alert(1)&lt;/script&gt;</mark> where is order B-9?" in markup
    assert "&lt;b&gt;tomorrow&lt;/b&gt;" in markup and "&lt;b&gt;tomorrow&lt;/b&gt;" in lookup
    assert "&lt;script&gt;alert(1)&lt;/script&gt; where is order B-9?" in lookup
    # The JSON API returns the text as it was said.
    detail = call(api, "GET", f"/api/review/{ids[('rv-script', MARKUP)]}").json()
    assert detail["verdict"]["evidence"] == [SCRIPT]
    assert detail["conversation"]["messages"][0]["content"] == f"{SCRIPT} where is order B-9?"


def test_form_decision_redirects_to_saved_item(api: str, ids: dict[tuple[str, str], int]) -> None:
    item_id = ids[("rv-html-2", CARRIER)]
    reply = post_form(api, f"/review/{item_id}/decision",
                      {"decision": "confirm", "reviewer": "Dr. <Amal>", "note": "promised a call"},
                      {"Origin": origin(api)})
    assert reply.status == 303, reply.body
    location = reply.header("Location") or ""
    # Save and next: on to the next pending item, with the name remembered in a cookie.
    next_path = urllib.parse.urlsplit(location).path
    assert next_path.startswith("/review/") and next_path != f"/review/{item_id}"
    remembered = [h.split(";", 1)[0] for h in reply.headers_named("Set-Cookie") if h.startswith("tracejudge_reviewer=")]
    assert remembered == ["tracejudge_reviewer=Dr.%20%3CAmal%3E"]
    page = assert_page(call(api, "GET", location, headers={"Cookie": remembered[0]}))
    assert f"Saved #{item_id}: confirmed" in page
    assert 'value="Dr. &lt;Amal&gt;"' in page and "Dr. <Amal>" not in page  # prefilled, escaped
    again = assert_page(call(api, "GET", f"/review/{item_id}"))
    assert 'name="force" value="1"' in again  # decided: deciding again is a forced decision
    item = call(api, "GET", f"/api/review/{item_id}").json()["item"]
    assert (item["state"], item["reviewer"], item["note"]) == ("confirmed", "Dr. <Amal>", "promised a call")


def test_pages_let_their_own_form_posts_carry_their_origin(api: str, ids: dict[tuple[str, str], int]) -> None:
    """A browser posts a form of a page served with ``Referrer-Policy: no-referrer`` with ``Origin: null``,
    which the CSRF check refuses; ``same-origin`` keeps the page's origin on its own posts and still gives
    other sites no address."""
    for path in ("/review", f"/review/{ids[('rv-html-3', CARRIER)]}", "/review/999999"):
        assert call(api, "GET", path).header("Referrer-Policy") == "same-origin", path


@pytest.mark.parametrize("other", ["https://evil.example", "null", "http://127.0.0.1:1"])
def test_form_post_from_another_site_is_refused(api: str, ids: dict[tuple[str, str], int], other: str) -> None:
    item_id = ids[("rv-html-3", CARRIER)]
    reply = post_form(api, f"/review/{item_id}/decision", {"decision": "confirm", "reviewer": "Mallory"},
                      {"Origin": other})
    page = assert_page(reply, 403)
    assert "another site" in page
    detail = call(api, "GET", f"/api/review/{item_id}").json()
    assert detail["item"]["state"] == "pending" and detail["history"] == []


def test_form_on_decided_item_needs_force(api: str, ids: dict[tuple[str, str], int]) -> None:
    item_id = ids[("rv-html-4", CARRIER)]
    path = f"/review/{item_id}/decision"
    same = {"Origin": origin(api)}
    assert post_form(api, path, {"decision": "confirm", "reviewer": "Ana"}, same).status == 303
    refused = assert_page(post_form(api, path, {"decision": "reject", "reviewer": "Ben"}, same), 409)
    assert "Not saved" in refused and "already confirmed" in refused
    assert call(api, "GET", f"/api/review/{item_id}").json()["item"]["state"] == "confirmed"
    no_name = assert_page(post_form(api, path, {"decision": "reject", "reviewer": " ", "force": "1"}, same), 400)
    assert "reviewer" in no_name
    forced = post_form(api, path, {"decision": "reject", "reviewer": "Ben", "force": "1"}, same)
    assert forced.status == 303, forced.body
    assert f"Saved #{item_id}: rejected" in assert_page(call(api, "GET", forced.header("Location") or ""))
    history = call(api, "GET", f"/api/review/{item_id}").json()["history"]
    assert [(h["reviewer"], h["state"], h["forced"]) for h in history] == [("Ana", "confirmed", False),
                                                                         ("Ben", "rejected", True)]
    unknown = assert_page(post_form(api, "/review/999999/decision", {"decision": "confirm", "reviewer": "A"},
                                    same), 404)
    assert "999999" in unknown


# --------------------------------------------------------------- with an API token


@pytest.fixture(scope="module")
def locked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, int]]:
    """A daemon with ``api.auth.bearer_token``, one item queued; with that item's id."""
    daemon = start_daemon(tmp_path_factory.mktemp("review-locked"), api={"auth": {"bearer_token": TOKEN}})
    try:
        send_conversations(daemon.grpc, [carrier_conversation("rv-locked")])
        (item,) = wait_items(daemon, {("rv-locked", CARRIER)}, token=TOKEN)
        yield daemon, item["id"]
    finally:
        daemon.end()


def cookie_pair(reply: Reply) -> tuple[str, str]:
    """The token cookie set by ``reply``, and its full Set-Cookie header."""
    (header,) = [h for h in reply.headers_named("Set-Cookie") if h.startswith("tracejudge_token=")]
    return header.split(";", 1)[0], header


def test_api_needs_the_bearer_token(locked: tuple[DaemonProcess, int]) -> None:
    daemon, item_id = locked
    api = daemon.api
    assert_error(call(api, "GET", "/api/review"), 401, "unauthorized", "bearer")
    assert_error(call(api, "GET", "/api/review", headers={"Authorization": "Bearer wrong"}), 401, "unauthorized")
    assert_error(post_json(api, f"/api/review/{item_id}/decision", {"decision": "confirm", "reviewer": "X"}),
                 401, "unauthorized")
    # A cookie is for the page only: the JSON API wants the header.
    assert_error(call(api, "GET", "/api/review", headers={"Cookie": f"tracejudge_token={TOKEN}"}), 401,
                 "unauthorized")
    good = call(api, "GET", "/api/review", headers={"Authorization": f"Bearer {TOKEN}"})
    assert good.status == 200 and [i["id"] for i in good.json()["items"]] == [item_id]
    assert call(api, "GET", "/healthz").status == 200


def test_page_sign_in_with_token_link(locked: tuple[DaemonProcess, int]) -> None:
    daemon, item_id = locked
    api = daemon.api
    for path in ("/review", f"/review/{item_id}"):
        page = assert_page(call(api, "GET", path), 401)
        assert 'action="/review/sign-in"' in page and 'type="password" id="token" name="token"' in page
        assert f'name="next" value="{path}"' in page
    wrong = call(api, "GET", "/review?token=not-the-token")
    assert_page(wrong, 401)
    assert not wrong.headers_named("Set-Cookie")

    signed = call(api, "GET", f"/review?token={TOKEN}")
    assert signed.status == 303
    assert signed.header("Location") == "/review"  # the token leaves the address bar
    cookie, header = cookie_pair(signed)
    attributes = [a.strip().lower() for a in header.split(";")[1:]]
    assert "httponly" in attributes and "samesite=strict" in attributes and "path=/" in attributes
    assert cookie == f"tracejudge_token={TOKEN}"

    listing = assert_page(call(api, "GET", "/review", headers={"Cookie": cookie}))
    assert f'href="/review/{item_id}"' in listing
    item_page = assert_page(call(api, "GET", f"/review/{item_id}", headers={"Cookie": cookie}))
    assert "<mark>carrier will call</mark>" in item_page
    assert_page(call(api, "GET", "/review", headers={"Cookie": "tracejudge_token=wrong"}), 401)

    # A form post needs the cookie too; with it, the decision is saved.
    form = {"decision": "confirm", "reviewer": "Dr. Amal"}
    same = {"Origin": origin(api)}
    assert_page(post_form(api, f"/review/{item_id}/decision", form, same), 401)
    saved = post_form(api, f"/review/{item_id}/decision", form, {**same, "Cookie": cookie})
    assert saved.status == 303, saved.body
    page = assert_page(call(api, "GET", saved.header("Location") or "", headers={"Cookie": cookie}))
    assert f"Saved #{item_id}: confirmed" in page
    item = daemon.get(f"/api/review/{item_id}", token=TOKEN)[1]["item"]
    assert (item["state"], item["reviewer"]) == ("confirmed", "Dr. Amal")


# --------------------------------------------------------------- the CLI on the same data


def test_the_sign_in_page_takes_the_token_typed_in(locked: tuple[DaemonProcess, int]) -> None:
    daemon, item_id = locked
    api, same = daemon.api, {"Origin": origin(daemon.api)}
    wrong = post_form(api, "/review/sign-in", {"token": "not-it", "next": f"/review/{item_id}"}, same)
    assert "That token is not the daemon" in assert_page(wrong, 401) and not wrong.headers_named("Set-Cookie")
    right = post_form(api, "/review/sign-in", {"token": TOKEN, "next": f"/review/{item_id}"}, same)
    assert right.status == 303 and right.header("Location") == f"/review/{item_id}"
    cookie, header = cookie_pair(right)
    assert "httponly" in header.lower() and "samesite=strict" in header.lower()
    assert "carrier will call" in assert_page(call(api, "GET", f"/review/{item_id}", headers={"Cookie": cookie}))
    away = post_form(api, "/review/sign-in", {"token": TOKEN, "next": "https://evil.example/"}, same)
    assert away.header("Location") == "/review"  # never sent elsewhere


@pytest.mark.slow
def test_a_reviewer_token_names_the_reviewer_of_every_decision(tmp_path: Path) -> None:
    ana = "ana-token-5e1b9c"
    daemon = start_daemon(tmp_path, api={"auth": {"bearer_token": TOKEN}},
                          review={"reviewers": [{"name": "Dr. Ana Ruiz", "token": ana}]})
    try:
        send_conversations(daemon.grpc, [carrier_conversation("rv-named")])
        (item,) = wait_items(daemon, {("rv-named", CARRIER)}, token=TOKEN)
        api, same = daemon.api, {"Origin": origin(daemon.api)}
        signed = post_form(api, "/review/sign-in", {"token": ana, "next": f"/review/{item['id']}"}, same)
        assert signed.status == 303
        cookie = cookie_pair(signed)[0]
        page = assert_page(call(api, "GET", f"/review/{item['id']}", headers={"Cookie": cookie}))
        assert 'name="reviewer" readonly dir="auto" value="Dr. Ana Ruiz"' in page
        forged = post_form(api, f"/review/{item['id']}/decision", {"decision": "confirm", "reviewer": "Mallory"},
                           {**same, "Cookie": cookie})
        assert "Dr. Ana Ruiz" in assert_page(forged, 403) and "Mallory" in forged.body  # a typed name is refused
        assert daemon.get(f"/api/review/{item['id']}", token=TOKEN)[1]["item"]["state"] == "pending"
        saved = post_form(api, f"/review/{item['id']}/decision", {"decision": "confirm", "reviewer": "Dr. Ana Ruiz"},
                          {**same, "Cookie": cookie})
        assert saved.status == 303, saved.body
        got = daemon.get(f"/api/review/{item['id']}", token=TOKEN)[1]["item"]
        assert (got["state"], got["reviewer"]) == ("confirmed", "Dr. Ana Ruiz")
        # A reviewer's token opens the review stage's JSON API, not the rest of it.
        assert call(api, "GET", "/api/review", headers={"Authorization": f"Bearer {ana}"}).status == 200
        assert_error(call(api, "GET", "/api/conversations", headers={"Authorization": f"Bearer {ana}"}), 401,
                     "unauthorized")
        # The API token names no reviewer: it reads, but decides nothing, and the page offers to sign in.
        assert_error(post_json(api, f"/api/review/{item['id']}/decision", {"decision": "reject", "reviewer": "Ana"},
                               {"Authorization": f"Bearer {TOKEN}"}), 403, "reviewer_token_required")
        admin = cookie_pair(call(api, "GET", f"/review?token={TOKEN}"))[0]
        page = assert_page(call(api, "GET", f"/review/{item['id']}", headers={"Cookie": admin}))
        assert "Sign in with your own reviewer token" in page and 'name="decision"' not in page
        assert_page(post_form(api, f"/review/{item['id']}/decision", {"decision": "reject", "reviewer": "Ana"},
                              {**same, "Cookie": admin}), 403)
        # Signed in already, the sign-in page takes another token.
        assert 'id="token"' in assert_page(call(api, "GET", "/review/sign-in", headers={"Cookie": admin}))
        switched = post_form(api, "/review/sign-in", {"token": ana, "next": f"/review/{item['id']}"},
                             {**same, "Cookie": admin})
        assert switched.status == 303 and cookie_pair(switched)[0] == f"tracejudge_token={ana}"
    finally:
        daemon.end()


def test_daemon_log_says_what_it_judges_in_words(judged: tuple[DaemonProcess, dict[tuple[str, str], int]]) -> None:
    assert "judging 4 criteria (4 code, 0 LLM) on 100% of ended conversations" in judged[0].output()


def _columns_line_up(text: str, header: list[str], right: tuple[str, ...] = ()) -> list[str]:
    """The rows of a table whose header names are ``header`` (indented detail lines left out): each column
    starts where its name starts, or for the ``right`` ones (numbers) ends where its name ends."""
    lines = [line for line in text.rstrip("\n").splitlines() if not line.startswith("    ")]
    for name in header[1:]:
        start = lines[0].index(name)
        end = start + len(name)
        for line in lines[1:]:
            if name in right:
                assert line[end - 1] != " " and line[end:end + 2] == "  ", (name, lines)
            else:
                assert line[start - 2:start] == "  " and line[start] != " ", (name, lines)
    return lines


@pytest.mark.slow
def test_cli_shows_a_conversations_verdicts_through_the_daemon_and_on_the_file(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path)
    cfg = str(daemon.config_path)
    try:
        send_conversations(daemon.grpc, [carrier_conversation("cli-carrier"), refund_conversation("cli-refund")])
        items = wait_items(daemon, {("cli-carrier", CARRIER), ("cli-refund", REFUND)})
        wait_until(lambda: len(daemon.get("/api/verdicts?limit=1000")[1]["verdicts"]) >= 8,
                   "every criterion's verdict on both conversations", interval=0.1)
        refund_item = next(i["id"] for i in items if i["conversation_id"] == "cli-refund")
        assert post_json(daemon.api, f"/api/review/{refund_item}/decision",
                         {"decision": "reject", "reviewer": "Dr. Amal Haddad-Lindqvist"}).status == 200

        def read() -> dict[str, str]:
            out = {}
            for name, args in [("verdicts", ["verdicts", "--conversation", "cli-carrier"]),
                               ("verdicts_json", ["verdicts", "--conversation", "cli-carrier", "--json"]),
                               ("show", ["conversations", "show", "cli-carrier"]),
                               ("list", ["conversations", "list"]),
                               ("review", ["review", "list", "--state", "all"])]:
                res = run_cli(*args, "--config", cfg)
                assert res.returncode == 0, res.stderr
                out[name] = res.stdout
            return out

        through_api = read()
    finally:
        assert daemon.stop() == 0
        daemon.log.close()
    on_file = read()
    assert on_file == through_api

    got = json.loads(on_file["verdicts_json"])
    assert {v["conversation_id"] for v in got} == {"cli-carrier"}
    assert sorted(v["criterion_id"] for v in got) == sorted([CARRIER, REFUND, MARKUP, LOOKUP])
    lines = _columns_line_up(on_file["verdicts"], ["judged at", "result", "criterion", "conversation"])
    assert len([line for line in lines if "cli-carrier" in line]) == 4

    show = on_file["show"]
    assert "ended by idle" in show and "USER: Where is my order B-1?" in show
    verdict_lines = show[show.index("verdicts (4):"):].splitlines()[1:]
    assert any(line.split()[:2] == ["fail", CARRIER] for line in verdict_lines), verdict_lines
    assert any(line.split()[:2] == ["pass", LOOKUP] for line in verdict_lines), verdict_lines

    _columns_line_up(on_file["list"], ["conversation", "state", "service", "turns", "msgs", "tokens in/out",
                                       "last data"], right=("turns", "msgs", "tokens in/out"))
    review = _columns_line_up(on_file["review"], ["item", "state", "judge said", "criterion", "conversation"])
    assert any("rejected by Dr. Amal Haddad-Lindqvist" in line for line in review)
