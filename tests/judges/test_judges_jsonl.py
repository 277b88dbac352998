"""JSON lines that survive every character: U+2028, U+2029 and U+0085 escaped when written, lines split on
``\\n`` only when read, files written before the escaping still read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
from hypothesis import given
from hypothesis import strategies as st

from judges import (
    CacheKey,
    Conversation,
    DiskCache,
    JudgeInfo,
    Message,
    Verdict,
    escape_line_breaks,
    json_line,
    read_conversations,
    split_json_lines,
)

from .conftest import chest_pain

SEPARATORS = "\u2028\u2029\x85"
# Text leaning on the characters that break lines somewhere (no lone surrogates: not UTF-8).
TEXT = st.text(st.sampled_from([*SEPARATORS, "\n", "\r", "\v", "\x1e", '"', "\\", "a", " "])
               | st.characters(exclude_categories=["Cs"]), max_size=30)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False, allow_infinity=False)
    | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)


def _one_line(line: str) -> None:
    assert line.splitlines() == [line] and not any(c in line for c in SEPARATORS), line


@given(JSON)
def test_a_json_line_is_one_line_for_every_reader(value: Any) -> None:
    line = json_line(value)
    assert line.endswith("\n")
    _one_line(line[:-1])
    assert json.loads(line) == value


@given(JSON)
def test_escaped_bytes_and_text_agree_and_keep_the_value(value: Any) -> None:
    encoded = escape_line_breaks(orjson.dumps(value))
    _one_line(encoded.decode("utf-8"))
    assert orjson.loads(encoded) == value
    assert encoded.decode("utf-8") == escape_line_breaks(orjson.dumps(value).decode("utf-8"))


@given(st.lists(JSON, max_size=5), st.booleans())
def test_lines_split_on_newline_only_also_as_written_before(values: list[Any], crlf: bool) -> None:
    end = "\r\n" if crlf else "\n"
    for text in ("".join(json_line(v)[:-1] + end for v in values),  # escaped, as written now
                 "".join(json.dumps(v, ensure_ascii=False) + end for v in values)):  # raw, as written before
        assert [json.loads(line) for line in split_json_lines(text)] == values


def test_blank_lines_keep_their_numbers_and_nothing_follows_the_last_newline() -> None:
    assert split_json_lines("") == []
    assert split_json_lines("1\n\n2\r\n\r\n") == ["1", "", "2", ""]
    assert split_json_lines("1\n2") == ["1", "2"]  # a last line without its newline


def _with_separators(cid: str) -> Conversation:
    return chest_pain(cid).model_copy(update={"messages": [
        Message(role="user", content=f"chest\u2028pain\u2029since\x85lunch {cid}"),
        Message(role="assistant", content="Call an ambulance.\u2028Now.")]})


def test_conversations_are_written_escaped_and_read_either_way(tmp_path: Path) -> None:
    convs = [_with_separators("a"), _with_separators("b")]
    for c in convs:
        _one_line(c.to_json())
    path = tmp_path / "c.jsonl"
    path.write_text("".join(c.to_json() + "\n" for c in convs), encoding="utf-8")
    assert read_conversations(path) == convs
    # Written before the escaping (raw characters), with Windows line ends.
    path.write_text("".join(c.model_dump_json(by_alias=True, exclude_none=True) + "\r\n" for c in convs),
                    encoding="utf-8")
    assert read_conversations(path) == convs


def test_the_verdict_cache_writes_escaped_and_reads_what_was_written_before(tmp_path: Path) -> None:
    key = CacheKey("c", 1, "p" * 64, "scripted/m", "t" * 64)
    verdict = Verdict(criterion_id="c", criterion_version=1, conversation_id="x", result="fail",
                      reasoning="It said\u2028call\x85later.", evidence=["call\u2029later"],
                      judge=JudgeInfo(provider="scripted", model="m"), transcript_sha256="t" * 64)
    path = tmp_path / "cache.jsonl"
    DiskCache(path).put(key, verdict)
    (line,) = path.read_text(encoding="utf-8").split("\n")[:-1]
    _one_line(line)
    assert DiskCache(path).get(key) == verdict
    path.write_text(json.dumps({"key": list(key), "verdict": verdict.model_dump(mode="json")}, ensure_ascii=False)
                    + "\n", encoding="utf-8")  # as written before: raw characters
    assert DiskCache(path).get(key) == verdict
