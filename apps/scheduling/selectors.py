"""Reads of the inventory, for the API and the cluster page."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db.models import Count, QuerySet, Sum
from django.utils import timezone

from apps.core.exceptions import NotFound
from apps.scheduling import queues
from apps.scheduling.models import Allocation, Node, NodeState, NodeTransition, Queue


def nodes() -> QuerySet[Node]:
    return Node.objects.all().order_by("name")


def node(name: str) -> Node:
    found = Node.objects.filter(name=name).first()
    if found is None:
        raise NotFound(f"No node '{name}'.")
    return found


def history(node: Node, limit: int = 20) -> list[NodeTransition]:
    """The node's latest transitions, newest first."""
    return list(node.transitions.order_by("-id")[:limit])


@dataclass(frozen=True)
class ClusterTotals:
    """GPUs in the inventory and those on nodes that take new work."""

    nodes: int
    gpus: int
    ready_nodes: int
    ready_gpus: int


def totals() -> ClusterTotals:
    everything = Node.objects.aggregate(n=Count("id"), g=Sum("gpu_count"))
    ready = Node.objects.filter(state=NodeState.READY).aggregate(n=Count("id"), g=Sum("gpu_count"))
    return ClusterTotals(nodes=everything["n"] or 0, gpus=everything["g"] or 0,
                         ready_nodes=ready["n"] or 0, ready_gpus=ready["g"] or 0)


def heartbeat_age_s(node: Node, now: datetime | None = None) -> int:
    return max(0, int(((now or timezone.now()) - node.last_heartbeat_at).total_seconds()))


def duration(seconds: float) -> str:
    """``45 s``, ``12 min``, ``5 h``, ``3 d``: how long, to a glance's precision."""
    seconds = max(0, int(seconds))
    for unit, size in (("d", 86_400), ("h", 3_600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds // size} {unit}"
    return f"{seconds} s"


def gpu_holders() -> dict[int, dict[int, str]]:
    """Node id -> GPU id -> the id of the run whose active allocation holds it."""
    out: dict[int, dict[int, str]] = {}
    for node_id, run_id, gpu_ids in Allocation.objects.filter(
            released_at__isnull=True).values_list("node_id", "run_id", "gpu_ids"):
        for gpu in gpu_ids:
            out.setdefault(node_id, {})[gpu] = str(run_id)
    return out


def node_runs() -> dict[int, list[str]]:
    """Node id -> ids of the runs holding an active allocation there (CPU work too)."""
    out: dict[int, list[str]] = {}
    for node_id, run_id in Allocation.objects.filter(released_at__isnull=True).values_list(
            "node_id", "run_id").order_by("node_id", "run_id"):
        out.setdefault(node_id, []).append(str(run_id))
    return out


@dataclass(frozen=True)
class QueueUse:
    """One team's queue on the cluster page: its quota and what its runs hold now."""

    team: str
    cohort: str
    configured: bool
    nominal: dict[str, float]
    in_use: dict[str, float]


def queue_use() -> list[QueueUse]:
    """Every team with a queue row or an active allocation, by slug. Use per flavor: GPUs
    held, or for ``cpu`` the cores the runs asked for on each node."""
    used: dict[str, dict[str, float]] = {}
    for slug, flavor, gpu_ids, resources in Allocation.objects.filter(
            released_at__isnull=True).values_list("run__team__slug", "flavor", "gpu_ids",
                                                  "run__resources"):
        amount = float(len(gpu_ids)) if gpu_ids else float((resources or {}).get("cpus", 1))
        per = used.setdefault(slug, {})
        per[flavor] = per.get(flavor, 0.0) + amount
    rows = {q.team.slug: q for q in Queue.objects.select_related("team")}
    cluster = queues.capacity(Node.objects.all())
    out = []
    for slug in sorted(set(rows) | set(used)):
        row = rows.get(slug)
        out.append(QueueUse(team=slug, cohort=row.cohort if row else "",
                            configured=row is not None,
                            nominal=dict(row.nominal) if row else cluster,
                            in_use=used.get(slug, {})))
    return out
