"""Today's policy, kept as the benchmark's peer: same interface as `decide.decide`.

Each pool (a GPU type; a run goes to the first type it lists) serves its runs strictly in order
of priority class, then arrival: the head starts as soon as it fits, first fit over the ready
nodes in name order, and everything behind it waits while it does not (head-of-line blocking).
No quotas, no reservations, no preemption.
"""

from __future__ import annotations

from workers.scheduling.actions import (
    GANG_INCOMPLETE,
    NO_FITTING_NODES,
    Action,
    Admit,
    Wait,
    behind,
)
from workers.scheduling.decide import Policy
from workers.scheduling.ledger import Allocation, Capacity
from workers.scheduling.spec import CPU_FLAVOR
from workers.scheduling.state import ClusterState, Workload, WorkloadStatus


def _pool(w: Workload, flavors: list[str]) -> str:
    res = w.resources
    if res.gpus_per_node == 0:
        return CPU_FLAVOR
    return res.gpu_types[0] if res.gpu_types else (flavors[0] if flavors else "")


def _first_fit(cap: Capacity, w: Workload, pool: str) -> tuple[Allocation | None, int]:
    res = w.resources
    names = [n.name for n in cap.ready.get(pool, ()) if cap.node_fits(n.name, res, [])]
    if len(names) < res.nodes:
        return None, len(names)
    return {n: tuple(cap.free_gpus[n][: res.gpus_per_node]) for n in names[: res.nodes]}, res.nodes


def decide(state: ClusterState, policy: Policy = Policy()) -> list[Action]:  # noqa: B008
    """One pass of per-pool FIFO; `policy` is accepted for the same interface and ignored."""
    del policy
    cap = Capacity.of(state, state.holders())
    value = {c.name: c.value for c in state.priority_classes}
    flavors = sorted(f for f in cap.ready if f != CPU_FLAVOR)
    pools: dict[str, list[Workload]] = {}
    for w in state.workloads:
        if w.status == WorkloadStatus.PENDING:
            pools.setdefault(_pool(w, flavors), []).append(w)
    admits: list[Action] = []
    waits: list[Action] = []
    for pool in sorted(pools):
        queue = sorted(pools[pool], key=lambda w: (-value.get(w.priority, 0), w.submitted_at,
                                                   w.id))
        blocked = 0
        for position, w in enumerate(queue, start=1):
            if blocked:
                waits.append(Wait(w.id, behind(blocked), position))
                continue
            alloc, fitted = _first_fit(cap, w, pool)
            if alloc is None:
                blocked = 1
                gang = 0 < fitted < w.resources.nodes
                waits.append(Wait(w.id, GANG_INCOMPLETE if gang else NO_FITTING_NODES, position))
                continue
            cap.take(w.resources, alloc)
            admits.append(Admit(workload_id=w.id, allocation=alloc, flavor=pool))
    return admits + waits
