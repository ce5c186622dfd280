"""The leaderboard's Pareto front and the gate's arithmetic, against hand-computed values
(pure functions: no database)."""

from __future__ import annotations

import pytest

from apps.evals.gating import EntryFigures, compare, totals, verdict
from apps.evals.pareto import dominates, pareto_front

MAX_MIN_MIN = ("max", "min", "min")


def test_front_of_capability_cost_latency_by_hand():
    # (capability ↑, cost ↓, latency ↓)
    points = [
        (0.80, 2.0, 0.10),  # A: best capability                      -> front
        (0.60, 1.0, 0.10),  # B: cheapest                             -> front
        (0.60, 1.5, 0.10),  # C: B is as capable, cheaper, as fast     -> dominated by B
        (0.50, 3.0, 0.05),  # D: fastest                              -> front
        (0.50, 3.0, 0.06),  # E: D beats it on latency, ties the rest  -> dominated by D
        (0.79, 2.0, 0.10),  # F: A is better on capability, ties rest  -> dominated by A
    ]
    assert pareto_front(points, MAX_MIN_MIN) == [True, True, False, True, False, False]


def test_equal_points_both_stay_and_unknown_values_are_off_the_front():
    points = [(0.5, 1.0), (0.5, 1.0), (None, 0.1), (0.4, 2.0)]
    # The two equal points do not dominate each other; the third has no capability (not on
    # the front, and it does not knock the fourth off even though it is cheaper).
    assert pareto_front(points, ("max", "min")) == [True, True, False, False]
    assert pareto_front([(None, 0.1), (0.1, 9.0)], ("max", "min")) == [False, True]


def test_single_axis_and_empty():
    assert pareto_front([(1.0,), (3.0,), (3.0,), (2.0,)], ("max",)) == [False, True, True, False]
    assert pareto_front([(1.0,), (3.0,)], ("min",)) == [True, False]
    assert pareto_front([], ("max",)) == []


def test_dominates_needs_one_strict_improvement():
    assert dominates((1, 1), (1, 0)) and not dominates((1, 1), (1, 1))
    assert not dominates((2, 0), (1, 1))


def test_a_point_with_the_wrong_number_of_values_is_refused():
    with pytest.raises(ValueError, match="2 values for 3 axes"):
        pareto_front([(1.0, 2.0)], MAX_MIN_MIN)


def test_compare_marks_a_drop_beyond_the_threshold():
    assert compare(0.5, 0.7, 0.1).regressed  # drop 0.2 > 0.1
    assert compare(0.5, 0.7, 0.1).delta == pytest.approx(-0.2)
    assert not compare(0.65, 0.7, 0.1).regressed  # drop 0.05
    # exactly the threshold is not a regression, even where floats round it up
    assert 0.8 - 0.7 > 0.1 and not compare(0.7, 0.8, 0.1).regressed
    assert not compare(0.9, 0.2, 0.0).regressed  # an improvement
    assert not compare(None, 0.7, 0.1).regressed
    nothing = compare(0.5, None, 0.1)
    assert (nothing.delta, nothing.regressed) == (None, False)


def test_verdict_order_pending_failed_regressed_passed():
    assert verdict(["succeeded", "pending"], [True]) == "pending"
    assert verdict(["succeeded", "failed"], [True]) == "failed"
    assert verdict(["succeeded", "succeeded"], [False, True]) == "regressed"
    assert verdict(["succeeded"], [False]) == "passed"


def test_totals_by_hand():
    t = totals([EntryFigures(score=0.5, tasks=4, cpu_seconds=8.0, gpu_seconds=0.0,
                             latency_s=0.2),
                EntryFigures(score=1.0, tasks=6, cpu_seconds=12.0, gpu_seconds=3.0,
                             latency_s=0.1)])
    assert t.capability == pytest.approx(0.75)  # (0.5 + 1.0) / 2
    assert t.tasks == 10
    assert t.cpu_seconds_per_task == pytest.approx(2.0)  # 20 / 10
    assert t.gpu_seconds_per_task == pytest.approx(0.3)  # 3 / 10
    assert t.latency_s == pytest.approx(0.14)  # (0.2·4 + 0.1·6) / 10
    missing = totals([EntryFigures(score=None, tasks=None, cpu_seconds=1.0, gpu_seconds=None,
                                   latency_s=None)])
    assert (missing.capability, missing.gpu_seconds_per_task, missing.latency_s) == \
        (None, None, None)
