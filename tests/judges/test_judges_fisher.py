"""Fisher's exact test: reference values and the symmetries of the 2x2 table."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from judges import fisher_exact

# scipy.stats.fisher_exact([[a, b], [c, d]]).pvalue, SciPy 1.17.1 (two-sided), in a throwaway
# environment: SciPy is not a dependency. The first three are also checked by hand in their comments.
REFERENCE = [
    ((5, 0, 0, 5), 0.007936507936507938),  # 2 / C(10, 5): only the two extreme tables
    ((1, 4, 0, 5), 1.0),  # the observed table is the most likely one
    ((4, 1, 0, 5), 0.04761904761904762),  # weights 5, 50, 100, 50, 5 of 210: (5 + 5) / 210
    ((3, 2, 0, 5), 0.16666666666666666),
    ((5, 0, 2, 3), 0.16666666666666666),
    ((1, 4, 4, 1), 0.2063492063492064),  # equal rows: the table and its mirror tie
    ((2, 3, 3, 2), 1.0),
    ((3, 1, 1, 3), 0.48571428571428565),  # Fisher's lady tasting tea
    ((8, 2, 1, 5), 0.034965034965034975),
    ((10, 10, 2, 18), 0.013814147851967652),
    ((0, 20, 7, 13), 0.008316008316008316),
    ((120, 80, 95, 105), 0.01598574593181204),
    ((96, 656, 834, 490), 2.8114856219345067e-118),
]

counts = st.integers(0, 40)


@pytest.mark.parametrize(("table", "expected"), REFERENCE)
def test_matches_scipy(table: tuple[int, int, int, int], expected: float) -> None:
    assert fisher_exact(*table) == pytest.approx(expected, rel=1e-9)


def test_empty_and_one_sided_tables_are_not_evidence() -> None:
    assert fisher_exact(0, 0, 0, 0) == 1.0
    assert fisher_exact(0, 5, 0, 5) == 1.0  # nothing failed on either side
    assert fisher_exact(5, 0, 0, 0) == 1.0  # one side was never judged


def test_negative_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        fisher_exact(1, -1, 0, 0)


@given(counts, counts, counts, counts)
def test_p_is_a_probability(a: int, b: int, c: int, d: int) -> None:
    assert 0 < fisher_exact(a, b, c, d) <= 1


@given(counts, counts, counts, counts)
def test_symmetric_under_transposition_and_swaps(a: int, b: int, c: int, d: int) -> None:
    p = fisher_exact(a, b, c, d)
    for other in [(a, c, b, d), (c, d, a, b), (b, a, d, c), (d, c, b, a)]:
        assert math.isclose(fisher_exact(*other), p, rel_tol=1e-9)


@given(counts, counts)
def test_identical_rows_give_one(a: int, b: int) -> None:
    assert fisher_exact(a, b, a, b) == 1.0


@given(counts, counts, st.integers(1, 4))
def test_proportional_rows_give_one(a: int, b: int, k: int) -> None:
    assert fisher_exact(a, b, k * a, k * b) == 1.0
