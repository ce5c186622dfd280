"""Acceptance sampling and the seeded review sample, against hand-computed values.

Closed forms used below: with 0 failures in n, the one-sided upper bound solves
(1 - p)^n = alpha, so p = 1 - alpha^(1/n); with n failures in n the lower bound solves
p^n = alpha. For 1 of 2: upper solves 1 - p^2 = alpha (p = sqrt(1 - alpha)), lower solves
1 - (1 - p)^2 = alpha (p = 1 - sqrt(1 - alpha)).
"""

from __future__ import annotations

import math

import pytest

from apps.review.acceptance import (
    binomial_cdf,
    binomial_sf,
    decide,
    lower_bound,
    next_sample_size,
    sample_size,
    upper_bound,
)
from apps.review.sampling import sample_indices


def test_binomial_tails_by_hand():
    # Binomial(4, 1/2): P(X<=1) = (1 + 4)/16; P(X>=3) = (4 + 1)/16
    assert binomial_cdf(1, 4, 0.5) == pytest.approx(5 / 16)
    assert binomial_sf(3, 4, 0.5) == pytest.approx(5 / 16)
    assert binomial_cdf(-1, 4, 0.5) == 0.0 and binomial_cdf(4, 4, 0.5) == 1.0
    assert binomial_sf(0, 4, 0.3) == pytest.approx(1.0)
    # Large n stays finite (log-space terms): P(X <= 0 | 5000, 0.001) = 0.999^5000
    assert binomial_cdf(0, 5000, 0.001) == pytest.approx(0.999 ** 5000, rel=1e-9)


def test_upper_bound_zero_failures_closed_form():
    assert upper_bound(0, 59, 0.95) == pytest.approx(1 - 0.05 ** (1 / 59), abs=1e-12)
    assert upper_bound(0, 59, 0.95) == pytest.approx(0.049508, abs=1e-6)


def test_lower_bound_all_failures_closed_form():
    assert lower_bound(10, 10, 0.95) == pytest.approx(0.05 ** 0.1, abs=1e-12)  # 0.741134
    assert lower_bound(0, 10, 0.95) == 0.0
    assert upper_bound(10, 10, 0.95) == 1.0


def test_one_of_two_closed_forms():
    assert upper_bound(1, 2, 0.95) == pytest.approx(math.sqrt(0.95), abs=1e-9)  # 0.974679
    assert lower_bound(1, 2, 0.95) == pytest.approx(1 - math.sqrt(0.95), abs=1e-9)


def test_one_of_ten_matches_published_clopper_pearson_interval():
    # The two-sided 90 % Clopper-Pearson interval for 1/10 is (0.0051, 0.3942): its ends are
    # the one-sided 95 % bounds.
    assert upper_bound(1, 10, 0.95) == pytest.approx(0.3942, abs=5e-5)
    assert lower_bound(1, 10, 0.95) == pytest.approx(1 - 0.95 ** 0.1, abs=1e-9)  # 0.005116


def test_bounds_solve_their_defining_equations():
    upper, lower = upper_bound(3, 59, 0.95), lower_bound(10, 59, 0.95)
    assert binomial_cdf(3, 59, upper) == pytest.approx(0.05, abs=1e-9)
    assert binomial_sf(10, 59, lower) == pytest.approx(0.05, abs=1e-9)


@pytest.mark.parametrize(("target", "confidence", "allowed", "expected"), [
    (0.05, 0.95, 0, 59),    # ln 0.05 / ln 0.95 = 58.4
    (0.05, 0.95, 1, 93),    # the classic c=1 plan
    (0.05, 0.95, 2, 124),   # and c=2
    (0.01, 0.95, 0, 299),   # ln 0.05 / ln 0.99 = 298.1
    (0.10, 0.90, 0, 22),    # ln 0.1 / ln 0.9 = 21.85
    (0.50, 0.90, 0, 4),     # ln 0.1 / ln 0.5 = 3.32
])
def test_sample_size(target, confidence, allowed, expected):
    assert sample_size(target, confidence, allowed_rejections=allowed) == expected


def test_sample_size_is_capped_by_the_batch():
    assert sample_size(0.05, 0.95, population=20) == 20
    assert sample_size(0.05, 0.95, population=1000) == 59


@pytest.mark.parametrize("bad", [
    {"target": 0.0, "confidence": 0.95}, {"target": 1.0, "confidence": 0.95},
    {"target": 0.05, "confidence": 1.0}, {"target": 0.05, "confidence": 0.3},
])
def test_sample_size_refuses_impossible_plans(bad):
    with pytest.raises(ValueError):
        sample_size(bad["target"], bad["confidence"])


def _decide(**kwargs):
    defaults = {"population": 1000, "sample": 59, "target": 0.05, "confidence": 0.95}
    return decide(**{**defaults, **kwargs})


def test_clean_sample_accepts():
    d = _decide(reviewed=59, rejected=0)
    assert d.outcome == "accept"
    assert d.upper == pytest.approx(0.049508, abs=1e-6)


def test_one_rejection_in_59_is_inconclusive_and_resamples_to_the_c1_plan():
    d = _decide(reviewed=59, rejected=1)
    assert d.outcome == "resample"
    # at least double (118) and at least the c=1 plan (93)
    assert d.next_sample_size == 118
    assert next_sample_size(sample=59, population=100, rejected=1, target=0.05,
                            confidence=0.95) == 100  # never beyond the batch


def test_many_rejections_reject_before_the_sample_is_done():
    # 3 of the first 3 rejected: lower bound 0.05^(1/3) = 0.368 > 0.05
    d = _decide(reviewed=3, rejected=3)
    assert d.outcome == "reject"
    assert d.lower == pytest.approx(0.05 ** (1 / 3), abs=1e-9)


def test_partial_sample_without_evidence_is_pending():
    assert _decide(reviewed=0, rejected=0).outcome == "pending"
    assert _decide(reviewed=30, rejected=0).outcome == "pending"
    assert _decide(reviewed=30, rejected=1).outcome == "pending"


def test_census_decides_exactly():
    # 10 records, target 20 %: at most 2 may be bad.
    assert decide(population=10, sample=10, reviewed=10, rejected=2, target=0.2,
                  confidence=0.95).outcome == "accept"
    assert decide(population=10, sample=10, reviewed=10, rejected=3, target=0.2,
                  confidence=0.95).outcome == "reject"


def test_small_plan_used_by_the_browser_tests():
    # target 50 %, 90 %: 4 records; 4 clean accept (upper 1 - 0.1^(1/4) = 0.438),
    # 4 of 4 rejected reject (lower 0.1^(1/4) = 0.562); 3 of 4 resamples to 12.
    plan = {"population": 10, "sample": 4, "target": 0.5, "confidence": 0.9}
    assert decide(reviewed=4, rejected=0, **plan).upper == pytest.approx(1 - 0.1 ** 0.25)
    assert decide(reviewed=4, rejected=0, **plan).outcome == "accept"
    assert decide(reviewed=4, rejected=4, **plan).outcome == "reject"
    resample = decide(reviewed=4, rejected=3, **plan)
    assert resample.outcome == "resample" and resample.next_sample_size == 10


def test_decide_refuses_inconsistent_counts():
    with pytest.raises(ValueError):
        _decide(reviewed=60, rejected=0)
    with pytest.raises(ValueError):
        _decide(reviewed=5, rejected=6)


def test_sample_is_seeded_and_grows_by_prefix():
    small = sample_indices(seed=7, population=1000, size=59)
    large = sample_indices(seed=7, population=1000, size=118)
    assert large[:59] == small
    assert len(set(large)) == 118 and all(0 <= i < 1000 for i in large)
    assert sample_indices(seed=8, population=1000, size=59) != small
    assert sorted(sample_indices(seed=1, population=5, size=5)) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        sample_indices(seed=1, population=5, size=6)
