"""The scheduler's decision engine: plain Python, no Django.

`decide(state, policy) -> actions` holds all admission policy (quotas, priorities, gangs,
backfill, preemption by checkpoint); `baseline.decide` is the policy it replaces, kept for the
benchmark. The control plane loads a `ClusterState`, calls one of them and applies the actions.
"""

from workers.scheduling.actions import Action, Admit, Preempt, Wait
from workers.scheduling.decide import Policy, decide
from workers.scheduling.spec import DEFAULT_PRIORITY_CLASSES, PriorityClass, QueueSpec, Resources
from workers.scheduling.state import ClusterState, Node, NodeState, Workload, WorkloadStatus

__all__ = [
    "DEFAULT_PRIORITY_CLASSES", "Action", "Admit", "ClusterState", "Node", "NodeState",
    "Policy", "Preempt", "PriorityClass", "QueueSpec", "Resources", "Wait", "Workload",
    "WorkloadStatus", "decide",
]
