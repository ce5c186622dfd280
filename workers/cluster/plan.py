"""Whether a claimed train run goes to Ray, and the placement it asks for. Pure Python (no Ray,
no torch): the train adapter calls it for every run, and a single-host run must not pay for
importing Ray."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# A Ray node started for Crucible node <name> offers this custom resource (one unit), so a
# placement can honour the scheduler's allocation node by node: `ray start ...
# --resources='{"crucible-node-<name>": 1}'`. Nodes without it are placed by count only.
NODE_RESOURCE_PREFIX = "crucible-node-"
_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def node_resource(name: str) -> str:
    """The custom Ray resource that marks the Ray node of Crucible node ``name``."""
    if not _NAME.match(name):
        raise ValueError(f"node name {name!r}: letters, digits, '.', '_' and '-' only")
    return NODE_RESOURCE_PREFIX + name


@dataclass(frozen=True)
class ClusterPlan:
    """What one multi-node attempt asks Ray for: one placement bundle per node (STRICT_SPREAD:
    never two on one node), ``ranks_per_node`` ranks on each, ``gpus_per_node`` GPUs per bundle
    (one per rank; 0 trains on CPU over gloo). ``node_names``, when given, pins bundle i to the
    Ray node labelled with :func:`node_resource` of the i-th name (the allocation's order)."""

    nodes: int
    ranks_per_node: int = 1
    gpus_per_node: int = 0
    cpus_per_rank: float = 1.0
    node_names: tuple[str, ...] = ()
    placement_timeout_s: float = 300.0  # a gang the cluster cannot place fails, never waits on
    collective_timeout_s: float = 1800.0  # a collective missing a peer raises after this
    failure_grace_s: float = 30.0  # after a first failed rank, how long the others may take
    stop_grace_s: float = 600.0  # after a cancel, how long the ranks may take to stop
    report_timeout_s: float = 1800.0  # rank 0 waits this long for a checkpoint's upload
    env: dict[str, str] = field(default_factory=dict)  # extra variables for every rank

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.ranks_per_node < 1:
            raise ValueError("a cluster plan needs at least one node and one rank per node")
        if self.node_names and len(self.node_names) != self.nodes:
            raise ValueError(f"{len(self.node_names)} node names for {self.nodes} nodes")
        if self.gpus_per_node and self.gpus_per_node != self.ranks_per_node:
            raise ValueError("on GPUs each rank takes one GPU: ranks_per_node must equal "
                             f"gpus_per_node ({self.gpus_per_node})")
        for name in self.node_names:
            node_resource(name)

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    def bundles(self) -> list[dict[str, float]]:
        """One placement bundle per node, in rank order (bundle i holds ranks
        i * ranks_per_node ...)."""
        out = []
        for i in range(self.nodes):
            bundle: dict[str, float] = {"CPU": self.cpus_per_rank * self.ranks_per_node}
            if self.gpus_per_node:
                bundle["GPU"] = float(self.gpus_per_node)
            if self.node_names:
                bundle[node_resource(self.node_names[i])] = 0.001
            out.append(bundle)
        return out


def plan_for(resources: dict[str, Any] | None, nodes: list[str] | None = None,
             rollout_actors: int = 0) -> ClusterPlan | None:
    """The plan of a claimed run (its frozen ``resources``, its allocation's node names and its
    spec's ``cluster.rollout_actors``), or None when it runs on one host without rollout
    actors: today's in-process path, with no Ray. Rollout actors need Ray even for a run
    whose ranks fit on one node (the actors take bundles of their own)."""
    resources = resources or {}
    names = tuple(nodes or ())
    count = max(int(resources.get("nodes", 1) or 1), len(names))
    if count <= 1 and not rollout_actors:
        return None
    gpus = int(resources.get("gpus_per_node", 0) or 0)
    return ClusterPlan(nodes=count, ranks_per_node=max(gpus, 1), gpus_per_node=gpus,
                       node_names=names if len(names) == count else ())
