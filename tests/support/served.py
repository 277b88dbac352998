"""The conversation stage's statements over a pipe to the daemon's side of the stage process, in one process.

``Served(store, settings)``: ``store`` for a ``Conversations`` stage (a ``RemoteStore``) whose cursor sends
its statements through a real pipe to ``StageProcess._serve``, which runs them on a cursor of the real
``store`` in a thread, as the daemon does for its stage process; ``close()`` ends it.
"""

from __future__ import annotations

import multiprocessing
import threading
from typing import Any

from collector.config import Conversations as Settings
from collector.conversations.process import RemoteCursor, RemoteStore, StageProcess
from collector.metrics import Metrics
from collector.store import Store


class Counting(RemoteCursor):
    """The stage process's cursor, counting the reads it posts ahead."""

    read_ahead = 0

    def query_ahead(self, queries: Any) -> Any:
        self.read_ahead += 1
        return super().query_ahead(queries)


class Gated(StageProcess):
    """The daemon's side of the stage process, answering while ``gate`` is open."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.gate = threading.Event()
        self.gate.set()

    def _answer(self, cur: Any, request: tuple[Any, ...]) -> Any:
        self.gate.wait()
        return super()._answer(cur, request)


class Served:
    """A stage's cursor whose statements the daemon's side of the stage process (``StageProcess._serve``)
    runs on ``store``, over a pipe."""

    def __init__(self, store: Store, settings: Settings) -> None:
        theirs, ours = multiprocessing.Pipe()
        self.server = Gated(store, settings, Metrics())
        self.server.cur = store.cursor()
        self.thread = threading.Thread(target=self.server._serve, args=(theirs,), daemon=True)
        self.thread.start()
        self.ours = ours
        self.cursor = Counting(ours, threading.Lock())
        self.store = RemoteStore(self.cursor)

    def close(self) -> None:
        self.ours.close()
        self.thread.join(30)
        assert not self.thread.is_alive()
        assert self.server.cur is not None
        self.server.cur.close()
