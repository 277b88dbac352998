"""Open alerts on the review page, acknowledged in a real browser (Debian's Chromium through chromedriver)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import pytest

from collector.alerts.store import ensure_schema, fire

from ..support.browser import chromium
from ..support.daemon import DaemonProcess, base_config, wait_until

pytestmark = pytest.mark.slow  # a daemon and a browser

T0 = dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.timezone.utc)
MARKUP = '<img src=x onerror="document.title=1">'
LIVE = {"service": "triage-bot", "conversation_id": "c-1042", "criterion": "red-flags", "severity": "high",
        "result": "fail", "evidence": [f"It can wait until tomorrow {MARKUP}"],
        "reasoning": "Chest pain was reported and the bot advised waiting.",
        "review_url": "http://127.0.0.1:9/review/17", "turn": 3}


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    with chromium(tmp_path / "chromium") as driver:
        yield driver


def by_css(driver: Any, selector: str) -> Any:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, selector)


def all_css(driver: Any, selector: str) -> list[Any]:
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)  # type: ignore[no-any-return]


def loaded(driver: Any) -> bool:
    return driver.execute_script("return document.readyState") == "complete"  # type: ignore[no-any-return]


def test_open_alerts_show_above_the_queue_and_are_acknowledged_there(browser: Any, tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path, base_config(tmp_path))
    con = duckdb.connect(str(daemon.duckdb))
    try:
        ensure_schema(con)
        rate = fire(con, type="failure_rate", key="failure_rate:red-flags:1", now=T0,
                    payload={"criterion": "red-flags", "value": 0.031, "above": 0.02, "window": "1h"})
        live = fire(con, type="live_failure", key="live_failure:c-1042:red-flags", payload=LIVE,
                    now=T0 + dt.timedelta(minutes=1))
    finally:
        con.close()
    daemon.start()
    browser.get(daemon.api + "/review")
    wait_until(lambda: loaded(browser), "the queue page")
    cards = all_css(browser, "#alerts .alert")
    assert [c.get_attribute("id") for c in cards] == [f"alert-{live}", f"alert-{rate}"]  # the newest first
    assert by_css(browser, "#alerts").location["y"] < by_css(browser, "form.filters").location["y"]  # on top
    first = cards[0]
    assert "Live failure: red-flags" in first.text and "c-1042" in first.text
    assert f"It can wait until tomorrow {MARKUP}" in first.text  # shown as text, never run
    assert browser.title == "Review queue"
    assert first.find_element("link text", "Open in review").get_attribute("href") == LIVE["review_url"]

    first.find_element("css selector", "input[name=reviewer]").send_keys("Dr. Ana Ruiz")
    first.find_element("css selector", "button[type=submit]").click()
    wait_until(lambda: "acknowledged=" in browser.current_url and loaded(browser), "back on the queue")
    assert f"Alert {live} acknowledged." in by_css(browser, "p[role=status]").text
    (left,) = all_css(browser, "#alerts .alert")
    assert left.get_attribute("id") == f"alert-{rate}"
    field = left.find_element("css selector", "input[name=reviewer]")
    assert field.get_attribute("value") == "Dr. Ana Ruiz"  # remembered from the last one
    left.find_element("css selector", "button[type=submit]").click()
    wait_until(lambda: f"acknowledged={rate}" in browser.current_url and loaded(browser), "the second acknowledged")
    assert all_css(browser, "#alerts") == []

    acked = daemon.get("/api/alerts?state=acknowledged")[1]["alerts"]
    assert {(a["id"], a["acknowledged_by"]) for a in acked} == {(live, "Dr. Ana Ruiz"), (rate, "Dr. Ana Ruiz")}
    assert daemon.get("/api/alerts")[1]["alerts"] == []
