"""The rule conditions as pure functions, against values worked out by hand."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from apps.alerts import rules


def test_ema_and_smoothed_drop_by_hand() -> None:
    # s0 = 1; s1 = .5*1 + .5*1 = 1; s2 = 1; s3 = .5*0 + .5*1 = .5; s4 = .25
    assert rules.ema([1, 1, 1, 0, 0], 0.5) == [1, 1, 1, 0.5, 0.25]
    assert rules.smoothed_drop([1, 1, 1, 0, 0], 0.5) == (1, 0.25, 0.75)
    # Rising: the current value is the peak, no drop.
    assert rules.ema([0.2, 0.4, 0.6], 0.5) == pytest.approx([0.2, 0.3, 0.45])
    assert rules.smoothed_drop([0.2, 0.4, 0.6], 0.5)[2] == 0.0
    # A negative reward falling further: peak -1, now -2, one whole |peak| below.
    assert rules.smoothed_drop([-1, -2], 1.0) == (-1, -2, 1.0)
    # All zero: no drop to speak of (and no division by zero).
    assert rules.smoothed_drop([0.0, 0.0], 0.3) == (0.0, 0.0, 0.0)


def test_reward_collapse_fires_past_the_drop_after_min_points() -> None:
    p = rules.parse_params("reward_collapse", {"alpha": 0.5, "drop": 0.7, "min_points": 5})
    found = rules.reward_collapse([1, 1, 1, 0, 0], p)
    assert found is not None and found.value == 0.75
    assert "75% below its peak 1" in found.message
    assert rules.reward_collapse([1, 1, 1, 0, 0], {**p, "min_points": 6}) is None
    assert rules.reward_collapse([1, 1, 1, 0, 0], {**p, "drop": 0.8}) is None
    # The window keeps only the last points: [1, 0, 0] smooths to [1, .5, .25].
    assert rules.reward_collapse([5, 5, 1, 0, 0], {**p, "window": 3, "min_points": 3}
                                 ).value == 0.75  # type: ignore[union-attr]


def test_nan_streak_counts_the_trailing_non_finite_values() -> None:
    assert rules.nan_streak([1.0, math.nan, None, math.inf]) == 3
    assert rules.nan_streak([math.nan, 1.0]) == 0
    assert rules.nan_streak([math.nan, math.nan]) == 2
    assert rules.nan_streak([]) == 0


def test_threshold_rules_need_every_point_of_the_span_above() -> None:
    assert rules.above_for([0.1, 0.3, 0.4], 0.2, 2)
    assert not rules.above_for([0.1, 0.3, 0.4], 0.2, 3)
    assert not rules.above_for([0.4], 0.2, 2)  # too few points yet
    p = rules.parse_params("mismatch_kl", {"bound": 0.05})
    found = rules.metric_finding("mismatch_kl", p, [0.01, 0.07])
    assert found is not None and found.value == 0.07 and "mismatch/kl" in found.message
    assert rules.metric_finding("mismatch_kl", p, [0.07, 0.05]) is None  # not above: equal
    p = rules.parse_params("sandbox_error_rate", {"threshold": 0.25, "for_points": 2})
    assert rules.metric_finding("sandbox_error_rate", p, [0.3, 0.5]) is not None
    assert rules.metric_finding("sandbox_error_rate", p, [0.1, 0.5]) is None


def test_backoff_doubles_up_to_the_cap() -> None:
    assert [rules.backoff_seconds(n, base=10, cap=60) for n in range(1, 6)] == \
        [10, 20, 40, 60, 60]


def test_params_fill_defaults_and_refuse_unknown_or_out_of_range() -> None:
    assert rules.parse_params("nan_streak", None) == {"streak": 2}
    assert rules.parse_params("mismatch_kl", {})["bound"] == 0.01
    assert rules.watched_metric("mismatch_kl", {}) == "mismatch/kl"
    assert rules.watched_metric("forgery_suspect", {}) == "reward/verdict_exited_early"
    with pytest.raises(ValidationError):
        rules.parse_params("nan_streak", {"streek": 3})
    with pytest.raises(ValidationError):
        rules.parse_params("reward_collapse", {"alpha": 0})
    with pytest.raises(ValidationError):
        rules.parse_params("metric_above", {"threshold": 1})  # no metric named
