"""Validation of requests and queues: errors a person can act on."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from workers.scheduling import ClusterState, Node, QueueSpec, Resources


def test_resources_from_json_and_their_quota_amount() -> None:
    res = Resources.model_validate({"gpus_per_node": 8, "nodes": 4, "gpu_types": ["H100"]})
    assert res.gpu_types == ("H100",) and res.total_gpus == 32 and res.quota_amount() == 32
    assert Resources(cpus=4, nodes=2).quota_amount() == 8


@pytest.mark.parametrize(("fields", "message"), [
    ({"nodes": 0}, "greater than or equal to 1"),
    ({"gpus_per_node": 0, "gpu_types": ["H100"]}, "gpus_per_node is 0"),
    ({"gpus_per_node": 1, "gpu_types": ["H100", "H100"]}, "lists a type twice"),
    ({"gpus_per_node": 1, "gpu_types": ["cpu"]}, "not a GPU type"),
    ({"gpus": 1}, "Extra inputs"),
])
def test_resources_reject_nonsense(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Resources.model_validate(fields)


def test_queue_limits() -> None:
    q = QueueSpec(name="a", cohort="c", nominal={"H100": 8}, lending_limit={"H100": 2},
                  borrowing_limit={"H100": 4})
    assert q.lendable("H100") == 2 and q.borrow_cap("H100") == 4
    assert QueueSpec(name="b", cohort="c", nominal={"H100": 8}).borrow_cap("H100") == float("inf")
    assert QueueSpec(name="solo", nominal={"H100": 8}).borrow_cap("H100") == 0
    with pytest.raises(ValidationError, match="exceeds its nominal"):
        QueueSpec(name="a", cohort="c", nominal={"H100": 8}, lending_limit={"H100": 9})
    with pytest.raises(ValidationError, match="need a cohort"):
        QueueSpec(name="a", nominal={"H100": 8}, borrowing_limit={"H100": 1})
    with pytest.raises(ValidationError, match=">= 0"):
        QueueSpec(name="a", nominal={"H100": -1})


def test_state_checks_its_parts() -> None:
    with pytest.raises(ValueError, match="only 'cpu' nodes"):
        Node(name="n", flavor="H100")
    with pytest.raises(ValueError, match="default priority 'urgent'"):
        ClusterState(nodes=(), queues=(QueueSpec(name="a", default_priority="urgent"),),
                     workloads=(), now=0)


def test_gpus_in_use_come_from_the_holders_only() -> None:
    from workers.scheduling import Resources, Workload, WorkloadStatus

    node = Node(name="n", flavor="H100", gpu_ids=(0, 1, 2, 3), cpus=8, memory_gb=8)
    res = Resources(gpus_per_node=2)
    held = Workload(id="a", queue="q", priority="default", resources=res, submitted_at=0,
                    status=WorkloadStatus.RUNNING, allocation={"n": (1, 2)})
    stopping = Workload(id="b", queue="q", priority="default", resources=res, submitted_at=0,
                        status=WorkloadStatus.STOPPING, allocation={"n": (0, 3)})
    snap = ClusterState(nodes=(node,), queues=(QueueSpec(name="q"),), workloads=(held, stopping),
                        now=0)
    assert snap.gpus_in_use() == {"n": {1, 2}}
