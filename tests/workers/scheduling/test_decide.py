"""Hand-built snapshots with hand-checked outcomes, one per rule of `decide()`."""

from __future__ import annotations

from workers.scheduling import NodeState, Policy, decide
from workers.scheduling.actions import GANG_INCOMPLETE, NO_FITTING_NODES, QUOTA, behind

from .build import admits, gpu_node, job, preempts, queue, running, state, waits


def test_many_admissions_in_one_pass_onto_specific_gpus() -> None:
    jobs = [job(f"j{i}", at=i) for i in range(10)]
    got = admits(decide(state([gpu_node("n1"), gpu_node("n2")], [queue("a", 16)], jobs)))
    assert len(got) == 10
    # best fit: the first job opens n1, the next seven fill it, then n2
    assert [got[f"j{i}"] for i in range(9)] == [{"n1": (i,)} for i in range(8)] + [{"n2": (0,)}]


def test_best_fit_prefers_the_partly_used_node() -> None:
    other = running(job("r", gpus=6), {"n2": (0, 1, 2, 3, 4, 5)})
    got = admits(decide(state([gpu_node("n1"), gpu_node("n2")], [queue("a", 16)],
                              [other, job("s", gpus=2)])))
    assert got == {"s": {"n2": (6, 7)}}


def test_gang_is_all_or_nothing() -> None:
    other = running(job("r", gpus=4), {"n2": (0, 1, 2, 3)})
    actions = decide(state([gpu_node("n1"), gpu_node("n2")], [queue("a", 32)],
                           [other, job("g", gpus=8, nodes=2)]))
    assert admits(actions) == {}
    assert waits(actions)["g"].reason == GANG_INCOMPLETE


def test_gang_gets_whole_nodes_of_one_flavor() -> None:
    nodes = [gpu_node("h1"), gpu_node("a1", "A100"), gpu_node("a2", "A100")]
    got = admits(decide(state(nodes, [queue("a", 16, flavor="A100")],
                              [job("g", gpus=8, nodes=2, types=("H100", "A100"))])))
    assert got == {"g": {"a1": tuple(range(8)), "a2": tuple(range(8))}}


def test_nodes_not_ready_get_no_new_work() -> None:
    nodes = [gpu_node("c", state=NodeState.CORDONED), gpu_node("d", state=NodeState.DRAINING),
             gpu_node("l", state=NodeState.LOST)]
    actions = decide(state(nodes, [queue("a", 24)], [job("j")]))
    assert admits(actions) == {}
    assert waits(actions)["j"].reason == NO_FITTING_NODES


def test_a_gpu_run_on_a_cluster_without_gpus_has_no_fitting_nodes() -> None:
    from workers.scheduling import Node

    cpu = Node(name="c1", flavor="cpu", cpus=16, memory_gb=64)
    assert waits(decide(state([cpu], [queue("a", 8)], [job("j")])))["j"].reason == \
        NO_FITTING_NODES


def test_quota_without_cohort() -> None:
    actions = decide(state([gpu_node("n1")], [queue("a", 4)], [job("big", gpus=8), job("s", at=1)]))
    assert set(admits(actions)) == {"s"}
    assert waits(actions)["big"].reason == QUOTA


def test_borrowing_within_the_limits() -> None:
    nodes = [gpu_node("n1"), gpu_node("n2")]
    want = [job("x", gpus=8), job("y", gpus=4, at=1)]
    free = [queue("a", 8, cohort="c"), queue("b", 8, cohort="c")]
    assert set(admits(decide(state(nodes, free, want)))) == {"x", "y"}
    capped = [queue("a", 8, cohort="c", borrow=2), queue("b", 8, cohort="c")]
    assert waits(decide(state(nodes, capped, want)))["y"].reason == QUOTA
    lends_little = [queue("a", 8, cohort="c"), queue("b", 8, cohort="c", lend=2)]
    assert waits(decide(state(nodes, lends_little, want)))["y"].reason == QUOTA


def test_a_lender_keeps_its_guaranteed_part() -> None:
    """b lends 4 of its 8; a has borrowed them; b's own 4 guaranteed GPUs stay usable."""
    nodes = [gpu_node("n1"), gpu_node("n2")]
    qs = [queue("a", 8, cohort="c"), queue("b", 8, cohort="c", lend=4)]
    borrowed = running(job("r", gpus=4, prio="production"), {"n2": (0, 1, 2, 3)})
    full_a = running(job("f", gpus=8, prio="production"), {"n1": tuple(range(8))})
    got = decide(state(nodes, qs, [full_a, borrowed, job("b1", "b", gpus=4)]))
    assert admits(got) == {"b1": {"n2": (4, 5, 6, 7)}}


def test_runs_that_cannot_be_preempted_stay_within_nominal() -> None:
    qs = [queue("a", 4, cohort="c"), queue("b", 8, cohort="c")]
    actions = decide(state([gpu_node("n1"), gpu_node("n2")], qs, [job("p", gpus=8,
                                                                       prio="production")]))
    assert waits(actions)["p"].reason == QUOTA
    # ... but may take the queue above nominal when what it then borrows is preemptible
    mine = running(job("d", gpus=4), {"n1": (0, 1, 2, 3)})
    actions = decide(state([gpu_node("n1"), gpu_node("n2")], qs,
                           [mine, job("p", gpus=4, prio="production")]))
    assert admits(actions) == {"p": {"n1": (4, 5, 6, 7)}}


def test_backfill_only_into_holes_that_end_before_the_reservation() -> None:
    """n1: 4 GPUs busy until t=100; n2: full until t=1000. The 8-GPU head reserves n1 from
    t=100: a 2-GPU run of 50 s fits the hole, one of 500 s would delay the head and waits."""
    nodes = [gpu_node("n1"), gpu_node("n2")]
    short = running(job("x", gpus=4, runtime=100), {"n1": (0, 1, 2, 3)}, started=0)
    long = running(job("y", gpus=8, runtime=1000), {"n2": tuple(range(8))}, started=0)
    pending = [job("head", gpus=8, at=1, prio="production"), job("s", gpus=2, at=2, runtime=50),
               job("l", gpus=2, at=3, runtime=500), job("u", gpus=2, at=4)]
    actions = decide(state(nodes, [queue("a", 64)], [short, long, *pending], now=0))
    assert set(admits(actions)) == {"s"}
    w = waits(actions)
    assert w["head"].reason == NO_FITTING_NODES and w["head"].estimated_start == 100
    assert w["l"].reason == behind(1) and w["u"].reason == behind(1)
    assert [w[k].position for k in ("head", "l", "u")] == [1, 2, 3]


def test_without_backfill_a_blocked_head_holds_its_flavor() -> None:
    nodes = [gpu_node("n1")]
    busy = running(job("x", gpus=4, runtime=100), {"n1": (0, 1, 2, 3)}, started=0)
    pending = [job("head", gpus=8, at=1), job("s", gpus=2, at=2, runtime=50)]
    actions = decide(state(nodes, [queue("a", 64)], [busy, *pending], now=0),
                     Policy(backfill=False))
    assert admits(actions) == {}


def test_higher_priority_preempts_the_run_losing_least_since_its_checkpoint() -> None:
    nodes = [gpu_node("n1")]
    old = running(job("old", gpus=4), {"n1": (0, 1, 2, 3)}, started=0, checkpoint=1000)
    fresh = running(job("fresh", gpus=4), {"n1": (4, 5, 6, 7)}, started=0, checkpoint=9900)
    actions = decide(state(nodes, [queue("a", 8)], [old, fresh, job("p", gpus=4,
                                                                    prio="production")]))
    assert preempts(actions) == {"fresh": "p"}
    assert admits(actions) == {"p": {"n1": (4, 5, 6, 7)}}


def test_reclaim_preempts_the_borrowers_run_that_loses_least() -> None:
    """a borrowed b's quota; b's within-nominal run takes it back from a."""
    nodes = [gpu_node("n1"), gpu_node("n2")]
    qs = [queue("a", 8, cohort="c"), queue("b", 8, cohort="c")]
    recent = running(job("recent", gpus=8), {"n1": tuple(range(8))}, started=0, checkpoint=9990)
    stale = running(job("stale", gpus=8, at=1), {"n2": tuple(range(8))}, started=0,
                    checkpoint=5000)
    actions = decide(state(nodes, qs, [recent, stale, job("b1", "b", gpus=8)]))
    assert preempts(actions) == {"recent": "b1"}
    assert admits(actions) == {"b1": {"n1": tuple(range(8))}}


def test_borrowed_victims_go_before_lower_priority_ones_within_quota() -> None:
    nodes = [gpu_node("n1"), gpu_node("n2"), gpu_node("n3")]
    qs = [queue("a", 8, cohort="c"), queue("b", 16, cohort="c")]
    a_own = running(job("a_own", "a", gpus=8, prio="production"), {"n1": tuple(range(8))})
    a_borrowed = running(job("a_def", "a", gpus=8), {"n2": tuple(range(8))}, checkpoint=9950)
    b_low = running(job("b_low", "b", gpus=8, prio="preemptible"), {"n3": tuple(range(8))},
                    checkpoint=9950)
    p = job("p", "b", gpus=8, prio="production")
    actions = decide(state(nodes, qs, [a_own, a_borrowed, b_low, p]))
    assert preempts(actions) == {"a_def": "p"}


def test_no_preemption_across_equal_priority_within_quota() -> None:
    nodes = [gpu_node("n1")]
    qs = [queue("a", 8, cohort="c"), queue("b", 0, cohort="c")]
    mine = running(job("mine", gpus=8), {"n1": tuple(range(8))}, started=0)
    actions = decide(state(nodes, qs, [mine, job("x", "a", gpus=8, prio="default")]))
    assert preempts(actions) == {} and admits(actions) == {}


def test_min_runtime_and_preemption_cap_prevent_thrash() -> None:
    nodes = [gpu_node("n1")]
    young = running(job("v", gpus=8), {"n1": tuple(range(8))}, started=9_800)
    actions = decide(state(nodes, [queue("a", 8)], [young, job("p", gpus=8, prio="production")]))
    assert preempts(actions) == {}
    capped = running(job("v", gpus=8), {"n1": tuple(range(8))}, started=0, checkpoint=9950,
                     preemptions=3)
    actions = decide(state(nodes, [queue("a", 8)], [capped, job("p", gpus=8,
                                                                prio="production")]))
    assert preempts(actions) == {}
    assert preempts(decide(state(nodes, [queue("a", 8)], [capped, job("p", gpus=8,
                                                                       prio="production")]),
                           Policy(max_preemptions=4))) == {"v": "p"}


def test_a_victim_that_would_lose_too_much_work_waits_for_its_checkpoint() -> None:
    nodes = [gpu_node("n1")]
    stale = running(job("v", gpus=8), {"n1": tuple(range(8))}, started=0, checkpoint=8000)
    p = job("p", gpus=8, prio="production")
    assert preempts(decide(state(nodes, [queue("a", 8)], [stale, p]))) == {}
    assert preempts(decide(state(nodes, [queue("a", 8)], [stale, p]),
                           Policy(max_victim_loss_s=None))) == {"v": "p"}
    fresh = running(job("v", gpus=8), {"n1": tuple(range(8))}, started=0, checkpoint=9800)
    assert preempts(decide(state(nodes, [queue("a", 8)], [fresh, p]))) == {"v": "p"}


def test_preemption_only_when_the_placement_then_succeeds() -> None:
    """A 2-node gang could clear n1 but n2 runs production work: nothing is preempted."""
    nodes = [gpu_node("n1"), gpu_node("n2")]
    victim = running(job("v", gpus=8), {"n1": tuple(range(8))}, started=0)
    keep = running(job("k", gpus=8, prio="production"), {"n2": tuple(range(8))}, started=0)
    gang = job("g", gpus=8, nodes=2, prio="production")
    actions = decide(state(nodes, [queue("a", 32)], [victim, keep, gang]))
    assert preempts(actions) == {} and admits(actions) == {}


def test_unneeded_victims_are_spared() -> None:
    """Freeing 4 GPUs takes the cheap 1-GPU victim first, then the 4-GPU one; the 1-GPU one
    turns out not to be needed and keeps running."""
    nodes = [gpu_node("n1")]
    vs = [running(job("big", gpus=4), {"n1": (0, 1, 2, 3)}, started=0, checkpoint=9500),
          running(job("small", gpus=1), {"n1": (4,)}, started=0, checkpoint=9999),
          running(job("prod", gpus=3, prio="production"), {"n1": (5, 6, 7)}, started=0)]
    actions = decide(state(nodes, [queue("a", 8)], [*vs, job("p", gpus=4, prio="production")]))
    assert preempts(actions) == {"big": "p"}
    assert admits(actions) == {"p": {"n1": (0, 1, 2, 3)}}


def test_fair_sharing_favours_the_queue_borrowing_less() -> None:
    nodes = [gpu_node("n1"), gpu_node("n2"), gpu_node("n3")]
    qs = [queue("a", 4, cohort="c"), queue("b", 4, cohort="c"), queue("c", 16, cohort="c")]
    a_big = running(job("ra", "a", gpus=8), {"n1": tuple(range(8))}, started=0)
    b_own = running(job("rb", "b", gpus=4), {"n2": (0, 1, 2, 3)}, started=0)
    pending = [job("pa", "a", gpus=4, at=1), job("pb", "b", gpus=4, at=2)]
    filler = running(job("rc", "c", gpus=8, prio="production"), {"n3": tuple(range(8))})
    got = admits(decide(state(nodes, qs, [a_big, b_own, filler, *pending])))
    assert set(got) == {"pb"}


def test_a_run_blocked_on_its_own_quota_is_overtaken_only_until_it_has_waited() -> None:
    nodes = [gpu_node("n1")]
    busy = running(job("r", gpus=4), {"n1": (0, 1, 2, 3)}, started=0)
    work = [busy, job("big", gpus=4, at=1), job("small", gpus=1, at=2)]
    fresh = decide(state(nodes, [queue("a", 6)], work, now=600))
    assert set(admits(fresh)) == {"small"} and waits(fresh)["big"].reason == QUOTA
    aged = decide(state(nodes, [queue("a", 6)], work, now=21_601))
    assert admits(aged) == {} and waits(aged)["big"].reason == QUOTA


def test_cpu_work_goes_to_cpu_nodes_on_cpu_quota() -> None:
    from workers.scheduling import Node, QueueSpec, Resources, Workload

    cpu = Node(name="c1", flavor="cpu", cpus=16, memory_gb=64)
    qs = [QueueSpec(name="a", nominal={"cpu": 12})]
    work = [Workload(id=f"s{i}", queue="a", priority="default", submitted_at=i,
                     resources=Resources(cpus=4, memory_gb=8)) for i in range(4)]
    actions = decide(state([cpu, gpu_node("g1")], qs, work))
    assert admits(actions) == {"s0": {"c1": ()}, "s1": {"c1": ()}, "s2": {"c1": ()}}
    assert waits(actions)["s3"].reason == QUOTA


def test_decide_is_deterministic_and_leaves_the_snapshot_alone() -> None:
    nodes = [gpu_node("n1"), gpu_node("n2")]
    snap = state(nodes, [queue("a", 16)], [job(f"j{i}", gpus=1 + i % 3, at=i % 4)
                                           for i in range(12)])
    assert decide(snap) == decide(snap)
    assert all(w.allocation == {} for w in snap.workloads)


def test_a_run_is_not_placed_on_the_nodes_it_avoids() -> None:
    """The control plane fills ``avoid`` with the nodes whose sandbox probe fails for a language
    the run needs: the run goes elsewhere (the best fit would have been n1), or waits."""
    from dataclasses import replace

    other = running(job("r", gpus=6), {"n1": (0, 1, 2, 3, 4, 5)})
    nodes = [gpu_node("n1"), gpu_node("n2")]
    picky = replace(job("s", gpus=2), avoid=frozenset({"n1"}))
    plain = job("p", gpus=2, at=1)
    got = admits(decide(state(nodes, [queue("a", 16)], [other, picky, plain])))
    assert got == {"s": {"n2": (0, 1)}, "p": {"n1": (6, 7)}}
    nowhere = replace(job("s", gpus=2), avoid=frozenset({"n1", "n2"}))
    actions = decide(state(nodes, [queue("a", 16)], [nowhere, job("p", gpus=2, at=1)]))
    assert waits(actions)["s"].reason == NO_FITTING_NODES
    assert set(admits(actions)) == {"p"}  # the same shape without avoid still fits


def test_a_run_that_avoids_the_only_node_does_not_stop_preemption_for_others() -> None:
    """Preemption for a run that avoids n1 cannot succeed; the same shape without `avoid`,
    later in the pass, still preempts (the pass's memo of failed shapes keys on avoid)."""
    from dataclasses import replace

    nodes = [gpu_node("n1")]
    victim = running(job("v", gpus=8), {"n1": tuple(range(8))}, started=0, checkpoint=9900)
    picky = replace(job("p1", gpus=8, prio="production"), avoid=frozenset({"n1"}))
    plain = job("p2", gpus=8, prio="production", at=1)
    actions = decide(state(nodes, [queue("a", 16)], [victim, picky, plain]))
    assert preempts(actions) == {"v": "p2"}
    assert admits(actions) == {"p2": {"n1": tuple(range(8))}}
    assert waits(actions)["p1"].reason == NO_FITTING_NODES
