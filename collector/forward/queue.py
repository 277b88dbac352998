"""One exporter's on-disk queue: a SQLite file in WAL mode, bounded in bytes.

SQLite (the standard library's ``sqlite3``) rather than a file format of our own:
a committed row survives ``kill -9`` and a power cut (``synchronous=FULL``), a
half-written one never appears, and reads and deletes by sequence number are
an index away. DuckDB would do too, but it is built for scans, not for a
stream of small appends and deletes from the front.

Appends from the receivers are committed together (group commit, in a thread
of the queue's own): each ``put`` returns a future resolved once its row is
on disk, so a receiver acknowledges only what a restart will find. The sender
reads from the front in order (``peek``), then deletes what was delivered or
dropped (``remove``).

Errors: ``sqlite3.Error`` from the file (a full disk): ``put``'s future raises
it, and the receiver answers 503 so the client retries.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS queue (
    seq INTEGER PRIMARY KEY,
    signal TEXT NOT NULL,
    size INTEGER NOT NULL,
    queued_at REAL NOT NULL,
    body BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS tried (seq INTEGER PRIMARY KEY);
"""
# ``size`` before ``body``: the front is chosen from the small columns without reading any body, and a send
# tried is noted in ``tried``, never by rewriting a row that holds a body.


@dataclass(frozen=True)
class Item:
    """One queued request."""

    seq: int
    signal: str
    body: bytes
    queued_at: float
    attempts: int
    """1 when a send of it was tried before (perhaps delivered, before a crash), else 0."""


class DiskQueue:
    """A bounded FIFO of request bodies in ``path`` (see the module docstring)."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.max_bytes = max_bytes
        self._con = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._con.execute("PRAGMA page_size=65536")  # bodies of hundreds of KB: fewer, larger overflow pages
        self._con.execute("PRAGMA journal_mode=WAL")
        self._con.execute("PRAGMA synchronous=FULL")
        self._con.executescript(SCHEMA)
        self._lock = threading.Lock()  # one statement at a time on the connection
        self._pending: list[tuple[str, bytes, float, Future[None]]] = []
        self._wake = threading.Condition()
        self._closed = False
        row = self._con.execute("SELECT count(*), coalesce(sum(size), 0), min(queued_at) FROM queue").fetchone()
        self.requests, self.bytes = int(row[0]), int(row[1])
        self._oldest: float | None = row[2]
        self._thread = threading.Thread(target=self._commit_loop, name=f"forward-queue-{path.stem}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ appends

    def put(self, signal: str, body: bytes) -> Future[None]:
        """Queue one request; the future is resolved once it is on disk."""
        fut: Future[None] = Future()
        with self._wake:
            if self._closed:
                fut.set_exception(RuntimeError("the forward queue is closed"))
                return fut
            self._pending.append((signal, body, time.time(), fut))
            self._wake.notify()
        return fut

    def _commit_loop(self) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._closed:
                    self._wake.wait()
                batch, self._pending = self._pending, []
                if not batch and self._closed:
                    return
            try:
                with self._lock:
                    self._con.execute("BEGIN IMMEDIATE")
                    self._con.executemany("INSERT INTO queue (signal, size, queued_at, body) VALUES (?, ?, ?, ?)",
                                          [(s, len(b), t, b) for s, b, t, _ in batch])
                    self._con.execute("COMMIT")
                    self.requests += len(batch)
                    self.bytes += sum(len(b) for _, b, _, _ in batch)
                    if self._oldest is None:
                        self._oldest = batch[0][2]
            except sqlite3.Error as exc:
                with self._lock:
                    if self._con.in_transaction:
                        self._con.execute("ROLLBACK")
                for *_, fut in batch:
                    fut.set_exception(exc)
                continue
            for *_, fut in batch:
                fut.set_result(None)

    # ------------------------------------------------------------ the front

    def full(self, incoming: int = 0) -> bool:
        """Whether ``incoming`` more bytes would pass the bound (requests waiting to commit count too)."""
        with self._wake:
            waiting = sum(len(b) for _, b, _, _ in self._pending)
        return self.bytes + waiting + incoming > self.max_bytes

    def oldest_age(self, now: float | None = None) -> float:
        """Seconds since the oldest queued request was queued; 0 when empty."""
        return 0.0 if self._oldest is None else max(0.0, (now or time.time()) - self._oldest)

    def peek(self, max_bytes: int, max_items: int = 512) -> list[Item]:
        """The oldest requests of one signal, in order, up to ``max_bytes`` together (at least one)."""
        with self._lock:
            heads = self._con.execute("SELECT seq, signal, size FROM queue ORDER BY seq LIMIT ?",
                                      [max_items]).fetchall()
            chosen: list[int] = []
            size = 0
            for seq, signal, n in heads:
                if chosen and (signal != heads[0][1] or size + n > max_bytes):
                    break
                chosen.append(seq)
                size += n
            if not chosen:
                return []
            rows = self._con.execute(
                "SELECT q.seq, q.signal, q.body, q.queued_at, t.seq IS NOT NULL FROM queue q "
                "LEFT JOIN tried t ON t.seq = q.seq WHERE q.seq BETWEEN ? AND ? ORDER BY q.seq",
                [chosen[0], chosen[-1]]).fetchall()
        return [Item(seq, signal, body, at, int(tried)) for seq, signal, body, at, tried in rows]

    def attempted(self, items: Sequence[Item]) -> None:
        """Record that these are about to be sent (after a crash, a resend may be a duplicate)."""
        with self._lock:
            self._con.executemany("INSERT OR IGNORE INTO tried VALUES (?)", [(i.seq,) for i in items])

    def remove(self, items: Sequence[Item]) -> None:
        """Delete delivered or dropped requests."""
        if not items:
            return
        with self._lock:
            self._con.execute("BEGIN")
            self._con.executemany("DELETE FROM queue WHERE seq = ?", [(i.seq,) for i in items])
            self._con.executemany("DELETE FROM tried WHERE seq = ?", [(i.seq,) for i in items])
            self._con.execute("COMMIT")
            self.requests -= len(items)
            self.bytes -= sum(len(i.body) for i in items)
            row = self._con.execute("SELECT min(queued_at) FROM queue").fetchone()
            self._oldest = row[0] if row else None

    def drop_oldest(self, room: int) -> list[Item]:
        """Remove the oldest requests until ``room`` more bytes fit; what was dropped."""
        dropped: list[Item] = []
        while self.requests and self.full(room):
            front = self.peek(max(room, 1), max_items=64)
            if not front:
                break
            self.remove(front)
            dropped += front
        return dropped

    def close(self) -> None:
        """Commit what is waiting, then close the file."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()
        with self._lock:
            self._con.close()
