"""What the conversation stage holds between cycles, shared by its jobs: ``StageState``.

The stage (``stage.Conversations``) is its loop and lifecycle; each job is a class of its own module over
this state: ``resolve.Resolve`` (traces to conversations), ``rebuild.Rebuild`` (transcripts, and the rows
they write), ``endings.Ending`` (end rules, idle, ended as stored). None has a cursor: what is stored is
reached through ``data`` (``data.StageData``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Mapping

from ..config import Conversations as Settings
from ..metrics import Metrics
from ..store.pacing import Pacing
from ..store.transactions import Batches
from .archive import ConversationArchive
from .assemble import ParseMemo
from .data import StageData
from .rows import RowCache, TraceRows
from .stitch import Stitcher
from .tracemap import TraceMap, Tracked
from .data import ConversationRow, Writes


class Stopping(Exception):
    """Raised inside a cycle (or a reindex's ``rebuild``) once ``stop`` is called: the rest is left to
    the next start."""


class StageState:
    """The conversations, traces, rows and writes the stage holds, and what its jobs share."""

    metrics: Metrics  # ``background.Loop``'s
    stopping: threading.Event

    def __init__(self, data: StageData, settings: Settings, clock: Callable[[], float], pacing: Pacing, *,
                 cache_spans: int, rebuild_interval: float, rebuild_settle: float, memo_rows: int, traces_kept: int,
                 conversations_kept: int) -> None:
        self.data = data
        self.settings = settings
        self.clock = clock
        self.pacing = pacing
        self.rows = RowCache(cache_spans)
        self.map = TraceMap(ConversationArchive(conversations_kept))  # ended ones keyed (``archive``)
        self._warned_no_content: set[str] = set()
        self._warned_no_id: set[str | None] = set()  # services told how to set a conversation id
        self.stitcher = Stitcher(settings.stitch.window, settings.stitch.conversations)
        self._counted_no_content: set[str] = set()  # pending traces counted as LLM calls without content
        # Parsed rows of recently rebuilt conversations, so a rebuild parses only new rows.
        # Bounded in rows parsed, not conversations: a long conversation's memo holds all of them.
        self._memos: OrderedDict[str, tuple[ParseMemo, int]] = OrderedDict()  # conversation -> (memo, rows)
        self._memo_rows = 0
        self.memo_rows = memo_rows
        self._rows_written: dict[str, ConversationRow] = {}  # the row last written, per conversation in memory
        self.rebuild_interval = rebuild_interval
        self.rebuild_settle = rebuild_settle
        self._hurry = False  # someone waits for this cycle (tests): no pauses
        self._dirty: dict[str, float] = {}  # conversation -> when its rebuild is due
        self._since: dict[str, int] = {}  # conversation -> the first commit its rebuild waits for
        self.traces_kept = traces_kept  # keyed in the trace map (``archive_traces``)
        self._writes = Writes(traces_kept=traces_kept)
        self._leaving: list[Tracked] = []  # ended with the writes not sent yet (``_write``)
        self._unranged: set[str] = set()  # traces read this cycle with no commits stored for them
        # The newest commit among the rows taken in: with the batch mark, where messages are written
        # (``ConversationRow.messages_batch``), increasing as they are (a reindex has no mark of its own).
        self._newest_batch = 0
        self.failed = 0  # rebuilds that failed (the conversation keeps its stored version)

    def _done(self, cid: str) -> None:
        """The conversation's rebuild is no longer waited for (written with the next flush)."""
        self._dirty.pop(cid, None)
        self._since.pop(cid, None)

    def _check_stop(self) -> None:
        if self.stopping.is_set():
            raise Stopping

    def _give_way(self) -> None:
        """Within a cycle: once a piece of work has run, let requests go first (``pacing``)."""
        if not self._hurry and not self.pacing.checkpoint(self.stopping):
            raise Stopping

    # ------------------------------------------------------------ one job's, called by another's

    def _flush(self) -> None:
        raise NotImplementedError

    def _batches(self, unstored: Callable[[str], Batches], taken: Mapping[str, Batches] | None = None
                 ) -> Callable[[list[str]], dict[str, Batches]]:
        raise NotImplementedError

    def _rebuild_one(self, conv: Tracked, rows: dict[str, TraceRows] | None = None) -> None:
        raise NotImplementedError

    def _drop_memo(self, cid: str) -> ParseMemo | None:
        raise NotImplementedError

    def _end(self, conv: Tracked, ended_by: str) -> None:
        raise NotImplementedError

    def _forget(self, conv: Tracked) -> None:
        raise NotImplementedError
