"""`time_to_reward` as a benchmark line that stays finite when a side never gets there.

Each run reports the training wall time at which its held-out reward first reached the
threshold, or infinity if it never did within its steps. A ratio against infinity (0) or of
infinity (inf) says nothing, so a run that never reached the threshold counts its whole
training time instead: the time it would have needed is at least that, so its figure is a
lower bound. Over repeats the median of those figures is taken (a lower bound of the median
whenever some run never reached the threshold). The ratio is then crucible / peer of the two
medians, marked by what is known about the true ratio:

    ratio=r   both sides reached the threshold in every run: r is the ratio
    ratio<r   only the peer fell short: its true time is longer, so the true ratio is below r
    ratio>r   only Crucible fell short: its true time is longer, the true ratio above r
    ratio~r   neither side reached it: r is the ratio of the training times, no bound either way

A side that fell short prints "not reached in N s" (every run) or ">=N (not reached in k of n
runs)" in place of its figure. Pure functions, no torch: unit-tested in test_reward_time.py.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def median_time(reached: Sequence[float], train_time: Sequence[float]) -> tuple[float, int]:
    """The median time to the threshold over runs and how many runs never reached it.
    `reached[i]` is run i's time to the threshold (inf: never), `train_time[i]` its whole
    training time, which stands in for inf."""
    if not reached or len(reached) != len(train_time):
        raise ValueError("time_to_reward needs one training time per run and at least one run")
    if any(not math.isfinite(t) or t < 0 for t in train_time):
        raise ValueError(f"training times must be finite and >= 0, got {list(train_time)}")
    times = [r if math.isfinite(r) else w for r, w in zip(reached, train_time, strict=True)]
    return statistics.median(times), sum(not math.isfinite(r) for r in reached)


def _figure(value: float, missed: int, runs: int) -> str:
    if not missed:
        return f"{value:.1f}"
    if missed == runs:
        return f"not reached in {value:.1f} s"
    return f">={value:.1f} (not reached in {missed} of {runs} runs)"


def reward_line(ours: tuple[float, int], peer: tuple[float, int], runs: int,
                peer_name: str = "trl", target: str = "<=0.5") -> str:
    """The `time_to_reward` line from each side's `median_time` over `runs` runs."""
    (c, c_missed), (t, t_missed) = ours, peer
    if c_missed and t_missed:
        op = "~"
    elif t_missed:
        op = "<"
    elif c_missed:
        op = ">"
    else:
        op = "="
    # Both figures are times of at least one optimizer step; guard a zero anyway, so the
    # line never says 0 or inf: a zero time on both sides is a ratio of 1.
    ratio = c / t if t > 0 else (1.0 if c == 0 else math.nan)
    shown = f"{ratio:.2f}" if math.isfinite(ratio) else "n/a (peer time 0)"
    return (f"time_to_reward: crucible={_figure(c, c_missed, runs)} "
            f"{peer_name}={_figure(t, t_missed, runs)} ratio{op}{shown} target={target}")
