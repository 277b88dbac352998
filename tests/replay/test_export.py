"""``tracejudge replay export``: stored conversations out as conversation/v1 JSONL, through a running daemon
(real OTLP in, the streaming API out) and from the file with no daemon, the same lines either way."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import stat
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import pytest
from aiohttp import web

from collector.api import export
from collector.conversations.record import conversation_record
from collector.demo.traffic import Persona, Turn
from collector.errors import UserError
from replay.export import write_lines

from ..support.daemon import REPO, DaemonProcess, base_config, clean_env, wait_conversations, wait_until
from ..support.online import send
from ..support.review import CARRIER, CRITERIA, carrier_conversation, wait_items
from ..support.stored import T0, StoredConversation, create_store, text_messages, tool_turn, write
from ..support.synthetic import real_conversations

pytestmark = pytest.mark.slow  # its tests, but four, export thousands of conversations

TOKEN = "export-token-51c2"


def cli(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``tracejudge ARGS`` of this checkout run in ``folder`` (its otel-config.yaml is the default config there)."""
    return subprocess.run([sys.executable, "-m", "collector", *args], capture_output=True, text=True,
                          env=clean_env(PYTHONPATH=str(REPO)), timeout=180, cwd=folder)


def exported(folder: Path, *args: str, name: str = "out.jsonl") -> list[dict[str, Any]]:
    res = cli(folder, "replay", "export", "--out", name, *args)
    assert res.returncode == 0, res.stderr
    return [json.loads(line) for line in (folder / name).read_text(encoding="utf-8").splitlines()]


def one_line_error(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    return res.stderr


def file_store(folder: Path, conversations: list[StoredConversation], **rows: Any) -> Path:
    """A store in ``folder`` holding ``conversations`` (and decisions, verdicts), with a config naming it."""
    db = folder / "tracejudge.duckdb"
    create_store(db)
    write(db, conversations, **rows)
    (folder / "otel-config.yaml").write_text("storage:\n  duckdb: {path: ./tracejudge.duckdb}\n", encoding="utf-8")
    return db


# --------------------------------------------------------------- from the file, no daemon


def test_from_the_file_every_conversation_in_id_order_as_its_record_reads(tmp_path: Path) -> None:
    convs = real_conversations(3000)
    convs[5].messages = tool_turn("Where is order B-1?", "call_9", '{"status": "shipped"}', "It shipped.")
    picked = {c.conversation_id for c in convs[:200:2]}
    decisions: list[tuple[str, bool, float, str, str | None]] = [
        *((cid, True, 0.25, "rules[0]", None) for cid in sorted(picked)),
        *((c.conversation_id, False, 0.25, "rules[0]", None) for c in convs[1:200:2])]
    db = file_store(tmp_path, convs, decisions=decisions)
    res = cli(tmp_path, "replay", "export", "--out", "real.jsonl")
    assert res.returncode == 0, res.stderr
    assert res.stderr.strip() == "wrote 3000 conversations to real.jsonl" and res.stdout == ""
    lines = (tmp_path / "real.jsonl").read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["id"] for r in records] == sorted(c.conversation_id for c in convs)
    con = duckdb.connect(str(db), read_only=True)
    try:
        for r in records:
            expected = conversation_record(con, r["id"])
            assert expected is not None
            if r["id"] in picked:  # the sampler picked it: its inclusion probability and rule
                expected["sampling"] = {"probability": 0.25, "rule": "rules[0]"}
            assert r == expected, r["id"]
    finally:
        con.close()
    assert records[5]["messages"][1]["tool_calls"] == [{"id": "call_9", "name": "lookup_order",
                                                        "arguments": {"order_id": "B-1"}}]
    # Written whole under another name and renamed; readable by its owner only (the users' own words).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["otel-config.yaml", "real.jsonl", "tracejudge.duckdb"]
    assert stat.S_IMODE((tmp_path / "real.jsonl").stat().st_mode) == 0o600


def _filter_world() -> tuple[list[StoredConversation], dict[str, Any]]:
    def conv(cid: str, minute: int, state: str = "ended") -> StoredConversation:
        return StoredConversation(cid, text_messages([(f"hello from {cid}", "hi")]), state=state,
                                  ended_by="idle" if state == "ended" else None,
                                  arrived=T0 + dt.timedelta(minutes=minute))

    convs = [conv("a-fail", 1), conv("b-superseded-fail", 2), conv("c-newer-version-passes", 3),
             conv("d-newer-version-fails", 4), conv("e-other-criterion", 5), conv("f-later-pass", 6),
             conv("g-open", 70, "open"), conv("h-budget", 80), conv("i-not-sampled", 90), conv("j-nothing", 100)]
    verdicts = [
        {"conversation_id": "a-fail", "criterion_id": "C", "result": "fail"},
        {"conversation_id": "b-superseded-fail", "criterion_id": "C", "result": "fail", "superseded": True,
         "sha": "1" * 64},
        {"conversation_id": "b-superseded-fail", "criterion_id": "C", "result": "pass"},
        {"conversation_id": "c-newer-version-passes", "criterion_id": "C", "result": "fail"},
        {"conversation_id": "c-newer-version-passes", "criterion_id": "C", "result": "pass", "version": 2},
        {"conversation_id": "d-newer-version-fails", "criterion_id": "C", "result": "pass"},
        {"conversation_id": "d-newer-version-fails", "criterion_id": "C", "result": "fail", "version": 2},
        {"conversation_id": "e-other-criterion", "criterion_id": "D", "result": "fail"},
        {"conversation_id": "f-later-pass", "criterion_id": "C", "result": "fail", "sha": "2" * 64},
        {"conversation_id": "f-later-pass", "criterion_id": "C", "result": "pass"},  # the newest on it
    ]
    decisions: list[tuple[str, bool, float, str, str | None]] = [
        (c, True, 0.5, "default", None) for c in ("a-fail", "b-superseded-fail", "g-open")]
    decisions += [("h-budget", True, 0.5, "default", "budget:conversations_per_hour"),
                  ("i-not-sampled", False, 0.5, "default", None)]
    return convs, {"verdicts": verdicts, "decisions": decisions}


FILTERS = [
    ((), "a-fail b-superseded-fail c-newer-version-passes d-newer-version-fails e-other-criterion f-later-pass "
         "g-open h-budget i-not-sampled j-nothing"),
    (("--state", "open"), "g-open"),
    (("--state", "ended"), "a-fail b-superseded-fail c-newer-version-passes d-newer-version-fails "
                           "e-other-criterion f-later-pass h-budget i-not-sampled j-nothing"),
    (("--since", (T0 + dt.timedelta(minutes=80)).isoformat()), "h-budget i-not-sampled j-nothing"),
    (("--sampled-only",), "a-fail b-superseded-fail g-open"),
    (("--criterion-failed", "C"), "a-fail d-newer-version-fails"),
    (("--criterion-failed", "D"), "e-other-criterion"),
    (("--criterion-failed", "nobody"), ""),
    (("--sampled-only", "--state", "ended", "--criterion-failed", "C"), "a-fail"),
]


def test_every_filter_from_the_file(tmp_path: Path) -> None:
    convs, rows = _filter_world()
    file_store(tmp_path, convs, **rows)
    for args, ids in FILTERS:
        records = exported(tmp_path, *args)
        assert [r["id"] for r in records] == ids.split(), args
    sampled = {r["id"]: r.get("sampling") for r in exported(tmp_path)}
    assert sampled["a-fail"] == {"probability": 0.5, "rule": "default"}
    assert sampled["h-budget"] is None and sampled["i-not-sampled"] is None and sampled["j-nothing"] is None


def test_a_file_without_the_evals_tables_has_nothing_sampled_or_failed(tmp_path: Path) -> None:
    db = tmp_path / "tracejudge.duckdb"
    con = duckdb.connect(str(db))
    from collector.conversations.tables import SCHEMA

    con.execute(SCHEMA)
    con.close()
    write(db, [StoredConversation("only", text_messages([("hi", "hello")]))])
    (tmp_path / "otel-config.yaml").write_text("storage:\n  duckdb: {path: ./tracejudge.duckdb}\n", encoding="utf-8")
    assert [r["id"] for r in exported(tmp_path)] == ["only"]
    assert exported(tmp_path, "--sampled-only") == [] and exported(tmp_path, "--criterion-failed", "C") == []


def _walk_world(db: Path) -> list[StoredConversation]:
    """A store as the conversation stage leaves it, and then some: 230 conversations, one longer than any
    window below, one without messages, and one whose messages were written apart (no writer does that
    today; the walk must still write it once)."""
    convs = real_conversations(230)
    convs.append(StoredConversation("long-one", text_messages([(f"question {n}", f"answer {n}") for n in range(40)])))
    convs.append(StoredConversation("no-messages", []))
    create_store(db)
    write(db, convs[:100])
    apart = StoredConversation("apart", text_messages([("first", "one"), ("second", "two"), ("third", "three")]))
    row, messages = apart.rows()
    con = duckdb.connect(str(db))
    try:
        con.execute(f"INSERT INTO live_conversations VALUES ({', '.join('?' * len(row))})", row)
        con.executemany(f"INSERT INTO messages VALUES ({', '.join('?' * len(messages[0]))})", messages[:4])
    finally:
        con.close()
    write(db, convs[100:])
    con = duckdb.connect(str(db))
    try:
        con.executemany(f"INSERT INTO messages VALUES ({', '.join('?' * len(messages[0]))})", messages[4:])
    finally:
        con.close()
    return [*convs, apart]


def test_both_walks_write_every_conversation_once_whatever_the_page_and_window(tmp_path: Path) -> None:
    db = tmp_path / "t.duckdb"
    convs = _walk_world(db)
    con = duckdb.connect(str(db), read_only=True)
    try:
        by_id = list(export.lines(con, export.ExportFilter()))
        records = [json.loads(line) for line in by_id]
        assert [r["id"] for r in records] == sorted(c.conversation_id for c in convs)
        for r in records:
            assert r == conversation_record(con, r["id"]), r["id"]
        assert len(next(r for r in records if r["id"] == "apart")["messages"]) == 6
        for size in (1, 7, 232, 233, 234):
            assert list(export.lines(con, export.ExportFilter(), size=size)) == by_id, size
        for window in (1, 3, 7, 64, 100_000):
            walk = export.Walk(con, export.ExportFilter(), window=window, by_id_max=0)
            lines = list(walk)
            assert len(lines) == walk.written == walk.total == len(convs), window
            assert sorted(lines) == sorted(by_id), window
        # Conversations come in the order their messages were stored; those without messages last.
        ids = [json.loads(line)["id"] for line in export.lines(con, export.ExportFilter(), window=5, by_id_max=0)]
        assert ids[:100] == [c.conversation_id for c in convs[:100]] and ids[-1] == "no-messages"
        ended = export.ExportFilter(state="ended")
        some = list(export.lines(con, ended, window=9, by_id_max=0))
        assert sorted(some) == list(export.lines(con, ended)) and len(some) == export.count(con, ended) < 233
    finally:
        con.close()


def test_every_filter_by_storage_position_selects_what_by_id_selects(tmp_path: Path) -> None:
    convs, rows = _filter_world()
    db = file_store(tmp_path, convs, **rows)
    con = duckdb.connect(str(db), read_only=True)
    try:
        for args, ids in FILTERS:
            f = export.ExportFilter(
                since=dt.datetime.fromisoformat(args[1]) if "--since" in args else None,
                state=args[args.index("--state") + 1] if "--state" in args else None,
                sampled_only="--sampled-only" in args,
                criterion_failed=args[args.index("--criterion-failed") + 1] if "--criterion-failed" in args else None)
            walked = [json.loads(line)["id"] for line in export.lines(con, f, window=2, by_id_max=0)]
            assert sorted(walked) == ids.split(), args
    finally:
        con.close()


def test_a_walk_writes_the_store_as_it_was_when_it_began(tmp_path: Path) -> None:
    """The daemon rebuilds, adds and deletes conversations while an export is under way: the export still writes each conversation selected at its start exactly once, as it was then."""
    from collector.conversations.tables import CONVERSATION_COLUMNS
    from collector.conversations.data import ConversationRow, Writes
    from collector.conversations.duck import DuckData
    from collector.store import Store

    db = tmp_path / "t.duckdb"
    convs = real_conversations(300)
    create_store(db)
    write(db, convs)
    con = duckdb.connect(str(db), read_only=True)
    before = sorted(export.lines(con, export.ExportFilter()))
    con.close()
    store = Store(db)
    store.open()
    try:
        cur = store.cursor()
        walk = export.Walk(cur, export.ExportFilter(), window=50, by_id_max=0)
        first = walk.page()
        assert first and walk.total == 300
        # As the conversation stage writes: the messages of a rebuilt conversation go and come back at the
        # end; one is deleted, one is new. Some were written already, some not yet.
        w = store.cursor()
        writes = Writes()
        for c in (convs[0], convs[1], convs[150], convs[299]):
            c.messages = [*c.messages, *text_messages([("one more thing", "sure")])]
            row, messages = c.rows()
            writes.conversations[c.conversation_id] = ConversationRow(**dict(zip(CONVERSATION_COLUMNS, row)))
            writes.messages[c.conversation_id] = messages
            writes.replace.add(c.conversation_id)
        writes.delete(convs[200].conversation_id)
        new = StoredConversation("new-one", text_messages([("hello", "hi")]))
        row, messages = new.rows()
        writes.conversations["new-one"] = ConversationRow(**dict(zip(CONVERSATION_COLUMNS, row)))
        writes.messages["new-one"] = messages
        DuckData(w).write(writes, 1)
        w.close()
        rest = [line for lines in iter(walk.page, None) for line in lines]
        walk.close()
        cur.close()
        assert sorted(first + rest) == before
    finally:
        store.close()
    con = duckdb.connect(str(db), read_only=True)
    try:  # the next walk sees the changes
        after = [json.loads(line) for line in export.lines(con, export.ExportFilter(), window=50, by_id_max=0)]
    finally:
        con.close()
    ids = [r["id"] for r in after]
    assert len(ids) == len(set(ids)) == 300 and "new-one" in ids and convs[200].conversation_id not in ids
    assert len(next(r for r in after if r["id"] == convs[150].conversation_id)["messages"]) == \
        len(convs[150].messages)


def test_out_dash_writes_the_lines_to_stdout_and_json_says_what_was_written(tmp_path: Path) -> None:
    file_store(tmp_path, real_conversations(40))
    res = cli(tmp_path, "replay", "export", "--out", "-")
    assert res.returncode == 0, res.stderr
    assert [json.loads(line)["id"] for line in res.stdout.splitlines()] == [f"real-{i:05d}" for i in range(40)]
    assert res.stderr.strip() == "wrote 40 conversations to standard output"
    exported(tmp_path, name="x.jsonl")
    assert res.stdout == (tmp_path / "x.jsonl").read_text(encoding="utf-8")
    res = cli(tmp_path, "replay", "export", "--out", "-", "--json", "--state", "open")
    assert res.returncode == 0 and json.loads(res.stderr) == {"written": len(res.stdout.splitlines()), "out": "-"}
    res = cli(tmp_path, "replay", "export", "--out", "y.jsonl", "--json")
    assert res.returncode == 0 and json.loads(res.stdout) == {"written": 40, "out": "y.jsonl"}, res.stderr


def test_an_export_that_fails_leaves_no_file_and_an_older_one_as_it_was(tmp_path: Path) -> None:
    target = tmp_path / "real.jsonl"

    def cut(n: int) -> Any:
        for i in range(n):
            yield b'{"schema": "conversation/v1"}\n'
        raise UserError("the export from the daemon was cut off")

    with pytest.raises(UserError):
        write_lines(cut(3), str(target))
    assert list(tmp_path.iterdir()) == []
    target.write_text("older\n")
    with pytest.raises(KeyboardInterrupt):
        write_lines((b"x\n" if i < 5 else (_ for _ in ()).throw(KeyboardInterrupt()) for i in range(10)),
                    str(target))
    assert [p.name for p in tmp_path.iterdir()] == ["real.jsonl"] and target.read_text() == "older\n"
    progress: list[int] = []
    assert write_lines((b"x\n" for _ in range(250)), str(target), on_progress=progress.append) == 250
    assert progress == [100, 100, 50] and target.read_text() == "x\n" * 250


def test_a_pipe_is_written_as_a_stream_and_a_link_keeps_pointing_at_its_file(tmp_path: Path) -> None:
    file_store(tmp_path, real_conversations(25))
    os.mkfifo(tmp_path / "pipe")
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append((tmp_path / "pipe").read_bytes()), daemon=True)
    reader.start()
    res = cli(tmp_path, "replay", "export", "--out", "pipe")
    reader.join(timeout=120)
    assert res.returncode == 0, res.stderr
    assert stat.S_ISFIFO((tmp_path / "pipe").stat().st_mode)  # still the pipe, never renamed over
    assert len(got[0].splitlines()) == 25
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "real.jsonl").write_text("older\n")
    (tmp_path / "latest.jsonl").symlink_to(tmp_path / "data" / "real.jsonl")
    res = cli(tmp_path, "replay", "export", "--out", "latest.jsonl")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "latest.jsonl").is_symlink() and (tmp_path / "data" / "real.jsonl").read_bytes() == got[0]
    assert os.listdir(tmp_path / "data") == ["real.jsonl"]


def test_bad_input_gets_one_line(tmp_path: Path) -> None:
    file_store(tmp_path, real_conversations(3))
    (tmp_path / "folder").mkdir()
    err = one_line_error(cli(tmp_path, "replay", "export", "--out", "nowhere/real.jsonl"))
    assert "nowhere" in err and "does not exist" in err
    assert "is a folder" in one_line_error(cli(tmp_path, "replay", "export", "--out", "folder"))
    assert "since" in one_line_error(cli(tmp_path, "replay", "export", "--out", "r.jsonl", "--since", "soon"))
    res = cli(tmp_path, "replay", "export", "--out", "r.jsonl", "--state", "closed")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    res = cli(tmp_path, "replay", "export")
    assert res.returncode == 2 and "--out" in res.stderr
    assert not (tmp_path / "r.jsonl").exists()
    err = one_line_error(cli(tmp_path / "folder", "replay", "export", "--out", "r.jsonl"))
    assert "no daemon is running" in err


def test_redact_passes_each_record_through_a_fresh_redactor(tmp_path: Path) -> None:
    from collector.redact import Redactor

    convs = [StoredConversation(f"r-{n}", text_messages([
        (f"Hi, my name is Anna Rossi, call me on +44 20 7946 0958 about order B-{n}", "Sure Anna."),
        ("my email is anna.rossi@example.com", "Thanks!")])) for n in range(3)]
    file_store(tmp_path, convs)
    plain = exported(tmp_path)
    redacted = exported(tmp_path, "--redact", name="redacted.jsonl")
    assert redacted == [Redactor().record(r) for r in plain]
    text = (tmp_path / "redacted.jsonl").read_text(encoding="utf-8")
    assert "Anna" not in text and "anna.rossi@example.com" not in text and "7946" not in text
    # One redactor per conversation: each starts its placeholders again.
    assert all("<PERSON_1>" in r["messages"][0]["content"] for r in redacted)


def test_redact_gives_an_id_that_is_personal_data_a_pseudonym_the_same_wherever_it_is(tmp_path: Path) -> None:
    """Over the wire from a daemon and from a second store's file, in one export: an id the redactor finds
    personal data in is written as its pseudonym, the same for the same conversation in both stores; an id
    that is not personal data stays, so that the records join back."""
    import hashlib

    def pseudonym(cid: str) -> str:  # as the README says: the digest scenario ids are named with
        return "redacted:" + hashlib.sha256(cid.encode()).hexdigest()[:16]

    email, phone = "alice.smith@example.com", "+44 20 7946 0958"
    live, moved = tmp_path / "live", tmp_path / "moved"
    live.mkdir()
    moved.mkdir()
    # The load balancer moved the e-mail's conversation: its end is in the other store.
    file_store(moved, [StoredConversation(email, text_messages([("And now?", "It arrives tomorrow.")]))])
    daemon = DaemonProcess(live, base_config(live, conversations={"idle_timeout": "1h"})).start()
    try:
        send(daemon.grpc, [Persona(cid, "en", "export-test", [Turn(f"Where is my parcel? ({n})", "It left today.")],
                                   conversation_id=cid) for n, cid in enumerate((email, phone, "c-17"))],
             service="export-test")
        wait_until(lambda: len(daemon.get("/api/conversations")[1]["conversations"]) == 3, "3 conversations")
        wait_conversations(daemon)
        res = cli(tmp_path, "replay", "export", "--config", str(daemon.config_path), "--redact", "--db",
                  str(daemon.duckdb), "--db", str(moved / "tracejudge.duckdb"), "--out", "redacted.jsonl")
        assert res.returncode == 0, res.stderr
    finally:
        daemon.end()
    text = (tmp_path / "redacted.jsonl").read_text(encoding="utf-8")
    assert "alice" not in text and "example.com" not in text and "7946" not in text
    ids = {json.loads(line)["messages"][0]["content"]: json.loads(line)["id"] for line in text.splitlines()}
    assert ids == {"Where is my parcel? (0)": pseudonym(email), "And now?": pseudonym(email),
                   "Where is my parcel? (1)": pseudonym(phone), "Where is my parcel? (2)": "c-17"}


# --------------------------------------------------------------- through a running daemon


def _otlp_daemon(folder: Path) -> DaemonProcess:
    criteria = folder / "criteria.yaml"
    criteria.write_text(CRITERIA, encoding="utf-8")
    cfg = base_config(
        folder, conversations={"idle_timeout": "1h", "end_rules": [
            {"attribute": "app.handover", "equals": True, "ended_by": "handover"}]},
        sampling={"rate": 0.0, "rules": [{"when": {"min_user_turns": 2}, "rate": 1.0}]},
        judges={"criteria": [str(criteria)]}, api={"auth": {"bearer_token": TOKEN}})
    return DaemonProcess(folder, cfg).start()


def _handover(cid: str, first: Turn, *, short: bool = False) -> Persona:
    """A conversation the bot hands over to a person: at its first turn when ``short``, else at its second."""
    if short:
        return Persona(cid, "en", "export-test", [Turn(first.user, first.answer, handover=True)],
                       conversation_id=cid)
    return Persona(cid, "en", "export-test", [
        first, Turn("Can I talk to a person?", "Of course, I am passing you to a colleague.", handover=True)],
        conversation_id=cid)


def test_through_the_daemon_and_from_the_file_the_lines_are_the_same(tmp_path: Path) -> None:
    daemon = _otlp_daemon(tmp_path)
    try:
        failing = carrier_conversation("ex-fail")
        failing.turns.append(Turn("Can I talk to a person?", "Passing you to a colleague.", handover=True))
        first = [failing, _handover("ex-pass", Turn("Where is my order B-2?", "It arrives tomorrow.")),
                 _handover("ex-short", Turn("hi", "hello"), short=True)]
        send(daemon.grpc, first, service="export-test")
        wait_items(daemon, {("ex-fail", CARRIER)}, token=TOKEN)
        wait_conversations_token(daemon)
        between = dt.datetime.now(dt.timezone.utc)
        send(daemon.grpc, [Persona("o", "en", "export-test", [Turn(f"question {n}", "answer"),
                                                              Turn("and?", "more")], conversation_id=f"ex-open-{n}")
                           for n in (1, 2)], service="export-test")
        wait_conversations_token(daemon)
        _wait_decisions(daemon, 3)
        # No token, no export: the route is guarded like the rest of the API.
        with pytest.raises(urllib.error.HTTPError) as denied:
            urllib.request.urlopen(daemon.api + "/api/export/conversations", timeout=30)
        assert denied.value.code == 401
        denied.value.close()
        for query, code in (("state=closed", "bad_parameter"), ("since=soon", "bad_parameter"),
                            ("sampled_only=maybe", "bad_parameter")):
            status, body = daemon.get(f"/api/export/conversations?{query}", token=TOKEN, check=False)
            assert status == 400 and body["error"]["code"] == code, (query, body)
        filters = {
            "all": (), "open": ("--state", "open"), "ended": ("--state", "ended"),
            "since": ("--since", between.isoformat()), "sampled": ("--sampled-only",),
            "failed": ("--criterion-failed", CARRIER), "ended-sampled": ("--state", "ended", "--sampled-only"),
        }
        expected = {"all": "ex-fail ex-open-1 ex-open-2 ex-pass ex-short", "open": "ex-open-1 ex-open-2",
                    "ended": "ex-fail ex-pass ex-short", "since": "ex-open-1 ex-open-2",
                    "sampled": "ex-fail ex-pass", "failed": "ex-fail", "ended-sampled": "ex-fail ex-pass"}
        live = {}
        for name, args in filters.items():
            res = cli(tmp_path, "replay", "export", "--config", str(daemon.config_path), "--out",
                      f"live-{name}.jsonl", *args)
            assert res.returncode == 0, res.stderr
            live[name] = (tmp_path / f"live-{name}.jsonl").read_bytes()
            assert [json.loads(line)["id"] for line in live[name].splitlines()] == expected[name].split(), name
        res = cli(tmp_path, "replay", "export", "--config", str(daemon.config_path), "--out", "-")
        assert res.returncode == 0 and res.stdout.encode() == live["all"]
        records = {json.loads(line)["id"]: json.loads(line) for line in live["all"].splitlines()}
        assert records["ex-fail"]["sampling"] == {"probability": 1.0, "rule": "rules[0]"}
        assert "sampling" not in records["ex-short"] and "sampling" not in records["ex-open-1"]
        assert records["ex-fail"]["ended_by"] == "handover" and records["ex-open-1"]["ended_by"] == "open"
        assert records["ex-fail"]["messages"][0]["content"] == "Where is my order B-1?"
        assert daemon.stop() == 0
        for name, args in filters.items():
            res = cli(tmp_path, "replay", "export", "--config", str(daemon.config_path), "--out",
                      f"file-{name}.jsonl", *args)
            assert res.returncode == 0, res.stderr
            assert (tmp_path / f"file-{name}.jsonl").read_bytes() == live[name], name
    finally:
        daemon.end()


def wait_conversations_token(daemon: DaemonProcess) -> None:
    def caught_up() -> bool:
        status = daemon.get("/api/status", token=TOKEN)[1]
        return bool(status["conversations_batch"] >= status["committed_batch"] and status["queue_depth"] == 0
                    and status["conversations_pending"] == 0)

    wait_until(caught_up, "conversations to catch up")


def _wait_decisions(daemon: DaemonProcess, n: int) -> None:
    def decided() -> bool:
        c = daemon.get("/api/stats", token=TOKEN)[1]["conversations"]
        return bool(c["sampled"] + c["not_sampled"] >= n and daemon.get("/api/status", token=TOKEN)[1][
            "evals_pending"] == 0)

    wait_until(decided, f"{n} sampling decisions", timeout=90)


def test_a_daemon_streams_an_export_of_many_pages(tmp_path: Path) -> None:
    convs = [c for c in real_conversations(6000) if c.state == "ended"]
    db = tmp_path / "tracejudge.duckdb"
    create_store(db)
    # Every conversation decided already: the daemon's evaluator finds nothing to change while it exports.
    write(db, convs, decisions=[(c.conversation_id, n % 3 == 0, 0.3, "default", None) for n, c in enumerate(convs)])
    daemon = DaemonProcess(tmp_path, base_config(tmp_path, sampling={"rate": 0.3})).start()
    try:
        wait_conversations(daemon)
        res = cli(tmp_path, "replay", "export", "--config", str(daemon.config_path), "--out", "live.jsonl")
        assert res.returncode == 0, res.stderr
        assert res.stderr.strip() == f"wrote {len(convs)} conversations to live.jsonl"
        res = cli(tmp_path, "replay", "export", "--config", str(daemon.config_path), "--out", "live-s.jsonl",
                  "--sampled-only")
        assert res.returncode == 0, res.stderr
        assert daemon.stop() == 0
        for name, args in (("live.jsonl", ()), ("live-s.jsonl", ("--sampled-only",))):
            res = cli(tmp_path, "replay", "export", "--config", str(daemon.config_path), "--out", "file.jsonl",
                      *args)
            assert res.returncode == 0, res.stderr
            assert (tmp_path / "file.jsonl").read_bytes() == (tmp_path / name).read_bytes(), name
        lines = (tmp_path / "live.jsonl").read_bytes().splitlines()
        assert len(lines) == len(convs) > 2 * export.PAGE
        assert len((tmp_path / "live-s.jsonl").read_bytes().splitlines()) == len(convs[::3])
    finally:
        daemon.end()


def test_the_progress_bar_goes_to_a_terminal_only(tmp_path: Path) -> None:
    """Under a pseudo-terminal the bar is drawn on stderr; the file's lines are the same."""
    import pty

    file_store(tmp_path, real_conversations(300))
    env = clean_env()
    code = ("import sys; from collector.cli import main; "
            "sys.argv = ['tracejudge', 'replay', 'export', '--out', 'tty.jsonl']; main()")
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=follower)
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    assert proc.wait(timeout=120) == 0, seen
    os.close(leader)
    assert b"exporting conversations" in seen and b"300/300" in seen and b"wrote 300 conversations" in seen
    assert len((tmp_path / "tty.jsonl").read_text().splitlines()) == 300


@contextlib.contextmanager
def served(app: web.Application) -> Iterator[str]:
    """``app`` on a loopback port in a thread of its own; its base URL."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.run_until_complete(runner.cleanup())
        loop.close()


def test_an_export_the_daemon_cannot_finish_is_an_error_never_a_short_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from collector.api.app import API
    from collector.api.client import APIClient
    from collector.config import Config
    from collector.metrics import Metrics
    from collector.store import Store

    db = tmp_path / "t.duckdb"
    create_store(db)
    write(db, real_conversations(30))
    store = Store(db)
    store.open()
    real_page = export.Walk.page

    fail_at_once = False

    def failing(walk: export.Walk) -> Any:
        if walk.written or fail_at_once:
            raise RuntimeError("the disk went away")
        walk.size = 10
        return real_page(walk)

    monkeypatch.setattr(export.Walk, "page", failing)
    try:
        with served(API(store, Metrics(), Config.model_validate({}).api).app) as base:
            client = APIClient(base, None)
            stream = client.export_conversations(since=None, state=None, sampled_only=False, criterion_failed=None)
            assert stream.total == 30
            with pytest.raises(UserError, match="was cut off"):
                write_lines(stream.lines, str(tmp_path / "real.jsonl"))
            stream.close()
            assert not [p for p in tmp_path.iterdir() if p.name.startswith((".real.jsonl", "real.jsonl"))]
            assert "the conversation export was cut off" in caplog.text
            fail_at_once = True  # before the answer starts: a status and the error shape
            with pytest.raises(UserError, match="answered 500: unexpected error"):
                client.export_conversations(since=None, state=None, sampled_only=False, criterion_failed=None)
    finally:
        store.close()
