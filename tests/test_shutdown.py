"""Stop signals: one that the kernel hands to a thread other than the main one still wakes the loop."""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from collections.abc import Iterator

import pytest

from collector.system.shutdown import SIGNALS, StopSignals

from .support.daemon import wait_until


@pytest.fixture
def signals() -> Iterator[StopSignals]:
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    stop = StopSignals().install()
    try:
        yield stop
    finally:
        stop.ignore()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_a_signal_taken_by_another_thread_wakes_an_idle_loop(signals: StopSignals) -> None:
    """A SIGTERM delivered to a DuckDB or gRPC thread: the idle loop would sleep through it without a wakeup fd."""

    main_thread = threading.get_ident()

    def signal_once_the_loop_sleeps() -> None:
        # Wait until the main thread sits in the selector's poll, then signal this thread itself,
        # so the main thread is not the one the signal interrupts.
        def in_select() -> bool:
            frame = sys._current_frames().get(main_thread)
            return frame is not None and frame.f_code.co_name == "select"

        wait_until(in_select, "the loop to sleep in select", interval=0.001)
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

    async def main() -> tuple[str, bool]:
        signals.attach()
        threading.Thread(target=signal_once_the_loop_sleeps, daemon=True).start()
        # Nothing else is scheduled: the loop wakes for the signal, or else only for this timer.
        timer = asyncio.get_running_loop().call_later(30, lambda: None)
        name = await signals.wait()
        return name, timer.when() <= asyncio.get_running_loop().time()

    name, woken_by_the_timer = asyncio.run(main())
    assert name == "SIGTERM" and not woken_by_the_timer
    assert signals.received == ["SIGTERM"]


def test_ignore_leaves_no_wakeup_fd_behind(signals: StopSignals) -> None:
    async def main() -> None:
        signals.attach()

    asyncio.run(main())
    signals.ignore()
    assert signal.set_wakeup_fd(-1) == -1  # nothing was left pointing at a closed socket
