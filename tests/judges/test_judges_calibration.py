"""Blind calibration: judge versus human labels, checked against numbers worked out by hand."""

from __future__ import annotations

import json
import math
from typing import Any, cast

import pytest

from judges import LABELS, MIN_N, InputError, Pair, calibrate, compare_reruns, kappa_interval

Z = 1.959963984540054


def from_matrix(matrix: dict[str, dict[str, int]], cid: str = "c") -> list[Pair]:
    """One reviewer per item; ``matrix[human][judge]`` items of each kind."""
    pairs = []
    for human, row in matrix.items():
        for judge, count in row.items():
            pairs += [Pair(cid, f"{human}-{judge}-{k}", "r1", human, judge) for k in range(count)]
    return pairs


def only(pairs: list[Pair], max_false_pass: float = 0.05) -> dict[str, Any]:
    """The one criterion entry of the JSON report."""
    (entry,) = calibrate(pairs, max_false_pass).model_dump(mode="json")["criteria"]
    return cast(dict[str, Any], entry)


def test_three_class_cohen_kappa() -> None:
    #              judge: pass fail n/a | row
    # human pass          8    1    1  |  10
    # human fail          2    4    1  |   7
    # human n/a           0    1    2  |   3
    # col                10    6    4  |  20
    # po = (8 + 4 + 2) / 20 = 0.7
    # pe = (10*10 + 7*6 + 3*4) / 20^2 = 154 / 400 = 0.385
    # kappa = (0.7 - 0.385) / (1 - 0.385) = 0.315 / 0.615 = 21/41
    m = {"pass": {"pass": 8, "fail": 1, "not_applicable": 1},
         "fail": {"pass": 2, "fail": 4, "not_applicable": 1},
         "not_applicable": {"pass": 0, "fail": 1, "not_applicable": 2}}
    e = only(from_matrix(m))
    assert e["n"] == 20
    assert e["confusion"] == m
    assert e["agreement"] == pytest.approx(0.7)
    assert e["kappa"] == pytest.approx(21 / 41)
    assert e["false_pass"]["rate"] == pytest.approx(2 / 7) and e["false_pass"]["n"] == 7
    assert e["false_fail"]["rate"] == pytest.approx(1 / 10) and e["false_fail"]["n"] == 10


def test_two_class_textbook_example() -> None:
    # A (human) yes/no against B (judge): a = 20 both yes, b = 5 A yes B no, c = 10 A no B yes, d = 15.
    # po = (20 + 15) / 50 = 0.70; A says yes 25/50, B 30/50
    # pe = 0.5*0.6 + 0.5*0.4 = 0.5; kappa = (0.7 - 0.5) / (1 - 0.5) = 0.4
    e = only(from_matrix({"pass": {"pass": 20, "fail": 5}, "fail": {"pass": 10, "fail": 15}}))
    assert e["n"] == 50
    assert e["agreement"] == pytest.approx(0.70)
    assert e["kappa"] == pytest.approx(0.4)
    assert e["false_pass"]["rate"] == pytest.approx(10 / 25)  # c / human fails
    assert e["false_fail"]["rate"] == pytest.approx(5 / 25)  # b / human passes
    assert e["calibrated"] is False


def test_perfect_agreement() -> None:
    e = only(from_matrix({"pass": {"pass": 5}, "fail": {"fail": 4}, "not_applicable": {"not_applicable": 3}}))
    assert e["agreement"] == 1.0
    assert e["kappa"] == 1.0
    assert e["false_pass"] == {"rate": 0.0, "low": 0.0, "high": pytest.approx(3 / 4), "n": 4, "count": 0,
                               "too_few": True}


def test_one_class_everywhere_has_no_kappa_and_is_not_calibrated() -> None:
    # Both always pass: pe = 1, kappa = 0/0; and no human fail shows the judge catches anything.
    e = only(from_matrix({"pass": {"pass": 10}}))
    assert e["agreement"] == 1.0
    assert e["kappa"] is None
    assert e["false_pass"] == {"rate": None, "low": None, "high": None, "n": 0, "count": 0, "too_few": True}
    assert e["calibrated"] is False and e["reason"] == "no_failures_found"
    assert e["reason_text"] == ("people found no failure among the 10 items compared: nothing shows yet that the "
                                "judge catches one")
    assert e["false_fail"]["rate"] == 0.0


def test_rule_of_three_decides_calibration_at_the_boundary() -> None:
    # 0 of 60 human fails passed: high = 3/60 = 0.05, not above 0.05 -> calibrated.
    e = only(from_matrix({"fail": {"fail": 60}, "pass": {"pass": 5}}))
    assert e["false_pass"] == {"rate": 0.0, "low": 0.0, "high": 0.05, "n": 60, "count": 0, "too_few": False}
    assert e["calibrated"] is True and e["reason"] is None and e["reason_text"] is None
    # 0 of 59: high = 3/59 = 0.0508 > 0.05 -> not calibrated.
    e = only(from_matrix({"fail": {"fail": 59}, "pass": {"pass": 5}}))
    assert e["false_pass"]["high"] == pytest.approx(3 / 59)
    assert e["calibrated"] is False and e["reason"] == "false_pass_too_high"
    assert e["reason_text"] == ("the judge passed 0 of the 59 items people failed: its false-pass rate may be up to "
                                "5.1%, above the 5.0% allowed")
    # A looser bound makes it calibrated.
    assert only(from_matrix({"fail": {"fail": 59}}), max_false_pass=0.06)["calibrated"] is True


def test_wilson_interval_of_two_in_twenty() -> None:
    # Wilson: p = 2/20 = 0.1, z = 1.96, center = (p + z^2/2n) / (1 + z^2/n),
    # half = z * sqrt(p(1-p)/n + z^2/4n^2) / (1 + z^2/n)  ->  (0.0279, 0.3010)
    n, p = 20, 0.1
    denom = 1 + Z * Z / n
    center = (p + Z * Z / (2 * n)) / denom
    half = Z * math.sqrt(p * (1 - p) / n + Z * Z / (4 * n * n)) / denom
    e = only(from_matrix({"fail": {"pass": 2, "fail": 18}}))
    fp = e["false_pass"]
    assert fp["rate"] == pytest.approx(0.1) and fp["n"] == 20
    assert fp["low"] == pytest.approx(center - half) and fp["high"] == pytest.approx(center + half)
    assert fp["low"] == pytest.approx(0.0279, abs=1e-4) and fp["high"] == pytest.approx(0.3010, abs=1e-4)
    assert e["calibrated"] is False


def test_json_contract_shape() -> None:
    pairs = from_matrix({"pass": {"pass": 1}}, cid="b") + from_matrix({"fail": {"fail": 1}}, cid="a")
    doc = json.loads(json.dumps(calibrate(pairs).to_json()))
    assert list(doc) == ["criteria"]
    assert [c["criterion_id"] for c in doc["criteria"]] == ["a", "b"]
    contract = {"criterion_id", "n", "confusion", "agreement", "kappa", "false_pass", "false_fail", "calibrated"}
    for c in doc["criteria"]:
        assert contract <= set(c)
        assert set(c["confusion"]) == set(LABELS)
        assert all(set(row) == set(LABELS) for row in c["confusion"].values())
        assert sum(v for row in c["confusion"].values() for v in row.values()) == c["n"] == 1
        for key in ("false_pass", "false_fail"):
            assert set(c[key]) == {"rate", "low", "high", "n", "count", "too_few"}
        assert {"reason", "reason_text"} <= set(c)  # keys added to the contract, never renamed
    assert calibrate(pairs).model_dump() == doc
    assert calibrate([]).to_json() == {"criteria": []}


def test_majority_ties_errors_and_unjudged() -> None:
    pairs = [
        # i1: pass, pass, fail -> pass; judge pass
        Pair("c", "i1", "ann", "pass", "pass"), Pair("c", "i1", "bob", "pass", "pass"),
        Pair("c", "i1", "cy", "fail", "pass"),
        # i2: pass, fail -> tie: left out
        Pair("c", "i2", "ann", "pass", "fail"), Pair("c", "i2", "bob", "fail", "fail"),
        # i3: ann says pass, then fail (last wins), bob fail -> fail; judge pass: a false pass
        Pair("c", "i3", "ann", "pass", "pass"), Pair("c", "i3", "bob", "fail", "pass"),
        Pair("c", "i3", "ann", "fail", "pass"),
        Pair("c", "i4", "ann", "fail", "error"),
        Pair("c", "i5", "ann", "fail", None),
    ]
    e = only(pairs)
    assert (e["items"], e["n"], e["ties"], e["judge_error"], e["unjudged"]) == (5, 2, 1, 1, 1)
    assert e["confusion"]["pass"]["pass"] == 1 and e["confusion"]["fail"]["pass"] == 1
    assert e["false_pass"]["rate"] == 1.0 and e["false_pass"]["n"] == 1
    # Reviewers over i1, i2, i3 (2+ reviewers each):
    #   i1 counts pass 2, fail 1 (3 raters): agreeing pairs 1 of 3, P = (4+1-3)/(3*2) = 1/3
    #   i2 pass 1, fail 1: 0 of 1, P = 0;   i3 fail 2: 1 of 1, P = 1
    #   pair agreement = (1 + 0 + 1) / (3 + 1 + 1) = 0.4; P_bar = (1/3 + 0 + 1) / 3 = 4/9
    #   labels: pass 3, fail 4 of 7 -> Pe = (9 + 16) / 49 = 25/49
    #   kappa = (4/9 - 25/49) / (1 - 25/49) = ((196 - 225)/441) / (24/49) = -29/216
    r = e["reviewers"]
    assert r["items"] == 3
    assert r["agreement"] == pytest.approx(0.4)
    assert r["kappa"] == pytest.approx(-29 / 216)


def test_fleiss_kappa_three_items_three_raters() -> None:
    # i1: pass pass pass      P1 = (9 - 3) / 6 = 1
    # i2: pass pass fail      P2 = (4 + 1 - 3) / 6 = 1/3
    # i3: fail fail n/a       P3 = 1/3
    # P_bar = 5/9; p = (5, 3, 1) / 9; Pe = (25 + 9 + 1) / 81 = 35/81
    # kappa = (45/81 - 35/81) / (46/81) = 10/46 = 5/23; pair agreement = (3 + 1 + 1) / 9 = 5/9
    rows = {"i1": ["pass", "pass", "pass"], "i2": ["pass", "pass", "fail"], "i3": ["fail", "fail", "not_applicable"]}
    pairs = [Pair("c", item, f"r{k}", label, "pass") for item, labels in rows.items() for k, label in enumerate(labels)]
    e = only(pairs)
    assert e["reviewers"] == {"items": 3, "agreement": pytest.approx(5 / 9), "kappa": pytest.approx(5 / 23)}
    # Majorities pass, pass, fail against a judge that always passes.
    assert e["confusion"]["pass"]["pass"] == 2 and e["confusion"]["fail"]["pass"] == 1


def test_reviewers_block_when_undefined() -> None:
    single = only(from_matrix({"pass": {"pass": 3}}))
    assert single["reviewers"] == {"items": 0, "agreement": None, "kappa": None}
    same = only([Pair("c", "i", r, "pass", "pass") for r in ("a", "b")])
    assert same["reviewers"] == {"items": 1, "agreement": 1.0, "kappa": None}  # one label everywhere: Pe = 1


def test_bad_labels_raise_input_error_naming_the_value() -> None:
    with pytest.raises(InputError, match=r"'i7'.*'ann'.*'passed'"):
        calibrate([Pair("c", "i7", "ann", "passed", "pass")])
    with pytest.raises(InputError, match=r"'i8'.*'bob'.*'maybe'"):
        calibrate([Pair("c", "i8", "bob", "pass", "maybe")])
    with pytest.raises(InputError, match="differs"):
        calibrate([Pair("c", "i9", "ann", "pass", "pass"), Pair("c", "i9", "bob", "pass", "fail")])
    with pytest.raises(InputError, match="'yes'"):
        compare_reruns({"i": "yes"}, {}, {})
    with pytest.raises(InputError, match=r"'i'.*after.*'PASS'"):
        compare_reruns({"i": "pass"}, {"i": "pass"}, {"i": "PASS"})


def test_compare_reruns() -> None:
    labels = {"a": "fail", "b": "fail", "c": "pass", "d": "pass", "e": "fail", "f": "pass", "g": "fail"}
    before = {"a": "pass", "b": "fail", "c": "pass", "d": "fail", "e": "pass", "f": "error", "g": "fail"}
    after = {"a": "fail", "b": "pass", "c": "pass", "d": "fail", "e": "pass", "f": "pass", "x": "pass"}
    # a: wrong -> right (fixed); b: right -> wrong (broken); c: right both; d, e: wrong both;
    # f: error -> right (fixed); g: missing from after; x: no human label, ignored.
    diff = compare_reruns(labels, before, after).to_json()
    assert diff["counts"] == {"fixed": 2, "broken": 1, "same": 3, "missing": 1}
    assert (diff["fixed"], diff["broken"], diff["missing"]) == (["a", "f"], ["b"], ["g"])
    # Human fails a, b, e, g. Before: a pass, b fail, e pass, g fail -> 2 of 4 passed.
    assert diff["false_pass_before"]["rate"] == pytest.approx(0.5) and diff["false_pass_before"]["n"] == 4
    # After (g missing): a fail, b pass, e pass -> 2 of 3.
    assert diff["false_pass_after"]["rate"] == pytest.approx(2 / 3) and diff["false_pass_after"]["n"] == 3
    empty = compare_reruns({"c": "pass"}, {}, {"c": "pass"}).to_json()
    assert empty["fixed"] == ["c"]  # missing from before counts as not agreeing then
    assert empty["false_pass_after"] == {"rate": None, "low": None, "high": None, "n": 0, "count": 0,
                                         "too_few": True}


@pytest.mark.parametrize(("matrix", "reason"), [
    # Nine compared, none failed by people: too few to say people find no failure.
    ({"pass": {"pass": 9}}, "too_few_labels"),
    # Ten compared, not one failed by people: nothing shows the judge catches a failure.
    ({"pass": {"pass": 10}}, "no_failures_found"),
    # Nine people's fails, all caught, among many passes: still too few to tell the false-pass rate.
    ({"fail": {"fail": 9}, "pass": {"pass": 100}}, "too_few_labels"),
    # Ten fails, all caught: enough to tell, and the rule of three allows up to 30%.
    ({"fail": {"fail": 10}}, "false_pass_too_high"),
    ({"fail": {"fail": 60}}, None),
])
def test_not_calibrated_names_its_reason(matrix: dict[str, dict[str, int]], reason: str | None) -> None:
    e = only(from_matrix(matrix))
    assert (e["calibrated"], e["reason"]) == (reason is None, reason)


def test_too_few_labels_says_how_many_it_takes_whatever_the_bound() -> None:
    # 1 of 5 fails passed: the interval (3.6% to 62.4%) sits under a loose bound of 70%, yet 5 tell nothing.
    e = only(from_matrix({"fail": {"pass": 1, "fail": 4}, "pass": {"pass": 3}}), max_false_pass=0.7)
    assert e["calibrated"] is False and e["reason"] == "too_few_labels"
    assert e["reason_text"] == (f"too few labels: people failed 5 of the 8 items compared; telling the false-pass "
                                f"rate takes at least {MIN_N} of their fails")
    assert e["false_pass"]["too_few"] is True and e["false_pass"]["count"] == 1
    assert e["false_fail"]["too_few"] is True and e["false_fail"]["n"] == 3


def _matrix(cells: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {h: {j: cells.get(h, {}).get(j, 0) for j in LABELS} for h in LABELS}


def test_kappa_interval_is_close_to_the_large_sample_one_and_the_same_on_every_run() -> None:
    m = _matrix({"pass": {"pass": 200, "fail": 20}, "fail": {"pass": 30, "fail": 150}})
    # po = 350/400, pe = (220*230 + 180*170)/400^2, kappa = (po - pe)/(1 - pe) = 0.746; its large-sample
    # standard error sqrt(po(1 - po) / (n (1 - pe)^2)) = 0.0337 gives 0.680 to 0.812.
    po, pe = 350 / 400, (220 * 230 + 180 * 170) / 400 ** 2
    kappa, se = (po - pe) / (1 - pe), math.sqrt(po * (1 - po) / (400 * (1 - pe) ** 2))
    interval = kappa_interval(m)
    assert interval is not None
    low, high = interval
    assert low < kappa < high
    assert low == pytest.approx(kappa - Z * se, abs=0.01) and high == pytest.approx(kappa + Z * se, abs=0.01)
    assert kappa_interval(m) == interval  # seeded: a monitor re-evaluated on the same labels decides the same
    assert kappa_interval(m, seed=1) != interval


def test_kappa_interval_of_nothing_or_of_one_label_everywhere_is_none() -> None:
    assert kappa_interval(_matrix({})) is None
    assert kappa_interval(_matrix({"pass": {"pass": 30}})) is None  # kappa is undefined in every resample
    assert kappa_interval(_matrix({"pass": {"pass": 30}, "fail": {"fail": 20}})) == (1.0, 1.0)
