"""Conversations stitched together from their history when the bot sends no conversation id.

Each LLM call resends the conversation so far. So a trace with no id (and no previous response
to chain to) whose first call was sent the whole transcript of a recent conversation of the same
service, and more, continues that conversation: its ``grouped_by`` becomes ``history``.

The rule, exactly:

- messages are compared in order by role, text (stripped), tool-call ids (the tool's name where a
  call has no id) and the id of the call a tool result answers: ``Message.key``, as the merge of
  a conversation's calls compares them;
- the candidate's whole transcript must be a prefix of the trace's first call's input
  (``Transcript.opening``), and that input must go on after it (the user's next message, or the
  results of the tools it called): a trace that only starts the same way (another user typing the
  same first message) is a conversation of its own;
- the candidate's last message must be the assistant's: one that ends with the user's (its answer
  not captured, or not come yet) is what another user's first call, typing the same, is sent too;
- candidates are the conversations without an id of the same service, among the ``kept`` whose
  transcripts were learnt last, whose data last arrived at most ``window`` seconds before the
  trace's (arrival times: the daemon's clock, never the spans');
- the longest match wins. Two candidates match as long only when their transcripts are equal:
  two users typed the same first message and got the same answer. Then the one that started first
  takes the trace: both hold the same messages, so the transcript is right whichever it goes to, and
  the other user's next turn, which differs, matches only the other one. Two users' different
  messages are never put in one conversation.

A candidate's transcript is known by a digest of it, chained message by message, so that a trace's
input is looked up at each length it could match with one digest each. An entry is exact or absent:
the conversation stage puts one when it stitches a trace (the conversation's transcript is then the
trace's own) or rebuilds a conversation, and drops it when anything else changes the conversation
until its rebuild puts it again.

Public: ``Opening``, ``opening``, ``answered``, ``digests``, ``started``, ``Stitcher``, ``GROUPED_BY``.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Sequence

import orjson

from .transcript import Transcript, TranscriptMessage

GROUPED_BY = ("id", "response", "history", "trace")
"""How a conversation's traces were grouped: by the conversation id they carry, by the previous response
their calls name (``gen_ai.request.previous_response.id``), by the history their calls resend (this
module), or not at all (one trace)."""

_DIGEST = 16  # bytes
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _key(m: TranscriptMessage) -> bytes:
    ids = [tc.id or tc.name for tc in m.tool_calls]
    return orjson.dumps([m.role, m.content.strip(), ids, m.tool_call_id or ""])


def answered(messages: Sequence[TranscriptMessage]) -> bytes | None:
    """The digest a conversation with these messages is a candidate under; None when it cannot be one
    (no message, or the last one is not the assistant's)."""
    if not messages or messages[-1].role != "assistant":
        return None
    return digests(messages)[-1]


def digests(messages: Sequence[TranscriptMessage], upto: int | None = None) -> list[bytes]:
    """The chained digest after each of the first ``upto`` messages (all by default): ``[i]`` is that of
    ``messages[:i + 1]``."""
    out: list[bytes] = []
    last = b""
    for m in messages[:upto]:
        last = hashlib.blake2b(last + _key(m), digest_size=_DIGEST).digest()
        out.append(last)
    return out


@dataclass(frozen=True)
class Opening:
    """What a trace with no id offers for stitching: its service, the digests of its first call's input at
    each length short of the whole input, the digest of its whole transcript (None when it cannot be continued: ``answered``)
    and when its first span started (ns)."""

    service: str | None
    prefixes: tuple[bytes, ...]
    digest: bytes | None
    started: int


def started(tr: Transcript) -> int:
    """When its first span started, in ns (0 if not known)."""
    at = tr.started_at
    return (at - _EPOCH) // timedelta(microseconds=1) * 1000 if isinstance(at, datetime) else 0


def opening(tr: Transcript) -> Opening | None:
    """The ``Opening`` of one trace's transcript (built from its rows alone); None with no history sent."""
    if not tr.opening or not tr.messages:
        return None
    chain = digests(tr.messages)
    last = chain[-1] if tr.messages[-1].role == "assistant" else None
    return Opening(tr.service, tuple(chain[:tr.opening - 1]), last, started(tr))


@dataclass
class _Entry:
    service: str | None
    digest: bytes
    started: int  # ns: among equal transcripts, the one that started first continues
    at: float  # when its data last arrived (daemon clock)


class Stitcher:
    """The transcripts of recent conversations without an id, to continue them (see the module docstring).

    ``window`` seconds and ``kept`` conversations bound it; ``kept`` 0 or ``window`` 0 turns stitching
    off. One per conversation stage, used by its thread only; rebuilt from the stored conversations at
    start (``Conversations._load_state``).
    """

    def __init__(self, window: float, kept: int) -> None:
        self.window = window
        self.kept = kept
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently put first
        self._by: dict[tuple[str | None, bytes], set[str]] = {}

    @property
    def enabled(self) -> bool:
        return self.kept > 0 and self.window > 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._by.clear()

    def find(self, op: Opening, at: float, exclude: str | None = None) -> str | None:
        """The conversation a trace that arrived at ``at`` continues, if any."""
        for digest in reversed(op.prefixes):
            cids = self._by.get((op.service, digest))
            if not cids:
                continue
            live = [c for c in cids if c != exclude and abs(at - self._entries[c].at) <= self.window]
            if live:
                return min(live, key=lambda c: (self._entries[c].started, c))
        return None

    def put(self, cid: str, service: str | None, digest: bytes, started: int, at: float) -> None:
        """``cid``'s whole transcript is now the one ``digest`` ends, its data last arrived ``at``."""
        if not self.enabled:
            return
        old = self.drop(cid)
        if old is not None:
            started = min(started, old.started) if started else old.started
            at = max(at, old.at)
        self._entries[cid] = _Entry(service, digest, started, at)
        self._by.setdefault((service, digest), set()).add(cid)
        # The least recently put go first; so do those past the window of the newest arrival.
        while self._entries:
            first, entry = next(iter(self._entries.items()))
            if len(self._entries) <= self.kept and at - entry.at <= self.window:
                break
            self.drop(first)

    def drop(self, cid: str) -> _Entry | None:
        """Forget ``cid``'s transcript (it changed, or its conversation is gone)."""
        entry = self._entries.pop(cid, None)
        if entry is not None:
            cids = self._by[(entry.service, entry.digest)]
            cids.discard(cid)
            if not cids:
                del self._by[(entry.service, entry.digest)]
        return entry
