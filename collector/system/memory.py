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
import functools
import importlib
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


def allocators() -> dict[str, int]:
    """What DuckDB's own allocator holds, in bytes; empty where it cannot be read.

    DuckDB allocates through the jemalloc linked into its library. ``duckdb_allocated`` is what is
    in use, ``duckdb_resident`` what jemalloc keeps resident: the difference is freed pages it has not
    returned yet. (glibc's own figures are left out: reading them walks every free chunk under the
    arena's lock, tens of milliseconds on a fragmented heap.)
    """
    ctl = _jemalloc_ctl()
    if ctl is None:
        return {}
    epoch, size = ctypes.c_uint64(1), ctypes.c_size_t(8)
    ctl(b"epoch", ctypes.byref(epoch), ctypes.byref(size), ctypes.byref(epoch), size)  # refresh the stats
    out: dict[str, int] = {}
    for key in ("allocated", "resident"):
        value, size = ctypes.c_size_t(), ctypes.c_size_t(ctypes.sizeof(ctypes.c_size_t))
        if ctl(f"stats.{key}".encode(), ctypes.byref(value), ctypes.byref(size), None, 0) == 0:
            out[f"duckdb_{key}"] = value.value
    return out


@functools.cache
def _jemalloc_ctl() -> Any:
    """DuckDB's jemalloc's ``mallctl``, found in the library the duckdb module loaded; None if absent
    (a build without jemalloc, such as macOS's)."""
    for name in ("_duckdb", "duckdb.duckdb"):  # the compiled module, named so from DuckDB 1.4 on, and before
        try:
            return ctypes.CDLL(importlib.import_module(name).__file__).duckdb_je_mallctl
        except (ImportError, OSError, AttributeError, TypeError):
            continue
    return None


def trimmer() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, which gives the free memory at the top of each arena back; None elsewhere."""
    return getattr(_libc(), "malloc_trim", None)
