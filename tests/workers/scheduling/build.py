"""Small builders for hand-made cluster snapshots (no Django, no fixtures needed)."""

from __future__ import annotations

from collections.abc import Mapping

from workers.scheduling import (
    ClusterState,
    Node,
    NodeState,
    QueueSpec,
    Resources,
    Workload,
    WorkloadStatus,
)
from workers.scheduling.actions import Action, Admit, Preempt, Wait


def gpu_node(name: str, flavor: str = "H100", gpus: int = 8,
             state: NodeState = NodeState.READY) -> Node:
    return Node(name=name, flavor=flavor, gpu_ids=tuple(range(gpus)), cpus=64, memory_gb=512,
                state=state)


def job(wid: str, queue: str = "a", *, gpus: int = 1, nodes: int = 1, prio: str = "default",
        at: float = 0.0, runtime: float | None = None, types: tuple[str, ...] = ()) -> Workload:
    res = Resources(gpus_per_node=gpus, nodes=nodes, gpu_types=types, cpus=1, memory_gb=1,
                    max_runtime_s=runtime)
    return Workload(id=wid, queue=queue, priority=prio, resources=res, submitted_at=at)


def running(w: Workload, allocation: Mapping[str, tuple[int, ...]], *, started: float = 0.0,
            checkpoint: float | None = None, preemptions: int = 0) -> Workload:
    return Workload(id=w.id, queue=w.queue, priority=w.priority, resources=w.resources,
                    submitted_at=w.submitted_at, status=WorkloadStatus.RUNNING,
                    allocation=dict(allocation), started_at=started,
                    last_checkpoint_at=checkpoint, preemptions=preemptions)


def queue(name: str, nominal: float, *, cohort: str | None = None, flavor: str = "H100",
          borrow: float | None = None, lend: float | None = None) -> QueueSpec:
    return QueueSpec(name=name, cohort=cohort, nominal={flavor: nominal},
                     borrowing_limit=None if borrow is None else {flavor: borrow},
                     lending_limit=None if lend is None else {flavor: lend})


def state(nodes: list[Node], queues: list[QueueSpec], workloads: list[Workload],
          now: float = 10_000.0) -> ClusterState:
    return ClusterState(nodes=tuple(nodes), queues=tuple(queues), workloads=tuple(workloads),
                        now=now)


def admits(actions: list[Action]) -> dict[str, Mapping[str, tuple[int, ...]]]:
    return {a.workload_id: a.allocation for a in actions if isinstance(a, Admit)}


def preempts(actions: list[Action]) -> dict[str, str]:
    return {a.workload_id: a.for_workload for a in actions if isinstance(a, Preempt)}


def waits(actions: list[Action]) -> dict[str, Wait]:
    return {a.workload_id: a for a in actions if isinstance(a, Wait)}
