"""The review page in a real browser (Debian's Chromium through chromedriver): a reviewer decides an item.

What only a browser shows: the form's own post carries the Origin the browser
gives it (under the page's Referrer-Policy), the token link becomes a cookie
that the form's post then carries, and the page renders (a screenshot of each
step is kept beside the test's daemon, in its tmp folder).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..support.browser import chromium
from ..support.daemon import DaemonProcess
from ..support.review import (
    CARRIER,
    TOKEN,
    carrier_conversation,
    send_conversations,
    start_daemon,
    stop_daemon,
    wait_items,
)



@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    with chromium(tmp_path / "chromium", window="1400,1000", extra=()) as driver:
        yield driver


def _decide(browser: Any, daemon: DaemonProcess, url: str, decision: str, shots: Path) -> None:
    """Open the queue at ``url``, follow the item's link, sign and submit the decision."""
    from selenium.webdriver.common.by import By

    browser.get(url)
    browser.save_screenshot(str(shots / "queue.png"))
    browser.find_element(By.CSS_SELECTOR, "table a[href^='/review/']").click()
    browser.find_element(By.ID, "reviewer").send_keys("Dr. Ana Ruiz")
    browser.find_element(By.ID, "note").send_keys("promised a call the carrier never offered")
    browser.save_screenshot(str(shots / "item.png"))
    browser.find_element(By.CSS_SELECTOR, f"button[value='{decision}']").click()
    browser.save_screenshot(str(shots / "saved.png"))
    assert "Saved:" in browser.page_source, browser.page_source[:2000]


def _state(daemon: DaemonProcess, token: str | None = None) -> tuple[str, str, str]:
    item = daemon.get("/api/review?state=all", token=token)[1]["items"][0]
    return item["state"], item["reviewer"], item["note"]


def test_a_reviewer_confirms_an_item_from_the_page(browser: Any, tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path)
    try:
        send_conversations(daemon.grpc, [carrier_conversation("br-open")])
        wait_items(daemon, {("br-open", CARRIER)})
        _decide(browser, daemon, daemon.api + "/review", "confirm", tmp_path)
        assert _state(daemon) == ("confirmed", "Dr. Ana Ruiz", "promised a call the carrier never offered")
    finally:
        stop_daemon(daemon)


def test_with_a_token_the_link_signs_in_and_the_form_posts_with_the_cookie(browser: Any, tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path, api={"auth": {"bearer_token": TOKEN}})
    try:
        send_conversations(daemon.grpc, [carrier_conversation("br-token")])
        wait_items(daemon, {("br-token", CARRIER)}, token=TOKEN)
        browser.get(daemon.api + "/review")
        assert "token" in browser.page_source  # signed out: the page says how to sign in
        _decide(browser, daemon, f"{daemon.api}/review?token={TOKEN}", "reject", tmp_path)
        assert "token=" not in browser.current_url  # the token left the address bar for a cookie
        assert _state(daemon, TOKEN) == ("rejected", "Dr. Ana Ruiz", "promised a call the carrier never offered")
    finally:
        stop_daemon(daemon)
