"""The stage process's data: operations by name and plain arguments, reads ahead and writes behind, over a real pipe.

The operations go through ``RemoteData`` to the daemon's side of the stage process
(``StageProcess._serve``) on a real store: a write behind that fails is raised by
the next call and leaves nothing of itself stored; a long answer read ahead, not
yet read, and a long write posted after it do not wait for each other; and the
daemon's side runs nothing but a named operation of plain data.
"""

from __future__ import annotations

import gc
import os
import pickle
import threading
import weakref
from pathlib import Path
from typing import Any, Iterator

import duckdb
import pytest

from collector.conversations.process import _result, plain_request
from collector.conversations.data import Writes
from collector.store import Store

from ..support.served import Served


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    store = Store(tmp_path / "t.duckdb")
    store.open()
    served = Served(store)
    try:
        yield served
    finally:
        served.close()
        store.close()


def _traces(served: Served) -> dict[str, str]:
    return {t: p.conversation_id for t, p in served.data.trace_map(["t-1"]).items()}


def test_a_write_behind_is_stored_before_the_next_operation_runs(served: Served) -> None:
    writes = Writes()
    writes.traces["t-1"] = ("c-1", 1, 1)
    served.data.write(writes, 7)
    assert _traces(served) == {"t-1": "c-1"}
    assert served.data.resume(0.0, 0).mark == 7
    assert served.data.in_flight == 0


def test_a_write_behind_that_fails_is_raised_by_the_next_call_and_leaves_nothing(served: Served) -> None:
    writes = Writes()
    writes.traces["t-1"] = ("c-1", 1, 1)  # written first, in the same transaction
    writes.messages["c-1"] = [("c-1", "not a number")]  # a row of the wrong shape: the insert fails
    served.data.write(writes, 7)
    assert served.data.in_flight == 1
    with pytest.raises((duckdb.Error, RuntimeError, ValueError, TypeError)):
        served.data.trace_map(["t-1"])
    # Raised once; the transaction was rolled back, and the data goes on.
    assert _traces(served) == {}
    assert served.data.resume(0.0, 0).mark == 0


@pytest.mark.slow
def test_a_long_answer_read_ahead_and_a_long_write_behind_do_not_wait_for_each_other(served: Served) -> None:
    """The answer (about 20 MB of rows) fills the pipe until this side reads it; the write (about 20 MB) fills
    it the other way. Posting the write reads the answer first."""
    text = "x" * 200
    cur = served.server.store.cursor()
    try:
        cur.execute("INSERT INTO span_records (trace_id, span_id, attributes, received_at, batch_id) "
                    "SELECT 't' || i, 's' || i, ? || i, now(), 1 FROM range(100000) t(i)", [text])
    finally:
        cur.close()
    ahead = served.data.commit_rows(1, 1)
    writes = Writes()
    writes.traces.update({f"t-{i:06d}": (f"c-{i}", 1, 1) for i in range(100_000)})
    writes.traces["t-long"] = ("c-" + "y" * 10_000_000, 1, 1)
    done = threading.Event()

    def post() -> None:
        served.data.write(writes, 1)
        served.data.sync()
        done.set()

    poster = threading.Thread(target=post, daemon=True)
    poster.start()
    assert done.wait(120), "the write behind waited for the answer ahead, and it for the write"
    rows = ahead.result().spans
    assert len(rows) == 100_000 and rows[0][6].startswith(text)
    assert len(served.data.trace_map(["t-long", "t-000001"])) == 2


def test_an_error_of_the_parent_is_raised_in_the_child_as_its_duckdb_type() -> None:
    """DuckDB's exceptions live in ``_duckdb``: the child raises them as such (the stage tells a fatal error,
    which no retry mends, from others), and anything else as a RuntimeError naming it."""
    error = duckdb.FatalException("FATAL Error: x")
    with pytest.raises(duckdb.FatalException, match="FATAL Error: x"):
        _result(("err", type(error).__module__, type(error).__name__, str(error)))
    with pytest.raises(RuntimeError, match="KeyError: 'k'"):
        _result(("err", "builtins", "KeyError", "'k'"))


class Runs:
    """An object whose unpickling would run code of the sender's choosing."""

    def __reduce__(self) -> Any:
        return (os.system, ("echo ran",))


def test_the_daemon_runs_only_named_operations_of_plain_data() -> None:
    assert plain_request(pickle.dumps(("trace_map", ["t-1"]))) == ("trace_map", (["t-1"],))
    assert plain_request(pickle.dumps(("write", Writes(), 3)))[0] == "write"
    for request in [("execute", "DROP TABLE spans", None), ("trace_map", Runs()), ("trace_map", threading.Event),
                    "resume", ()]:
        with pytest.raises(ValueError):
            plain_request(pickle.dumps(request))


def test_an_operation_the_daemon_refuses_is_raised_where_it_was_made(served: Served) -> None:
    with pytest.raises(RuntimeError, match=r"ValueError: unknown operation 'execute'.* \(in \(unread\)\)"):
        served.data._call("execute", "SELECT 1")
    assert served.data.trace_map(["t-1"]) == {}  # and the pipe goes on
    # A failure names its operation: one posted behind is raised at a later call, not its own.
    with pytest.raises(RuntimeError, match=r"TypeError: .* \(in trace_map\)"):
        served.data._call("trace_map", 5)
    assert served.data.trace_map(["t-1"]) == {}


def test_an_answer_read_ahead_is_freed_once_read_without_the_garbage_collector(served: Served) -> None:
    """A read ahead holds its answer (a commit's rows) until it is read; then nothing refers to it. The
    stage's process collects garbage only every few seconds: an answer held by a cycle stayed that long,
    and at 6,000 spans/s the process held twice the memory."""
    ahead = served.data.commit_rows(1, 1)
    gone = threading.Event()
    weakref.finalize(ahead, gone.set)
    gc.disable()
    try:
        ahead.result()
        del ahead
        assert gone.is_set()
    finally:
        gc.enable()
