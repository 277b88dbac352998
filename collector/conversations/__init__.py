"""Conversations: traces grouped by conversation id, each transcript rebuilt, ends detected.

``keys`` resolves a trace's conversation, ``assemble`` rebuilds a transcript
from its rows (with ``normalize``) into a ``transcript``, ``stage`` keeps every
conversation current as commits arrive, with its jobs in ``rows`` (the row
cache), ``tracemap`` (traces to conversations), ``endings`` (end rules, idle)
and ``writes`` (its one transaction); ``tables`` holds what it writes and the
reads of it, ``record`` is the one conversation/v1 builder (``conversation_v1``), for live
and stored conversations alike, and ``reindex`` rebuilds every conversation beside the
live ones and swaps them in.
"""

from .record import conversation_record, conversation_v1
from .stage import Conversations
from .tables import conversation_counts, list_conversations

__all__ = ["Conversations", "conversation_counts", "conversation_record", "conversation_v1", "list_conversations"]
