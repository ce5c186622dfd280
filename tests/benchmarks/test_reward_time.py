"""The time_to_reward line of bench-rl: finite in every case, its bound marked."""

import math

import pytest

from tests.benchmarks.reward_time import median_time, reward_line

INF = math.inf


def test_median_time_counts_a_miss_as_its_training_time():
    assert median_time([1.0, 3.0, 2.0], [9.0, 9.0, 9.0]) == (2.0, 0)
    # the miss stands at 12.0, so the sorted figures are 1.0, 2.0, 12.0
    assert median_time([1.0, INF, 2.0], [9.0, 12.0, 9.0]) == (2.0, 1)
    assert median_time([INF, INF], [10.0, 14.0]) == (12.0, 2)


def test_median_time_refuses_bad_input():
    with pytest.raises(ValueError, match="one training time per run"):
        median_time([], [])
    with pytest.raises(ValueError, match="one training time per run"):
        median_time([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="finite"):
        median_time([INF], [INF])


def test_both_reached_is_the_plain_ratio():
    assert reward_line((0.7, 0), (2.8, 0), 3) == (
        "time_to_reward: crucible=0.7 trl=2.8 ratio=0.25 target=<=0.5")


def test_peer_never_reached_gives_an_upper_bound():
    assert reward_line((0.6, 0), (12.3, 3), 3) == (
        "time_to_reward: crucible=0.6 trl=not reached in 12.3 s ratio<0.05 target=<=0.5")


def test_crucible_never_reached_gives_a_lower_bound():
    assert reward_line((4.0, 1), (2.0, 0), 1) == (
        "time_to_reward: crucible=not reached in 4.0 s trl=2.0 ratio>2.00 target=<=0.5")


def test_neither_reached_is_the_ratio_of_training_times_unbounded():
    assert reward_line((2.0, 2), (8.0, 2), 2) == (
        "time_to_reward: crucible=not reached in 2.0 s trl=not reached in 8.0 s "
        "ratio~0.25 target=<=0.5")


def test_some_runs_short_shows_a_lower_bound_figure():
    line = reward_line((1.0, 0), (5.0, 1), 3)
    assert line == ("time_to_reward: crucible=1.0 trl=>=5.0 (not reached in 1 of 3 runs) "
                    "ratio<0.20 target=<=0.5")


def test_never_zero_or_inf():
    for ours in ((0.5, 0), (0.5, 3)):
        for peer in ((3.0, 0), (3.0, 3), (0.0, 0)):
            line = reward_line(ours, peer, 3)
            ratio = line.split("ratio")[1][1:].split(" ")[0]
            assert ratio not in ("0.00", "inf"), line
    assert "ratio=1.00" in reward_line((0.0, 0), (0.0, 0), 1)
    assert "n/a" in reward_line((0.5, 0), (0.0, 0), 1)
