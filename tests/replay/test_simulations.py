"""``tracejudge replay import``, ``eval --source simulation`` and ``stats --by source``: simulated conversations
stored beside real ones, never sampled, judged on demand with the same criteria, compared side by side."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.api_http import post_json
from tests.support.daemon import DaemonProcess, clean_env, run_cli
from tests.support.review import CARRIER, CARRIER_ANSWER, carrier_conversation, send_conversations, start_daemon, \
    wait_items

pytestmark = pytest.mark.slow  # each test starts the daemon


def _sim(i: int, *, fail: bool) -> dict[str, Any]:
    return {"schema": "conversation/v1", "id": f"sim-{i}", "source": "simulation", "persona_id": f"case-{i % 3}",
            "ended_by": "goal_reached", "messages": [
                {"role": "user", "content": "Where is my parcel?"},
                {"role": "assistant", "content": CARRIER_ANSWER if fail else "It is at the depot."}]}


def _write(path: Path, records: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


def _cli(config: Path, *args: str, rc: int = 0) -> Any:
    res = run_cli(*args, "--config", str(config), env=clean_env())
    assert res.returncode == rc, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    return res


def _json(config: Path, *args: str) -> Any:
    return json.loads(_cli(config, *args, "--json").stdout)


@pytest.fixture
def daemon(tmp_path: Path) -> Any:
    d = start_daemon(tmp_path)
    yield d
    d.end()


def _entry(stats: dict[str, Any], criterion: str) -> dict[str, Any]:
    return next(e for e in stats["criteria"] if e["criterion_id"] == criterion)


def test_simulated_conversations_are_imported_judged_on_demand_and_compared(daemon: DaemonProcess,
                                                                             tmp_path: Path) -> None:
    send_conversations(daemon.grpc, [carrier_conversation("real-1")])
    wait_items(daemon, {("real-1", CARRIER)})
    sims = _write(tmp_path / "sim.jsonl", [_sim(i, fail=i < 3) for i in range(10)])
    cfg = daemon.config_path

    assert _json(cfg, "replay", "import", str(sims)) == {"stored": 10, "already_imported": 0}
    assert _json(cfg, "replay", "import", str(sims)) == {"stored": 0, "already_imported": 10}  # idempotent by id
    status = daemon.get("/api/stats")[1]
    assert status["conversations"]["sampled"] == 1  # the evaluator never samples them

    judged = _json(cfg, "eval", "--source", "simulation")
    assert judged["total"] == 10 and judged["done"] == 10 and judged["errors"] == 0
    by = _json(cfg, "stats", "--by", "source")["by_source"]
    prod, sim = _entry(by["production"], CARRIER), _entry(by["simulation"], CARRIER)
    assert (prod["judged"], prod["fail"]) == (1, 1)
    assert (sim["judged"], sim["fail"], sim["pass"]) == (10, 3, 7)
    assert sim["failure_rate"]["estimate"] == pytest.approx(0.3)
    assert by["simulation"]["conversations"] == {"imported": 10, "judged": 10}
    assert by["production"]["conversations"]["judged"] == 1
    # Production's figures are production's alone, and simulated fails open no review item.
    assert _entry(daemon.get("/api/stats")[1], CARRIER)["judged"] == 1
    items = daemon.get("/api/review?state=all&limit=1000")[1]["items"]
    assert not [i for i in items if i["conversation_id"].startswith("sim-")]
    text = _cli(cfg, "stats", "--by", "source").stdout
    assert "simulation failure rate" in text and CARRIER in text

    # The same on the file, with no daemon: the new ones only, judged once.
    daemon.end()
    more = _write(tmp_path / "more.jsonl", [_sim(i, fail=True) for i in range(8, 12)])
    assert _json(cfg, "replay", "import", str(more)) == {"stored": 2, "already_imported": 2}
    again = _json(cfg, "eval", "--source", "simulation")
    # Four criteria: the two new ones are judged on each, the ten judged before on none.
    assert again["total"] == 12 and again["verdicts"] == 2 * 4 and again["skipped"] == 10 * 4
    sim = _entry(_json(cfg, "stats", "--by", "source")["by_source"]["simulation"], CARRIER)
    assert (sim["judged"], sim["fail"]) == (12, 5)


HALF = "Where is my parcel? \ud83d"  # an emoji cut in half: a lone surrogate, which JSON escapes can spell


@pytest.mark.parametrize("line, error", [
    ("{not json", "sim.jsonl:2: not JSON"),
    (json.dumps({**_sim(9, fail=False), "messages": [{"role": "user", "content": HALF}]}),
     "sim.jsonl:2: messages.0.content: '\\ud83d' is a lone surrogate"),
    (json.dumps({**_sim(9, fail=False), "attributes": {"note\udc00": 1}}),
     "sim.jsonl:2: attributes: the key 'note\\udc00' holds a lone surrogate"),
    (json.dumps({**_sim(9, fail=False), "schema": "conversation/v2"}), "sim.jsonl:2: schema is 'conversation/v2'"),
    (json.dumps({k: v for k, v in _sim(9, fail=False).items() if k != "messages"}), "sim.jsonl:2: messages"),
    (json.dumps({**_sim(9, fail=False), "source": "production"}), "has source 'production'"),
    ("[1, 2]", "sim.jsonl:2: expected a JSON object"),
])
def test_a_bad_line_is_named_and_nothing_is_stored(daemon: DaemonProcess, tmp_path: Path, line: str,
                                                   error: str) -> None:
    cfg = daemon.config_path
    sims = _write(tmp_path / "sim.jsonl", [_sim(1, fail=False), line])
    res = _cli(cfg, "replay", "import", str(sims), rc=2)
    assert error in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert _json(cfg, "replay", "import", str(_write(tmp_path / "ok.jsonl", [_sim(1, fail=False)]))) == {
        "stored": 1, "already_imported": 0}  # the good line of the bad file was not stored before


def test_a_lone_surrogate_posted_is_a_400_naming_the_record_and_nothing_is_stored(daemon: DaemonProcess) -> None:
    bad = {**_sim(2, fail=False), "messages": [{"role": "user", "content": HALF}]}
    reply = post_json(daemon.api, "/api/simulations", {"records": [_sim(1, fail=False), bad]})
    assert reply.status == 400, reply.body
    assert reply.json()["error"] == {
        "code": "bad_request",
        "message": "conversation 'sim-2': messages.0.content: '\\ud83d' is a lone surrogate, half of a character, "
                   "not text"}
    assert _json(daemon.config_path, "stats", "--by", "source")["by_source"]["simulation"]["conversations"] == {
        "imported": 0, "judged": 0}


def test_simulated_and_production_ids_are_two_spaces_neither_hides_the_other(daemon: DaemonProcess,
                                                                              tmp_path: Path) -> None:
    cfg = daemon.config_path
    # A simulated victim-1 first, then production's victim-1 (and real-2, which a simulation takes after).
    assert _json(cfg, "replay", "import", str(_write(tmp_path / "first.jsonl", [
        {**_sim(1, fail=False), "id": "victim-1"}]))) == {"stored": 1, "already_imported": 0}
    send_conversations(daemon.grpc, [carrier_conversation("victim-1"), carrier_conversation("real-2")])
    wait_items(daemon, {("victim-1", CARRIER), ("real-2", CARRIER)})
    prod = _entry(daemon.get("/api/stats")[1], CARRIER)
    assert (prod["judged"], prod["fail"]) == (2, 2)
    assert _json(cfg, "replay", "import", str(_write(tmp_path / "then.jsonl", [
        {**_sim(2, fail=False), "id": "real-2"}]))) == {"stored": 1, "already_imported": 0}

    judged = _json(cfg, "eval", "--source", "simulation")
    assert (judged["total"], judged["errors"]) == (2, 0)
    by = _json(cfg, "stats", "--by", "source")["by_source"]
    prod, sim = _entry(by["production"], CARRIER), _entry(by["simulation"], CARRIER)
    assert (prod["judged"], prod["fail"]) == (2, 2)  # the simulated passes supersede nothing of production's
    assert (sim["judged"], sim["pass"], sim["fail"]) == (2, 2, 0)
    assert by["production"]["conversations"]["judged"] == 2 and by["simulation"]["conversations"] == {
        "imported": 2, "judged": 2}
    # Each id's verdicts are its own space's.
    mine = {"production": "fail", "simulation": "pass"}
    for source, result in mine.items():
        rows = _json(cfg, "verdicts", "--conversation", "victim-1", "--criterion", CARRIER, "--source", source)
        assert [v["result"] for v in rows] == [result], source
    assert len(daemon.get("/api/review?state=all&limit=1000")[1]["items"]) == 2  # production's two fails
    # Production's conversation reads as it was sent.
    assert daemon.get("/api/conversations/victim-1")[1]["messages"][-1]["content"] == CARRIER_ANSWER


def test_a_file_that_kept_simulated_verdicts_among_productions_has_them_moved_apart(tmp_path: Path) -> None:
    """An older version stored simulated conversations' verdicts in ``verdicts`` (their rule named
    ``simulation``): the first command on the file moves them, and production's figures leave them out."""
    import duckdb

    from tests.support.stored import StoredConversation, create_store, text_messages, verdict_row, write

    db = tmp_path / "tracejudge.duckdb"
    create_store(db)
    write(db, [StoredConversation("p-1", text_messages([("Where is it?", CARRIER_ANSWER)]))],
          decisions=[("p-1", True, 1.0, "default", None)],
          verdicts=[{"conversation_id": "p-1", "criterion_id": CARRIER, "result": "fail"}])
    con = duckdb.connect(str(db))
    try:  # the older layout: one table of verdicts, and a not-run record of the simulated conversation too
        con.execute("DROP TABLE simulated_verdicts; DROP TABLE simulated_not_run")
        con.execute("INSERT INTO simulated_conversations VALUES ('sim-1', NULL, 'goal_reached', ?, now())",
                    [json.dumps(_sim(1, fail=False))])
        row = {**verdict_row("sim-1", CARRIER, "pass"), "sampling_rule": "simulation"}
        con.execute(f"INSERT INTO verdicts ({', '.join(row)}, seq) VALUES ({', '.join('?' * len(row))}, 9)",
                    list(row.values()))
        con.execute("INSERT INTO not_run VALUES ('sim-1', 'other', 1, 'no provider configured', now())")
    finally:
        con.close()
    cfg = tmp_path / "otel-config.yaml"
    cfg.write_text("storage:\n  duckdb: {path: ./tracejudge.duckdb}\n", encoding="utf-8")

    by = _json(cfg, "stats", "--by", "source")["by_source"]
    prod, sim = _entry(by["production"], CARRIER), _entry(by["simulation"], CARRIER)
    assert (prod["judged"], prod["fail"], prod["pass"]) == (1, 1, 0)
    assert (sim["judged"], sim["pass"]) == (1, 1) and _entry(by["simulation"], "other")["not_run"] == 1
    con = duckdb.connect(str(db), read_only=True)
    try:
        assert con.execute("SELECT sampling_rule FROM verdicts").fetchall() == [("default",)]
        assert con.execute("SELECT count(*) FROM not_run").fetchall() == [(0,)]
    finally:
        con.close()
