"""A snapshot of the cluster that `decide()` reads: frozen, so a decision cannot change it.

The control plane loads one of these per admission pass (nodes, queues, workloads, the clock)
and applies the actions that come back; the benchmark's simulator builds them the same way.

Which GPUs are in use is not stored twice: a node lists all its GPU ids, and the workloads that
*hold* resources (status `admitted` or `running`) carry their allocations. A `stopping` workload
(asked to checkpoint and stop) holds nothing any more: its GPUs were handed, in the decision that
preempted it, to the workload admitted in its place, which the control plane starts once they are
physically free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

from workers.scheduling.spec import (
    CPU_FLAVOR,
    DEFAULT_PRIORITY_CLASSES,
    PriorityClass,
    QueueSpec,
    Resources,
)


class NodeState(StrEnum):
    READY = "ready"          # takes new work
    CORDONED = "cordoned"    # keeps its runs, takes no new ones
    DRAINING = "draining"    # its runs are being stopped; takes no new ones
    LOST = "lost"            # missed its heartbeats


class WorkloadStatus(StrEnum):
    PENDING = "pending"      # waiting for admission (new, or back from a preemption)
    ADMITTED = "admitted"    # has an allocation, not yet started on its nodes
    RUNNING = "running"
    STOPPING = "stopping"    # asked to checkpoint and stop; its resources are already re-promised


HOLDING = frozenset({WorkloadStatus.ADMITTED, WorkloadStatus.RUNNING})
"""Statuses whose allocation counts against nodes and quotas."""

EMPTY_ALLOCATION: Mapping[str, tuple[int, ...]] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Node:
    """One host. `flavor` is its GPU type (`cpu` for a host without GPUs)."""

    name: str
    flavor: str
    gpu_ids: tuple[int, ...] = ()
    cpus: float = 1.0
    memory_gb: float = 1.0
    pool: str = "default"
    state: NodeState = NodeState.READY

    def __post_init__(self) -> None:
        if (self.flavor == CPU_FLAVOR) != (not self.gpu_ids):
            raise ValueError(f"node {self.name}: flavor '{self.flavor}' with "
                             f"{len(self.gpu_ids)} GPUs (only '{CPU_FLAVOR}' nodes have none)")


@dataclass(frozen=True, slots=True)
class Workload:
    """A run as the scheduler sees it. `allocation` maps node name to the GPU ids it holds there
    (an empty tuple for CPU work); it is empty while pending."""

    id: str
    queue: str
    priority: str
    resources: Resources
    submitted_at: float
    status: WorkloadStatus = WorkloadStatus.PENDING
    allocation: Mapping[str, tuple[int, ...]] = field(default_factory=lambda: EMPTY_ALLOCATION)
    estimated_runtime_s: float | None = None
    started_at: float | None = None
    last_checkpoint_at: float | None = None
    preemptions: int = 0
    avoid: frozenset[str] = frozenset()
    """Nodes it must not be placed on: the control plane fills it with the nodes whose
    sandbox health probe fails for a language the run's environments need."""

    def runtime_estimate(self) -> float | None:
        """`max_runtime_s` if the run declared one (a promise), else the history estimate."""
        return self.resources.max_runtime_s or self.estimated_runtime_s


@dataclass(frozen=True, slots=True)
class ClusterState:
    """Everything one admission pass needs. `now` is seconds on the control plane's clock."""

    nodes: tuple[Node, ...]
    queues: tuple[QueueSpec, ...]
    workloads: tuple[Workload, ...]
    now: float
    priority_classes: tuple[PriorityClass, ...] = DEFAULT_PRIORITY_CLASSES

    def __post_init__(self) -> None:
        names = [q.name for q in self.queues]
        if len(set(names)) != len(names):
            raise ValueError(f"queue names repeat: {sorted(names)}")
        classes = {c.name for c in self.priority_classes}
        for q in self.queues:
            if q.default_priority not in classes:
                raise ValueError(f"queue '{q.name}': default priority '{q.default_priority}' "
                                 f"is not one of {sorted(classes)}")

    def cohorts(self) -> dict[str, tuple[str, ...]]:
        """Cohort name -> the names of its queues."""
        out: dict[str, list[str]] = {}
        for q in self.queues:
            if q.cohort is not None:
                out.setdefault(q.cohort, []).append(q.name)
        return {c: tuple(qs) for c, qs in out.items()}

    def holders(self) -> list[Workload]:
        return [w for w in self.workloads if w.status in HOLDING]

    def gpus_in_use(self) -> dict[str, set[int]]:
        """Node name -> GPU ids that holders' allocations cover (for pages and the API: which
        GPUs are free is each node's `gpu_ids` minus these)."""
        used: dict[str, set[int]] = {n.name: set() for n in self.nodes}
        for w in self.holders():
            for name, ids in w.allocation.items():
                used.setdefault(name, set()).update(ids)
        return used
