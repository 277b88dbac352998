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

The kernel hands a process's signal to any thread that does not block it, and
the Python handler runs only when the main thread next runs bytecode: a loop
asleep in ``select`` with nothing to do would sleep through a SIGTERM that
landed on a DuckDB or gRPC thread. ``attach()`` therefore points the signal
wakeup fd at a socket the loop reads, which wakes it whichever thread took the
signal.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
from types import FrameType

log = logging.getLogger("tracejudge.daemon")

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """SIGTERM and SIGINT as one stop request; later signals are logged and change nothing."""

    def __init__(self) -> None:
        self.received: list[str] = []  # signal names, in arrival order
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self._wakeup: tuple[socket.socket, socket.socket] | None = None

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
        if self._wakeup is not None:
            signal.set_wakeup_fd(-1)
            for sock in self._wakeup:
                sock.close()
            self._wakeup = None

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
        self._loop = loop = asyncio.get_running_loop()
        if threading.current_thread() is threading.main_thread() and self._wakeup is None:
            read, write = socket.socketpair()
            read.setblocking(False)
            write.setblocking(False)
            loop.add_reader(read.fileno(), _drain, read)
            signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
            self._wakeup = (read, write)

    async def wait(self) -> str:
        """The name of the first signal, once one has arrived (``attach`` first)."""
        assert self._event is not None
        await self._event.wait()
        return self.received[0]


def _drain(sock: socket.socket) -> None:
    """Empty the wakeup socket; waking the loop was the point (the handler itself runs as bytecode)."""
    try:
        while sock.recv(512):
            pass
    except (BlockingIOError, InterruptedError):
        pass
