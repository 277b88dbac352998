"""Ended conversations past the newest ones, kept without a key, and a Bloom filter that says which ids they are.

DuckDB keeps a primary key's index whole in memory for as long as its rows are kept: about 95 bytes a
conversation with 36-character ids, so the conversations of a few months outgrow ``storage.memory_limit``
and every commit fails. ``live_conversations`` keys the open conversations and the newest ``kept`` ended
ones (by last arrival); past that, ``ConversationArchive.move`` takes the oldest ended ones to
``archived_conversations``, which has no key: once a quarter of ``kept`` more have ended, or half of
``MOVED_AT_ONCE`` if that is less. The view ``conversations`` is
both, for every reader that lists or joins.

The stage looks up every conversation id it has not seen yet, in every commit, to find whether it is
stored: a chat thread reopened days later is real. Reading the unkeyed archive for each would cost a scan
of it per commit (20 ms at a million rows, 96 ms at five million), so ``ArchiveFilter``, a Bloom filter of
every id archived, says which ids may be there. One it has never seen is new, with no read; one that may be
there is read from the archive (about 1 new id in 2,000 reads it for nothing). The stage writes a
conversation read back from the archive to ``live_conversations``, and the same flush deletes its archived
row (``Writes.unarchive``).

The filter is kept in the file, updated in the transaction of each move, and read back when the stage
starts: building it from the archive took 2 s a million ids. It is in layers of growing capacity (each
twice the last, as a scalable Bloom filter), 16 bits and 11 hashes an id: 2 bytes an id, in the file and in
the stage's memory. Ids are hashed with blake2b (DuckDB's ``hash`` may change between versions). Ids that
retention deletes stay set until no archived conversation is as old as a layer's newest: the layer goes
then, its few survivors (kept for review, or still due for judging) added to the newest layer first.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Collection, Iterable, Sequence

from .data import Layer, StageData

# Ended conversations keyed in live_conversations: about 10 MB of DuckDB's memory. At 200 conversations a
# second (3,000 spans/s) the last 8 minutes, at one a second the last day.
ARCHIVE_KEPT = 100_000
# Conversations moved at most at once, in one transaction: 5,000 took 220 ms at two million conversations
# kept (a quarter of it writing the filter's newest layer), 31,000 630 ms, which ingestion waited for. An
# older file's million keyed conversations move a flush at a time.
MOVED_AT_ONCE = 10_000
FIRST_CAPACITY = 1 << 16
BITS_PER_ID = 16
HASHES = 11
RETIRE_SURVIVORS = 100  # ids of an old layer still archived, added to the newest so that the old one goes


def _hashes(cid: str) -> tuple[int, int]:
    digest = hashlib.blake2b(cid.encode(), digest_size=16).digest()
    return int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little") | 1


class ArchiveFilter:
    """Which conversation ids may be archived (never a false no)."""

    def __init__(self, layers: dict[int, Layer] | None = None) -> None:
        self.layers: dict[int, Layer] = layers or {}

    def __len__(self) -> int:
        """Ids added, over every layer."""
        return sum(layer.ids for layer in self.layers.values())

    def nbytes(self) -> int:
        return sum(len(layer.bits) for layer in self.layers.values())

    def maybe(self, ids: Iterable[str]) -> list[str]:
        """Those of ``ids`` that may be archived."""
        if not self.layers:
            return []
        layers = list(self.layers.values())
        out = []
        for cid in ids:
            h1, h2 = _hashes(cid)
            for layer in layers:
                bits, size = layer.bits, layer.size
                for i in range(HASHES):
                    p = (h1 + i * h2) % size
                    if not bits[p >> 3] & (1 << (p & 7)):
                        break
                else:
                    out.append(cid)
                    break
        return out

    def add(self, ids: Sequence[str], newest: dt.datetime | None) -> set[int]:
        """Set these ids (whose latest last arrival is ``newest``); the layers changed."""
        changed: set[int] = set()
        i = 0
        while i < len(ids):
            n = max(self.layers, default=-1)
            if n < 0 or self.layers[n].ids >= self.layers[n].capacity:
                capacity = self.layers[n].capacity * 2 if n >= 0 else FIRST_CAPACITY
                n += 1
                self.layers[n] = Layer(capacity, 0, bytearray(capacity * BITS_PER_ID // 8), None)
            layer = self.layers[n]
            part = ids[i:i + layer.capacity - layer.ids]
            bits, size = layer.bits, layer.size
            for cid in part:
                h1, h2 = _hashes(cid)
                for k in range(HASHES):
                    p = (h1 + k * h2) % size
                    bits[p >> 3] |= 1 << (p & 7)
            layer.ids += len(part)
            if newest is not None and (layer.newest is None or newest > layer.newest):
                layer.newest = newest
            changed.add(n)
            i += len(part)
        return changed

    def changed(self, layers: Iterable[int]) -> dict[int, Layer | None]:
        """These layers as they are now, to be written (None: gone)."""
        return {n: self.layers.get(n) for n in layers}


class ConversationArchive:
    """The stage's side of the archive: which ids may be there, and the moves (see the module docstring)."""

    def __init__(self, kept: int = ARCHIVE_KEPT) -> None:
        self.kept = kept
        self.filter = ArchiveFilter()
        self._written = 0  # conversations written since the live table was last counted
        self._over = True  # the last count found more than kept: count again at the next flush

    def load(self, layers: dict[int, Layer]) -> None:
        """The filter as stored (``Resume.filter_layers``)."""
        self.filter = ArchiveFilter(layers)
        self._over = True

    def written(self, conversations: int) -> None:
        self._written += conversations

    def due(self) -> bool:
        return self._over or self._written >= max(1, self.kept // 16)

    def move(self, data: StageData, held: Collection[str]) -> int:
        """Past ``kept`` ended conversations and a few more (``slack``), the oldest go to the archive (not
        ``held``, those the stage has in memory), in one transaction with the filter's changes; how many moved."""
        self._written = 0
        ended = data.ended_to_archive(self.kept + self.slack, self.kept, MOVED_AT_ONCE, sorted(held))
        self._over = ended.ended > self.kept + self.slack
        if not self._over:
            return 0
        if not ended.oldest:
            self._over = False
            return 0
        ids = [cid for cid, _ in ended.oldest]
        newest = max((at for _, at in ended.oldest if at is not None), default=None)
        changed = self.filter.add(ids, newest)  # before the write: a set bit too many costs one read at most
        changed |= self._retire(data, ended.oldest)
        data.archive(ids, self.filter.changed(changed))
        self._over = ended.ended - len(ids) > self.kept + self.slack
        return len(ids)

    @property
    def slack(self) -> int:
        return min(self.kept // 4, MOVED_AT_ONCE // 2)

    def _retire(self, data: StageData, moving: Sequence[tuple[str, dt.datetime | None]]) -> set[int]:
        """The oldest layer goes once at most ``RETIRE_SURVIVORS`` archived conversations are as old as its
        newest (those archived already, and those ``moving`` there now): every other id set in it was deleted,
        or moved again (into a newer layer) after coming back. The ones moving now are in the newest layer."""
        layers = self.filter.layers
        if len(layers) < 2:
            return set()
        oldest = min(layers)
        newest_at = layers[oldest].newest
        old = sum(1 for _, at in moving if at is None or (newest_at is not None and at <= newest_at))
        if old > RETIRE_SURVIVORS:
            return set()
        survivors = data.archived_by(newest_at, RETIRE_SURVIVORS + 1 - old)
        if len(survivors) + old > RETIRE_SURVIVORS:
            return set()
        del layers[oldest]
        return {oldest} | (self.filter.add(survivors, newest_at) if survivors else set())
