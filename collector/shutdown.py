"""Stop requests: SIGTERM and SIGINT, from before the daemon starts until its process exits.

Lifecycle: ``StopSignals().install()`` first thing in ``tracejudge serve`` (a signal
during start-up is remembered in ``requested``, and start-up stops at its next
step) -> ``attach()`` first thing on the daemon's loop (a signal then wakes it)
-> ``wait()`` while serving -> ``ignore()`` once everything has stopped.

One handler for the whole process (DESIGN: one asyncio process, one signal
handler), installed with ``signal.signal`` rather than ``loop.add_signal_handler``:
``loop.close()`` removes the loop's handlers, and a second signal (Ctrl-C reaches
every process of the group, then ``demo`` forwards SIGTERM) would then kill a
daemon still finishing its shutdown. ``ignore()`` covers the last stretch: the
interpreter restores the default action of signals with Python handlers as it
exits.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType

log = logging.getLogger("tracejudge.daemon")

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """SIGTERM and SIGINT as one stop request; later signals are logged and change nothing."""

    def __init__(self) -> None:
        self.received: list[str] = []  # signal names, in arrival order
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    @property
    def requested(self) -> bool:
        return bool(self.received)

    def install(self) -> StopSignals:
        for sig in SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def ignore(self) -> None:
        """Everything has stopped: a signal from here to the exit changes nothing."""
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Runs in the main thread between two bytecodes: record, and leave the rest to the loop.
        self.received.append(signal.Signals(signum).name)
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._on_loop, len(self.received))
            except RuntimeError:  # the loop has closed: the shutdown is past needing it
                pass

    def _on_loop(self, count: int) -> None:
        if count == 1:
            assert self._event is not None
            self._event.set()
        else:
            log.info("%s received while stopping: the shutdown continues (SIGKILL cuts it short)",
                     self.received[count - 1])

    def attach(self) -> None:
        """From now on a signal wakes the running loop (call first thing on it)."""
        self._event = asyncio.Event()
        if self.requested:
            self._event.set()
        self._loop = asyncio.get_running_loop()

    async def wait(self) -> str:
        """The name of the first signal, once one has arrived (``attach`` first)."""
        assert self._event is not None
        await self._event.wait()
        return self.received[0]
