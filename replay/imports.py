"""``tracejudge replay import``: an offline suite's simulated conversations, stored beside production ones.

The file is read twice, a line at a time: first every line is checked (a bad
one stops the import before anything is stored, naming the file and line; text
holding half a character, a lone surrogate, is bad too: it cannot be stored),
then the records are stored ``CHUNK`` at a time, through the daemon's API when
one runs, else on the file (``collector.evals.simulations``), idempotent by id.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from judges import Conversation, ConversationError, parse_conversations

from collector.evals.simulations import not_text

CHUNK = 500
CHUNK_BYTES = 512 * 1024  # a chunk's JSON, well within the API's 1 MiB request limit


class _Lines:
    """A file's lines, and the number of the last one read (``parse_conversations`` reads one per record)."""

    def __init__(self, f: TextIO) -> None:
        self.f = f
        self.number = 0

    def __iter__(self) -> Iterator[str]:
        for self.number, line in enumerate(self.f, 1):
            yield line


def _records(path: Path) -> Iterator[Conversation]:
    try:
        with open(path, encoding="utf-8") as f:
            lines = _Lines(f)
            for c in parse_conversations(lines, source=str(path)):
                if c.source != "simulation":
                    raise ConversationError(f"{path}:{lines.number}: conversation {c.id!r} has source {c.source!r}: "
                                            "replay import stores simulated conversations (source: simulation)")
                bad = not_text(c)
                if bad:
                    raise ConversationError(f"{path}:{lines.number}: {bad}")
                yield c
    except OSError as exc:
        raise ConversationError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConversationError(f"{path}: not UTF-8 ({exc.reason} at byte {exc.start})") from None


def check_file(path: Path) -> int:
    """How many records the file holds, every line checked.

    Raises:
        ConversationError: naming the file and line of the first bad record.
    """
    return sum(1 for _ in _records(path))


def import_file(client: Any, path: Path, on_chunk: Callable[[int], None] | None = None) -> dict[str, int]:
    """Store the file's records (``check_file`` it first) through ``client.import_simulations``;
    ``{"stored", "already_imported"}``."""
    total = {"stored": 0, "already_imported": 0}
    chunk: list[dict[str, Any]] = []
    size = 0

    def flush() -> None:
        nonlocal size
        got = client.import_simulations(chunk)
        for k in total:
            total[k] += int(got[k])
        if on_chunk is not None:
            on_chunk(len(chunk))
        chunk.clear()
        size = 0

    for c in _records(path):
        record = c.model_dump(mode="json", by_alias=True, exclude_none=True)
        n = len(c.to_json())
        if chunk and (len(chunk) >= CHUNK or size + n > CHUNK_BYTES):
            flush()
        chunk.append(record)
        size += n
    if chunk:
        flush()
    return total
