"""The rows of each trace as the conversation stage reads them: a bounded cache over DuckDB.

A trace first seen whole in the commits handed to the stage keeps its rows in
memory (the least recently used go beyond ``max_rows``); any other trace is read
back (``StageData.trace_rows``) when a rebuild needs it, within the
commits its caller knows to hold its rows (``Batches``: rows are stored in commit
order, so the read skips every row group outside them, and its cost follows the
rows read, not the size of the table nor the age of the conversation). Each
trace's rows know the first and last commits among them (``TraceRows.first_batch``,
``last_batch``), which is how callers learn them.

Every row is a ``StoredRow``: its JSON columns are parsed once between two
writes of the stage, however many readers (the conversation key, the end rules,
the transcript) look at it; ``release`` drops the parsed trees after each write.
Log rows carry their ``arrival`` (commit, place in it: the position in the
commit for rows handed over, the stored ``seq`` for rows read back), so records
sharing a timestamp keep the order they were sent in.

Lifecycle: one per stage, used by its thread only; ``clear()`` after a failed
cycle (memory may be ahead of what is stored).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from ..store import Committed
from ..store.transactions import Batches
from .data import LOG_COLUMNS, SPAN_COLUMNS, CommitRows, Later, StageData
from .keys import StoredRow

# A group of commits is taken in, then the conversations the group before it touched (and it did not)
# are rebuilt from the cache: a conversation's rows span the group it starts in, the one it ends in and
# the one taken in before its rebuild, and all three must fit in the cache (with a fourth to spare),
# or its first rows are evicted and read back from DuckDB (at 10,000 spans/s, groups of 4,096 light rows
# beside a cache of 10,000 made a quarter of the stage process's waits reads of evicted rows).
GROUPS_CACHED = 4

@dataclass
class TraceRows:
    """The span and log rows of one trace."""

    spans: list[StoredRow] = field(default_factory=list)
    logs: list[StoredRow] = field(default_factory=list)
    first_batch: int | None = None  # the first commit among these rows; None without rows
    last_batch: int | None = None

    def __len__(self) -> int:
        return len(self.spans) + len(self.logs)

    def extend(self, other: "TraceRows") -> None:
        self.spans.extend(other.spans)
        self.logs.extend(other.logs)
        self.saw(other.first_batch)
        self.saw(other.last_batch)

    def saw(self, batch_id: int | None) -> None:
        """Rows of this commit are among these."""
        if batch_id is None:
            return
        if self.first_batch is None or batch_id < self.first_batch:
            self.first_batch = batch_id
        if self.last_batch is None or batch_id > self.last_batch:
            self.last_batch = batch_id

    def batches(self) -> Batches:
        return self.first_batch, self.last_batch

    def start(self) -> int:
        """The earliest start (or log time) of its rows, in ns; 0 without one."""
        starts = [r["start_time_unix_nano"] for r in self.spans if r.get("start_time_unix_nano")]
        starts += [r["time_unix_nano"] or r["observed_time_unix_nano"] or 0 for r in self.logs]
        return min(starts) if starts else 0


@dataclass
class Light:
    """A commit queued while the stage is behind, without its rows (read back by commit range, with the
    traces they touched): a few numbers, so that a backlog of thousands of commits costs next to nothing."""

    batch_id: int
    received_at: float
    rows: int = 0  # spans and log records in the commit

    @classmethod
    def of(cls, committed: Committed) -> "Light":
        return cls(committed.batch_id, committed.received_at, len(committed.spans) + len(committed.logs))


def commit_rows(c: Committed | Light) -> int:
    """The spans and log records of a commit."""
    return c.rows if isinstance(c, Light) else len(c.spans) + len(c.logs)


def groups(committed: list[Committed | Light], max_rows: int) -> list[list[Committed | Light]]:
    """Commits in order, cut so that each group holds at most ``max_rows`` rows (a larger commit is a
    group of its own): light ones are read back a group at a time, and the cache holds several."""
    out: list[list[Committed | Light]] = []
    group: list[Committed | Light] = []
    rows = 0
    for c in committed:
        n = commit_rows(c)
        if group and rows + n > max_rows:
            out.append(group)
            group, rows = [], 0
        rows += n
        group.append(c)
    if group:
        out.append(group)
    return out


@dataclass
class Taken:
    """What a group of commits brought: each touched trace's rows, when it last arrived, its commits."""

    rows: dict[str, TraceRows] = field(default_factory=dict)
    arrived: dict[str, float] = field(default_factory=dict)
    first: dict[str, int] = field(default_factory=dict)  # trace -> the first of these commits with its rows
    last: dict[str, int] = field(default_factory=dict)
    # Read ahead with the rows: the stored conversation of each trace of the light commits (None: none).
    mapped: dict[str, str | None] = field(default_factory=dict)

    def add(self, tid: str, batch_id: int, received_at: float) -> TraceRows:
        self.arrived[tid] = received_at
        self.first.setdefault(tid, batch_id)
        self.last[tid] = batch_id
        rows = self.rows.setdefault(tid, TraceRows())
        rows.saw(batch_id)
        return rows


class RowCache:
    """Rows of recent traces, and the reads of the others (see the module docstring)."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self._traces: OrderedDict[str, TraceRows] = OrderedDict()
        self._rows = 0  # rows held
        # Cached traces handed out since the last release, the only cached rows readers can have parsed:
        # a release costs what the cycle read, not what the cache holds. (Rows not cached go with
        # their reader, parsed trees and all.)
        self._lent: set[str] = set()

    def clear(self) -> None:
        self._traces.clear()
        self._rows = 0
        self._lent.clear()

    def held(self) -> dict[str, int]:
        """Rows cached and traces cached."""
        return {"cached_rows": self._rows, "cached_traces": len(self._traces)}

    def take(self, data: StageData, committed: list[Committed | Light],
             ahead: Later[CommitRows] | None = None) -> Taken:
        """The rows these commits brought, by trace: handed over, or read back for light commits
        (``ahead``: as ``read_ahead`` asked for them)."""
        taken = Taken()
        lights = [c for c in committed if isinstance(c, Light)]
        stored: dict[int, tuple[list[StoredRow], list[StoredRow]]] = {}
        if lights:
            later = ahead if ahead is not None else self.read_ahead(data, [*lights])
            assert later is not None
            read = later.result()
            stored = _by_commit(lights, read)
            taken.mapped = {row["trace_id"]: None for spans, logs in stored.values() for row in (*spans, *logs)}
            taken.mapped.update(read.mapped)
        for c in committed:
            if isinstance(c, Light):
                span_rows, log_rows = stored[c.batch_id]
                for stored_row in span_rows:
                    taken.add(stored_row["trace_id"], c.batch_id, c.received_at).spans.append(stored_row)
                for stored_row in log_rows:  # read back with a trace id only
                    taken.add(stored_row["trace_id"], c.batch_id, c.received_at).logs.append(stored_row)
                continue
            for row in c.spans.rows():
                taken.add(row["trace_id"], c.batch_id, c.received_at).spans.append(StoredRow(row))
            for pos, row in enumerate(c.logs.rows()):
                if row["trace_id"] is None:
                    continue  # a log record with no trace belongs to no conversation
                log_row = StoredRow(row)
                log_row["arrival"] = (c.batch_id, pos)
                taken.add(row["trace_id"], c.batch_id, c.received_at).logs.append(log_row)
        return taken

    def keep(self, taken: Taken, seen: set[str]) -> None:
        """Cache what a trace seen for the first time brought (it has all its rows in these commits);
        add new rows to traces cached already. ``seen``: traces with older rows in DuckDB."""
        for tid, rows in taken.rows.items():
            cached = self._traces.get(tid)
            if cached is not None:
                cached.extend(rows)
                self._traces.move_to_end(tid)
            elif tid in seen:
                continue  # older rows are in DuckDB: read the whole trace when needed
            else:
                self._traces[tid] = rows
            self._rows += len(rows)
        self._evict()

    def get(self, data: StageData, trace_ids: Iterable[str],
            where: Callable[[list[str]], Mapping[str, Batches]] | None = None) -> dict[str, TraceRows]:
        """Every stored row of these traces: the cache, else one read from DuckDB.

        ``where(traces)``: the commits that can hold each of these traces' rows (``Batches``), asked
        for the traces not cached; the read covers those commits (without it, the whole table).
        """
        out: dict[str, TraceRows] = {}
        missing = []
        for t in trace_ids:
            rows = self._traces.get(t)
            if rows is not None:
                self._traces.move_to_end(t)
                out[t] = rows
            else:
                missing.append(t)
        if missing:
            loaded = self._read(data, missing, where(missing) if where is not None else {})
            for t, rows in loaded.items():
                self._traces[t] = rows
                self._rows += len(rows)
                out[t] = rows
            self._evict()
        self._lent.update(t for t in out if t in self._traces)
        return out

    def drop(self, trace_ids: Iterable[str]) -> None:
        """These traces leave the cache (their conversation ended)."""
        for t in trace_ids:
            rows = self._traces.pop(t, None)
            if rows is not None:
                self._rows -= len(rows)
                self._lent.discard(t)

    def release(self) -> None:
        """Drop the parsed JSON of every cached row handed out since the last release (what the cache
        keeps is text, bounded in rows)."""
        for t in self._lent:  # every one cached: eviction and drop take theirs out
            rows = self._traces[t]
            for row in rows.spans:
                row.release()
            for row in rows.logs:
                row.release()
        self._lent.clear()

    def _read(self, data: StageData, missing: list[str], batches: Mapping[str, Batches]) -> dict[str, TraceRows]:
        loaded = {t: TraceRows() for t in missing}
        read = data.trace_rows(missing, [batches.get(t, (None, None)) for t in missing])
        n = len(SPAN_COLUMNS)
        for rec in read.spans:
            trace = loaded[rec[0]]
            trace.spans.append(StoredRow(zip(SPAN_COLUMNS, rec)))  # zip stops before batch_id
            trace.saw(rec[n])
        n = len(LOG_COLUMNS)
        for rec in read.logs:
            row = StoredRow(zip(LOG_COLUMNS, rec))
            row["arrival"] = (rec[n], rec[n + 1] or 0)  # NULL: stored before the place was kept
            trace = loaded[rec[1]]
            trace.logs.append(row)
            trace.saw(rec[n])
        return loaded

    @staticmethod
    def read_ahead(data: StageData, committed: list[Committed | Light]) -> Later[CommitRows] | None:
        """The rows of these commits' light ones, asked for now and read with ``take`` (in the stage process
        the daemon reads them while the stage works); None when there is nothing to read.

        With their traces' stored conversations: the daemon has run every write sent before, and the
        stage keeps a conversation in memory until its writes are sent (``Conversations._flush``).
        """
        lights = [c for c in committed if isinstance(c, Light)]
        if not lights:
            return None
        return data.commit_rows(min(c.batch_id for c in lights), max(c.batch_id for c in lights))

    def _evict(self) -> None:
        """Drop the least recently used traces beyond ``max_rows`` rows."""
        while self._rows > self.max_rows and self._traces:
            tid, rows = self._traces.popitem(last=False)
            self._rows -= len(rows)
            self._lent.discard(tid)


def _by_commit(lights: list[Light], read: CommitRows) -> dict[int, tuple[list[StoredRow], list[StoredRow]]]:
    """The rows read back for these commits, by commit."""
    out: dict[int, tuple[list[StoredRow], list[StoredRow]]] = {c.batch_id: ([], []) for c in lights}
    n = len(SPAN_COLUMNS)
    for rec in read.spans:
        got = out.get(rec[n])
        if got is not None:
            got[0].append(StoredRow(zip(SPAN_COLUMNS, rec)))
    n = len(LOG_COLUMNS)
    for rec in read.logs:
        got = out.get(rec[n])
        if got is not None:
            row = StoredRow(zip(LOG_COLUMNS, rec))
            row["arrival"] = (rec[n], rec[n + 1] or 0)
            got[1].append(row)
    return out
