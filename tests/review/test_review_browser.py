"""The review pages in a real browser (Debian's Chromium through chromedriver).

What only a browser shows: the keyboard (the same-origin script, under the
page's CSP), a quote followed to its message and highlighted there, the
decision buttons on a 390 px screen, production markup that runs nothing, the
sign-in form's cookie, and blind labelling that moves the calibration page's
counts. Screenshots of the queue, an item and the calibration page go to
``docs/`` when ``TRACEJUDGE_SCREENSHOTS=1`` (how the README's are made), else
beside the test's daemon.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from collector.demo.traffic import Persona, Turn

from ..support.browser import chromium
from ..support.daemon import REPO, DaemonProcess, wait_until
from ..support.review import (
    CARRIER,
    TOKEN,
    carrier_conversation,
    refund_conversation,
    send_conversations,
    start_daemon,
    wait_items,
)

pytestmark = pytest.mark.slow  # each test drives a browser


def shots(tmp_path: Path) -> Path:
    return REPO / "docs" if os.environ.get("TRACEJUDGE_SCREENSHOTS") == "1" else tmp_path


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    with chromium(tmp_path / "chromium", window="1400,1000") as driver:
        yield driver


@pytest.fixture
def phone(tmp_path: Path) -> Iterator[Any]:
    with chromium(tmp_path / "chromium-390", window="390,844") as driver:
        yield driver


def by_css(driver: Any, selector: str) -> Any:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, selector)


def keys(driver: Any, text: str) -> None:
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(driver).send_keys(text).perform()


def loaded(driver: Any) -> bool:
    """The page is parsed whole: ``get`` and a navigation the page started may hand back one still loading."""
    return driver.execute_script("return document.readyState") == "complete"  # type: ignore[no-any-return]


def load(driver: Any, url: str) -> None:
    driver.get(url)
    wait_until(lambda: loaded(driver), f"{url} loaded")


def test_a_reviewer_follows_a_quote_and_confirms_with_the_keyboard_landing_on_the_next(
        browser: Any, tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path)
    try:
        send_conversations(daemon.grpc, [carrier_conversation(f"br-{n}") for n in range(1, 4)]
                           + [refund_conversation("br-refund")])
        wait_items(daemon, {*((f"br-{n}", CARRIER) for n in range(1, 4))})
        load(browser, daemon.api + "/review")
        browser.save_screenshot(str(shots(tmp_path) / "review-queue.png"))
        top = by_css(browser, "table a[href^='/review/']")
        first = top.get_attribute("href").rsplit("/", 1)[1]
        top.click()
        wait_until(lambda: browser.current_url.endswith(f"/review/{first}") and loaded(browser), "the item page")
        quote = by_css(browser, "a.quote")
        target, quoted = quote.get_attribute("href").rsplit("#", 1)[1], quote.text.strip("\u201c\u201d")
        quote.click()
        assert browser.execute_script("return document.querySelector(':target').id") == target
        highlighted = browser.execute_script(
            "return getComputedStyle(document.querySelector(':target')).backgroundColor")
        assert highlighted == "rgb(255, 243, 196)"  # .msg:target
        assert browser.execute_script("return document.activeElement.id") == target  # for screen readers too
        assert by_css(browser, f"#{target} mark").text == quoted  # the quote, marked in its message
        browser.save_screenshot(str(shots(tmp_path) / "review-item.png"))

        by_css(browser, "#reviewer").send_keys("Dr. Ana Ruiz")
        keys(browser, "\ue00c")  # Escape: out of the field, so keys are commands again
        keys(browser, "c")
        wait_until(lambda: "saved=confirmed" in browser.current_url and loaded(browser),
                   "the next item after the decision")
        landed = browser.current_url.split("?")[0].rsplit("/", 1)[1]
        assert landed != first and f"Saved #{first}: confirmed" in browser.page_source
        assert by_css(browser, "#reviewer").get_attribute("value") == "Dr. Ana Ruiz"  # remembered
        item = daemon.get(f"/api/review/{first}")[1]["item"]
        assert (item["state"], item["reviewer"]) == ("confirmed", "Dr. Ana Ruiz")

        keys(browser, "s")  # skip: on to the next, nothing decided
        wait_until(lambda: "skipped=" in browser.current_url and loaded(browser), "the item after the skipped one")
        assert daemon.get(f"/api/review/{landed}")[1]["item"]["state"] == "pending"
        keys(browser, "?")
        assert by_css(browser, "#help").get_attribute("open") is not None
        # Times are shown in the browser's own zone, the UTC text kept as a tooltip.
        stamp = by_css(browser, "time")
        assert stamp.get_attribute("title").endswith("UTC") and not stamp.text.endswith("UTC")
    finally:
        daemon.end()


PICKED = "rgb(255, 243, 196)"  # --picked: a selected row, like a followed quote's message


def selection(driver: Any) -> tuple[list[int], int | None]:
    """The queue's rows as a person sees them: those highlighted, and the one whose link has the focus."""
    highlighted, focused = driver.execute_script(
        "const rows = Array.from(document.querySelectorAll('#queue tbody tr'));"
        "return [rows.flatMap((r, i) => getComputedStyle(r).backgroundColor === arguments[0] ? [i] : []),"
        " rows.findIndex(r => r.contains(document.activeElement))];", PICKED)
    return highlighted, None if focused < 0 else focused


def test_the_queue_by_keyboard_j_k_select_enter_opens_and_question_mark_shows_the_help(
        browser: Any, tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path)
    try:
        send_conversations(daemon.grpc, [carrier_conversation(f"br-key-{n}") for n in range(1, 4)])
        wait_items(daemon, {(f"br-key-{n}", CARRIER) for n in range(1, 4)})
        load(browser, daemon.api + "/review")
        links = [a.get_attribute("href") for a in browser.find_elements("css selector", "#queue a.open")]
        assert len(links) == 3 and selection(browser) == ([], None)
        assert not by_css(browser, "#help li").is_displayed()
        keys(browser, "?")
        wait_until(lambda: by_css(browser, "#help li").is_displayed(), "the help, opened by ?")
        assert "Enter" in by_css(browser, "#help").text

        for key, row in (("j", 0), ("j", 1), ("j", 2), ("j", 2), ("k", 1)):  # stops at the last row
            keys(browser, key)
            wait_until(lambda: selection(browser) == ([row], row), f"row {row} selected after {key}")
        browser.save_screenshot(str(tmp_path / "review-queue-selected.png"))
        keys(browser, "\ue007")  # Enter, on the selected row's link
        wait_until(lambda: browser.current_url == links[1] and loaded(browser), "the selected item opened")

        load(browser, daemon.api + "/review")
        keys(browser, "k")  # from no selection: the first row
        wait_until(lambda: selection(browser) == ([0], 0), "row 0 selected after k")
        browser.execute_script("document.activeElement.blur()")  # a click beside it: the selection stays
        assert selection(browser) == ([0], None)
        keys(browser, "\ue007")
        wait_until(lambda: browser.current_url == links[0] and loaded(browser),
                   "the selected item opened with the focus elsewhere")
    finally:
        daemon.end()


def test_at_390_px_the_decision_buttons_are_on_screen(phone: Any, tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path)
    try:
        send_conversations(daemon.grpc, [carrier_conversation("br-phone")])
        item, = wait_items(daemon, {("br-phone", CARRIER)})
        load(phone, f"{daemon.api}/review/{item['id']}")
        height = phone.execute_script("return window.innerHeight")
        width = phone.execute_script("return document.documentElement.clientWidth")
        for value in ("confirm", "reject", "unclear", "skip"):
            box = phone.execute_script("return arguments[0].getBoundingClientRect().toJSON()",
                                       by_css(phone, f"button[value={value}]"))
            assert 0 <= box["top"] and box["bottom"] <= height and 0 <= box["left"] and box["right"] <= width, \
                (value, box, height, width)
        assert phone.execute_script("return document.documentElement.scrollWidth") <= width  # no sideways scroll
        phone.save_screenshot(str(shots(tmp_path) / "review-item-390.png"))
    finally:
        daemon.end()


HOSTILE = Persona("hostile", "en", "review-test", [
    Turn("<script>document.title='pwned-script'</script> <img src=x onerror=\"document.title='pwned-img'\">",
         "See <a href=\"javascript:document.title='pwned-link'\">this link</a> and the carrier will call you."),
], conversation_id="br-hostile")


def test_a_transcript_of_markup_renders_as_text_and_runs_nothing(browser: Any, tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path)
    try:
        send_conversations(daemon.grpc, [HOSTILE])
        items = wait_items(daemon, {("br-hostile", CARRIER)})
        item = next(i for i in items if i["criterion_id"] == CARRIER)
        load(browser, f"{daemon.api}/review/{item['id']}")
        chat = by_css(browser, "section.chat")
        assert "<script>document.title='pwned-script'</script>" in chat.text
        assert "<img src=x onerror=" in chat.text and "javascript:document.title" in chat.text
        assert not chat.find_elements("css selector", "img, script, a[href^='javascript:']")
        for link in browser.find_elements("css selector", "a"):
            assert not (link.get_attribute("href") or "").startswith("javascript:")
        assert "pwned" not in browser.title
        assert browser.execute_script("return document.scripts.length") == 1  # the page's own, nothing else
    finally:
        daemon.end()


def test_a_token_typed_into_the_sign_in_page_lets_the_reviewer_decide(browser: Any, tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path, api={"auth": {"bearer_token": TOKEN}})
    try:
        send_conversations(daemon.grpc, [carrier_conversation("br-token")])
        item, = wait_items(daemon, {("br-token", CARRIER)}, token=TOKEN)
        load(browser, f"{daemon.api}/review/{item['id']}")
        by_css(browser, "#token").send_keys("not-the-token\n")
        wait_until(lambda: "That token is not the daemon" in browser.page_source, "the wrong token refused")
        by_css(browser, "#token").send_keys(TOKEN + "\n")
        wait_until(lambda: browser.find_elements("css selector", "#reviewer") and loaded(browser),
                   "the item page, signed in")
        assert browser.current_url.endswith(f"/review/{item['id']}") and "token" not in browser.current_url
        by_css(browser, "#reviewer").send_keys("Dr. Ana Ruiz")
        by_css(browser, "button[value=reject]").click()
        wait_until(lambda: "saved=rejected" in browser.current_url and loaded(browser), "the decision saved")
        got = daemon.get(f"/api/review/{item['id']}", token=TOKEN)[1]["item"]
        assert (got["state"], got["reviewer"]) == ("rejected", "Dr. Ana Ruiz")
    finally:
        daemon.end()


def _labelled(browser: Any, daemon: DaemonProcess, criterion: str) -> int:
    load(browser, daemon.api + "/calibration")
    return int(by_css(browser, f"#c-{criterion} .n").text)


def test_a_blind_task_labelled_on_the_page_moves_the_calibration_counts(browser: Any, tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path, review={"calibration_rate": 1.0})
    try:
        send_conversations(daemon.grpc, [carrier_conversation("br-cal-1"), refund_conversation("br-cal-2")])
        wait_until(lambda: len(daemon.get(f"/api/calibration/items?criterion={CARRIER}")[1]["items"]) == 2,
                   "the blind tasks")
        load(browser, daemon.api + "/calibration")
        assert "No blind labels yet" in browser.page_source
        load(browser, daemon.api + "/review/label")
        page = browser.page_source
        assert "A blind task" in page and "Judge said" not in page and "reasoning" not in page.lower()
        task = browser.current_url.rsplit("/", 1)[1]
        criterion = daemon.get(f"/api/calibration/items/{task}")[1]["item"]["criterion_id"]
        by_css(browser, "#reviewer").send_keys("Dr. Ana Ruiz")
        keys(browser, "\ue00c")
        keys(browser, "f")
        wait_until(lambda: "saved=fail" in browser.current_url and loaded(browser),
                   "the next task after the label")
        assert _labelled(browser, daemon, criterion) == 1
        browser.save_screenshot(str(shots(tmp_path) / "calibration.png"))
    finally:
        daemon.end()
