"""Reads of teams' queues as the scheduler sees them (``QueueSpec``), and the flavor of a
node. A team with no ``Queue`` row gets :func:`default_spec`: the whole cluster's capacity as
its nominal quota and no cohort, so a single host with the scheduler on just works."""

from __future__ import annotations

from collections.abc import Iterable

from apps.scheduling.models import Node, Queue
from workers.scheduling.spec import CPU_FLAVOR, QueueSpec

GENERIC_GPU = "gpu"
"""The flavor of a GPU node whose agent reported no GPU model."""


def node_flavor(node: Node) -> str:
    """A GPU node's flavor is its GPU type; a node without GPUs is ``cpu``."""
    if node.gpu_count <= 0:
        return CPU_FLAVOR
    return node.gpu_type.strip() or GENERIC_GPU


def node_amount(node: Node) -> float:
    """What a node adds to its flavor's capacity: GPUs, or CPU cores for a ``cpu`` node."""
    return float(node.gpu_count) if node.gpu_count > 0 else float(node.cpus)


def capacity(nodes: Iterable[Node]) -> dict[str, float]:
    """The cluster's capacity per flavor (every registered node, whatever its state: a
    default queue's quota should not shrink while a node is cordoned)."""
    out: dict[str, float] = {}
    for node in nodes:
        flavor = node_flavor(node)
        out[flavor] = out.get(flavor, 0.0) + node_amount(node)
    return out


def default_spec(name: str, cluster: dict[str, float]) -> QueueSpec:
    return QueueSpec(name=name, nominal=dict(cluster))


def spec_of(row: Queue, name: str) -> QueueSpec:
    """A stored queue as the engine's spec (rows are validated when saved)."""
    return QueueSpec(name=name, cohort=row.cohort or None, nominal=dict(row.nominal or {}),
                     borrowing_limit=row.borrowing_limit, lending_limit=row.lending_limit,
                     default_priority=row.default_priority)


def queue_row(team_id: int) -> Queue | None:
    return Queue.objects.filter(team_id=team_id).first()


def team_spec(team_id: int, name: str) -> QueueSpec:
    """The team's queue, or the default one over the cluster as it is now."""
    row = queue_row(team_id)
    if row is not None:
        return spec_of(row, name)
    return default_spec(name, capacity(Node.objects.all()))


def default_priority(team_id: int) -> str:
    row = queue_row(team_id)
    return row.default_priority if row is not None else "default"
