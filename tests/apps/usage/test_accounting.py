"""Usage accounting (apps.usage.accounting) against hand-computed timelines: no database."""

from __future__ import annotations

import pytest

from apps.runs.goodput import Attempt, CheckpointMark, compute
from apps.usage.accounting import (
    Hold,
    Usage,
    attempt_holds,
    cost,
    day_bounds,
    needs_reached,
    parse_rates,
    pieces,
    redone_steps,
    tally,
    tally_by_day,
)

# 10 s a step on one node of 8 H100s and 16 cores. Admitted at 0; attempt 1 claimed at 10,
# began at 30 (20 s startup), checkpointed step 50 at 530, preempted at step 70 (730); the
# allocation was released at 735. Re-admitted at 800: attempt 2 claimed at 800, resumed
# from step 50 and began at 840 (40 s reload), trained steps 51-100 and succeeded at 1340.
PREEMPTED = [
    Attempt(1, "preempted", claimed_at=10, ended_at=730, started_at=30, resume_step=0),
    Attempt(2, "succeeded", claimed_at=800, ended_at=1340, started_at=840, resume_step=50),
]
MARK_50 = [CheckpointMark(50, 530)]
HOLDS = [Hold(0, 735, 8, 16, "H100"), Hold(800, 1340, 8, 16, "H100")]


def test_a_preemption_at_step_70_after_a_checkpoint_at_50_loses_20_steps():
    u = tally(pieces(PREEMPTED, MARK_50, HOLDS, now=2000, finished_at=1340))
    # per GPU: useful 500 (steps 1-50) + 500 (steps 51-100); startup 20; restart 40; lost to
    # the preemption 200 (steps 51-70, 20 steps x 10 s, trained again); held with no
    # attempt running 10 (admitted, not claimed) + 5 (stopped, not released). Allocated
    # 735 + 540 = 1275 = the sum of the parts.
    assert u.gpu_s == {"useful": 8000, "startup": 160, "restart": 320,
                       "lost_preemption": 1600, "lost_failure": 0, "held": 120}
    assert u.allocated_gpu_s == 8 * 1275
    assert u.cpu_s["lost_preemption"] == 16 * 200 and u.allocated_cpu_s == 16 * 1275
    assert u.gpu_s_by_type == {"H100": 8 * 1275}
    assert u.goodput == 8000 / 10200
    # The same timeline's goodput (wall time, not GPU-time) comes from the same function.
    g = compute(PREEMPTED, MARK_50, now=2000, finished_at=1340)
    assert (g.useful, g.preemption, g.startup) == (1000, 200, 60)


def test_a_failure_with_no_checkpoint_loses_everything_and_no_allocation_means_the_request():
    # Scheduler off: no allocation rows; each attempt held the request (2 GPUs x 1 node,
    # 4 cores) from claim to end. Attempt 1 failed at 100 having begun at 10 with no
    # checkpoint: 90 s of work lost; attempt 2 ran 200-300 (began at 205).
    attempts = [Attempt(1, "lost", claimed_at=0, ended_at=100, started_at=10, resume_step=0),
                Attempt(2, "succeeded", claimed_at=200, ended_at=300, started_at=205,
                        resume_step=0)]
    holds = attempt_holds(attempts, gpus=2, cpus=4, flavor="gpu")
    u = tally(pieces(attempts, [], holds, now=400, finished_at=300))
    assert u.gpu_s == {"useful": 2 * 95, "startup": 2 * 10, "restart": 2 * 5,
                       "lost_preemption": 0, "lost_failure": 2 * 90, "held": 0}
    assert u.allocated_gpu_s == 2 * 200  # the queued gap 100-200 held nothing


def test_an_active_attempt_counts_up_to_now_and_an_unreleased_hold_too():
    attempts = [Attempt(1, "active", claimed_at=5, started_at=15)]
    u = tally(pieces(attempts, [], [Hold(0, None, 4, 8, "A100")], now=65))
    assert u.gpu_s["held"] == 4 * 5 and u.gpu_s["startup"] == 4 * 10
    assert u.gpu_s["useful"] == 4 * 50 and u.allocated_gpu_s == 4 * 65


def test_windows_and_days_clip_pieces_at_their_bounds():
    day = 86_400
    # 2 GPUs useful from 23:00 on day 0 to 02:00 on day 1
    attempts = [Attempt(1, "succeeded", claimed_at=day - 3600, ended_at=day + 7200,
                        started_at=day - 3600)]
    parts = pieces(attempts, [], [Hold(day - 3600, day + 7200, 2, 1, "H100")], now=3 * day)
    by_day = tally_by_day(parts, 0, 2 * day)
    assert sorted(by_day) == [0, day]
    assert by_day[0].gpu_s["useful"] == 2 * 3600 and by_day[day].gpu_s["useful"] == 2 * 7200
    assert tally(parts, day, day + 3600).gpu_s["useful"] == 2 * 3600
    assert tally(parts, 2 * day, 3 * day).allocated_gpu_s == 0
    # a window that starts mid-day: the first bucket starts there
    assert day_bounds(day / 2, 2 * day) == [(day / 2, day), (day, 2 * day)]
    assert sorted(tally_by_day(parts, day / 2, 2 * day)) == [day / 2, day]


def test_cost_prices_types_falls_back_to_gpu_and_reports_unpriced_types():
    u = Usage()
    u.gpu_s_by_type = {"H100": 7200.0, "L40S": 3600.0, "B200": 1800.0}
    u.cpu_only_s = 36_000.0
    c = cost(u, {"H100": 2.5, "L40S": 1.0, "cpu": 0.05})
    assert c.gpu == pytest.approx(2 * 2.5 + 1.0) and c.cpu == pytest.approx(0.5)
    assert c.unpriced_gpu_s == {"B200": 1800.0} and c.total == pytest.approx(6.5)
    fallback = cost(u, {"H100": 2.5, "gpu": 4.0})
    assert fallback.gpu == pytest.approx(5 + 4 + 2) and fallback.unpriced_gpu_s == {}
    assert fallback.cpu == 0


def test_cpu_only_holds_are_what_the_cpu_rate_prices():
    attempts = [Attempt(1, "succeeded", claimed_at=0, ended_at=3600, started_at=0)]
    u = tally(pieces(attempts, [], [Hold(0, 3600, 0, 8, "cpu")], now=4000))
    assert u.allocated_gpu_s == 0 and u.cpu_only_s == 8 * 3600 and u.goodput == 1
    assert cost(u, {"cpu": 0.05}).total == pytest.approx(0.4)
    # a GPU node's cores come with its GPU rate
    g = tally(pieces(attempts, [], [Hold(0, 3600, 1, 8, "H100")], now=4000))
    assert cost(g, {"H100": 2.0, "cpu": 0.05}).total == pytest.approx(2.0)


def test_idle_shares_are_fractions_of_useful():
    u = tally(pieces(PREEMPTED, MARK_50, HOLDS, now=2000, finished_at=1340))
    u.with_idle(0.25, None)
    assert u.idle_gpu_s == {"idle_learner": 2000, "idle_generators": 0}
    assert u.idle_cpu_s["idle_learner"] == 16 * 1000 * 0.25
    assert u.with_idle(1.7, -1).idle_gpu_s == {"idle_learner": 8000, "idle_generators": 0}


def test_totals_add_up():
    a = tally(pieces(PREEMPTED, MARK_50, HOLDS, now=2000, finished_at=1340))
    b = tally(pieces(PREEMPTED, MARK_50, HOLDS, now=2000, finished_at=1340))
    a.add(b)
    assert a.gpu_s["useful"] == 16000 and a.gpu_s_by_type == {"H100": 2 * 10200}


def test_no_attempt_holds_everything_as_held_and_nothing_held_has_no_goodput():
    u = tally(pieces([], [], [Hold(0, 100, 1, 1, "H100")], now=200))
    assert u.gpu_s["held"] == 100 and u.goodput == 0
    assert Usage().goodput is None


@pytest.mark.parametrize("raw, message", [
    ([1], "JSON object"),
    ({"H100": "2"}, "non-negative number"),
    ({"H100": -1}, "non-negative number"),
    ({"H100": True}, "non-negative number"),
    ({"H100": float("nan")}, "non-negative number"),
    ({" ": 1}, "cannot be empty"),
])
def test_rates_are_validated(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_rates(raw)


def test_rates_parse():
    assert parse_rates({"H100": 2.5, "cpu": 0}) == {"H100": 2.5, "cpu": 0.0}


def test_redone_steps_count_what_the_next_attempt_trained_again():
    # attempt 1 reached step 70, attempt 2 resumed from 50: steps 51-70 trained twice
    assert redone_steps(PREEMPTED, {1: 70, 2: 100}) == 20
    # a lost attempt whose successor resumed from the start redid everything it reached
    attempts = [Attempt(1, "lost", claimed_at=0, ended_at=10, started_at=1, resume_step=0),
                Attempt(2, "failed", claimed_at=20, ended_at=30, started_at=21, resume_step=0),
                Attempt(3, "active", claimed_at=40, started_at=41, resume_step=5)]
    assert redone_steps(attempts, {1: 7, 2: 9}) == 7 + 4
    assert [a.number for a in needs_reached(attempts)] == [1, 2]
    # unknown progress counts nothing; a succeeded last attempt has no successor
    assert redone_steps(attempts, {}) == 0
    assert needs_reached(PREEMPTED) == [PREEMPTED[0]]
