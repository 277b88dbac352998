"""Each trace knows the first and last commits holding its rows, each conversation the first of its traces',
and reads of their older rows stay within them.

A rebuild after a restart (nothing cached) reads a conversation's traces back
within those commits, not from the whole table; so the stored commits must hold
every row of every trace that went into the conversation, however it came: a
trace whose spans arrived before the one carrying the conversation id (pending),
a trace that moved from its own ``trace:`` conversation to a keyed one, a span
that arrives long after the rest of its trace, and a file stored by an older
version without them.
"""

from __future__ import annotations

import json
import urllib.parse
from typing import Any

import duckdb
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from ..support.daemon import wait_conversations
from ..support.wire import add_attributes, post

pytestmark = pytest.mark.slow  # each test restarts the daemon on a grown file

T0 = 1_764_478_800_000_000_000
Span = tuple[int, int, "int | None", str, dict[str, Any]]  # trace, span, parent, name, attributes


def _request(spans: list[Span]) -> bytes:
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    kv = rs.resource.attributes.add()
    kv.key, kv.value.string_value = "service.name", "shopbot"
    ss = rs.scope_spans.add()
    for trace, span, parent, name, attrs in spans:
        sp = ss.spans.add()
        sp.trace_id, sp.span_id, sp.name = trace.to_bytes(16, "big"), span.to_bytes(8, "big"), name
        if parent is not None:
            sp.parent_span_id = parent.to_bytes(8, "big")
        sp.start_time_unix_nano = T0 + trace * 10_000_000 + span * 1000  # a later trace starts later
        sp.end_time_unix_nano = sp.start_time_unix_nano + 900
        add_attributes(sp.attributes, attrs)
    return req.SerializeToString()


def _root(trace: int) -> Span:
    return (trace, 1, None, "invoke_agent ShopBot", {"gen_ai.operation.name": "invoke_agent",
                                                     "gen_ai.conversation.id": "c-1"})


def _chat(trace: int, n: int) -> Span:
    text = lambda role, content: {"role": role, "parts": [{"type": "text", "content": content}]}  # noqa: E731
    return (trace, 2, 1, "chat gpt-4o-mini", {
        "gen_ai.operation.name": "chat", "gen_ai.request.model": "gpt-4o-mini",
        "gen_ai.input.messages": json.dumps([text("user", f"question {n}")]),
        "gen_ai.output.messages": json.dumps([text("assistant", f"answer {n}")])})


def _send(daemon: Any, spans: list[Span]) -> None:
    status, _, body = post(daemon.http, "/v1/traces", _request(spans))
    assert status == 200, body
    wait_conversations(daemon)


def _turns(daemon: Any) -> list[str]:
    record = daemon.get("/api/conversations/" + urllib.parse.quote("c-1", safe=""))[1]
    return [m["content"] for m in record["messages"]]


def _firsts(daemon: Any) -> dict[str, tuple[Any, Any]]:
    """Per conversation: (the stored first commit, the first commit of its traces' rows)."""
    return {cid: (stored, actual) for cid, stored, actual in daemon.query(
        "SELECT c.conversation_id, c.first_batch, min(r.batch_id) FROM conversations c "
        "JOIN trace_conversations t USING (conversation_id) "
        "JOIN (SELECT trace_id, batch_id FROM span_records UNION ALL "
        "      SELECT trace_id, batch_id FROM log_records) r USING (trace_id) GROUP BY 1, 2")}


def _as_an_older_version_wrote(daemon: Any, update: str) -> None:
    """Run ``update`` on the stopped daemon's file."""
    con = duckdb.connect(str(daemon.duckdb))
    try:
        con.execute(update)
    finally:
        con.close()


def _ranges(daemon: Any) -> dict[str, tuple[Any, ...]]:
    """Per trace: (stored first and last commits, the first and last commits of its rows)."""
    return {tid: (stored, actual) for tid, *stored_actual in daemon.query(
        "SELECT t.trace_id, t.first_batch, t.last_batch, min(r.batch_id), max(r.batch_id) FROM trace_conversations t "
        "JOIN (SELECT trace_id, batch_id FROM span_records UNION ALL "
        "      SELECT trace_id, batch_id FROM log_records) r USING (trace_id) GROUP BY 1, 2, 3")
        for stored, actual in [(tuple(stored_actual[:2]), tuple(stored_actual[2:]))]}


def test_a_conversation_rebuilt_after_a_restart_reads_every_row_from_its_first_commit(make_daemon: Any) -> None:
    daemon = make_daemon()
    # First commit: trace 1's model call, with no conversation id yet (it gets a trace: conversation of
    # its own), and a plain HTTP span of trace 2 (nothing conversational: pending).
    _send(daemon, [_chat(1, 1), (2, 3, 1, "GET /orders", {"http.request.method": "GET"})])
    first = daemon.get("/api/status")[1]["committed_batch"]
    # Later commits: the spans carrying the id, and trace 2's model call.
    _send(daemon, [_root(1)])
    _send(daemon, [_root(2), _chat(2, 2)])
    assert _turns(daemon) == ["question 1", "answer 1", "question 2", "answer 2"]
    assert daemon.stop() == 0
    assert _firsts(daemon)["c-1"] == (first, first)

    # After a restart nothing is cached: a new turn rebuilds c-1 from rows read back from its first commit.
    daemon.start()
    _send(daemon, [_root(3), _chat(3, 3)])
    assert _turns(daemon) == ["question 1", "answer 1", "question 2", "answer 2", "question 3", "answer 3"]
    assert daemon.stop() == 0
    assert _firsts(daemon)["c-1"] == (first, first)

    # A conversation an older version stored has no first commit: it is read whole once, and learns it.
    _as_an_older_version_wrote(daemon, "UPDATE live_conversations SET first_batch = NULL")
    daemon.start()
    _send(daemon, [_root(4), _chat(4, 4)])
    assert _turns(daemon)[-2:] == ["question 4", "answer 4"] and len(_turns(daemon)) == 8
    assert daemon.stop() == 0
    firsts = _firsts(daemon)
    assert firsts["c-1"] == (first, first)
    assert all(stored == actual for stored, actual in firsts.values()), firsts


def test_a_span_arriving_long_after_its_trace_is_read_back_with_it_after_a_restart(make_daemon: Any) -> None:
    daemon = make_daemon()
    tid = lambda n: f"{n:032x}"  # noqa: E731
    _send(daemon, [_root(1), _chat(1, 1)])
    for n in range(10, 14):  # other conversations' commits in between
        _send(daemon, [(n, 1, None, "invoke_agent ShopBot", {"gen_ai.operation.name": "invoke_agent",
                                                              "gen_ai.conversation.id": f"other-{n}"})])
    # A retried export brings trace 1's second model call late, after the commits of the others.
    late = _chat(1, 9)
    _send(daemon, [(1, 3, 1, late[3], late[4])])
    assert _turns(daemon) == ["question 1", "answer 1", "question 9", "answer 9"]
    assert daemon.stop() == 0
    ranges = _ranges(daemon)
    assert all(stored == actual for stored, actual in ranges.values()), ranges
    first, last = ranges[tid(1)][0]
    assert last - first >= 5, "trace 1's rows span the other conversations' commits"

    # Nothing cached after a restart: a new turn reads trace 1 back within its stored commits, late span and all.
    daemon.start()
    _send(daemon, [_root(2), _chat(2, 2)])
    assert _turns(daemon) == ["question 1", "answer 1", "question 9", "answer 9", "question 2", "answer 2"]
    assert daemon.stop() == 0
    assert all(stored == actual for stored, actual in _ranges(daemon).values()), _ranges(daemon)

    # A file an older version wrote has no commits per trace: the conversation's rebuild reads its traces
    # from its first commit on, and stores each trace's commits.
    _as_an_older_version_wrote(daemon, "UPDATE trace_conversations SET first_batch = NULL, last_batch = NULL")
    daemon.start()
    _send(daemon, [_root(3), _chat(3, 3)])
    assert _turns(daemon)[-4:] == ["question 2", "answer 2", "question 3", "answer 3"] and len(_turns(daemon)) == 8
    assert daemon.stop() == 0
    ranges = _ranges(daemon)
    ours = {tid(n) for n in (1, 2, 3)}
    assert all(ranges[t][0] == ranges[t][1] for t in ours), "the rebuilt conversation's traces learn their commits"
    assert all(stored == (None, None) for t, (stored, _) in ranges.items() if t not in ours), ranges
