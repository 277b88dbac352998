"""Conversations: traces grouped by conversation id, each transcript rebuilt, ends detected.

``keys`` resolves a trace's conversation, ``assemble`` rebuilds a transcript
from its rows (with ``normalize``) into a ``transcript``. ``stage`` keeps every
conversation current as commits arrive: rebuild logic with no cursor, its jobs
in ``resolve`` (traces to conversations, with ``tracemap`` and ``stitch``),
``rebuild`` (transcripts, with ``rows``, the row cache) and ``endings`` (end
rules, idle), over ``state``, building the rows ``rebuild`` writes. All it reads and
writes goes through ``data.StageData``, named operations with typed rows:
``duck`` runs them on DuckDB (all of the stage's SQL), ``process`` runs the
stage in a process of its own and carries them to the daemon by name.
``archive`` keeps older ended conversations unkeyed, ``tables`` holds the tables
and the reads of them, ``record`` is the one conversation/v1 builder
(``conversation_v1``), for live and stored conversations alike, and ``reindex``
rebuilds every conversation beside the live ones and swaps them in.
"""

from .record import conversation_record, conversation_v1
from .stage import Conversations
from .tables import conversation_counts, list_conversations

__all__ = ["Conversations", "conversation_counts", "conversation_record", "conversation_v1", "list_conversations"]
