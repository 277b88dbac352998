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


@pytest.fixture(autouse=True)
def no_daemon_left() -> Iterator[None]:
    """Every daemon a test made ends with the test, also one it never stopped because it failed first:
    a daemon left running holds its ports and its file, and outlives the suite. Daemons of module-scoped
    fixtures were made before this and are their fixture's to stop."""
    before = len(DaemonProcess.started)
    yield
    for d in DaemonProcess.started[before:]:
        d.end()
    del DaemonProcess.started[before:]


def pytest_sessionfinish() -> None:
    for d in DaemonProcess.started:  # those of module-scoped fixtures, if one did not stop its own
        d.end()


@pytest.fixture
def make_daemon(tmp_path: Path) -> Any:
    def make(env: dict[str, str] | None = None, start: bool = True, **sections: Any) -> DaemonProcess:
        d = DaemonProcess(tmp_path, base_config(tmp_path, **sections), env)
        return d.start() if start else d

    return make


@pytest.fixture
def daemon(make_daemon: Any) -> DaemonProcess:
    return make_daemon()  # type: ignore[no-any-return]
