"""The reading subcommands where a newcomer starts: no daemon, no database, and how output is written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from collector.cli.common import table
from collector.cli.conversations import render
from collector.words import percent, plural

from ..support.daemon import clean_env

READERS = [["conversations", "list"], ["conversations", "show", "c-1"], ["verdicts"], ["stats"],
           ["review", "list"], ["review", "show", "1"]]


def cli_in(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``tracejudge ARGS`` run from ``folder``, as a newcomer types it there."""
    return subprocess.run([sys.executable, "-m", "collector", *args], capture_output=True, text=True,
                          env=clean_env(), timeout=120, cwd=folder)


def one_line_error(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    return res.stderr


@pytest.mark.parametrize("args", READERS, ids=[" ".join(a) for a in READERS])
def test_no_daemon_and_no_database_names_the_file_and_suggests_config(tmp_path: Path, args: list[str]) -> None:
    err = one_line_error(cli_in(tmp_path, *args))
    assert str(tmp_path / "tracejudge.duckdb") in err and "no daemon is running" in err
    assert "no --config given and no ./otel-config.yaml here" in err and "--config FILE" in err
    assert "tracejudge-demo" not in err


def test_the_demos_config_is_suggested_when_it_is_there(tmp_path: Path) -> None:
    demo = tmp_path / "tracejudge-demo"
    demo.mkdir()
    (demo / "otel-config.yaml").write_text("storage:\n  duckdb: {path: ./demo.duckdb}\n", encoding="utf-8")
    err = one_line_error(cli_in(tmp_path, "conversations", "list"))
    assert "--config tracejudge-demo/otel-config.yaml" in err
    # Given the demo's config itself (its daemon stopped, its data gone), the hint does not repeat it.
    err = one_line_error(cli_in(tmp_path, "stats", "--config", "tracejudge-demo/otel-config.yaml"))
    assert str(demo / "demo.duckdb") in err and "storage.duckdb.path of tracejudge-demo/otel-config.yaml" in err
    assert "e.g. --config" not in err


def test_plurals_and_percentages() -> None:
    assert [plural(n, "turn") for n in (0, 1, 2)] == ["0 turns", "1 turn", "2 turns"]
    assert plural(1, "criterion", "criteria") == "1 criterion" and plural(3, "criterion", "criteria") == "3 criteria"
    assert [percent(r) for r in (1, 0.1, 0.125, 0.05, 0)] == ["100%", "10%", "12.5%", "5%", "0%"]


def test_table_columns_line_up_whatever_the_widths() -> None:
    rows = [["item", "state", "criterion", "conversation"], ["7", "confirmed by Dr. Amal Haddad", "x", "c-1"],
            ["12", "pending", "a-much-longer-criterion-id", "c-2"]]
    lines = table(rows, align="rll").splitlines()
    for column in (1, 2, 3):
        starts = {line.index(row[column], len("  ".join(row[:column]))) for line, row in zip(lines, rows)}
        assert len(starts) == 1, (column, lines)
    assert lines[1].startswith("   7  ") and lines[2].startswith("  12  ")


def test_an_open_conversation_reads_still_open() -> None:
    record = {"id": "c-1", "service": "bot", "started_at": "2026-11-30T09:00:00Z", "ended_at": None,
              "ended_by": "open", "messages": [], "attributes": {}}
    text = render(record)
    assert "still open" in text and "ended by" not in text and ": open" not in text
    assert "ended by handover" in render({**record, "ended_by": "handover", "ended_at": "2026-11-30T09:05:00Z"})
