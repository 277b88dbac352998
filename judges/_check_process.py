"""Code checks in worker processes: a time limit that holds, and the caller's interpreter left free.

A code check is a regex or a team's own Python, and either can run for
minutes: inside ``re`` the interpreter lock is held until the match returns,
so in the caller's process one slow check would stop every other thread (a
daemon's receivers among them), and no thread could end it. Each check
therefore runs in a worker process, and one that runs past its criterion's
``timeout`` has its worker killed: the check records ``error``, never a verdict.

The built-in checks that only walk the messages (``tool_called``, ``ended_by``,
``max_user_turns``, with no ``applies_if`` pattern) cannot run long: they run in
the caller's process, and a daemon that uses only those starts no worker.

Lifecycle: ``pool()`` is shared by every run and event loop of the process.
A worker is started (``python -c``, with the caller's ``sys.path``) when a
check finds none idle, at most one per thread of the pool; it answers pickled
requests over a pipe and is kept for the next check, for ``IDLE_LIMIT`` seconds at
most (each holds about 25 MB: a daemon at rest keeps none). It is killed when its check runs
out of time or its caller is cancelled, and it exits by itself when its pipe
closes (the caller exited, even by ``kill -9``) or, as a last resort, when a
check outlives its limit by ``GRACE`` seconds. Workers left at exit are killed.

Unix only (pipes passed by descriptor). A check and its parameters travel by
pickle: built-in checks, ``python`` checks (their ``module:function`` is
imported again in the worker) and outside checks defined at the top level of
an importable module.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from ._checks import CodeCheck
from ._criteria import CodeCriterion
from ._transcript import Conversation
from ._verdict import CheckResult

GRACE = 1.0
"""Seconds past its limit after which a check's worker ends itself (its caller may be gone)."""
START_TIMEOUT = 60.0
"""Seconds a new worker may take to import what it needs (not counted in a check's limit)."""
IDLE_LIMIT = 60.0
"""Seconds an idle worker is kept for the next check before it is stopped (each holds about 25 MB)."""
_READY = "ready"
_BOOT = ("import json, sys; sys.path[:] = json.loads(sys.argv[3]); "
         "from judges._check_process import serve; serve(int(sys.argv[1]), int(sys.argv[2]))")


class CheckFailed(Exception):
    """A check gave no result: ``code`` (``timeout``, ``check_failed``) and ``detail`` make the error's reason."""

    def __init__(self, code: str, detail: str) -> None:
        self.code = code
        self.detail = detail
        super().__init__(f"{code}: {detail}")


# --------------------------------------------------------------- the worker's side


def decide(check: CodeCheck, criterion: CodeCriterion, conversation: Conversation) -> CheckResult | None:
    """Run one code criterion on a conversation; None when its ``applies_if`` does not hold."""
    if criterion.applies_if is not None and not criterion.applies_if.holds(conversation):
        return None
    out = check.run(conversation, criterion.params)
    return out if isinstance(out, CheckResult) else CheckResult.model_validate(out)


def in_process(check: CodeCheck, criterion: CodeCriterion) -> bool:
    """Whether a check runs in the caller's process: a ``bounded`` one (one walk over the messages,
    no pattern, no outside code) whose ``applies_if`` has no pattern. It takes microseconds, and a
    worker would cost a process of about 25 MB and a round trip."""
    return getattr(check, "bounded", False) is True and (
        criterion.applies_if is None or not criterion.applies_if.has_patterns)


def _answer(message: bytes) -> tuple[str, Any]:
    try:
        check, criterion, conversation = pickle.loads(message)
    except Exception as exc:  # noqa: BLE001 - e.g. a module the worker cannot import
        return ("failed", f"cannot load the check in its worker process: {type(exc).__name__}: {exc}")
    # SIGALRM's default action ends the process whatever the check holds: the last resort
    # when the caller is gone and cannot kill this worker.
    signal.setitimer(signal.ITIMER_REAL, criterion.timeout + GRACE)
    try:
        return ("done", decide(check, criterion, conversation))
    except BaseException as exc:  # noqa: BLE001 - a check that raises (even SystemExit) records error
        return ("raised", f"{type(exc).__name__}: {exc}")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def serve(read_fd: int, write_fd: int) -> None:
    """The worker's loop: one request in, one reply out, until the pipe closes."""
    # Signals for a whole process group or cgroup (Ctrl-C, a service manager's stop) are the caller's:
    # it stops its workers itself, and a check cut short here would record a spurious error.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    requests, replies = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    replies.send(_READY)
    while True:
        try:
            reply = _answer(requests.recv_bytes())
            try:
                replies.send(reply)
            except (pickle.PicklingError, TypeError, AttributeError) as exc:  # a result that does not pickle
                replies.send(("raised", f"{type(exc).__name__}: {exc}"))
        except (EOFError, OSError):
            return  # the caller is gone


# --------------------------------------------------------------- the caller's side


class _Worker:
    """One worker process and the two ends of its pipes that the caller holds."""

    def __init__(self) -> None:
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(req_r), str(rep_w), json.dumps([str(p) for p in sys.path])],
                pass_fds=(req_r, rep_w), stdin=subprocess.DEVNULL)
        except BaseException:
            for fd in (req_r, req_w, rep_r, rep_w):
                os.close(fd)
            raise
        os.close(req_r)
        os.close(rep_w)
        self.requests = Connection(req_w, readable=False)
        self.replies = Connection(rep_r, writable=False)
        if not self.replies.poll(START_TIMEOUT) or self._recv() != _READY:
            code = self.proc.poll()
            self.close()
            why = f"within {START_TIMEOUT:g}s" if code is None else f"(exit code {code})"
            raise CheckFailed("check_failed", f"its worker process did not start {why}")

    def _recv(self) -> Any:
        try:
            return self.replies.recv()
        except (EOFError, OSError):
            return None

    def call(self, message: bytes, limit: float) -> tuple[str, Any]:
        """Send one request, wait at most ``limit`` seconds for its reply.

        Raises:
            CheckFailed: out of time, or the worker ended; the worker is then closed.
        """
        try:
            self.requests.send_bytes(message)
        except OSError:
            self.close()
            raise CheckFailed("check_failed", f"its worker process ended (exit code {self.proc.returncode})") from None
        if not self.replies.poll(limit):
            self.close()
            raise CheckFailed("timeout", f"check ran longer than {limit:g}s")
        reply = self._recv()
        if reply is None:
            self.close()
            raise CheckFailed("check_failed", f"its worker process ended (exit code {self.proc.returncode})")
        return reply  # type: ignore[no-any-return]

    def kill(self) -> None:
        """Stop the process now; its owner's ``call`` then returns (from any thread)."""
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass

    def close(self) -> None:
        """Kill, reap and release the pipes (by the thread that owns the worker); again is a no-op."""
        self.kill()
        self.proc.wait()
        self.requests.close()
        self.replies.close()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None and not self.requests.closed


class _Call:
    """One check on its way: lets the event loop's side stop the worker a thread waits for."""

    def __init__(self) -> None:
        self.cancelled = False
        self.worker: _Worker | None = None


class WorkerPool:
    """``size`` threads, each waiting for one worker at a time; idle workers kept for the next check,
    for ``idle_limit`` seconds at most (a thread of the pool's own stops the others).

    The threads are the pool's own, so checks queued behind slow ones never
    hold up the event loop's default executor (DNS lookups of judge calls).
    """

    def __init__(self, size: int, idle_limit: float = IDLE_LIMIT) -> None:
        self.pid = os.getpid()
        self.size = size
        self.idle_limit = idle_limit
        self.threads = ThreadPoolExecutor(max_workers=size, thread_name_prefix="judges-check")
        self._lock = threading.Lock()
        self._idle: list[tuple[_Worker, float]] = []  # (worker, idle since), the most recently used last
        self._closed = threading.Event()
        self._reaper: threading.Thread | None = None

    def run(self, message: bytes, limit: float, call: _Call) -> tuple[str, Any]:
        """Run one pickled request on a worker (blocking: on one of ``threads``); see ``_Worker.call``."""
        with self._lock:
            worker = self._idle.pop()[0] if self._idle else None
        if worker is not None and not worker.alive:  # ended while idle (killed from outside)
            worker.close()
            worker = None
        worker = worker or _Worker()
        with self._lock:
            call.worker = worker
            cancelled = call.cancelled
        try:
            if cancelled:
                raise CheckFailed("check_failed", "cancelled")
            return worker.call(message, limit)
        finally:
            with self._lock:
                call.worker = None
                keep = worker.alive and not call.cancelled and not self._closed.is_set()
                if keep:
                    self._idle.append((worker, time.monotonic()))
                    if self._reaper is None:
                        self._reaper = threading.Thread(target=self._reap, name="judges-check-reaper", daemon=True)
                        self._reaper.start()
            if not keep:
                worker.close()

    def _reap(self) -> None:
        """Stop the workers idle for ``idle_limit`` seconds, until the pool closes."""
        while not self._closed.wait(max(self.idle_limit / 4, 0.01)):
            old = time.monotonic() - self.idle_limit
            with self._lock:
                expired = [w for w, since in self._idle if since <= old]
                self._idle = [(w, since) for w, since in self._idle if since > old]
            for worker in expired:
                worker.close()

    def cancel(self, call: _Call) -> None:
        """Stop ``call``: its worker, if it has one yet, is killed (from the event loop's thread)."""
        with self._lock:
            call.cancelled = True
            worker = call.worker
        if worker is not None:
            worker.kill()

    def close(self) -> None:
        """Stop the idle workers (those in use are stopped by their calls)."""
        self._closed.set()
        with self._lock:
            idle, self._idle = self._idle, []
        for worker, _ in idle:
            worker.close()


_POOL: WorkerPool | None = None
_POOL_LOCK = threading.Lock()
_SIZE: int | None = None  # set_check_workers; None: one per core, at most four
_IDLE_LIMIT = IDLE_LIMIT


def set_check_workers(workers: int | None, idle_limit: float = IDLE_LIMIT) -> None:
    """How many code checks run at once, each in a worker process of its own (None: one per core,
    at most four), and how long an idle worker is kept. A pool already started otherwise is stopped
    (its running checks end first) and the next check starts a new one."""
    global _SIZE, _IDLE_LIMIT, _POOL
    if workers is not None and workers < 1:
        raise ValueError(f"check workers must be at least 1, not {workers}")
    if idle_limit <= 0:
        raise ValueError(f"an idle limit is a number of seconds above 0, not {idle_limit}")
    with _POOL_LOCK:
        _SIZE, _IDLE_LIMIT = workers, idle_limit
        old = _POOL
        if old is not None and (old.size, old.idle_limit) != (_pool_size(), idle_limit):
            _POOL = None
    if old is not None and _POOL is None:
        old.threads.shutdown(wait=False)
        old.close()


def _pool_size() -> int:
    return _SIZE if _SIZE is not None else min(4, os.cpu_count() or 1)


def pool() -> WorkerPool:
    """The process's pool (a new one in a forked child: the parent's workers are not its own)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL.pid != os.getpid():
            _POOL = WorkerPool(size=_pool_size(), idle_limit=_IDLE_LIMIT)
        return _POOL


@atexit.register
def _stop_workers() -> None:
    if _POOL is not None and _POOL.pid == os.getpid():
        _POOL.close()


async def run_check(check: CodeCheck, criterion: CodeCriterion, conversation: Conversation) -> CheckResult | None:
    """``decide`` in a worker process, within ``criterion.timeout`` seconds; here and now if it is
    ``in_process``.

    Raises:
        CheckFailed: out of time, the check raised, or it could not be run; the message is the reason.
    """
    if in_process(check, criterion):
        try:
            return decide(check, criterion, conversation)
        except Exception as exc:  # noqa: BLE001 - a check that raises records error, as in a worker
            raise CheckFailed("check_failed", f"{type(exc).__name__}: {exc}") from None
    try:
        message = pickle.dumps((check, criterion, conversation), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - pickling raises many kinds
        raise CheckFailed("check_failed", f"cannot send the check to its worker process ({type(exc).__name__}: "
                          f"{exc}): define it at the top level of an importable module") from None
    workers, call = pool(), _Call()
    try:
        kind, value = await asyncio.get_running_loop().run_in_executor(
            workers.threads, workers.run, message, criterion.timeout, call)
    except asyncio.CancelledError:
        workers.cancel(call)  # a queued call never starts; a running one returns at once: its worker is gone
        raise
    if kind == "done":
        return value  # type: ignore[no-any-return]
    raise CheckFailed("check_failed", str(value))
