"""Shared test fixtures (the helpers they use are in ``tests.support``), and the property-test profile."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import settings

from .support.daemon import DaemonProcess, base_config

# Property tests run the same examples every run, so that one never fails one run in eight;
# HYPOTHESIS_PROFILE=explore draws new ones (and keeps what fails in .hypothesis/) when hunting bugs.
settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("explore")
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator[Any]:
    started: list[DaemonProcess] = []

    def make(env: dict[str, str] | None = None, start: bool = True, **sections: Any) -> DaemonProcess:
        d = DaemonProcess(tmp_path, base_config(tmp_path, **sections), env)
        started.append(d)
        return d.start() if start else d

    yield make
    for d in started:
        if d.proc is not None and d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()
        if hasattr(d, "log") and not d.log.closed:
            d.log.close()


@pytest.fixture
def daemon(make_daemon: Any) -> DaemonProcess:
    return make_daemon()  # type: ignore[no-any-return]
