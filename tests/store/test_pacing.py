"""The one ingestion-first pace both background stages follow, on an injected clock."""

from __future__ import annotations

import threading

import pytest

from collector.store.pacing import Pacing


class World:
    """The clock and the store's idle seconds, both set by the test."""

    def __init__(self) -> None:
        self.now = 100.0
        self.idle = 0.0  # seconds since ingestion's queue last emptied (0: something waits to be stored)

    def pacing(self, **kw: float) -> Pacing:
        args = {"idle_gap": 0.1, "share": 0.25, "max_wait": 30.0, "poll": 0.01, **kw}
        return Pacing(lambda: self.idle, clock=lambda: self.now, **args)


def test_work_runs_at_once_in_a_pause_of_ingestion() -> None:
    w = World()
    w.idle = 0.5
    assert w.pacing().ready()


def test_work_waits_for_a_pause_then_takes_its_share() -> None:
    w = World()
    p = w.pacing()
    assert not p.ready()  # busy: it starts waiting now
    w.now += 29.9
    assert not p.ready()
    w.now += 0.1  # waited max_wait without a pause
    assert p.ready()
    w.now += 2.0  # the piece ran 2 s
    p.done()
    w.now += 5.9  # a quarter of the time: 2 s of work, then 6 s for ingestion
    assert not p.ready()
    w.now += 0.1
    assert p.ready()


def test_a_pause_starts_the_wait_again_and_rest_does_too() -> None:
    w = World()
    p = w.pacing()
    assert not p.ready()
    w.now += 20
    w.idle = 1.0
    assert p.ready()  # a pause: it works
    p.done()
    w.idle = 0.0
    w.now += 15
    assert not p.ready()  # busy again: a new wait of max_wait from now
    w.now += 30
    assert p.ready()
    p.rest()  # it has done what it had: the next work waits for a pause again
    w.now += 1
    assert not p.ready()


def test_checkpoint_gives_way_once_a_piece_has_run_and_stop_ends_the_wait() -> None:
    w = World()
    p = w.pacing(max_wait=0.0, piece=0.02)
    assert p.ready()  # max_wait 0: its share at once
    w.now += 0.01
    assert p.checkpoint()  # the piece has run under 20 ms: go on
    w.now += 0.02
    stop = threading.Event()
    stop.set()
    assert not p.checkpoint(stop)  # its share is used up and ingestion is busy: the stop ends the wait


def test_share_must_be_a_fraction() -> None:
    with pytest.raises(ValueError, match="share must be in"):
        World().pacing(share=0)
