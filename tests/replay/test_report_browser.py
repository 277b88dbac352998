"""The ``replay compare --html`` report in a real browser (Debian's Chromium through chromedriver).

What only a browser shows: the page renders from the file alone (opened as
``file://``, nothing else to fetch), and every histogram is drawn, simulated
beside real, with bars of both colours. With ``TRACEJUDGE_SCREENSHOTS=1`` the
test also writes the README's picture, ``docs/replay-compare.png``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from replay.compare import DISTRIBUTIONS
from replay.report import REAL_COLOR, SIM_COLOR

from ..support.browser import chromium
from ..support.daemon import REPO, clean_env
from ..support.stored import create_store, write
from ..support.synthetic import real_conversations, sim_records

pytestmark = pytest.mark.slow  # it drives a browser

SCREENSHOT = REPO / "docs" / "replay-compare.png"


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    with chromium(tmp_path / "chromium", window="1200,1500", extra=("--hide-scrollbars",)) as driver:
        yield driver


def _cli(folder: Path, *args: str) -> None:
    res = subprocess.run([sys.executable, "-m", "collector", *args], capture_output=True, text=True,
                         env=clean_env(), timeout=300, cwd=folder)
    assert res.returncode == 0, res.stderr


# Per figure: its key, its drawn size, and the bars of each side with a height (matplotlib draws a bar as a
# path filled with the side's colour).
FIGURES_JS = """
return Array.from(document.querySelectorAll('figure')).map(f => {
  const svg = f.querySelector('svg');
  const box = svg ? svg.getBoundingClientRect() : {width: 0, height: 0};
  const bars = color => svg ? Array.from(svg.querySelectorAll(`path[style*="fill: ${color}"]`))
      .filter(p => p.getBoundingClientRect().height > 0 && p.getBoundingClientRect().width > 0).length : 0;
  return {key: f.dataset.key, kind: f.className, width: box.width, height: box.height,
          sim: bars(arguments[0]), real: bars(arguments[1])};
});
"""


def test_the_report_draws_every_histogram_side_by_side(browser: Any, tmp_path: Path) -> None:
    create_store(tmp_path / "tracejudge.duckdb")
    write(tmp_path / "tracejudge.duckdb", real_conversations(1500))
    (tmp_path / "otel-config.yaml").write_text("storage:\n  duckdb: {path: ./tracejudge.duckdb}\n", encoding="utf-8")
    (tmp_path / "sim.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sim_records(1500)), encoding="utf-8")
    _cli(tmp_path, "replay", "export", "--out", "real.jsonl")
    _cli(tmp_path, "replay", "compare", "sim.jsonl", "real.jsonl", "--html", "report.html")

    browser.get((tmp_path / "report.html").as_uri())
    assert browser.title == "Simulated vs real conversations"
    figures = browser.execute_script(FIGURES_JS, SIM_COLOR, REAL_COLOR)
    assert [f["key"] for f in figures if f["kind"] == "histogram"] == [key for key, _, _ in DISTRIBUTIONS]
    assert [f["key"] for f in figures if f["kind"] == "mix"] == ["ended_by", "languages"]
    for f in figures:
        assert f["width"] > 600 and f["height"] > 100, f  # laid out at its size, not collapsed
        assert f["sim"] > 0 and f["real"] > 0, f  # bars of both sides drawn
    # The summary table names both files, and the page fits its window's width.
    text = browser.find_element("css selector", "table").text
    assert "sim.jsonl" in text and "real.jsonl" in text and "median" in text
    assert browser.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
    browser.save_screenshot(str(tmp_path / "report.png"))
    if os.environ.get("TRACEJUDGE_SCREENSHOTS") == "1":
        browser.set_window_size(1200, 1500)
        browser.execute_script("window.scrollTo(0, 0)")
        browser.save_screenshot(str(SCREENSHOT))
