"""U+2028, U+2029 and U+0085 in a message, over the wire: every JSON-lines file the conversation reaches keeps
one record per line (``str.splitlines`` splits on them), and every reader splits on ``\\n`` only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from collector.demo.traffic import Persona, ToolCall, Turn
from collector.review.regression import KEY, read_set, write_set
from replay.scenarios import CASES, ScenarioWriter, scenario_id

from ..support.daemon import DaemonProcess, clean_env, run_cli
from ..support.review import CARRIER, send_conversations, start_daemon, wait_items

SEPARATORS = "\u2028\u2029\x85"
USER = "Where is my order B-1?\u2028It was due Monday.\u2029Please check.\x85Thanks"
ANSWER = "Your order B-1 left the depot;\u2028the carrier will call you tomorrow.\x85Anything else?\u2029"
SEPARATED = Persona("sep", "en", "review-test", [
    Turn(USER, ANSWER, ToolCall("lookup_order", {"order_id": "B-1"}, '{"note": "due\u2028Monday"}')),
], conversation_id="sep-1")


def _cli(daemon: DaemonProcess, *args: str) -> Any:
    res = run_cli(*args, "--config", str(daemon.config_path), env=clean_env())
    assert "Traceback" not in res.stderr, res.stderr
    return res


def _lines(path: Path) -> list[str]:
    """The file's lines as a JSON-lines reader must see them: on ``\\n`` only, each one whole."""
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n") and not any(s in text for s in SEPARATORS), text  # escaped, never raw
    return text[:-1].split("\n")


@pytest.mark.slow
def test_a_message_with_unicode_line_separators_stays_one_line_in_every_file(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path, scenarios={"out_dir": str(tmp_path / "incoming"), "draft_with_provider": False})
    try:
        send_conversations(daemon.grpc, [SEPARATED])
        (item,) = [it for it in wait_items(daemon, {("sep-1", CARRIER)}) if it["criterion_id"] == CARRIER]
        res = _cli(daemon, "review", "confirm", str(item["id"]), "--reviewer", "Ana")
        assert res.returncode == 0, res.stderr

        # The cases ledger: a second export finds the first one's line and writes nothing.
        sid = scenario_id(CARRIER, "sep-1")
        for written in ([sid], []):
            res = _cli(daemon, "scenarios", "export", "--json")
            assert res.returncode == 0, res.stderr
            assert [w["id"] for w in json.loads(res.stdout)["written"]] == written
        (case,) = [json.loads(line) for line in _lines(tmp_path / "incoming" / CASES)]
        assert case["id"] == sid and case["input"]["persona"]["opening"] == USER
        scenario = yaml.safe_load((tmp_path / "incoming" / f"{sid}.yaml").read_text(encoding="utf-8"))
        assert scenario["opening"] == USER  # the YAML too: raw, a reader takes U+0085 for a line break

        # replay export, then the offline judge on its file.
        res = _cli(daemon, "replay", "export", "--out", str(tmp_path / "real.jsonl"))
        assert res.returncode == 0, res.stderr
        (record,) = [json.loads(line) for line in _lines(tmp_path / "real.jsonl")]
        res = _cli(daemon, "replay", "export", "--redact", "--out", str(tmp_path / "redacted.jsonl"))
        assert res.returncode == 0, res.stderr
        assert len(_lines(tmp_path / "redacted.jsonl")) == 1
        assert [m["content"] for m in record["messages"] if m["role"] != "tool" and m["content"]] == [USER, ANSWER]
        res = _cli(daemon, "judge", "--out", str(tmp_path / "verdicts.jsonl"), "--fail-on", "fail",
                   str(tmp_path / "real.jsonl"))
        assert res.returncode == 1, res.stderr  # read whole, and judged: the carrier criterion fails
        verdicts = {v["criterion_id"]: v for v in map(json.loads, _lines(tmp_path / "verdicts.jsonl"))}
        assert verdicts[CARRIER]["result"] == "fail" and verdicts[CARRIER]["conversation_id"] == "sep-1"
    finally:
        daemon.end()


def _record(cid: str) -> dict[str, Any]:
    return {"schema": "conversation/v1", "id": cid, "source": "production", "ended_by": "idle",
            "messages": [{"role": "user", "content": USER}, {"role": "assistant", "content": ANSWER}],
            KEY: {"criterion_id": CARRIER, "criterion_version": 1, "label": "fail", "labels": [], "judge": None}}


def test_the_ledger_and_regression_sets_written_before_the_escaping_still_read(tmp_path: Path) -> None:
    # As written before: separators raw, which str.splitlines cut; Windows line ends read as before.
    raw = {f"prod-{n}": json.dumps({"id": f"prod-{n}", "input": {"persona": {"opening": USER}}}, ensure_ascii=False)
           for n in range(2)}
    (tmp_path / CASES).write_text("\r\n".join(raw.values()) + "\r\n", encoding="utf-8")
    assert ScenarioWriter(tmp_path).exported() == set(raw)

    before = tmp_path / "before.jsonl"
    before.write_text("".join(json.dumps(_record(f"c-{n}"), ensure_ascii=False) + "\n" for n in range(2)),
                      encoding="utf-8")
    now = tmp_path / "now.jsonl"
    write_set(now, [_record(f"c-{n}") for n in range(2)], force=False)
    _lines(now)  # escaped, one line each
    for path in (before, now):
        frozen = read_set(path)
        assert [(f.conversation.id, f.conversation.messages[0].content, f.label) for f in frozen] == [
            ("c-0", USER, "fail"), ("c-1", USER, "fail")]
