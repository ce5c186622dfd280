"""DB rows -> the engine's ``ClusterState``. :func:`build_state` is pure (plain rows in, a
frozen snapshot out, tested without a database); :func:`snapshot` does the queries.

How runs map to workloads:

- ``queued`` without an active allocation: ``pending``;
- ``queued`` with one: ``admitted`` (a pass placed it; not yet claimed), holding its GPUs;
- ``claimed``/``running`` with one: ``running``, or ``stopping`` once the scheduler asked it to
  checkpoint and stop (its GPUs were already promised to the run admitted in its place);
- ``claimed``/``running`` without one (started before the scheduler was turned on): left
  out; their pool's workers were sized for them by hand.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from django.db.models import Max, Prefetch
from django.utils import timezone

from apps.runs.models import ACTIVE_STATUSES, Run, RunEnvironment, RunStatus
from apps.runs.validation.resources import default_resources
from apps.scheduling import queues as queue_reads
from apps.scheduling.models import Allocation, Node, Queue
from workers.envs.spec import sandbox_languages
from workers.scheduling.spec import QueueSpec, Resources
from workers.scheduling.state import ClusterState, NodeState, Workload, WorkloadStatus
from workers.scheduling.state import Node as EngineNode


@dataclass(frozen=True)
class NodeRow:
    name: str
    flavor: str
    gpu_count: int
    cpus: float
    memory_gb: float
    pool: str
    state: str
    broken: frozenset[str] = frozenset()  # sandbox languages whose probe fails here


@dataclass(frozen=True)
class RunRow:
    id: str
    queue: str
    priority_class: str
    resources: Mapping[str, object]
    status: str
    submitted_at: datetime
    allocation: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    started_at: datetime | None = None
    last_checkpoint_at: datetime | None = None
    preemptions: int = 0
    stopping: bool = False
    languages: frozenset[str] = frozenset()  # sandbox languages its environments execute


def _ts(value: datetime | None) -> float | None:
    return None if value is None else value.timestamp()


def workload_status(row: RunRow) -> WorkloadStatus | None:
    """The row's status for the engine, or None when the engine should not see it."""
    if row.status == RunStatus.QUEUED:
        return WorkloadStatus.ADMITTED if row.allocation else WorkloadStatus.PENDING
    if row.status in ACTIVE_STATUSES and row.allocation:
        return WorkloadStatus.STOPPING if row.stopping else WorkloadStatus.RUNNING
    return None


def build_state(*, nodes: Iterable[NodeRow], queues: Iterable[QueueSpec],
                runs: Iterable[RunRow], now: datetime) -> ClusterState:
    """A run is kept off the nodes whose sandbox probe fails a language it needs."""
    nodes = list(nodes)
    engine_nodes = tuple(
        EngineNode(name=n.name, flavor=n.flavor, gpu_ids=tuple(range(n.gpu_count)),
                   cpus=float(max(n.cpus, 0.0)), memory_gb=max(n.memory_gb, 0.0),
                   pool=n.pool, state=NodeState(n.state))
        for n in nodes)
    workloads = []
    for row in runs:
        status = workload_status(row)
        if status is None:
            continue
        avoid = frozenset(n.name for n in nodes if n.broken & row.languages)
        workloads.append(Workload(
            id=row.id, queue=row.queue, priority=row.priority_class,
            resources=Resources.model_validate(dict(row.resources)),
            submitted_at=row.submitted_at.timestamp(), status=status,
            allocation=(dict(row.allocation) if status != WorkloadStatus.PENDING else {}),
            started_at=_ts(row.started_at), last_checkpoint_at=_ts(row.last_checkpoint_at),
            preemptions=row.preemptions, avoid=avoid))
    return ClusterState(nodes=engine_nodes, queues=tuple(queues), workloads=tuple(workloads),
                        now=now.timestamp())


def _node_rows(nodes: Iterable[Node]) -> list[NodeRow]:
    return [NodeRow(name=n.name, flavor=queue_reads.node_flavor(n), gpu_count=n.gpu_count,
                    cpus=float(n.cpus), memory_gb=n.memory_mb / 1024, pool=n.pool,
                    state=n.state, broken=n.broken_languages()) for n in nodes]


def snapshot(now: datetime | None = None) -> tuple[ClusterState, dict[str, Run]]:
    """The state of the cluster for one pass, and the runs it names by id."""
    now = now or timezone.now()
    nodes = list(Node.objects.order_by("name"))
    runs = list(
        Run.objects.filter(status__in=[RunStatus.QUEUED, *ACTIVE_STATUSES])
        .select_related("team")
        .annotate(last_checkpoint=Max("checkpoints__created_at"))
        .prefetch_related(Prefetch(
            "allocations", to_attr="active_allocations",
            queryset=Allocation.objects.filter(released_at__isnull=True)
            .select_related("node")),
            Prefetch("environment_pins", to_attr="pinned_environments",
                     queryset=RunEnvironment.objects.select_related("environment_version")))
        .select_related("environment_version")
        .order_by("created_at", "id"))
    cluster = queue_reads.capacity(nodes)
    specs: dict[str, QueueSpec] = {}
    for row in Queue.objects.select_related("team"):
        specs[row.team.slug] = queue_reads.spec_of(row, row.team.slug)
    rows = []
    for run in runs:
        slug = run.team.slug
        if slug not in specs:
            specs[slug] = queue_reads.default_spec(slug, cluster)
        allocation: dict[str, tuple[int, ...]] = {}
        for a in run.active_allocations:  # type: ignore[attr-defined]
            allocation[a.node.name] = tuple(sorted(a.gpu_ids))
        rows.append(RunRow(
            id=str(run.pk), queue=slug,
            priority_class=run.priority_class or specs[slug].default_priority,
            resources=run.resources or _legacy_resources(run.pool), status=run.status,
            submitted_at=run.queued_at or run.created_at, allocation=allocation,
            # This attempt's start: a run requeued after a preemption or a lost worker
            # counts its minimum runtime and the work it would lose afresh once claimed.
            started_at=run.claimed_at if run.status in ACTIVE_STATUSES else None,
            last_checkpoint_at=run.last_checkpoint,  # type: ignore[attr-defined]
            preemptions=run.preemptions, stopping=run.preempt_deadline_at is not None,
            languages=_languages(run) if run.status == RunStatus.QUEUED else frozenset()))
    state = build_state(nodes=_node_rows(nodes), queues=sorted(specs.values(),
                                                                key=lambda q: q.name),
                        runs=rows, now=now)
    return state, {str(r.pk): r for r in runs}


def _languages(run: Run) -> frozenset[str]:
    """The sandbox languages the run's pinned environments execute."""
    versions = [p.environment_version for p in run.pinned_environments]  # type: ignore[attr-defined]
    if not versions and run.environment_version is not None:
        versions = [run.environment_version]
    found: frozenset[str] = frozenset()
    for version in versions:
        found |= sandbox_languages(version.spec)
    return found


def _legacy_resources(pool: str) -> dict[str, object]:
    """A run launched before runs stored their request: today's pool semantics."""
    return default_resources(pool).model_dump(mode="json")
