"""Production conversations as a conversation/v1 JSONL file (``tracejudge replay export``).

The conversations come through collector's store read API
(``collector.api.client``): a running daemon's ``GET /api/export/conversations``
streams them, else the DuckDB file is read, read-only; both read with
``collector.api.export.Walk``, so they give the same lines. Nothing here holds
more than one line: a million conversations stream through.

A file is written beside its target under a temporary name and renamed over it
once complete, so an export that fails or is interrupted leaves no half file
(and an older file of the same name as it was).

Errors: ``collector.errors.UserError`` (a folder that does not exist, the
redaction module missing, the daemon refusing or cutting the stream), one line
at the CLI edge.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import orjson

from judges import escape_line_breaks

from collector.errors import UserError

STDOUT = "-"
"""``--out -``: the lines go to standard output."""

PROGRESS_EVERY = 100
"""Lines between two calls of ``on_progress``."""


def pseudonym(conversation_id: str) -> str:
    """The id ``--redact`` writes for a conversation id that is personal data: ``redacted:`` and 16 hex digits
    of the id's SHA-256, the digest ``scenarios export`` names scenarios with. The same id always gets the
    same one, in a file and across exports, so whoever holds the original ids can join the records back; it
    does not spell the id out, but whoever guesses an id can check the guess (a pseudonym, not anonymity)."""
    return "redacted:" + hashlib.sha256(conversation_id.encode("utf-8")).hexdigest()[:16]


def redaction() -> Callable[[Iterable[bytes]], Iterator[bytes]]:
    """What ``--redact`` does to the lines: each record passed through a fresh ``collector.redact.Redactor``
    (one per conversation, so that what it learns of one conversation's names stays in it), and its id,
    when the redactor finds personal data in it (an e-mail, a phone number, a name the conversation gives),
    replaced by its ``pseudonym``; other ids stay as they are.

    Raises:
        UserError: ``collector.redact`` cannot be imported.
    """
    try:
        from collector.redact import Redactor
    except ImportError as exc:
        raise UserError(f"--redact needs the collector.redact module, which cannot be imported: {exc}") from None

    def redacted(lines: Iterable[bytes]) -> Iterator[bytes]:
        for line in lines:
            redactor = Redactor()
            record = redactor.record(orjson.loads(line))
            if redactor.findings(record["id"]):  # after record(): the names it learned count too
                record["id"] = pseudonym(record["id"])
            yield escape_line_breaks(orjson.dumps(record)) + b"\n"

    return redacted


def write_lines(lines: Iterable[bytes], out: str, *, stdout: BinaryIO | None = None,
                on_progress: Callable[[int], None] | None = None) -> int:
    """Write JSON lines to ``out`` (a path, or ``-`` for ``stdout``).

    Args:
        lines: each ending in a newline.
        out: the file to write; it appears only once complete (see the module docstring). One that
            exists and is not a regular file (a FIFO, ``/dev/stdout``) is written to as a stream.
        stdout: where ``-`` writes (the process's standard output by default).
        on_progress: called with the number of lines written since its last call, every
            ``PROGRESS_EVERY`` lines and at the end.

    Returns:
        How many lines were written.

    Raises:
        UserError: ``out`` is a folder, or its folder does not exist or cannot be written
            (then nothing is left behind).
    """
    if out == STDOUT:
        import sys

        sink = stdout or sys.stdout.buffer
        n = _copy(lines, sink, on_progress)
        sink.flush()
        return n
    given = Path(out)
    if given.is_dir():
        raise UserError(f"{out} is a folder; give the file to write, e.g. {given / 'real.jsonl'}")
    if given.exists() and not given.is_file():
        # A device or a pipe (/dev/stdout, a FIFO): written as a stream, never replaced by a rename.
        try:
            with open(given, "wb") as sink:
                return _copy(lines, sink, on_progress)
        except OSError as exc:
            raise UserError(f"{out}: cannot write: {exc.strerror or exc}") from None
    target = given.resolve()  # through a symbolic link: the link stays, the file it names is written
    folder = target.parent
    if not folder.is_dir():
        raise UserError(f"{out}: the folder {given.parent} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{target.name}.", suffix=".part")
    except OSError as exc:
        raise UserError(f"{out}: cannot write in {folder}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            n = _copy(lines, fh, on_progress)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):  # a full disk, a quota: nothing was written
            raise UserError(f"{out}: cannot write: {exc.strerror or exc}") from None
        raise
    return n


def _copy(lines: Iterable[bytes], sink: BinaryIO, on_progress: Callable[[int], None] | None) -> int:
    n = step = 0
    for line in lines:
        sink.write(line)
        n += 1
        step += 1
        if on_progress is not None and step == PROGRESS_EVERY:
            on_progress(step)
            step = 0
    if on_progress is not None and step:
        on_progress(step)
    return n
