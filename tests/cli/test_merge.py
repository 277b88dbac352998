"""``--db FILE`` given more than once: several daemons' stores (behind a load balancer) read as one.

Two stores with different conversations, sampling decisions, verdicts, review items and not-run records,
and a third holding all the rows of both: what the commands print over the two must be what they print
over the third.
"""

from __future__ import annotations

import datetime as dt
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import duckdb
import pytest

from collector.evals.verdicts import VERDICT_COLUMNS

from ..support.daemon import DaemonProcess, base_config, clean_env
from ..support.stored import T0, StoredConversation, create_store, text_messages, verdict_row, write

pytestmark = pytest.mark.slow  # each test runs the CLI on several stores, some with a daemon on them

CRITERIA = {"tone": "style", "triage": "safety", "handover": None}


def cli(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "collector", *args], capture_output=True, text=True,
                          env=clean_env(), timeout=180, cwd=folder)


def ok_json(folder: Path, *args: str) -> Any:
    res = cli(folder, *args, "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


class Shard:
    """The rows of one store, kept so that a store of several shards' rows can be written too."""

    def __init__(self) -> None:
        self.conversations: list[StoredConversation] = []
        self.decisions: list[tuple[str, bool, float, str, str | None]] = []
        self.verdicts: list[dict[str, Any]] = []
        self.reviews: list[tuple[str, str, str, str]] = []  # verdict id, conversation, criterion, state
        self.not_run: list[tuple[str, str, int, str]] = []
        self.criteria: set[tuple[str, int, str | None]] = {(c, 1, g) for c, g in CRITERIA.items()}


def shard(prefix: str, n: int, rng: random.Random, clock: list[int]) -> Shard:
    """``n`` conversations, most of them ended, sampled at several rates; verdicts judged at times ``clock``
    hands out (shared by the shards, so that their verdicts interleave in time)."""
    s = Shard()
    for i in range(n):
        cid = f"{prefix}-{i:03d}"
        arrived = T0 + dt.timedelta(minutes=rng.randrange(0, 600), seconds=rng.randrange(60),
                                    microseconds=rng.choice([0, 250000]))
        state = "open" if i % 9 == 4 else "ended"
        s.conversations.append(StoredConversation(
            cid, text_messages([(f"question {cid}", f"answer {cid}"), ("thanks", "bye")]), state=state,
            ended_by="idle" if state == "ended" else None, arrived=arrived, service=rng.choice(["shopbot", "triage"])))
        if state == "open":
            continue
        p = rng.choice([0.1, 0.25, 0.5, 1.0])
        skipped = "budget:per_hour" if i % 11 == 7 else None
        sampled = skipped is None and rng.random() < 0.75
        s.decisions.append((cid, sampled, p, "rules[0]" if p < 1 else "default", skipped))
        if not sampled:
            continue
        for crit in CRITERIA:
            if rng.random() < 0.1:
                s.not_run.append((cid, crit, 1, rng.choice(["no_provider", "no_content"])))
                continue
            result = rng.choices(["pass", "fail", "not_applicable", "error"], [6, 3, 1, 1])[0]
            if rng.random() < 0.15:  # an older verdict on an earlier transcript: superseded, never counted
                s.verdicts.append(_verdict(cid, crit, rng.choice(["pass", "fail"]), p, clock, rng, superseded=True))
            v = _verdict(cid, crit, result, p, clock, rng)
            s.verdicts.append(v)
            if result == "fail" or rng.random() < 0.05:
                s.reviews.append((v["id"], cid, crit, rng.choice(["pending", "confirmed", "rejected"])))
    return s


def _verdict(cid: str, crit: str, result: str, p: float, clock: list[int], rng: random.Random, *,
             superseded: bool = False) -> dict[str, Any]:
    clock[0] += rng.randrange(1, 90)
    v = verdict_row(cid, crit, result, superseded=superseded, sha=("1" if superseded else "0") * 64)
    v.update(inclusion_probability=p, judged_at=T0 + dt.timedelta(hours=12, seconds=clock[0]),
             evidence_verified=result != "pass" or rng.random() < 0.9, flagged=result == "fail" and rng.random() < 0.2,
             error_reason="timeout: the judge did not answer" if result == "error" else None,
             input_tokens=rng.randrange(100, 900), output_tokens=rng.randrange(10, 90))
    return v


def store(path: Path, *shards: Shard) -> Path:
    """One store holding every row of ``shards``; verdicts stored in the order they were judged."""
    create_store(path)
    write(path, [c for s in shards for c in s.conversations], decisions=[d for s in shards for d in s.decisions])
    con = duckdb.connect(str(path))
    try:
        verdicts = sorted((v for s in shards for v in s.verdicts), key=lambda v: v["judged_at"])
        for seq, v in enumerate(verdicts):
            con.execute(f"INSERT INTO verdicts ({', '.join(VERDICT_COLUMNS)}, seq) VALUES "
                        f"({', '.join('?' for _ in VERDICT_COLUMNS)}, ?)", [v[c] for c in VERDICT_COLUMNS] + [seq])
        for n, (vid, cid, crit, state) in enumerate(r for s in shards for r in s.reviews):
            con.execute("INSERT INTO review_items VALUES (?, ?, ?, ?, ?, NULL, NULL, ?, NULL, false)",
                        [n, vid, cid, crit, state, T0])
        for cid, crit, version, reason in (r for s in shards for r in s.not_run):
            con.execute("INSERT INTO not_run VALUES (?, ?, ?, ?, ?)", [cid, crit, version, reason, T0])
        for crit, version, group in sorted(set().union(*(s.criteria for s in shards))):
            con.execute("INSERT INTO criteria VALUES (?, ?, 'llm', 'high', ?, ?, ?)",
                        [crit, version, group, f"text of {crit} v{version}", T0])
    finally:
        con.close()
    return path


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Shard, Shard]:
    """``a.duckdb`` and ``b.duckdb`` beside ``all.duckdb`` holding both, in one folder."""
    folder = tmp_path_factory.mktemp("merge")
    rng, clock = random.Random(20261130), [0]
    a, b = shard("a", 70, rng, clock), shard("b", 55, rng, clock)
    b.criteria.add(("tone", 2, "style"))  # one daemon recorded a newer version of a criterion, same group
    b.criteria.add(("handover", 2, None))
    store(folder / "a.duckdb", a)
    store(folder / "b.duckdb", b)
    store(folder / "all.duckdb", a, b)
    return folder, a, b


MERGED = ("--db", "a.duckdb", "--db", "b.duckdb")
ONE = ("--db", "all.duckdb")


@pytest.mark.parametrize("args", [(), ("--criterion", "triage"), ("--since", "2026-11-30T12:30:00Z")])
def test_merged_stats_are_the_stats_of_one_store_holding_all_rows(stores: tuple[Path, Shard, Shard],
                                                                   args: tuple[str, ...]) -> None:
    folder = stores[0]
    merged = ok_json(folder, "stats", *MERGED, *args)
    assert merged == ok_json(folder, "stats", *ONE, *args)
    assert merged["criteria"] and all(e["failure_rate"] for e in merged["criteria"])
    if not args:
        parts = [ok_json(folder, "stats", "--db", f) for f in ("a.duckdb", "b.duckdb")]
        assert merged["conversations"]["ended"] == sum(p["conversations"]["ended"] for p in parts)
        assert merged["conversations"]["sampled"] == sum(p["conversations"]["sampled"] for p in parts)
        assert merged["groups"] and merged["tokens"]["input_tokens"] == sum(p["tokens"]["input_tokens"] for p in parts)
        groups = {e["criterion_id"]: e["group"] for e in merged["criteria"]}
        assert groups == CRITERIA


def test_the_merged_rate_weighs_the_union_of_the_verdicts_not_the_files_rates(
        stores: tuple[Path, Shard, Shard]) -> None:
    folder, a, b = stores
    merged = {e["criterion_id"]: e for e in ok_json(folder, "stats", *MERGED)["criteria"]}
    for crit in CRITERIA:
        current = [v for v in a.verdicts + b.verdicts if v["criterion_id"] == crit and not v["superseded"]
                   and (v["result"] == "fail" or (v["result"] == "pass" and v["evidence_verified"]))]
        weights = [(v["result"] == "fail", 1 / v["inclusion_probability"]) for v in current]
        expected = sum(w for failed, w in weights if failed) / sum(w for _, w in weights)
        rate = merged[crit]["failure_rate"]
        assert rate["estimate"] == pytest.approx(expected) and rate["n"] == len(current)
        files = [ok_json(folder, "stats", "--db", f, "--criterion", crit)["criteria"][0]["failure_rate"]
                 for f in ("a.duckdb", "b.duckdb")]
        assert rate["n"] == sum(f["n"] for f in files) and rate["count"] == sum(f["count"] for f in files)
        assert rate["n_eff"] > max(f["n_eff"] for f in files)  # a larger sample: a narrower interval
        assert rate["high"] - rate["low"] < max(f["high"] - f["low"] for f in files)


def test_merged_stats_by_source_and_as_text(stores: tuple[Path, Shard, Shard]) -> None:
    folder = stores[0]
    assert ok_json(folder, "stats", *MERGED, "--by", "source") == ok_json(folder, "stats", *ONE, "--by", "source")
    res, one = cli(folder, "stats", *MERGED), cli(folder, "stats", *ONE)
    assert res.returncode == 0 and res.stdout == one.stdout and "failure rate" in res.stdout


def test_db_once_reads_as_a_config_naming_that_file_would(stores: tuple[Path, Shard, Shard],
                                                          tmp_path: Path) -> None:
    folder = stores[0]
    (tmp_path / "otel-config.yaml").write_text(f"storage:\n  duckdb: {{path: {folder / 'all.duckdb'}}}\n",
                                               encoding="utf-8")
    for args in (("stats",), ("conversations", "list"), ("verdicts",)):
        assert ok_json(tmp_path, *args) == ok_json(folder, *args, *ONE)
    # --db wins over --config for where data is read
    assert ok_json(tmp_path, "stats", "--db", str(folder / "a.duckdb")) == ok_json(folder, "stats", "--db", "a.duckdb")


@pytest.mark.parametrize("args", [(), ("--limit", "7"), ("--limit", "500"), ("--state", "open"),
                                  ("--service", "triage", "--limit", "12")])
def test_merged_conversations_list_is_the_one_store_list(stores: tuple[Path, Shard, Shard],
                                                         args: tuple[str, ...]) -> None:
    folder = stores[0]
    merged = ok_json(folder, "conversations", "list", *MERGED, *args)
    assert merged == ok_json(folder, "conversations", "list", *ONE, *args)
    if not args:
        assert {c["conversation_id"][0] for c in merged} == {"a", "b"}
    res, one = cli(folder, "conversations", "list", *MERGED, *args), cli(folder, "conversations", "list", *ONE, *args)
    assert res.returncode == 0 and res.stdout == one.stdout


@pytest.mark.parametrize("args", [(), ("--limit", "9"), ("--result", "error"), ("--criterion", "tone", "--limit", "30"),
                                  ("--since", "2026-11-30T13:00:00Z", "--limit", "100000")])
def test_merged_verdicts_are_the_one_store_verdicts(stores: tuple[Path, Shard, Shard], args: tuple[str, ...]) -> None:
    folder = stores[0]
    merged = ok_json(folder, "verdicts", *MERGED, *args)
    assert merged == ok_json(folder, "verdicts", *ONE, *args)
    if not args:
        assert {v["conversation_id"][0] for v in merged} == {"a", "b"}
    res, one = cli(folder, "verdicts", *MERGED, *args), cli(folder, "verdicts", *ONE, *args)
    assert res.returncode == 0 and res.stdout == one.stdout


def _lines(folder: Path, name: str) -> list[str]:
    return (folder / name).read_text(encoding="utf-8").splitlines()


@pytest.mark.parametrize("args", [(), ("--sampled-only",), ("--criterion-failed", "triage"), ("--state", "ended")])
def test_merged_export_is_the_one_store_export(stores: tuple[Path, Shard, Shard], tmp_path: Path,
                                               args: tuple[str, ...]) -> None:
    folder = stores[0]
    res = cli(folder, "replay", "export", *MERGED, *args, "--out", str(tmp_path / "merged.jsonl"))
    assert res.returncode == 0, res.stderr
    one = cli(folder, "replay", "export", *ONE, *args, "--out", str(tmp_path / "one.jsonl"))
    assert one.returncode == 0, one.stderr
    merged, single = _lines(tmp_path, "merged.jsonl"), _lines(tmp_path, "one.jsonl")
    assert len(merged) == len(set(merged)) and set(merged) == set(single) and merged
    assert "warning" not in res.stderr
    assert res.stderr.strip().splitlines()[-1] == f"wrote {len(merged)} conversations to {tmp_path / 'merged.jsonl'}"


def test_an_id_in_two_files_is_exported_from_both_with_a_warning(stores: tuple[Path, Shard, Shard],
                                                                 tmp_path: Path) -> None:
    folder, a, _ = stores
    moved = Shard()  # two conversations a rebalancing split: their later part on another daemon
    moved.conversations = [StoredConversation(c.conversation_id, text_messages([("later", "part")]),
                                              arrived=c.arrived + dt.timedelta(hours=1))
                           for c in a.conversations[:2]]
    store(tmp_path / "c.duckdb", moved)
    res = cli(folder, "replay", "export", *MERGED, "--db", str(tmp_path / "c.duckdb"), "--json",
              "--out", str(tmp_path / "out.jsonl"))
    assert res.returncode == 0, res.stderr
    lines = [json.loads(line) for line in _lines(tmp_path, "out.jsonl")]
    total = len(a.conversations) + len(stores[2].conversations) + 2
    assert len(lines) == total and json.loads(res.stdout)["written"] == total
    assert [r["id"] for r in lines].count(a.conversations[0].conversation_id) == 2
    warning = [line for line in res.stderr.splitlines() if "warning" in line]
    assert len(warning) == 1 and "2 conversation ids found in more than one --db file" in warning[0]


@pytest.mark.parametrize("args", [("stats",), ("conversations", "list"), ("verdicts",),
                                  ("replay", "export", "--out", "x.jsonl")])
def test_a_missing_db_file_is_one_line_naming_it(stores: tuple[Path, Shard, Shard], args: tuple[str, ...]) -> None:
    folder = stores[0]
    for dbs in (("--db", "nowhere.duckdb"), ("--db", "a.duckdb", "--db", "nowhere.duckdb")):
        res = cli(folder, *args, *dbs)
        assert res.returncode == 2, (res.stdout, res.stderr)
        assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert "nowhere.duckdb" in res.stderr
    assert not (folder / "x.jsonl").exists()


def test_a_file_a_daemon_runs_on_is_read_through_its_api(stores: tuple[Path, Shard, Shard], tmp_path: Path) -> None:
    folder, a, _ = stores
    served = tmp_path / "a.duckdb"
    served.write_bytes((folder / "a.duckdb").read_bytes())
    expected = {args: ok_json(folder, *args, *MERGED) for args in (("stats",), ("conversations", "list"), ("verdicts",))}
    # (a long idle timeout: the daemon leaves the open conversations open, so that the figures stay the same)
    daemon = DaemonProcess(tmp_path, base_config(tmp_path, storage={"duckdb": {"path": str(served)}},
                                                 conversations={"idle_timeout": "10000h"})).start()
    try:
        for args, want in expected.items():  # the daemon holds the file's lock: only its API can read it
            assert ok_json(folder, *args, "--db", str(served), "--db", "b.duckdb") == want
        res = cli(folder, "replay", "export", "--db", str(served), "--db", "b.duckdb", "--out", str(tmp_path / "d.jsonl"))
        assert res.returncode == 0, res.stderr
        one = cli(folder, "replay", "export", *ONE, "--out", str(tmp_path / "one.jsonl"))
        assert one.returncode == 0, one.stderr
        assert set(_lines(tmp_path, "d.jsonl")) == set(_lines(tmp_path, "one.jsonl"))
        assert daemon.stop() == 0
    finally:
        daemon.end()
