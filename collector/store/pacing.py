"""Ingestion first: how a background stage gives way to the receivers.

The receivers, the conversation stage and the evaluator share one interpreter
lock, two cores and DuckDB; requests come first. Ingestion is busy while
something waits to be stored, and for ``idle_gap`` after the queue last
emptied (``Store.idle_seconds``: the store's one notion of it). A stage's work
runs in pieces, each when ingestion pauses; once the stage has waited
``max_wait`` without a pause it works anyway, at most ``share`` of the time,
until a pause comes.

``Store.pacing(...)`` gives each stage a ``Pacing`` of its own (its own waiting
clock and share) over that one notion.

Lifecycle: one per stage, used by one thread (or one event loop) at a time.
``ready()`` (non-blocking), ``wait(stop)`` (blocking) or ``await turn(stop)``
(async) grant a piece; ``done()`` ends it (the share is kept by leaving
``1/share - 1`` times the piece's length before the next forced piece), and
``checkpoint(stop)`` does both for work that runs in one stretch, once it has
run ``piece`` seconds. ``rest()`` says the stage has done what it had: its
next work waits up to ``max_wait`` for a pause again.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from typing import Callable


class Pacing:
    """When a background stage's next piece of work may run (see the module docstring)."""

    def __init__(self, idle_seconds: Callable[[], float], *, idle_gap: float, share: float, max_wait: float,
                 poll: float, piece: float = math.inf, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], not {share}")
        self._idle_seconds = idle_seconds
        self.idle_gap = idle_gap
        """Seconds with nothing waiting to be stored that make a pause in ingestion."""
        self.share = share
        """The most of the time work takes while it runs without a pause (after ``max_wait``)."""
        self.max_wait = max_wait
        """Seconds work waits for a pause before it takes its share anyway."""
        self.piece = piece
        """Seconds of work between two checkpoints (``checkpoint``)."""
        self.poll = poll
        """Seconds between two looks at ingestion while waiting."""
        self._clock = clock
        self._waiting_since: float | None = None  # since when work has waited for a pause
        self._next_turn = 0.0  # the earliest start of a piece that does not wait for a pause
        self._began: float | None = None  # when the current piece began

    def busy(self) -> bool:
        """Whether ingestion is busy now (something to store, or the queue emptied under ``idle_gap`` ago)."""
        return self._idle_seconds() < self.idle_gap

    def ready(self) -> bool:
        """Whether a piece may start now; if so it has begun (end it with ``done``)."""
        now = self._clock()
        if not self.busy():
            self._waiting_since = None
        else:
            if self._waiting_since is None:
                self._waiting_since = now
            if now - self._waiting_since < self.max_wait or now < self._next_turn:
                return False
        self._began = now
        return True

    def wait(self, stop: threading.Event | None = None) -> bool:
        """Block until a piece may start (it has begun); False if ``stop`` was set first."""
        while not self.ready():
            if stop is None:
                time.sleep(self.poll)
            elif stop.wait(self.poll):
                return False
        return True

    async def turn(self, stop: threading.Event | None = None) -> bool:
        """``wait`` for an event loop; False if ``stop`` was set first."""
        while not self.ready():
            if stop is not None and stop.is_set():
                return False
            await asyncio.sleep(self.poll)
        return True

    def done(self) -> None:
        """The piece has ended: the next one that does not wait for a pause keeps the share."""
        if self._began is not None:
            now = self._clock()
            self._next_turn = now + (now - self._began) * (1 / self.share - 1)
            self._began = None

    def checkpoint(self, stop: threading.Event | None = None) -> bool:
        """Within work that runs in one stretch: once the piece has run ``piece`` seconds, end it and
        wait for the next. False if ``stop`` was set while waiting."""
        if self._began is not None and self._clock() - self._began < self.piece:
            return True
        self.done()
        return self.wait(stop)

    def rest(self) -> None:
        """The stage has done what it had: its next work waits up to ``max_wait`` for a pause again."""
        self.done()
        self._waiting_since = None
