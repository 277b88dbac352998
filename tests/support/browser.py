"""Debian's Chromium driven through chromedriver (selenium), for the tests of pages."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@contextlib.contextmanager
def chromium(profile: Path, *, window: str = "1400,1000", extra: tuple[str, ...] = ()) -> Iterator[Any]:
    """A headless Chromium with its profile in ``profile``; skips (fails on CI) when it is not installed."""
    if CHROMIUM is None or CHROMEDRIVER is None:
        if os.environ.get("CI"):
            pytest.fail("chromium and chromium-driver are missing: .ci/run installs them")
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                "--no-first-run", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", f"--window-size={window}", f"--user-data-dir={profile}", *extra):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
