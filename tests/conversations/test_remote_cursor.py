"""The stage process's cursor: reads posted ahead and writes posted behind, over a real pipe.

The statements go through ``RemoteCursor`` to the daemon's side of the stage
process (``StageProcess._serve``) on a real store: a write behind that fails is
raised by the next call and leaves nothing of itself stored; a long answer read
ahead, not yet read, and a long write posted after it do not wait for each other.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Iterator

import duckdb
import pytest

from collector.config import Conversations as Settings
from collector.conversations.process import _result
from collector.conversations.tables import SCHEMA
from collector.conversations.writes import Writes
from collector.store import Store

from ..support.served import Served


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    store = Store(tmp_path / "t.duckdb")
    store.open()
    served = Served(store, Settings())
    served.cursor.execute(SCHEMA)
    try:
        yield served
    finally:
        served.close()
        store.close()


def _traces(cursor: Any) -> list[tuple[Any, ...]]:
    return cursor.execute("SELECT trace_id, conversation_id FROM trace_conversations ORDER BY 1").fetchall()


def test_a_write_behind_is_stored_before_the_next_statement_runs(served: Served) -> None:
    writes = Writes()
    writes.traces["t-1"] = ("c-1", 1, 1)
    served.cursor.write_behind(writes, 7)
    assert _traces(served.cursor) == [("t-1", "c-1")]
    assert served.cursor.execute("SELECT value FROM tracejudge_state WHERE key = 'conversations.batch'"
                                 ).fetchall() == [("7",)]
    assert served.cursor.in_flight == 0


def test_a_write_behind_that_fails_is_raised_by_the_next_call_and_leaves_nothing(served: Served) -> None:
    writes = Writes()
    writes.traces["t-1"] = ("c-1", 1, 1)  # written first, in the same transaction
    writes.messages["c-1"] = [("c-1", "not a number")]  # a row of the wrong shape: the insert fails
    served.cursor.write_behind(writes, 7)
    assert served.cursor.in_flight == 1
    with pytest.raises((duckdb.Error, RuntimeError, ValueError, TypeError)):
        served.cursor.execute("SELECT 1")
    # Raised once; the transaction was rolled back, and the cursor goes on.
    assert _traces(served.cursor) == []
    assert served.cursor.execute("SELECT count(*) FROM tracejudge_state").fetchall() == [(0,)]


@pytest.mark.slow
def test_a_long_answer_read_ahead_and_a_long_write_behind_do_not_wait_for_each_other(served: Served) -> None:
    """The answer (about 20 MB) fills the pipe until this side reads it; the write (about 20 MB) fills
    it the other way. Posting the write reads the answer first."""
    text = "x" * 200
    ahead = served.cursor.query_ahead([("SELECT ? || i FROM range(100000) t(i)", [text])])
    writes = Writes()
    writes.traces.update({f"t-{i:06d}": (f"c-{i}", 1, 1) for i in range(100_000)})
    writes.traces["t-long"] = ("c-" + "y" * 10_000_000, 1, 1)
    done = threading.Event()

    def post() -> None:
        served.cursor.write_behind(writes, 1)
        served.cursor.sync()
        done.set()

    poster = threading.Thread(target=post, daemon=True)
    poster.start()
    assert done.wait(120), "the write behind waited for the answer ahead, and it for the write"
    rows = ahead.result()[0]
    assert len(rows) == 100_000 and rows[0] == (text + "0",)
    assert served.cursor.execute("SELECT count(*) FROM trace_conversations").fetchall() == [(100_001,)]


def test_an_error_of_the_parent_is_raised_in_the_child_as_its_duckdb_type() -> None:
    """DuckDB's exceptions live in ``_duckdb``: the child raises them as such (the stage tells a fatal error,
    which no retry mends, from others), and anything else as a RuntimeError naming it."""
    error = duckdb.FatalException("FATAL Error: x")
    with pytest.raises(duckdb.FatalException, match="FATAL Error: x"):
        _result(("err", type(error).__module__, type(error).__name__, str(error)))
    with pytest.raises(RuntimeError, match="KeyError: 'k'"):
        _result(("err", "builtins", "KeyError", "'k'"))
