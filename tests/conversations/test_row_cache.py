"""The stage's row cache: a release drops what readers parsed in the cached rows they were handed."""

from __future__ import annotations

from typing import Any

from collector.conversations.keys import StoredRow
from collector.conversations.rows import RowCache, Taken


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
