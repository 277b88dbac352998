"""The allocator setting both processes make at start: threads share two malloc arenas, not one each,
unless the operator chose a number with MALLOC_ARENA_MAX."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import duckdb

from collector.system.memory import allocators, peak_resident_bytes, resident_bytes

REPO = Path(__file__).resolve().parents[1]

# Eight threads each allocate once, all at the same time; glibc's malloc_info then lists the arenas.
ARENAS_AFTER_THREADS = textwrap.dedent("""
    import ctypes, sys, tempfile, threading
    from collector.system.memory import limit_arenas
    limited = limit_arenas() if sys.argv[1] == "limit" else None
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    together = threading.Barrier(8)
    def allocate():
        together.wait()
        libc.malloc(1000)
        together.wait()
    threads = [threading.Thread(target=allocate) for _ in range(8)]
    for t in threads: t.start()
    for t in threads: t.join()
    with tempfile.NamedTemporaryFile("r") as out:
        fp = libc.fopen(out.name.encode(), b"w")
        libc.malloc_info(0, fp)
        libc.fclose(fp)
        print(limited, open(out.name).read().count("<heap nr="))
""")


def arenas(mode: str, **env: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", ARENAS_AFTER_THREADS, mode], cwd=REPO, check=True,
                         capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"} | env).stdout
    limited, count = out.split()
    return limited, int(count)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_threads_share_two_arenas_once_limited() -> None:
    limited, unlimited = arenas("none")
    assert limited == "None" and unlimited > 2  # the main thread's and one per thread, up to 8 per core
    assert arenas("limit") == ("True", 2)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_an_operators_malloc_arena_max_is_kept() -> None:
    assert arenas("limit", MALLOC_ARENA_MAX="3") == ("False", 3)


def test_resident_set_is_read_from_the_kernel() -> None:
    assert 0 < resident_bytes() <= peak_resident_bytes()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="DuckDB's Linux builds link jemalloc")
def test_duckdbs_allocator_is_read_and_follows_what_duckdb_holds() -> None:
    before = allocators()["duckdb_allocated"]
    con = duckdb.connect()
    con.execute("CREATE TABLE t AS SELECT range AS i FROM range(2000000)")  # about 16 MB of table blocks
    held = allocators()
    assert held["duckdb_allocated"] - before > 10_000_000
    assert held["duckdb_allocated"] <= held["duckdb_resident"]
    con.close()
