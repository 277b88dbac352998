"""The process's memory as the kernel counts it, and the glibc allocator settings that keep it low.

The command line caps the arenas before any command starts (the daemon, a reindex), the
conversation stage's process does at its own start, and both report their resident set.

glibc's malloc gives each new thread an arena of its own, up to eight per core, and
seldom returns an arena's free memory. The daemon has many threads (receivers, the
writer, the stages, the senders, DuckDB's own), and under ingestion most of what those
arenas hold is free memory that nobody uses. With two arenas, ``bench/memory.py`` measured
the resident set after a burst settling 13-15% lower, and ingest was no slower.
"""

from __future__ import annotations

import ctypes
import os
import resource
from typing import Any, Callable

ARENAS = 2  # malloc arenas for the whole process
_M_ARENA_MAX = -8  # mallopt's parameter number (glibc malloc.h)


def resident_bytes() -> int:
    """The process's resident set (Linux), 0 where /proc is not there."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_resident_bytes() -> int:
    """The largest resident set the process has had. The kernel updates its high-water mark lazily
    (when pages are unmapped), so the current resident set can be the larger one."""
    return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, resident_bytes())  # KiB on Linux


# DuckDB's key indexes (ART) stay whole in its memory. The span table, the trace map and the conversations
# key only their newest rows, about 40 MB at most; past storage.memory_limit, commits fail.
INDEX_WARNING = ("key indexes hold over half of DuckDB's memory (they key the newest spans, traces and "
                 "conversations, about 40 MB at most): raise storage.memory_limit")


def duckdb_memory(cur: Any) -> dict[str, tuple[int, int]]:
    """DuckDB's memory by what holds it (``duckdb_memory()``): tag -> (bytes held, bytes spilled to disk)."""
    return {tag: (int(used), int(spilled)) for tag, used, spilled in cur.execute(
        "SELECT tag, memory_usage_bytes, temporary_storage_bytes FROM duckdb_memory()").fetchall()}


def index_eighths(index_bytes: int, limit_bytes: int) -> int:
    """Eighths of DuckDB's memory limit its key indexes hold: ``INDEX_WARNING`` from 4 on."""
    return index_bytes * 8 // limit_bytes


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def limit_arenas(arenas: int = ARENAS) -> bool:
    """At most ``arenas`` malloc arenas from now on; False where this is not glibc.

    A ``MALLOC_ARENA_MAX`` in the environment is the operator's choice, and glibc has read
    it already: it is left as it is. Call this before starting threads, which take their
    arena at their first allocation.
    """
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    mallopt = getattr(_libc(), "mallopt", None)
    return bool(mallopt is not None and mallopt(_M_ARENA_MAX, arenas) == 1)


def trimmer() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, which gives the free memory at the top of each arena back; None elsewhere."""
    return getattr(_libc(), "malloc_trim", None)
