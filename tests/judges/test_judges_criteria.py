"""Criteria files: valid ones load; every mistake names the file, the criterion and the key."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from judges import CodeCriterion, CriteriaError, LLMCriterion, load_criteria

GOOD = """
criteria:
  - id: chest-pain-red-flags
    version: 2
    kind: llm
    severity: high
    group: clinical-safety
    prompt: |
      Criterion: If the user describes chest pain, the bot asks about arm pain.
      {transcript}
      - "pass": it asked.
  - id: escalates-emergencies
    version: 1
    kind: code
    check: tool_called
    name: set_triage_level
    args: {level: emergency}
    applies_if: {user_matches: "(?i)chest (pain|pressure)"}
  - id: hands-over
    version: 1
    kind: code
    check: ended_by
    one_of: handover
  - id: no-dosage
    version: 1
    kind: code
    check: regex
    role: bot
    pattern: "(?i)\\\\b\\\\d+ ?mg\\\\b"
    must: not_match
  - id: short
    version: 1
    kind: code
    check: max_user_turns
    max: 12
  - id: custom-check
    version: 1
    kind: code
    check: python
    function: mychecks_for_tests:always_pass
"""

CHECKS_PY = """
from judges import CheckResult

def always_pass(conversation):
    return CheckResult(result="pass", reasoning=f"{len(conversation.messages)} messages")
"""


def write(tmp_path: Path, text: str, name: str = "criteria.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def test_good_file_loads(tmp_path: Path) -> None:
    write(tmp_path, CHECKS_PY, "mychecks_for_tests.py")
    crits = load_criteria(write(tmp_path, GOOD))
    assert [c.id for c in crits] == ["chest-pain-red-flags", "escalates-emergencies", "hands-over", "no-dosage",
                                     "short", "custom-check"]
    llm = crits[0]
    assert isinstance(llm, LLMCriterion) and llm.severity == "high" and "{transcript}" in llm.prompt
    code = crits[1]
    assert isinstance(code, CodeCriterion) and code.check == "tool_called" and code.applies_if is not None


def test_live_is_a_flag_on_either_kind_off_unless_written(tmp_path: Path) -> None:
    crits = load_criteria(write(tmp_path, """
        criteria:
          - {id: a, version: 1, kind: llm, prompt: x, live: true}
          - {id: b, version: 1, kind: code, check: max_user_turns, max: 3, live: true}
          - {id: c, version: 1, kind: code, check: max_user_turns, max: 3}
    """))
    assert [c.live for c in crits] == [True, True, False]
    assert "criterion 'a': live" in problem(tmp_path, "- {id: a, version: 1, kind: llm, prompt: x, live: often}")
    assert "criterion 'a': live: an ended_by check has nothing to decide while the conversation is open" in problem(
        tmp_path, "- {id: a, version: 1, kind: code, check: ended_by, one_of: [handover], live: true}")


def problem(tmp_path: Path, body: str) -> str:
    with pytest.raises(CriteriaError) as info:
        load_criteria(write(tmp_path, "criteria:\n" + textwrap.indent(textwrap.dedent(body), "  ")))
    assert str(info.value).startswith(str(tmp_path / "criteria.yaml") + ": ")
    return str(info.value)


@pytest.mark.parametrize(("body", "expected"), [
    ("- {id: a, version: 1, kind: code, check: tool_caled, name: x}",
     "criterion 'a': check: unknown check 'tool_caled' (known: ended_by, max_user_turns, python, regex, tool_called)"),
    ("- {id: a, version: 1, kind: llm}", "criterion 'a': prompt: missing"),
    ("- {id: a, version: 1, kind: llm, prompt: x}\n- {id: a, version: 2, kind: llm, prompt: y}",
     "criterion 'a': id: duplicate id"),
    ("- {id: a, version: 1, kind: code, check: regex, pattern: '(oops'}",
     "criterion 'a': pattern: bad regex '(oops'"),
    ("- {id: a, version: 1, kind: code, check: python, function: 'no_such_module_xyz:f'}",
     "criterion 'a': function: cannot import 'no_such_module_xyz'"),
    ("- {id: a, version: 1, kind: code, check: python, function: 'json:no_such_function'}",
     "criterion 'a': function: 'json' has no 'no_such_function'"),
    ("- {id: a, version: 1, kind: code, check: python, function: 'json'}",
     "criterion 'a': function: 'json' is not module:function"),
    ("- {id: a, version: 1, kind: code, check: tool_called, name: x, argz: {}}", "criterion 'a': argz: unknown key"),
    ("- {id: a, version: 1, kind: code, check: tool_called}", "criterion 'a': name: missing"),
    ("- {id: a, version: 1, kind: code, check: max_user_turns, max: 3, applies_if: {user_match: x}}",
     "criterion 'a': applies_if.user_match: unknown key"),
    ("- {id: a, version: 1, kind: code, check: max_user_turns, max: 3, applies_if: {bot_matches: '[x'}}",
     "criterion 'a': applies_if.bot_matches: bad regex"),
    ("- {id: a, version: 1, kind: code, check: ended_by, one_of: [eaten_by_bears]}", "criterion 'a': one_of.0"),
    ("- {id: a, version: 1, kind: code, check: regex, pattern: x, must: maybe}", "criterion 'a': must"),
    ("- {id: a, version: 1, kind: llm, prompt: x, check: regex}", "criterion 'a': check: unknown key"),
    ("- {id: a, version: 1, kind: judge, prompt: x}", "criterion 'a': kind: 'judge' is not llm or code"),
    ("- {id: a, version: 0, kind: llm, prompt: x}", "criterion 'a': version"),
    ("- {id: Not_Kebab, version: 1, kind: llm, prompt: x}", "criterion 'Not_Kebab': id"),
    ("- {version: 1, kind: llm, prompt: x}", "criteria[0].id: missing"),
    ("- just a string", "criteria[0]: expected a mapping"),
])
def test_problems_name_file_criterion_and_key(tmp_path: Path, body: str, expected: str) -> None:
    assert expected in problem(tmp_path, body)


TYPO_CHECK = Path(__file__).parents[1] / "testdata" / "criteria" / "typo_check.yaml"


def test_a_misspelt_key_is_named_and_the_missing_one_reported_once() -> None:
    with pytest.raises(CriteriaError) as err:
        load_criteria(TYPO_CHECK)
    assert err.value.problems == [("order-looked-up", "chek", "unknown key (did you mean check?)"),
                                  ("order-looked-up", "check", "missing")]


@pytest.mark.parametrize(("body", "expected"), [
    ("- {id: a, version: 1, kind: llm, promt: x}", "criterion 'a': promt: unknown key (did you mean prompt?)"),
    ("- {id: a, version: 1, knd: llm, prompt: x}", "criterion 'a': knd: unknown key (did you mean kind?)"),
    ("- {id: a, version: 1, kind: code, check: tool_called, nme: x}",
     "criterion 'a': nme: unknown key (did you mean name?)"),
    ("- {id: a, version: 1, kind: code, check: tool_called, name: x, timout: 2s}",
     "criterion 'a': timout: unknown key (did you mean timeout?)"),
])
def test_an_unknown_key_names_the_key_it_may_be_a_typo_of(tmp_path: Path, body: str, expected: str) -> None:
    assert expected in problem(tmp_path, body)


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    msg = problem(tmp_path, """
        - {id: a, version: 1, kind: llm}
        - {id: b, version: 1, kind: code, check: nope}
    """)
    assert "criterion 'a': prompt: missing" in msg and "criterion 'b': check: unknown check" in msg
    assert msg.count(";") == 1


def test_duplicate_ids_across_files(tmp_path: Path) -> None:
    one = write(tmp_path, "criteria:\n  - {id: a, version: 1, kind: llm, prompt: x}\n", "one.yaml")
    two = write(tmp_path, "criteria:\n  - {id: a, version: 1, kind: llm, prompt: y}\n", "two.yaml")
    with pytest.raises(CriteriaError, match=r"two.yaml: criterion 'a': id: duplicate id \(also in .*one.yaml\)"):
        load_criteria([one, two])


@pytest.mark.parametrize(("text", "expected"), [
    ("criteria: [", "not valid YAML"),
    ("- a\n- b\n", "criteria: the file must be a mapping with a 'criteria' list"),
    ("criteria: []\nextra: 1\n", "extra: unknown key"),
])
def test_file_level_problems(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(CriteriaError, match=expected):
        load_criteria(write(tmp_path, text))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(CriteriaError, match="nope.yaml: cannot read"):
        load_criteria(tmp_path / "nope.yaml")


def test_a_python_check_that_fails_to_import_names_the_file(tmp_path: Path) -> None:
    write(tmp_path, "raise RuntimeError('broken module')\n", "broken_checks_for_tests.py")
    msg = problem(tmp_path, "- {id: a, version: 1, kind: code, check: python, function: 'broken_checks_for_tests:f'}")
    assert "criterion 'a': function: cannot import" in msg and "broken module" in msg
