"""No starvation: a run within its queue's nominal quota starts within a bounded number of
passes, however hard another queue of the cohort floods the cluster with borrowing work.

A tiny closed loop: each pass's actions are applied (admitted runs start at once, preempted
ones go back to pending), the clock moves to the next completion, and the flooding queue adds
new runs every pass.
"""

from __future__ import annotations

import random
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from workers.scheduling import ClusterState, Policy, Workload, WorkloadStatus, decide
from workers.scheduling.actions import Admit, Preempt

from .build import gpu_node, job, queue

BOUND = 17
"""Every pass ends at a completion; once the cohort stops lending the target's quota, it waits at
most for the runs that held the cluster's 16 GPUs when it arrived (at most 16 one-GPU runs) to
end, plus the pass that admits it."""


def passes_until_admitted(seed: int, size: int, policy: Policy, limit: int = 60) -> int | None:
    """How many passes after its submission the within-quota run waits (None: never)."""
    rng = random.Random(seed)
    nodes = (gpu_node("n1"), gpu_node("n2"))
    queues = (queue("a", 8, cohort="c"), queue("b", 8, cohort="c"))
    now, serial = 0.0, 0
    work: dict[str, Workload] = {}
    runtime: dict[str, float] = {}
    for step in range(limit + 5):
        for _ in range(3):
            serial += 1
            length = rng.uniform(600, 7200)
            w = job(f"b{serial:04d}", "b", gpus=rng.randint(1, 4), at=now, runtime=length)
            work[w.id], runtime[w.id] = w, length
        if step == 5:
            work["target"] = job("target", "a", gpus=size, at=now, runtime=3600)
            runtime["target"] = 3600
        actions = decide(ClusterState(nodes=nodes, queues=queues,
                                      workloads=tuple(work.values()), now=now), policy)
        for a in actions:
            if isinstance(a, Preempt):
                v = work[a.workload_id]
                work[v.id] = replace(v, status=WorkloadStatus.PENDING, allocation={},
                                     started_at=None, preemptions=v.preemptions + 1)
            elif isinstance(a, Admit):
                if a.workload_id == "target":
                    return step - 5
                work[a.workload_id] = replace(work[a.workload_id], status=WorkloadStatus.RUNNING,
                                              allocation=dict(a.allocation), started_at=now)
        ends = sorted((w.started_at + runtime[w.id], w.id) for w in work.values()
                      if w.started_at is not None)
        if ends:
            now = max(now, ends[0][0])
            for end, wid in ends:
                if end <= now:
                    del work[wid]
    return None


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 8), st.booleans())
def test_a_within_quota_run_is_admitted_within_a_bounded_number_of_passes(
        seed: int, size: int, preemption: bool) -> None:
    """With preemption it reclaims its lent quota; without, its reservation and the cohort's
    pause on new borrowing get it in as the borrowers finish."""
    waited = passes_until_admitted(seed, size, Policy(preemption=preemption))
    assert waited is not None and waited <= BOUND


def test_without_reservations_or_preemption_the_same_run_starves() -> None:
    """The bound above is the engine's doing: with neither, the flood overtakes the run."""
    starved = [passes_until_admitted(seed, 8, Policy(max_reservations=0, preemption=False))
               for seed in range(5)]
    assert any(w is None or w > BOUND for w in starved)
