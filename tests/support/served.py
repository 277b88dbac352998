"""The conversation stage's operations over a pipe to the daemon's side of the stage process, in one process.

``Served(store)``: ``data``, a ``RemoteData`` whose operations go through a real pipe to
``StageProcess._serve``, which runs them on a ``DuckData`` over a cursor of the real ``store`` in a thread,
as the daemon does for its stage process; ``close()`` ends it. ``stage_on(store, settings, served)`` is a
stage on either.
"""

from __future__ import annotations

import multiprocessing
import threading
from typing import Any

from collector.config import Conversations as Settings
from collector.conversations.data import CommitRows, Later
from collector.conversations.duck import DuckData
from collector.conversations.stage import local_stage
from collector.conversations.process import RemoteData, StageProcess
from collector.conversations.stage import Conversations
from collector.metrics import Metrics
from collector.store import Store


class Counting(RemoteData):
    """The stage process's data, counting the reads of commits it posts."""

    read_ahead = 0

    def commit_rows(self, first: int, last: int) -> Later[CommitRows]:
        self.read_ahead += 1
        return super().commit_rows(first, last)


class Gated(StageProcess):
    """The daemon's side of the stage process, answering while ``gate`` is open."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.gate = threading.Event()
        self.gate.set()

    def _answer(self, data: DuckData, name: str, args: tuple[Any, ...]) -> Any:
        self.gate.wait()
        return super()._answer(data, name, args)


class Served:
    """A stage's data whose operations the daemon's side of the stage process (``StageProcess._serve``)
    runs on ``store``, over a pipe."""

    def __init__(self, store: Store, settings: Settings | None = None) -> None:
        theirs, ours = multiprocessing.Pipe()
        self.server = Gated(store, settings or Settings(), Metrics())
        self.server.cur = store.cursor()
        self.server.data = DuckData(self.server.cur, store)
        self.thread = threading.Thread(target=self.server._serve, args=(theirs,), daemon=True)
        self.thread.start()
        self.ours = ours
        self.data = Counting(ours)

    def close(self) -> None:
        self.ours.close()
        self.thread.join(30)
        assert not self.thread.is_alive()
        assert self.server.cur is not None
        self.server.cur.close()


def stage_on(store: Store, settings: Settings, served: Served | None = None, **kw: Any) -> Conversations:
    """A stage on ``store`` in this process, or with ``served`` on its data over the pipe, as in the stage
    process: never busy there (it gives way through its nice value), so ``idle_gap`` and ``max_wait`` go."""
    if served is None:
        return local_stage(store, settings, **kw)
    kw.pop("idle_gap", None)
    kw.pop("max_wait", None)
    return Conversations(served.data, settings, **kw)
