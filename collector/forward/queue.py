"""The forward queue: each accepted request written once, on disk, with a cursor per exporter.

Request bodies are appended to segment files (``bodies/<n>.seg``). A SQLite
file in WAL mode (``index.sqlite``, the standard library's ``sqlite3``) holds,
per request, its signal, size, arrival time and place in a segment, and per
exporter how far it got (``cursors``: the last sequence number it delivered or
dropped). Every exporter reads the same bodies from its own cursor, so a
request costs one write however many exporters forward it.

Why not the bodies in SQLite: a body of hundreds of KB in a WAL database is
written twice (the WAL, then the checkpoint) and its pages written again when
it is deleted. Measured on a 600 KB request: 2.9 ms of CPU to put it and 2.8 ms
to read and delete it, per exporter, against 1 ms to append and fsync it once
to a file. SQLite keeps what needs transactions: the index and the cursors.

Why a crash loses nothing acknowledged: the bodies of a group are appended and
``fdatasync``'d, then their index rows are committed (``synchronous=FULL``),
and only then are the ``put`` futures resolved. A crash in between leaves bytes
no row points at, never a row pointing at bytes that are not there. A request
is deleted once every exporter that forwards its signal is past it; a segment
once none of its requests is left; and at the start, every segment no row
points at (what a crash left).

Errors: ``OSError`` (a full disk) or ``sqlite3.Error``: ``put``'s future raises
it, and the receiver answers 503 so the client retries.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("tracejudge.forward")

SCHEMA = """
CREATE TABLE IF NOT EXISTS queue (
    seq INTEGER PRIMARY KEY,
    signal TEXT NOT NULL,
    size INTEGER NOT NULL,
    queued_at REAL NOT NULL,
    segment INTEGER NOT NULL,
    offset INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS cursors (exporter TEXT PRIMARY KEY, seq INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS tried (exporter TEXT, seq INTEGER, PRIMARY KEY (exporter, seq)) WITHOUT ROWID;
"""

SEGMENT_BYTES = 64 * 1024 * 1024
"""A new segment is started once the current one holds this much (disk in use is at most about one segment
more than the largest exporter's queue)."""


@dataclass(frozen=True)
class Item:
    """One queued request."""

    seq: int
    signal: str
    body: bytes
    queued_at: float
    attempts: int
    """1 when this exporter tried to send it before (perhaps delivered, before a crash), else 0."""


def _segment_name(n: int) -> str:
    return f"{n:012d}.seg"


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class ForwardStore:
    """The bodies and the index in ``folder`` (see the module docstring), and one ``ExporterQueue`` per exporter.

    Args:
        exporters: each exporter's name and the signals it forwards. An exporter new to the folder starts at
            the next request; one no longer configured has its cursor removed, with a warning naming what it
            had queued.
    """

    def __init__(self, folder: Path, exporters: Iterable[tuple[str, Sequence[str], int]]) -> None:
        self.folder = folder
        self.bodies = folder / "bodies"
        self.bodies.mkdir(parents=True, exist_ok=True)
        self._con = sqlite3.connect(folder / "index.sqlite", check_same_thread=False, isolation_level=None)
        self._con.execute("PRAGMA journal_mode=WAL")
        self._con.execute("PRAGMA synchronous=FULL")
        self._con.executescript(SCHEMA)
        self._lock = threading.Lock()  # one statement at a time on the connection, and the counters
        # Past every request and every cursor: with all delivered, the queue is empty but the cursors are not.
        self._next = 1 + int(self._con.execute(
            "SELECT max(coalesce((SELECT max(seq) FROM queue), 0), coalesce((SELECT max(seq) FROM cursors), 0))"
        ).fetchone()[0])
        self.queues = {name: ExporterQueue(self, name, tuple(signals), max_bytes)
                       for name, signals, max_bytes in exporters}
        self._open_cursors()
        self._fd: int | None = None  # the segment being appended to, opened at the first append
        self._size = 0
        self._segment = 0
        self._segments: list[int] = []  # the segment files in use, oldest first
        with self._lock:
            self._collect()
            used = {n for (n,) in self._con.execute("SELECT DISTINCT segment FROM queue")}
        for p in self.bodies.glob("*.seg"):  # what a crash left: bytes of requests never committed
            if not (p.stem.isdigit() and int(p.stem) in used):
                p.unlink()
        self._segments = sorted(used)
        self._segment = (self._segments[-1] if self._segments else 0) + 1
        self._pending: list[tuple[str, bytes, float, Future[None]]] = []
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._commit_loop, name="forward-queue", daemon=True)
        self._thread.start()

    def _open_cursors(self) -> None:
        known = dict(self._con.execute("SELECT exporter, seq FROM cursors").fetchall())
        for name in set(known) - set(self.queues):
            n = self._con.execute("SELECT count(*) FROM queue WHERE seq > ?", [known[name]]).fetchone()[0]
            log.warning("exporter %s is no longer configured: the %d requests it had queued are not sent to it",
                        name, n)
            self._con.execute("DELETE FROM cursors WHERE exporter = ?", [name])
            self._con.execute("DELETE FROM tried WHERE exporter = ?", [name])
        for name, q in self.queues.items():
            if name not in known:
                self._con.execute("INSERT INTO cursors VALUES (?, ?)", [name, self._next - 1])
                q.cursor = self._next - 1
            else:
                q.cursor = int(known[name])
            q.recount()

    # ------------------------------------------------------------ appends

    def put(self, signal: str, body: bytes) -> Future[None]:
        """Queue one request for every exporter that forwards ``signal``; the future is resolved once it is on
        disk."""
        fut: Future[None] = Future()
        with self._wake:
            if self._closed:
                fut.set_exception(RuntimeError("the forward queue is closed"))
                return fut
            self._pending.append((signal, body, time.time(), fut))
            self._wake.notify()
        return fut

    def waiting_bytes(self, signal: str) -> int:
        """Bytes of ``signal`` handed to ``put`` and not yet on disk."""
        with self._wake:
            return sum(len(b) for s, b, _, _ in self._pending if s == signal)

    def _commit_loop(self) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._closed:
                    self._wake.wait()
                batch, self._pending = self._pending, []
                if not batch and self._closed:
                    return
            try:
                places = self._append([b for _, b, _, _ in batch])
                with self._lock:
                    seqs = range(self._next, self._next + len(batch))
                    rows = [(seq, s, len(b), t, seg, off) for seq, (s, b, t, _), (seg, off) in zip(seqs, batch, places)]
                    self._con.execute("BEGIN IMMEDIATE")
                    self._con.executemany("INSERT INTO queue VALUES (?, ?, ?, ?, ?, ?)", rows)
                    self._con.execute("COMMIT")
                    self._next += len(batch)
                    for q in self.queues.values():
                        q.added([(s, size, t) for _, s, size, t, _, _ in rows])
            except (OSError, sqlite3.Error) as exc:
                with self._lock:
                    if self._con.in_transaction:
                        self._con.execute("ROLLBACK")
                for *_, fut in batch:
                    fut.set_exception(exc)
                continue
            for *_, fut in batch:
                fut.set_result(None)

    def _append(self, bodies: list[bytes]) -> list[tuple[int, int]]:
        """Write ``bodies`` to the current segment and sync it; where each one is."""
        if self._fd is None or self._size >= SEGMENT_BYTES:
            if self._fd is not None:
                os.close(self._fd)
                self._segment += 1
            self._fd = os.open(self.bodies / _segment_name(self._segment), os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                               0o600)
            dir_fd = os.open(self.bodies, os.O_RDONLY)
            try:
                os.fsync(dir_fd)  # the new file's name survives a power cut too
            finally:
                os.close(dir_fd)
            with self._lock:
                self._segments.append(self._segment)
        offset = os.fstat(self._fd).st_size  # past the bytes of a write that failed half-way, if one did
        places = []
        for body in bodies:
            places.append((self._segment, offset))
            _write_all(self._fd, body)
            offset += len(body)
        os.fdatasync(self._fd)
        self._size = offset
        return places

    # ------------------------------------------------------------ reads and deletes (ExporterQueue's)

    def read(self, rows: Sequence[tuple[int, int, int]]) -> list[bytes]:
        """The bodies at (segment, offset, size)."""
        out: list[bytes] = []
        fds: dict[int, int] = {}
        try:
            for segment, offset, size in rows:
                if segment not in fds:
                    fds[segment] = os.open(self.bodies / _segment_name(segment), os.O_RDONLY)
                body = os.pread(fds[segment], size, offset)
                if len(body) != size:
                    raise OSError(f"segment {_segment_name(segment)} ends before the {size} bytes at {offset}")
                out.append(body)
        finally:
            for fd in fds.values():
                os.close(fd)
        return out

    def _collect(self) -> None:
        """Delete the requests every exporter is past, then the segments no request is left in (under the
        lock)."""
        low = min((q.front_seq() for q in self.queues.values()), default=self._next)
        if self._con.execute("SELECT 1 FROM queue WHERE seq < ? LIMIT 1", [low]).fetchone():
            self._con.execute("DELETE FROM queue WHERE seq < ?", [low])
        first = self._con.execute("SELECT min(segment) FROM queue").fetchone()[0]
        current = self._segment if self._fd is not None else None
        keep = []
        for n in self._segments:
            if (first is None or n < first) and n != current:
                (self.bodies / _segment_name(n)).unlink(missing_ok=True)
            else:
                keep.append(n)
        self._segments = keep

    def secret(self) -> bytes:
        """This folder's random key (made at the first call, kept in ``pseudonym.key``): what keys pseudonyms,
        so that the same id gets the same one across requests and restarts."""
        path = self.folder / "pseudonym.key"
        if path.exists():
            key = path.read_bytes()
            if len(key) != 32:
                raise OSError(f"{path} is not a 32-byte key: remove it to make a new one "
                              "(conversation ids that are personal data then get new pseudonyms)")
            return key
        key, tmp = os.urandom(32), path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _write_all(fd, key)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)  # whole or not there, whenever a crash comes
        return key

    def close(self) -> None:
        """Commit what is waiting, then close the files."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()
        with self._lock:
            self._con.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class ExporterQueue:
    """One exporter's view of the store: the requests of its signals after its cursor, bounded in bytes."""

    def __init__(self, store: ForwardStore, name: str, signals: tuple[str, ...], max_bytes: int) -> None:
        self.store, self.name, self.signals, self.max_bytes = store, name, signals, max_bytes
        self.cursor = 0
        self.requests = 0
        self.bytes = 0
        self._oldest: float | None = None
        self._mine = f"signal IN ({', '.join('?' * len(signals))})"

    def recount(self) -> None:
        """Requests, bytes and the oldest arrival from the index (at the start)."""
        row = self.store._con.execute(
            f"SELECT count(*), coalesce(sum(size), 0), min(queued_at) FROM queue WHERE seq > ? AND {self._mine}",
            [self.cursor, *self.signals]).fetchone()
        self.requests, self.bytes, self._oldest = int(row[0]), int(row[1]), row[2]

    def added(self, rows: Sequence[tuple[str, int, float]]) -> None:
        """Count newly committed (signal, size, queued_at) rows that are this exporter's (under the lock)."""
        for signal, size, at in rows:
            if signal in self.signals:
                self.requests += 1
                self.bytes += size
                if self._oldest is None:
                    self._oldest = at

    def front_seq(self) -> int:
        """The first request this exporter still needs; the next one to come when none (under the lock)."""
        row = self.store._con.execute(f"SELECT min(seq) FROM queue WHERE seq > ? AND {self._mine}",
                                      [self.cursor, *self.signals]).fetchone()
        return self.store._next if row[0] is None else int(row[0])

    def _excess(self, incoming: int) -> int:
        waiting = sum(self.store.waiting_bytes(s) for s in self.signals)
        return self.bytes + waiting + incoming - self.max_bytes

    def full(self, incoming: int = 0) -> bool:
        """Whether ``incoming`` more bytes would pass the bound (requests waiting to commit count too)."""
        return self._excess(incoming) > 0

    def oldest_age(self, now: float | None = None) -> float:
        """Seconds since the oldest queued request was queued; 0 when empty."""
        return 0.0 if self._oldest is None else max(0.0, (now or time.time()) - self._oldest)

    def _heads(self, limit: int) -> list[tuple[int, str, int, float, int, int]]:
        return self.store._con.execute(
            f"SELECT seq, signal, size, queued_at, segment, offset FROM queue WHERE seq > ? AND {self._mine} "
            "ORDER BY seq LIMIT ?", [self.cursor, *self.signals, limit]).fetchall()

    def peek(self, max_bytes: int, max_items: int = 512) -> list[Item]:
        """The oldest requests of one signal, in order, up to ``max_bytes`` together (at least one)."""
        with self.store._lock:
            heads = self._heads(max_items)
            chosen: list[tuple[int, str, int, float, int, int]] = []
            size = 0
            for row in heads:
                if chosen and (row[1] != heads[0][1] or size + row[2] > max_bytes):
                    break
                chosen.append(row)
                size += row[2]
            if not chosen:
                return []
            tried = {s for (s,) in self.store._con.execute(
                "SELECT seq FROM tried WHERE exporter = ? AND seq BETWEEN ? AND ?",
                [self.name, chosen[0][0], chosen[-1][0]])}
        # Outside the lock: nothing after this cursor is deleted, and appends never touch written bytes.
        bodies = self.store.read([(seg, off, n) for _, _, n, _, seg, off in chosen])
        return [Item(seq, signal, body, at, int(seq in tried))
                for (seq, signal, _, at, _, _), body in zip(chosen, bodies)]

    def attempted(self, items: Sequence[Item]) -> None:
        """Record that these are about to be sent (after a crash, a resend may be a duplicate).

        Without an fsync: the mark survives the process dying (it is in the WAL, in the OS), and a power cut
        that loses it costs a duplicate left uncounted, nothing more. This runs before every send.
        """
        con = self.store._con
        with self.store._lock:
            con.execute("PRAGMA synchronous=NORMAL")
            try:
                con.executemany("INSERT OR IGNORE INTO tried VALUES (?, ?)", [(self.name, i.seq) for i in items])
            finally:
                con.execute("PRAGMA synchronous=FULL")

    def remove(self, items: Sequence[Item]) -> None:
        """Move the cursor past delivered or dropped requests (the front ones)."""
        if items:
            self._advance(items[-1].seq, len(items), sum(len(i.body) for i in items))

    def _advance(self, seq: int, requests: int, size: int) -> None:
        store = self.store
        with store._lock:
            store._con.execute("BEGIN")
            store._con.execute("UPDATE cursors SET seq = ? WHERE exporter = ?", [seq, self.name])
            store._con.execute("DELETE FROM tried WHERE exporter = ? AND seq <= ?", [self.name, seq])
            store._con.execute("COMMIT")
            self.cursor = seq
            self.requests -= requests
            self.bytes -= size
            head = self._heads(1)
            self._oldest = head[0][3] if head else None
            store._collect()

    def hold(self, item: Item, reason: str) -> Path:
        """Keep the front request in ``held/<exporter>/`` (never to be sent), then move past it; the file."""
        folder = self.store.folder / "held" / self.name
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{item.seq:012d}.{item.signal}.{reason}.pb"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _write_all(fd, item.body)
            os.fsync(fd)
        finally:
            os.close(fd)
        self.remove([item])
        return path

    def drop_oldest(self, room: int) -> int:
        """Skip the oldest requests until ``room`` more bytes fit; how many were dropped."""
        total = 0
        while self.requests and (over := self._excess(room)) > 0:
            with self.store._lock:
                heads = self._heads(1024)
            dropped, size, last = 0, 0, 0
            for seq, _, n, _, _, _ in heads:
                if size >= over:
                    break
                dropped, size, last = dropped + 1, size + n, seq
            if not dropped:
                break
            self._advance(last, dropped, size)
            total += dropped
        return total
