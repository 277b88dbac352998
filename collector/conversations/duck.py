"""The conversation stage's data in DuckDB: ``DuckData``, every statement the stage makes (``data.StageData``).

One implementation, on one cursor: the daemon's side of the stage process runs the child's operations on it
(``process``), ``tracejudge reindex`` runs a stage on it in its own schema (``reindex``), and tests run a
stage on it in one process. Each operation answers before it returns, and each write is one transaction
(inside the caller's when one is open on the cursor: a reindex commits a chunk with how far it got).

``delete_messages`` and ``archive_traces`` are shared with retention, which deletes conversations.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import duckdb
import orjson

from ..store import Transaction, insert_rows
from ..words import plural
from ..store.transactions import COMMIT_TRACES, Batches, batch_filter, by_keys, conversation_traces, one, \
    registered_rows, write_conflict
from .data import (LOG_COLUMNS, SPAN_COLUMNS, CommitRows, EndedToArchive, Ending, Later, Layer, RecentTranscript,
                   Resume, StoredConversation, StoredRows, TracePlace, TraceSince, Writes)
from .record import stored_select, stored_transcript, stored_transcripts
from .tables import CONVERSATION_COLUMNS, MESSAGE_COLUMNS, TRACE_MAP_COLUMNS, ensure_tables
from .transcript import Transcript, from_unix_nano

if TYPE_CHECKING:
    from ..store import Store

log = logging.getLogger("tracejudge.conversations")

_UTC = dt.timezone.utc
_CONVERSATION = ("conversation_id, state, ended_by, trace_ids, newest_trace_id, transcript_hash, revision, "
                 "epoch(first_arrival_at), epoch(last_arrival_at), epoch(closed_at), first_batch, grouped_by")
STITCH_CHUNK = 500  # stored transcripts read back at once when the stage starts
# Seconds between tries of a write or an archive move that met another transaction deleting the same
# rows: retention deletes the oldest ended conversations with their traces, the very ones the archive
# moves and the write's trace map moves (``archive_traces``). Its chunk commits within a second or so;
# the write or move then goes again. Before, DuckDB's "Conflict on tuple deletion" failed the stage's
# cycle (once in each 10-minute soak), and the stage started again from the stored state.
CONFLICT_WAITS = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6)


class DuckData:
    """``StageData`` on a DuckDB cursor (see the module docstring). ``store``: where the commits made come
    from (``resume``); without one (a bare cursor in a test) they are taken to be the batch mark."""

    def __init__(self, cur: duckdb.DuckDBPyConnection, store: Store | None = None) -> None:
        self.cur = cur
        self.store = store
        self.pause: Callable[[float], None] = time.sleep
        """Between two tries of a write or an archive move (``CONFLICT_WAITS``)."""
        ensure_tables(cur)

    # ------------------------------------------------------------ reads

    def resume(self, stitch_since: float, stitch_kept: int) -> Resume:
        cur = self.cur
        mark = self.mark()
        committed, opened = (self.store.batch_id, self.store.opened_batch) if self.store is not None else (mark, mark)
        layers = self.filter_layers()
        conversations = _stored(cur.execute(f"SELECT {_CONVERSATION} FROM live_conversations "
                                            "WHERE state = 'open'").fetchall())
        return Resume(mark, committed, opened, conversations, layers,
                      self._recent(stitch_since, stitch_kept) if stitch_kept > 0 else [])

    def filter_layers(self) -> dict[int, Layer]:
        """The archive's filter as stored (``archive.ArchiveFilter``)."""
        return {n: Layer(capacity, ids, bytearray(bits), utc(newest)) for n, capacity, ids, bits, newest in self.cur.execute(
            "SELECT layer, capacity, ids, bits, newest FROM conversation_filter ORDER BY layer").fetchall()}

    def mark(self) -> int:
        """The stored batch mark (the last commit whose conversations are all written)."""
        row = one(self.cur.execute("SELECT value FROM tracejudge_state WHERE key = 'conversations.batch'"))
        return int(row[0]) if row else 0

    def _recent(self, since: float, kept: int) -> list[RecentTranscript]:
        rows = self.cur.execute(
            f"SELECT {stored_select()}, epoch(last_arrival_at) FROM live_conversations "
            "WHERE starts_with(conversation_id, 'trace:') AND content_captured AND last_arrival_at >= ? "
            "ORDER BY last_arrival_at DESC, conversation_id LIMIT ?",
            [dt.datetime.fromtimestamp(since, _UTC), kept]).fetchall()
        rows.reverse()  # the most recent last: the last to go
        out = []
        for i in range(0, len(rows), STITCH_CHUNK):
            part = rows[i:i + STITCH_CHUNK]
            arrived = {r[0]: r[-1] for r in part}
            out += [RecentTranscript(cid, tr, arrived[cid]) for cid, tr, _ in stored_transcripts(self.cur, part)]
        return out

    def trace_map(self, trace_ids: Sequence[str]) -> dict[str, TracePlace]:
        return {t: TracePlace(c, first, last) for t, c, first, last in by_keys(
            self.cur, "SELECT trace_id, conversation_id, first_batch, last_batch FROM trace_conversations "
            "WHERE trace_id IN {keys}", list(trace_ids))}

    def conversations(self, ids: Sequence[str], maybe_archived: Sequence[str]) -> list[StoredConversation]:
        found = _stored(by_keys(self.cur, f"SELECT {_CONVERSATION} FROM live_conversations "
                                          "WHERE conversation_id IN {keys}", sorted(ids)))
        live = {c.conversation_id for c in found}
        rest = [c for c in maybe_archived if c not in live]
        if rest:
            found += _stored(self.cur.execute(f"SELECT {_CONVERSATION} FROM archived_conversations "
                                              "WHERE conversation_id IN (SELECT unnest(?::VARCHAR[]))",
                                              [rest]).fetchall(), archived=True)
        return found

    def trace_rows(self, trace_ids: Sequence[str], batches: Sequence[Batches]) -> StoredRows:
        # Rows are stored in commit order: the ranges let DuckDB skip every row group outside them.
        ranges, bounds = batch_filter(batches)
        where = f"trace_id IN (SELECT unnest(?)){ranges}"
        params: list[Any] = [list(trace_ids), *bounds]
        spans = self.cur.execute(f"SELECT {', '.join(SPAN_COLUMNS)}, batch_id FROM span_records WHERE {where}",
                                 params).fetchall()
        logs = self.cur.execute(f"SELECT {', '.join(LOG_COLUMNS)}, batch_id, seq FROM log_records WHERE {where}",
                                params).fetchall()
        return StoredRows(spans, logs)

    def commit_rows(self, first: int, last: int) -> Later[CommitRows]:
        return Later(lambda: self.read_commits(first, last))

    def read_commits(self, first: int, last: int) -> CommitRows:
        """``commit_rows``, read now (one range read on ``batch_id`` per table: commits are stored in batch
        order, so it skips every other row group)."""
        spans = self.cur.execute(f"SELECT {', '.join(SPAN_COLUMNS)}, batch_id FROM span_records "
                                 "WHERE batch_id BETWEEN ? AND ? AND trace_id IS NOT NULL", [first, last]).fetchall()
        logs = self.cur.execute(f"SELECT {', '.join(LOG_COLUMNS)}, batch_id, seq FROM log_records "
                                "WHERE batch_id BETWEEN ? AND ? AND trace_id IS NOT NULL", [first, last]).fetchall()
        mapped = dict(self.cur.execute(
            f"SELECT trace_id, conversation_id FROM trace_conversations WHERE trace_id IN ({COMMIT_TRACES})",
            [first, last, first, last]).fetchall())
        return CommitRows(spans, logs, mapped)

    def traces_since(self, after: int, upto: int | None) -> list[TraceSince]:
        last = 2**63 - 1 if upto is None else upto
        return [TraceSince(t, at, int(a), int(b)) for t, at, a, b in self.cur.execute(
            "SELECT trace_id, epoch(max(received_at)), min(batch_id), max(batch_id) FROM ("
            " SELECT trace_id, received_at, batch_id, start_time_unix_nano AS t FROM span_records"
            " WHERE batch_id BETWEEN ? AND ? UNION ALL"
            " SELECT trace_id, received_at, batch_id, time_unix_nano FROM log_records WHERE batch_id BETWEEN ? AND ?"
            " AND trace_id IS NOT NULL) "
            # a chunk's traces are stitched in the order they started: so are the chunks
            "GROUP BY trace_id ORDER BY 4, 2, min(t), 1", [after + 1, last, after + 1, last]).fetchall()]

    def stored_transcript(self, conversation_id: str) -> Transcript | None:
        stored = stored_transcript(self.cur, conversation_id)
        return None if stored is None else stored[0]

    def ended_to_archive(self, over: int, keep: int, most: int, held: Sequence[str]) -> EndedToArchive:
        row = one(self.cur.execute("SELECT count(*) FROM live_conversations WHERE state = 'ended'"))
        count = int(row[0]) if row else 0
        if count <= over:
            return EndedToArchive(count, [])
        oldest = self.cur.execute(
            "SELECT conversation_id, last_arrival_at FROM live_conversations WHERE state = 'ended' "
            "AND conversation_id NOT IN (SELECT unnest(?::VARCHAR[])) "
            "ORDER BY last_arrival_at NULLS FIRST, conversation_id LIMIT ?",
            [list(held), min(count - keep, most)]).fetchall()
        return EndedToArchive(count, [(c, utc(at)) for c, at in oldest])

    def archived_by(self, last_arrival: dt.datetime | None, limit: int) -> list[str]:
        return [r[0] for r in self.cur.execute(
            "SELECT conversation_id FROM archived_conversations WHERE last_arrival_at IS NULL OR last_arrival_at <= ? "
            "LIMIT ?", [last_arrival, limit]).fetchall()]

    # ------------------------------------------------------------ writes

    def write(self, writes: Writes, mark: int) -> None:
        """Everything in one transaction, column-wise, with the batch mark.

        Keyed rows known to be new are inserted; the others replace their stored rows (``_write`` says
        why not ``INSERT OR REPLACE``). Should one taken as new be stored after all, the transaction is
        rolled back and written again with every row replacing, so what is written never depends on it.
        """
        def write() -> None:
            try:
                self._write(writes, mark, trust_new=True)
            except duckdb.ConstraintException as exc:
                if Transaction.is_open(self.cur):
                    raise  # part of a caller's transaction, which the failure ended: it cannot be redone here
                log.warning("a conversation or trace taken as new was stored already (%s); written again "
                            "replacing every row", exc)
                self._write(writes, mark, trust_new=False)

        self._again_on_conflict(lambda: f"writing {plural(len(writes.conversations), 'conversation')}", write)

    def _write(self, w: Writes, mark: int, trust_new: bool) -> None:
        """One transaction. A keyed row is replaced by deleting the stored one by key (``by_keys``, in the
        key's index), then inserting: DuckDB's ``INSERT OR REPLACE`` checked every row against the key
        at about five times the cost of an insert (trace map at 200,000 keys), and most rows the stage
        writes are new."""
        cur = self.cur
        conversations = [(cid, row) for cid, row in w.conversations.items() if cid not in w.deleted]
        with Transaction(cur):
            # Untrusted, a transcript written in full replaces any stored one as well.
            gone = sorted(w.deleted | w.replace | (set() if trust_new else w.messages.keys()))
            if gone:
                delete_messages(cur, gone, w.unarchive)
            stored = [cid for cid, _ in conversations if not trust_new or cid not in w.new]
            by_keys(cur, "DELETE FROM live_conversations WHERE conversation_id IN {keys}", sorted(w.deleted) + stored)
            if w.unarchive:
                cur.execute("DELETE FROM archived_conversations WHERE conversation_id IN (SELECT unnest(?))",
                            [sorted(w.unarchive)])
            by_keys(cur, "DELETE FROM trace_conversations WHERE trace_id IN {keys}",
                    [t for t in w.traces if not trust_new or t not in w.new_traces])
            insert_rows(cur, "INSERT INTO trace_conversations", TRACE_MAP_COLUMNS,
                        [(t, *where) for t, where in w.traces.items()])
            archive_traces(cur, w.traces_kept)
            insert_rows(cur, "INSERT INTO messages", MESSAGE_COLUMNS,
                        [m for cid, msgs in w.messages.items() if cid not in w.deleted for m in msgs])
            insert_rows(cur, "INSERT INTO live_conversations", CONVERSATION_COLUMNS,
                        [row.values() for _, row in conversations])
            cur.execute("INSERT OR REPLACE INTO tracejudge_state VALUES ('conversations.batch', ?)", [str(mark)])

    def end_stored(self, endings: Sequence[Ending], first_batch: int, updated_at: dt.datetime) -> None:
        # ended_at is the last span end, as a rebuild finds it: one read of the span ends of these
        # conversations, within the commits of their traces.
        cur = self.cur
        traces = conversation_traces(cur, [e.conversation_id for e in endings])
        within, bounds = batch_filter([(first, last) for _, _, first, last in traces])
        with registered_rows(cur, "ending_traces", ("trace_id", "conversation_id"), [(t, c) for t, c, _, _ in traces]):
            ends = dict(cur.execute(
                "SELECT e.conversation_id, max(s.end_time_unix_nano) FROM ending_traces e "
                "JOIN span_records s USING (trace_id) "
                f"WHERE s.end_time_unix_nano > 0 AND s.batch_id >= ?{within} GROUP BY 1",
                [first_batch, *bounds]).fetchall())
        rows = [(e.conversation_id, from_unix_nano(ends.get(e.conversation_id)), e.ended_by, e.closed_at, updated_at)
                for e in endings]
        with Transaction(cur), registered_rows(
                cur, "ended_now", ("conversation_id", "ended_at", "ended_by", "closed_at", "updated_at"), rows):
            cur.execute("UPDATE live_conversations AS c SET state = 'ended', ended_at = e.ended_at, "
                        "ended_by = e.ended_by, closed_at = e.closed_at, updated_at = e.updated_at "
                        "FROM ended_now e WHERE c.conversation_id = e.conversation_id")

    def archive(self, ids: Sequence[str], layers: Mapping[int, Layer | None]) -> None:
        self._again_on_conflict(lambda: f"moving {plural(len(ids), 'conversation')} to the archive",
                                lambda: self._archive(ids, layers))

    def _again_on_conflict(self, what: Callable[[], str], attempt: Callable[[], None]) -> None:
        """``attempt``, one transaction, tried again after each of ``CONFLICT_WAITS`` while it meets another
        transaction deleting the same rows: DuckDB rolled all of it back, so it goes again whole."""
        for wait in (*CONFLICT_WAITS, None):
            try:
                attempt()
                return
            except duckdb.TransactionException as exc:
                if wait is None or not write_conflict(exc) or Transaction.is_open(self.cur):
                    raise
                log.info("%s met another transaction deleting some of the same rows (retention's); "
                         "trying again in %.2f s", what(), wait)
                self.pause(wait)

    def _archive(self, ids: Sequence[str], layers: Mapping[int, Layer | None]) -> None:
        """One try: the rows still in ``live_conversations`` move, with the filter's changes."""
        cur = self.cur
        with Transaction(cur):
            cur.execute("INSERT INTO archived_conversations SELECT * FROM live_conversations "
                        "WHERE conversation_id IN (SELECT unnest(?::VARCHAR[]))", [list(ids)])
            cur.execute("DELETE FROM live_conversations WHERE conversation_id IN (SELECT unnest(?::VARCHAR[]))",
                        [list(ids)])
            for n in sorted(layers):
                layer = layers[n]
                if layer is None:
                    cur.execute("DELETE FROM conversation_filter WHERE layer = ?", [n])
                else:
                    cur.execute("INSERT OR REPLACE INTO conversation_filter VALUES (?, ?, ?, ?, ?)",
                                [n, layer.capacity, layer.ids, bytes(layer.bits), layer.newest])

    def swap(self, now: dt.datetime) -> int:
        return swap_reindexed(self.cur, now)

    def sync(self) -> None:
        """Every operation has answered already."""

    @property
    def in_flight(self) -> int:
        return 0

    def close(self) -> None:
        self.cur.close()


def utc(at: dt.datetime | None) -> dt.datetime | None:
    """A time read from DuckDB (in the session's zone) in UTC: plain data for the stage process's pipe,
    which carries ``datetime.timezone``, not a zone database's objects."""
    return at.astimezone(_UTC) if at is not None else None


def _stored(rows: list[tuple[Any, ...]], archived: bool = False) -> list[StoredConversation]:
    return [StoredConversation(r[0], r[1], r[2], list(orjson.loads(r[3] or "[]")), r[4], r[5], r[6] or 0,
                               r[7] or 0.0, r[8] or 0.0, r[9], r[10], r[11], archived) for r in rows]


def delete_messages(cur: duckdb.DuckDBPyConnection, conversations: list[str], archived: Collection[str] = (),
                    arrived_by: dt.datetime | None = None) -> None:
    """Delete these conversations' stored messages, reading only the row groups that can hold them.

    ``messages`` has no index, and a transcript is replaced at every update, so a delete by id alone
    reads the whole table each time: the longer the history, the slower the stage. Each row carries
    in ``first_batch`` the ``messages_batch`` its conversations row was written with, in the same
    transaction; the smallest of the stored ones bounds the delete, and DuckDB skips the row groups
    written before it (rows are appended in the order they are written): the cost follows how long
    ago these transcripts were last written, not how long ago their conversations began. The largest
    bounds it above, so that retention's delete of the oldest conversations skips the newer ones. A row
    written before ``messages_batch`` carries its conversation's ``first_batch``, found from there
    (no upper bound then); one from before either is NULL, and still found.

    Their rows are read from ``live_conversations`` by key, and those of ``archived`` from the archive too,
    there only among the rows that arrived by ``arrived_by`` when given (moves append the oldest first,
    so DuckDB skips the newer row groups).
    """
    bounds = ("SELECT count(*), min(coalesce(messages_batch, first_batch)), max(messages_batch), "
              "count(*) FILTER (WHERE messages_batch IS NULL) FROM {table} WHERE conversation_id IN {keys}")
    found = by_keys(cur, bounds.format(table="live_conversations", keys="{keys}"), conversations)
    if archived:
        keys = "(SELECT unnest(?::VARCHAR[]))" + (" AND last_arrival_at <= ?" if arrived_by else "")
        found += cur.execute(bounds.format(table="archived_conversations", keys=keys),
                             [sorted(archived), *([arrived_by] if arrived_by else [])]).fetchall()
    low, high = 2**63 - 1, 0
    for stored, first, last, unknown in found:
        if not stored:
            continue
        low = min(low, first if first is not None else 0)
        high = max(high, 2**63 - 1 if unknown or last is None else last)
    if low > high:
        return  # none is stored
    cur.execute("DELETE FROM messages WHERE (first_batch BETWEEN ? AND ? OR first_batch IS NULL) "
                "AND conversation_id IN (SELECT unnest(?))", [low, high, conversations])


TRACES_MOVED_AT_ONCE = 50_000


def archive_traces(cur: duckdb.DuckDBPyConnection, kept: int) -> None:
    """Keep at most ``kept`` traces keyed in ``trace_conversations`` (and a quarter more between moves):
    past that, those with the oldest last commits move to ``trace_archive`` (``TRACE_MAP`` says why).

    A trace back after the map forgot it has a keyed row and an archived one (views take the keyed
    one); its archived row goes when the new one moves. Finding it reads the archive's trace ids, so
    moves come a quarter of ``kept`` at a time: a quarter of a second per move at 10 million archived.
    """
    count = one(cur.execute("SELECT count(*) FROM trace_conversations"))
    if not count or count[0] <= kept + kept // 4:
        return
    # At most TRACES_MOVED_AT_ONCE a flush: a file of an older version, with every trace keyed, moves its
    # excess over several (800,000 of a million at once took 9 s, 50,000 0.6 s).
    step = min(count[0] - kept, TRACES_MOVED_AT_ONCE)
    cutoff = one(cur.execute("SELECT coalesce(last_batch, 0) FROM trace_conversations "
                             "ORDER BY last_batch NULLS FIRST LIMIT 1 OFFSET ?", [step - 1]))
    assert cutoff is not None, "the count says the row at this offset exists"
    moved = "last_batch IS NULL OR last_batch <= ?"
    columns = ", ".join(TRACE_MAP_COLUMNS)
    cur.execute(f"DELETE FROM trace_archive WHERE trace_id IN (SELECT trace_id FROM trace_conversations WHERE {moved})",
                [cutoff[0]])
    cur.execute(f"INSERT INTO trace_archive ({columns}) SELECT {columns} FROM trace_conversations WHERE {moved}",
                [cutoff[0]])
    cur.execute(f"DELETE FROM trace_conversations WHERE {moved}", [cutoff[0]])


REINDEX_SCHEMA = "reindex"
"""Where a reindex rebuilds every conversation, beside the live ones (``reindex``)."""
REBUILT = ("live_conversations", "archived_conversations", "conversation_filter", "messages", "trace_conversations",
            "trace_archive")


def swap_reindexed(cur: duckdb.DuckDBPyConnection, now: dt.datetime) -> int:
    """Replace the live conversations with the reindex's, in one transaction, at ``now``; how many there are.

    ``cur`` is on the main schema. A transcript that changed gets the next revision (to be judged again), one
    that did not keeps its own; the conversation stage's batch mark goes where the reindex stopped reading.
    """
    with Transaction(cur):
        row = one(cur.execute(f"SELECT value FROM {REINDEX_SCHEMA}.tracejudge_state WHERE key = 'reindex.upto'"))
        upto = row[0] if row else None
        for table in ("live_conversations", "archived_conversations"):
            cur.execute(
                f"UPDATE {REINDEX_SCHEMA}.{table} AS n SET revision = CASE WHEN o.transcript_hash = "
                "n.transcript_hash THEN o.revision ELSE coalesce(o.revision, 0) + 1 END "
                "FROM main.conversations o WHERE o.conversation_id = n.conversation_id")
            cur.execute(f"UPDATE {REINDEX_SCHEMA}.{table} SET updated_at = ?", [now])
        for table in REBUILT:
            cur.execute(f"DELETE FROM main.{table}")
            cur.execute(f"INSERT INTO main.{table} SELECT * FROM {REINDEX_SCHEMA}.{table}")
        cur.execute("INSERT OR REPLACE INTO main.tracejudge_state VALUES ('conversations.batch', ?)", [upto])
        cur.execute(f"DROP SCHEMA {REINDEX_SCHEMA} CASCADE")
        row = one(cur.execute("SELECT count(*) FROM main.conversations"))
    return int(row[0]) if row else 0
