"""Verdict cache: judging the same transcript again by the same judge costs nothing.

A verdict is reused when the criterion id, its version, the prompt text (the
frame and the criterion prompt), the judge (provider and model) and the
transcript hash are all the same. ``error`` verdicts are never stored: the next
run tries again.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import NamedTuple, Protocol

from pydantic import ValidationError

from ._jsonl import json_line, split_json_lines
from ._verdict import Verdict


class CacheKey(NamedTuple):
    """What must match for a verdict to be reused."""

    criterion_id: str
    criterion_version: int
    prompt_sha256: str
    judge: str
    """``provider/model``."""
    transcript_sha256: str


class VerdictCache(Protocol):
    """Where verdicts are kept between runs. Calls come from one event loop and must not block long."""

    def get(self, key: CacheKey) -> Verdict | None:
        """The verdict stored under ``key``, if any."""
        ...

    def put(self, key: CacheKey, verdict: Verdict) -> None:
        """Store a verdict (callers never pass ``error`` verdicts)."""
        ...


class MemoryCache:
    """A cache that lives as long as the object."""

    def __init__(self) -> None:
        self._data: dict[CacheKey, Verdict] = {}

    def get(self, key: CacheKey) -> Verdict | None:
        """See ``VerdictCache.get``."""
        return self._data.get(key)

    def put(self, key: CacheKey, verdict: Verdict) -> None:
        """See ``VerdictCache.put``."""
        if verdict.result != "error":
            self._data[key] = verdict

    def __len__(self) -> int:
        return len(self._data)


class DiskCache(MemoryCache):
    """A cache in one append-only JSON-lines file, read whole when opened.

    Each line is ``{"key": [...], "verdict": {...}}``; a torn or unreadable line
    (a run killed mid-write, an older format) is skipped, which only costs a
    judge call.

    Args:
        path: the file; created with its folder when missing.
    """

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self.path = Path(path)
        self._lock = threading.Lock()
        if self.path.exists():
            for line in split_json_lines(self.path.read_text(encoding="utf-8")):
                try:
                    row = json.loads(line)
                    key = CacheKey(*row["key"])
                    self._data[key] = Verdict.model_validate(row["verdict"])
                except (ValueError, KeyError, TypeError, ValidationError):
                    continue

    def put(self, key: CacheKey, verdict: Verdict) -> None:
        """Store a verdict in memory and append it to the file (see ``VerdictCache.put``)."""
        if verdict.result == "error" or self._data.get(key) == verdict:
            return
        self._data[key] = verdict
        line = json_line({"key": list(key), "verdict": verdict.model_dump(mode="json")})
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as f:
                f.write(line)
