"""``tracejudge replay compare``: simulated beside real, descriptive, never a gate; bad input is one line."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from replay.compare import DISTRIBUTIONS, LanguageDetector, clauses, compare, facts, is_fact, questions

from ..support.daemon import REPO, clean_env
from ..support.stored import create_store, write
from ..support.synthetic import real_conversations, sim_records

pytestmark = pytest.mark.slow  # its tests, but two, export stores or run the CLI many times

N = 3000


def cli(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "collector", *args], capture_output=True, text=True,
                          env=clean_env(), timeout=300, cwd=folder)


def jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any], list[dict[str, Any]]]:
    """A store of N real-like conversations exported with the CLI, and N simulated records beside it."""
    folder = tmp_path_factory.mktemp("compare")
    real = real_conversations(N)
    create_store(folder / "tracejudge.duckdb")
    write(folder / "tracejudge.duckdb", real)
    (folder / "otel-config.yaml").write_text("storage:\n  duckdb: {path: ./tracejudge.duckdb}\n", encoding="utf-8")
    res = cli(folder, "replay", "export", "--out", "real.jsonl")
    assert res.returncode == 0, res.stderr
    sims = sim_records(N)
    jsonl(folder / "sim.jsonl", sims)
    return folder, real, sims


def test_export_then_compare_a_few_thousand_of_each_kind(world: tuple[Path, list[Any], list[dict[str, Any]]]) -> None:
    folder, real, sims = world
    res = cli(folder, "replay", "compare", "sim.jsonl", "real.jsonl", "--json")
    assert res.returncode == 0 and res.stderr == "", res.stderr
    out = json.loads(res.stdout)
    sim, got = out["sim"], out["real"]
    assert out["version"] == 1 and out["language_detector"].startswith("py3langid ")
    assert out["fact_heuristic"] == "clauses-v1"
    assert (sim["file"], got["file"]) == ("sim.jsonl", "real.jsonl")
    assert sim["conversations"] == got["conversations"] == N
    assert sim["sources"] == {"simulation": N} and got["sources"] == {"production": N}

    real_users = [[m.content for m in c.messages if m.role == "user"] for c in real]
    sim_users = [[m["content"] for m in r["messages"] if m["role"] == "user"] for r in sims]
    for side, users in ((sim, sim_users), (got, real_users)):
        turns = side["user_messages_per_conversation"]
        assert turns["count"] == N and turns["median"] == statistics.median(len(u) for u in users)
        assert turns["min"] == min(len(u) for u in users) and turns["max"] == max(len(u) for u in users)
        assert side["user_messages"] == sum(len(u) for u in users)
        lengths = [len(t) for u in users for t in u]
        assert side["user_message_chars"]["median"] == statistics.median(lengths)
        assert side["user_message_chars"]["mean"] == round(statistics.fmean(lengths), 3)
        for key, _, _ in DISTRIBUTIONS:
            hist = side[key]["histogram"]
            assert len(hist["edges"]) == len(hist["counts"]) + 1 and sum(hist["counts"]) == side[key]["count"]
            assert hist["edges"] == (sim if side is got else got)[key]["histogram"]["edges"]  # bins shared

    # ended_by, cut off early and unanswered, as generated.
    sim_ends = Counter(r["ended_by"] for r in sims)
    assert sim["ended_by"] == {k: {"count": n, "share": n / N} for k, n in
                               sorted(sim_ends.items(), key=lambda kv: (-kv[1], kv[0]))}
    assert sim["cut_off_early"] == {"unanswered": sim_ends["unanswered"] / N, "turn_limit": sim_ends["turn_limit"] / N,
                                    "any": (sim_ends["unanswered"] + sim_ends["turn_limit"]) / N}
    assert sim["last_message_from_user"] == sim_ends["unanswered"] / N
    real_ends = Counter(c.ended_by if c.state == "ended" else "open" for c in real)
    assert {k: v["count"] for k, v in got["ended_by"].items()} == dict(real_ends)
    assert got["cut_off_early"] == {"unanswered": 0.0, "turn_limit": 0.0, "any": 0.0}
    assert got["last_message_from_user"] == sum(1 for c in real if c.messages[-1].role == "user") / N > 0

    # Simulated users put every fact in their first message; real ones spread them over the later ones.
    assert sim["facts_first_share"] == 1.0 and got["facts_first_share"] == 0.0
    assert sim["facts_in_first_user_message"]["median"] >= 2 and got["facts_in_later_user_messages"]["mean"] > 1

    # Languages: one real conversation in ten is in Spanish; the rest English (or too short to tell).
    spanish = sum(len(u) for c, u in zip(real, real_users) if int(c.conversation_id[5:]) % 10 == 3)
    assert 0.75 * spanish <= got["languages"]["es"]["count"] <= spanish
    assert set(got["languages"]) <= {"en", "es", "und", "pt", "it", "fr", "gl", "ca"}, got["languages"]
    assert sim["languages"]["en"]["share"] > 0.6

    text = cli(folder, "replay", "compare", "sim.jsonl", "real.jsonl")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0].split() == ["simulated", "real"]
    assert any(line.startswith("user messages / conversation") and "median 2 " in line for line in lines)
    assert any(line.startswith("cut off early") for line in lines) and "py3langid" in text.stdout


KEYS = {"version", "language_detector", "fact_heuristic", "sim", "real"}
SIDE_KEYS = {"file", "conversations", "sources", "user_messages", "assistant_messages",
             *(key for key, _, _ in DISTRIBUTIONS), "user_messages_with_a_question", "facts_first_share",
             "cut_off_early", "last_message_from_user", "ended_by", "languages"}
DISTRIBUTION_KEYS = {"count", "mean", "min", "p10", "median", "p90", "max", "histogram"}


def test_the_json_keys_are_the_documented_contract(tmp_path: Path) -> None:
    sim = jsonl(tmp_path / "s.jsonl", sim_records(20))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n", encoding="utf-8")
    out = compare(sim, empty)  # an empty side is read, and measured as empty: exit 0 all the same
    assert set(out) == KEYS and set(out["sim"]) == set(out["real"]) == SIDE_KEYS
    for key, _, _ in DISTRIBUTIONS:
        assert set(out["sim"][key]) == DISTRIBUTION_KEYS and set(out["sim"][key]["histogram"]) == {"edges", "counts"}
    assert out["real"]["conversations"] == 0 and out["real"]["user_message_chars"]["median"] is None
    assert out["real"]["cut_off_early"] == {"unanswered": None, "turn_limit": None, "any": None}
    readme = (REPO / "docs" / "scenarios.md").read_text(encoding="utf-8")
    section = readme[readme.index("### `tracejudge replay compare`"):]
    section = section[:section.index("\n### ")]
    for key in KEYS | SIDE_KEYS | DISTRIBUTION_KEYS | {"edges", "counts", "unanswered", "turn_limit", "any",
                                                       "share"}:
        assert f"`{key}`" in section, f"docs/scenarios.md does not document {key}"
    res = cli(tmp_path, "replay", "compare", "s.jsonl", "empty.jsonl")
    assert res.returncode == 0, res.stderr


GOOD = {"schema": "conversation/v1", "id": "s-1", "source": "simulation", "ended_by": "goal_reached",
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
BAD_LINES = {
    "not JSON": ('{"schema": "conversation/v1", ', "not JSON"),
    "not an object": ('["conversation/v1"]', "expected a JSON object"),
    "unknown schema": (json.dumps({**GOOD, "schema": "conversation/v2"}), "schema is 'conversation/v2'"),
    "no schema": (json.dumps({k: v for k, v in GOOD.items() if k != "schema"}), "schema is None"),
    "missing messages": (json.dumps({k: v for k, v in GOOD.items() if k != "messages"}), "messages: Field required"),
    "a message without role": (json.dumps({**GOOD, "messages": [{"content": "hi"}]}), "messages.0.role"),
    "a message without content": (json.dumps({**GOOD, "messages": [{"role": "user"}]}), "messages.0.content"),
    "an unknown ended_by": (json.dumps({**GOOD, "ended_by": "crashed"}), "ended_by"),
}


@pytest.mark.parametrize("side", ["sim", "real"])
@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_each_bad_input_is_one_line_naming_the_file_and_the_line(tmp_path: Path, case: str, side: str) -> None:
    bad, words = BAD_LINES[case]
    good = json.dumps(GOOD)
    (tmp_path / "sim.jsonl").write_text(f"{good}\n\n{bad}\n" if side == "sim" else f"{good}\n", encoding="utf-8")
    (tmp_path / "real.jsonl").write_text(f"{good}\n\n{bad}\n" if side == "real" else f"{good}\n", encoding="utf-8")
    res = cli(tmp_path, "replay", "compare", "sim.jsonl", "real.jsonl", "--html", "r.html")
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert f"{side}.jsonl:3: " in res.stderr and words in res.stderr, res.stderr
    assert res.stdout == "" and not (tmp_path / "r.html").exists()


def test_an_unreadable_file_is_one_line_too(tmp_path: Path) -> None:
    jsonl(tmp_path / "sim.jsonl", [GOOD])
    (tmp_path / "latin1.jsonl").write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"id": "caf\xe9"}\n')
    for args, words in ((("sim.jsonl", "missing.jsonl"), "missing.jsonl: cannot read: No such file"),
                        (("sim.jsonl", "latin1.jsonl"), "latin1.jsonl:2: not UTF-8 text"),
                        (("sim.jsonl", "sim.jsonl", "--html", "nowhere/r.html"), "nowhere")):
        res = cli(tmp_path, "replay", "compare", *args)
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert words in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_the_html_report_is_one_file_that_works_offline(world: tuple[Path, list[Any], list[dict[str, Any]]]) -> None:
    folder, _, _ = world
    res = cli(folder, "replay", "compare", "sim.jsonl", "real.jsonl", "--html", "report.html")
    assert res.returncode == 0, res.stderr
    assert res.stdout.rstrip().endswith("report: report.html")
    page = (folder / "report.html").read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and page.count("<svg") == len(DISTRIBUTIONS) + 2
    # Nothing to fetch: no script, stylesheet, image, font or link; the only URLs are SVG's namespace names.
    assert not re.search(r"<script|<link|<img|<iframe|@import|@font-face|url\(\s*['\"]?(?!#)", page, re.IGNORECASE)
    assert not re.search(r"\b(?:src|href)\s*=", page.replace('xlink:href="#', ""), re.IGNORECASE)
    assert set(re.findall(r"https?://[^\s\"'<>]+", page)) == {"http://www.w3.org/2000/svg",
                                                             "http://www.w3.org/1999/xlink"}
    assert "py3langid" in page and "clauses-v1" in page


def test_without_matplotlib_the_html_report_says_what_to_install(tmp_path: Path) -> None:
    jsonl(tmp_path / "sim.jsonl", [GOOD])
    # As in an install without the plots extra: a module set to None in sys.modules cannot be imported.
    code = ("import sys; sys.modules['matplotlib'] = None; from collector.cli import main; "
            "main(['replay', 'compare', sys.argv[1], sys.argv[1], '--html', sys.argv[2]])")
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "sim.jsonl"), str(tmp_path / "r.html")],
                         capture_output=True, text=True, env=clean_env(), timeout=120, cwd=REPO)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert res.stderr == ("tracejudge: error: the HTML report draws its plots with matplotlib, which is not "
                          "installed: pip install 'tracejudge[plots]'\n")
    assert res.stdout == "" and not (tmp_path / "r.html").exists()


def test_facts_and_questions_are_counted_as_the_readme_says() -> None:
    # A point, comma or colon between digits does not split a clause.
    assert clauses("I ordered 3.5 kg, at 10:30, for 1,200 euros. Where is it?\nThanks") == [
        "I ordered 3.5 kg", "at 10:30", "for 1,200 euros", "Where is it", "Thanks"]
    assert facts("hi") == 0 and facts("hello, where is my order?") == 0
    assert facts("my order B-35 never came") == 1  # a number
    assert facts("I ordered it on Monday, it was for my mother Anna. Where is it?") == 2  # a date, a name
    assert facts("my son has a fever since yesterday; he is tired, and I'm worried") == 3
    assert is_fact("my arm hurts") and is_fact("I've been waiting") and not is_fact("I want to know")
    assert not is_fact("Thanks a lot") and is_fact("thanks for the help, Marco")
    assert questions("where? when?? and why") == 2 and questions("¿dónde está?") == 1 and questions("ok") == 0


def test_the_language_of_a_user_message() -> None:
    detect = LanguageDetector()
    assert detect("Where is my order? It was due on Monday and it never came.") == "en"
    assert detect("Hola, mi pedido no ha llegado todavía, ¿dónde está?") == "es"
    assert detect("Ciao, il mio ordine non è ancora arrivato. Dov'è?") == "it"
    assert detect("ok") == detect("B-1042") == detect("thanks") == "und"
