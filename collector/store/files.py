"""Opening the DuckDB file: attached with its row-group size, a lock held by another process, a damaged file.

Every failure to open or read the file becomes one line (``UserError``) naming the
file, what is wrong with it and what to do; ``file_fault`` tells such an error from
a fault in our own SQL.
"""

from __future__ import annotations

import re
from pathlib import Path

import duckdb

from ..errors import DatabaseLocked, UserError

ATTACHED = "tracejudge"
# Rows per row group. A checkpoint rewrites the row group that commits are still
# filling; at DuckDB's default of 122,880 rows of 1-2 KB spans that took up to
# 2.8 s (every request waits for it) and held its memory; 8192 rows take ~0.15 s.
ROW_GROUP_SIZE = 8192
# Row-group merges (vacuum tasks) a checkpoint runs at most. A merge reads row groups with deleted rows
# back into memory and writes them again, fewer: after retention's deletes DuckDB's default of 100 at once
# took its memory from 25 to 135-160 MB at one checkpoint, past the 128MB limit (bench/checkpoint_memory.py);
# one at a time adds about 30-40 MB, and checkpoints come every few seconds under load, so freed
# space is still reused. None is worse: rows deleted among kept ones (retention's, the stage's rewritten
# messages) stay, and in the retention soak the file grew 47 MB a minute and the daemon's memory with it.
VACUUM_TASKS = 1

# What DuckDB's messages about a file it cannot read mean, in the user's words, and
# whether its own words add anything (a block's location does; a repeated path does not).
_UNREADABLE = (
    ("not a valid DuckDB database file", "it is not a DuckDB database file", False),
    ("Is a directory", "it is a directory, not a DuckDB database file", False),
    ("WAL does not match", "its write-ahead log {wal} belongs to another database file", False),
    ("WAL", "its write-ahead log {wal} is damaged", True),
    ("Could not read enough bytes", "the file is truncated", True),
    ("Corrupt database file", "the file is damaged", True),
)


def _lock_holder(message: str) -> str:
    m = re.search(r"PID (\d+)", message)
    return m.group(1) if m else "unknown"


def first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def unreadable(path: Path, exc: duckdb.Error) -> UserError:
    """The one line for a DuckDB file that cannot be opened or read: which file, what is wrong, what to do."""
    detail = first_line(exc).removeprefix("IO Error: ")
    what, show = next(((plain, show) for phrase, plain, show in _UNREADABLE if phrase in detail),
                      ("DuckDB cannot read it", True))
    if path.is_file() and path.stat().st_size == 0:
        what, show = "the file is empty", False
    what = what.format(wal=f"{path}.wal") + (f" ({detail})" if show else "")
    return UserError(f"cannot open {path}: {what}; restore it from a backup, or move it "
                     f"(and {path.name}.wal) away to start with an empty store")


def attach_sql(path: Path, row_group_size: int, read_only: bool) -> str:
    quoted = str(path).replace("'", "''")
    # TYPE duckdb: never guess another format (DuckDB would fetch its SQLite extension from the network).
    return (f"ATTACH '{quoted}' AS {ATTACHED} (TYPE duckdb, ROW_GROUP_SIZE {int(row_group_size)}"
            f"{', READ_ONLY' if read_only else ''})")


def connect(path: Path, read_only: bool = False, memory_limit: str | None = None,
            row_group_size: int | None = None) -> duckdb.DuckDBPyConnection:
    """Open the DuckDB file, turning a lock conflict or a damaged file into one clear line.

    With ``row_group_size`` the file is attached as ``ATTACHED`` (the only way to set it),
    and every cursor must ``USE`` it (``Store.cursor`` does).

    Raises:
        DatabaseLocked: another process holds the file.
        UserError: the file cannot be read (not DuckDB, truncated, damaged, a directory...).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    config: dict[str, str | bool | int | float | list[str]] = {"max_vacuum_tasks": VACUUM_TASKS}
    if memory_limit:
        config["memory_limit"] = memory_limit
    try:
        if row_group_size is None:
            return duckdb.connect(str(path), read_only=read_only, config=config)
        con = duckdb.connect(config={**config, "temp_directory": f"{path}.tmp"})
        try:
            con.execute(attach_sql(path, row_group_size, read_only))
            con.execute(f"USE {ATTACHED}")
        except BaseException:
            con.close()
            raise
        return con
    except duckdb.Error as exc:
        msg = str(exc)
        if isinstance(exc, duckdb.IOException) and "lock" in msg.lower():
            raise DatabaseLocked(
                f"{path} is locked by process {_lock_holder(msg)}, which does not answer as a tracejudge daemon"
            ) from None
        raise unreadable(path, exc) from None




def file_fault(exc: BaseException) -> bool:
    """Whether a DuckDB error is about the file (damaged, unreadable), not about our SQL."""
    return isinstance(exc, duckdb.Error) and not isinstance(exc, duckdb.ProgrammingError)
