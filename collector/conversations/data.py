"""What the conversation stage reads and writes, as named operations with typed rows: ``StageData``.

The stage (``stage`` and the modules of its jobs) is rebuild logic with no cursor: everything it
keeps in DuckDB goes through these operations. ``duck.DuckData`` runs them on a DuckDB cursor (the
daemon's side of the stage process, ``tracejudge reindex`` and tests); ``process.RemoteData`` sends
them, by name and with plain arguments, to the daemon's side, which runs them on its ``DuckData``;
``tests/support/memory.py`` keeps them in memory, for the stage's unit tests.

Every argument and every row is plain data: str, int, float, bool, None, datetime, bytes, lists,
tuples, dicts, sets, and the dataclasses and named tuples below, made of those. ``OPERATIONS`` names them all: the
process boundary carries nothing else.

Lifecycle: ``write`` and ``commit_rows`` may return before the work is done (in the stage process the
daemon runs a write while the stage goes on, and reads the next commits' rows ahead); ``sync()``
waits for all of it and raises a write's error. Everything else answers before it returns.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, NamedTuple, Protocol, TypeVar

from ..store.transactions import Batches
from .tables import CONVERSATION_COLUMNS, TRACES_KEPT
from .transcript import Transcript

T = TypeVar("T")

SPAN_COLUMNS = ("trace_id", "span_id", "parent_span_id", "name", "start_time_unix_nano", "end_time_unix_nano",
                "attributes", "events", "resource", "service")
"""The span columns the stage reads (keys, end rules, transcripts); a ``SpanRow`` is these, then ``batch_id``.
A span row has 21 columns and half are never read here: rows read back carry only these."""
LOG_COLUMNS = ("log_id", "trace_id", "span_id", "time_unix_nano", "observed_time_unix_nano", "event_name",
               "body", "attributes", "service")
"""The log columns the stage reads; a ``LogRow`` is these, then ``batch_id`` and ``seq`` (its place in the commit)."""

SpanRow = tuple[Any, ...]
"""A stored span: ``SPAN_COLUMNS`` then its commit (``batch_id``)."""
LogRow = tuple[Any, ...]
"""A stored log record: ``LOG_COLUMNS`` then its commit and its place in it (``seq``, None before it was kept)."""


def timestamp(seconds: float | None) -> dt.datetime | None:
    """Seconds since the epoch as a UTC time, as the stage's rows carry them."""
    return dt.datetime.fromtimestamp(seconds, dt.timezone.utc) if seconds is not None else None


@dataclass(frozen=True)
class ConversationRow:
    """One row of ``conversations``, its fields in the table's column order."""

    conversation_id: str
    service: str | None
    started_at: dt.datetime | None
    ended_at: dt.datetime | None
    ended_by: str | None
    state: str
    user_turns: int
    input_tokens: int | None
    output_tokens: int | None
    llm_calls: int
    message_count: int
    models: str
    system: str | None
    content_captured: bool
    no_content_reason: str | None
    transcript_hash: str | None
    revision: int
    trace_ids: str
    newest_trace_id: str | None
    first_arrival_at: dt.datetime | None
    last_arrival_at: dt.datetime | None
    closed_at: dt.datetime | None
    updated_at: dt.datetime | None
    unparsed_spans: int
    unparsed_logs: int
    sources: str
    first_batch: int | None
    messages_batch: int | None
    grouped_by: str

    def ended(self, ended_at: dt.datetime | None, ended_by: str | None, state: str, closed_at: dt.datetime | None,
              updated_at: dt.datetime | None) -> "ConversationRow":
        """This row once the conversation ended idle, its transcript unchanged."""
        return dataclasses.replace(self, ended_at=ended_at, ended_by=ended_by, state=state, closed_at=closed_at,
                                   updated_at=updated_at)

    def values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, c) for c in CONVERSATION_COLUMNS)  # astuple copies deep: slower



assert tuple(f.name for f in dataclasses.fields(ConversationRow)) == CONVERSATION_COLUMNS


@dataclass
class Writes:
    """What one cycle changes, written together by ``StageData.write``."""

    conversations: dict[str, ConversationRow] = field(default_factory=dict)
    messages: dict[str, list[tuple[Any, ...]]] = field(default_factory=dict)
    replace: set[str] = field(default_factory=set)  # conversations whose stored messages go
    new: set[str] = field(default_factory=set)  # of ``conversations``, those with no row stored
    deleted: set[str] = field(default_factory=set)
    unarchive: set[str] = field(default_factory=set)  # read back from the archive: their archived rows go
    # trace -> (its conversation, the first and last commits with its rows)
    traces: dict[str, tuple[str, int | None, int | None]] = field(default_factory=dict)
    new_traces: set[str] = field(default_factory=set)  # of ``traces``, those not keyed in ``trace_conversations``
    traces_kept: int = TRACES_KEPT  # keyed in ``trace_conversations``; older ones go to ``trace_archive``

    def __len__(self) -> int:
        """Conversations waiting to be written or deleted."""
        return len(self.conversations) + len(self.deleted)

    def delete(self, cid: str) -> None:
        self.deleted.add(cid)
        self.conversations.pop(cid, None)
        self.messages.pop(cid, None)


@dataclass
class Layer:
    capacity: int
    ids: int
    bits: bytearray
    newest: dt.datetime | None  # the latest last_arrival_at of the conversations added

    @property
    def size(self) -> int:
        return len(self.bits) * 8


class StoredRows(NamedTuple):
    """Stored span and log rows (``trace_rows``, ``commit_rows``)."""

    spans: list[SpanRow]
    logs: list[LogRow]


class CommitRows(NamedTuple):
    """The rows of a range of commits, with the trace map's conversation of each trace among them that
    has one, as it was when they were read."""

    spans: list[SpanRow]
    logs: list[LogRow]
    mapped: dict[str, str]


class TracePlace(NamedTuple):
    """A keyed trace's row in the trace map: its conversation, and the first and last commits with its rows
    (None: stored by an older version, unknown)."""

    conversation_id: str
    first_batch: int | None
    last_batch: int | None


class StoredConversation(NamedTuple):
    """A stored conversation as the stage tracks it (``tracemap.Tracked``)."""

    conversation_id: str
    state: str
    ended_by: str | None
    trace_ids: list[str]
    newest_trace_id: str | None
    transcript_hash: str | None
    revision: int
    first_arrival: float
    last_arrival: float
    closed_at: float | None
    first_batch: int | None
    grouped_by: str | None  # None in rows older than the column
    archived: bool  # read from ``archived_conversations``


class RecentTranscript(NamedTuple):
    """A recent stored conversation without an id (``trace:...``), to continue by its history (``stitch``)."""

    conversation_id: str
    transcript: Transcript
    last_arrival: float


class TraceSince(NamedTuple):
    """A trace with rows committed in a range: when they last arrived, and the first and last of those commits."""

    trace_id: str
    last_arrival: float
    first_batch: int
    last_batch: int


class Ending(NamedTuple):
    """A conversation ended as it is stored (``end_stored``)."""

    conversation_id: str
    ended_by: str | None
    closed_at: dt.datetime


class EndedToArchive(NamedTuple):
    """``ended_to_archive``: ended conversations in the live table, and the oldest of them to move."""

    ended: int
    oldest: list[tuple[str, dt.datetime | None]]  # (conversation id, last arrival), oldest first


@dataclass
class Resume:
    """Where the stored conversations stand, read when the stage starts and after a failed cycle."""

    mark: int  # the batch mark: every commit up to it has its conversations written
    committed: int  # the last commit made before now
    opened: int  # the last commit of the runs before this one (``Store.opened_batch``)
    conversations: list[StoredConversation] = field(default_factory=list)  # the open ones
    filter_layers: dict[int, Layer] = field(default_factory=dict)  # ``archive.ArchiveFilter``
    recent: list[RecentTranscript] = field(default_factory=list)  # oldest first


class Later(Generic[T]):
    """An answer that may come later: ``result()`` waits for it (a local one is read then)."""

    def __init__(self, read: Callable[[], T]) -> None:
        self._read = read

    def result(self) -> T:
        return self._read()


class StageData(Protocol):
    """The stage's data, as named operations (see the module docstring)."""

    def resume(self, stitch_since: float, stitch_kept: int) -> Resume:
        """The batch mark, the commits made, the open conversations, the archive's filter, and the latest
        ``stitch_kept`` conversations without an id that arrived since ``stitch_since`` (unix seconds)."""
        ...

    def trace_map(self, trace_ids: Sequence[str]) -> dict[str, TracePlace]:
        """The keyed trace map's rows of these traces (those it does not hold are left out)."""
        ...

    def conversations(self, ids: Sequence[str], maybe_archived: Sequence[str]) -> list[StoredConversation]:
        """These stored conversations: live ones by key, then those of ``maybe_archived`` not live from
        the archive."""
        ...

    def trace_rows(self, trace_ids: Sequence[str], batches: Sequence[Batches]) -> StoredRows:
        """Every stored row of these traces within these commits (one range per trace; an unknown first
        commit reads the whole table)."""
        ...

    def commit_rows(self, first: int, last: int) -> Later[CommitRows]:
        """The rows with a trace of commits ``first`` to ``last``, and their traces' conversations; it may be
        read while the caller works, after every write sent before."""
        ...

    def traces_since(self, after: int, upto: int | None) -> list[TraceSince]:
        """Traces with rows committed after ``after`` (up to ``upto``), by last commit, then arrival and start."""
        ...

    def stored_transcript(self, conversation_id: str) -> Transcript | None:
        """A stored conversation's transcript, or None."""
        ...

    def write(self, writes: Writes, mark: int) -> None:
        """Write a cycle's conversations, messages and trace map with the batch mark, in one transaction;
        it may go on after this returns (its error raised by a later call)."""
        ...

    def end_stored(self, endings: Sequence[Ending], first_batch: int, updated_at: dt.datetime) -> None:
        """End these stored conversations as they are stored (their last span end read within the commits
        of their traces from ``first_batch`` on), in one transaction."""
        ...

    def ended_to_archive(self, over: int, keep: int, most: int, held: Sequence[str]) -> EndedToArchive:
        """How many ended conversations the live table holds; past ``over``, the oldest beyond ``keep`` (at
        most ``most``, none of ``held``)."""
        ...

    def archived_by(self, last_arrival: dt.datetime | None, limit: int) -> list[str]:
        """Archived conversations that last arrived by then (or never), ``limit`` at most."""
        ...

    def archive(self, ids: Sequence[str], layers: Mapping[int, Layer | None]) -> None:
        """Move these ended conversations to the archive, with the filter's changed layers (None: gone),
        in one transaction."""
        ...

    def swap(self, now: dt.datetime) -> int:
        """Swap a finished reindex's conversations in (``reindex``), in one transaction; how many there are."""
        ...

    def sync(self) -> None:
        """Wait until every operation sent is done, raising a write's error."""
        ...

    @property
    def in_flight(self) -> int:
        """Operations sent and not answered yet (0 for a local one)."""
        ...

    def close(self) -> None:
        """The stage stopped: let go of what is held (a local cursor)."""
        ...


OPERATIONS = frozenset({"resume", "trace_map", "conversations", "trace_rows", "commit_rows", "traces_since",
                        "stored_transcript", "write", "end_stored", "ended_to_archive", "archived_by", "archive",
                        "swap"})
"""The operations the stage process may ask the daemon for, by name: nothing else crosses."""
