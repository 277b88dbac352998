"""The stage's row cache: a release drops what readers parsed in the cached rows they were handed; a read
of traces not cached stays within the commits it is given."""

from __future__ import annotations

from typing import Any

from collector.conversations.keys import StoredRow
from collector.conversations.rows import RowCache, Taken
from collector.store.transactions import MAX_RANGES, batch_filter


def taken(*trace_ids: str) -> Taken:
    """One span row per trace, as a commit hands them over."""
    out = Taken()
    for i, tid in enumerate(trace_ids):
        out.add(tid, batch_id=i + 1, received_at=0.0).spans.append(
            StoredRow({"trace_id": tid, "attributes": '{"gen_ai.conversation.id": "c-%d"}' % i}))
    return out


def parsed(rows: dict[str, Any], tid: str) -> Any:
    return rows[tid].spans[0].json("attributes")


def test_release_drops_what_was_parsed_in_every_cached_row_handed_out_since_the_last() -> None:
    cache = RowCache(max_rows=3)
    cache.keep(taken("t1", "t2"), seen=set())
    first = cache.get(None, ["t1", "t2"])  # type: ignore[arg-type]  # all cached: no read
    before = {t: parsed(first, t) for t in ("t1", "t2")}
    cache.keep(taken("t3"), seen=set())
    for t in ("t1", "t2"):
        assert parsed(first, t) is before[t], "parsed once until a release"
    cache.release()
    for t in ("t1", "t2"):
        again = parsed(first, t)
        assert again == before[t] and again is not before[t], f"{t}'s parse was not dropped"
    assert cache.held() == {"cached_rows": 3, "cached_traces": 3}


def test_a_release_leaves_nothing_to_drop_for_the_next() -> None:
    cache = RowCache(max_rows=10)
    cache.keep(taken("t1"), seen=set())
    rows = cache.get(None, ["t1"])  # type: ignore[arg-type]
    one = parsed(rows, "t1")
    cache.release()
    two = parsed(rows, "t1")  # parsed after the release, by a reader of the same cycle
    cache.release()  # t1 was not handed out again: its new parse stays
    assert parsed(rows, "t1") is two and two is not one
    cache.get(None, ["t1"])  # type: ignore[arg-type]
    cache.release()
    assert parsed(rows, "t1") is not two


def test_a_read_of_missing_traces_stays_within_the_commits_it_is_given() -> None:
    import duckdb

    from collector.conversations.duck import DuckData
    from collector.store.schema import SCHEMA

    con = duckdb.connect()
    con.execute(SCHEMA)
    data = DuckData(con)
    for batch, span in ((1, "a"), (5, "b"), (9, "c")):  # trace t1's rows in three commits
        con.execute("INSERT INTO span_records (trace_id, span_id, received_at, batch_id) VALUES ('t1', ?, now(), ?)",
                    [span, batch])
    spans = lambda rows: sorted(r["span_id"] for r in rows["t1"].spans)  # noqa: E731
    assert spans(RowCache(10).get(data, ["t1"], where=lambda ts: {"t1": (1, 5)})) == ["a", "b"]
    assert spans(RowCache(10).get(data, ["t1"], where=lambda ts: {"t1": (5, None)})) == ["b", "c"]
    got = RowCache(10).get(data, ["t1"], where=lambda ts: {"t1": (None, None)})  # unknown: the whole table
    assert spans(got) == ["a", "b", "c"] and got["t1"].batches() == (1, 9)


def test_batch_ranges_merge_and_split_at_the_widest_gaps() -> None:
    assert batch_filter([]) == ("", [])
    assert batch_filter([(3, 4), (None, None)]) == ("", []), "one trace's commits unknown: the whole table"
    assert batch_filter([(7, 8), (1, 3), (2, 5), (6, None)]) == (" AND (batch_id >= ?)", [1])
    assert batch_filter([(7, 8), (1, 3), (2, 4)]) == (" AND (batch_id BETWEEN ? AND ? OR batch_id BETWEEN ? AND ?)",
                                                      [1, 4, 7, 8])
    # A trace of a conversation open for days beside many recent ones: a range of its own.
    recent = [(1000 + 3 * i, 1000 + 3 * i) for i in range(40)]
    sql, params = batch_filter([*recent, (5, 6)])
    assert sql.count("BETWEEN") == MAX_RANGES and params[:2] == [5, 6]
    pairs = list(zip(params[::2], params[1::2]))
    assert all(any(lo <= a and b <= hi for lo, hi in pairs) for a, b in [*recent, (5, 6)]), "every trace covered"
    assert sum(hi - lo + 1 for lo, hi in pairs) < 2 + 120, "no range reaches across the gap"
