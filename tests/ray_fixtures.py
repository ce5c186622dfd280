"""A local multi-node Ray cluster for the multi-node tests (``ray.cluster_utils.Cluster``): a
head with no CPUs (it runs only the driver's relay) and three one-core worker nodes, each
offering its Crucible node resource, CPU only, small object stores. Node death is noticed
within a few seconds. Shut down when the module's tests are done. A test module imports
``ray_cluster_fixture`` and asks for ``ray_cluster``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray  # the cluster extra (.[cluster]): `make test` installs it
from ray.cluster_utils import Cluster

from workers.cluster.plan import node_resource

REPO = Path(__file__).resolve().parents[1]
NODES = ("n0", "n1", "n2")
NAMES: dict[str, str] = {}  # Ray node id -> the Crucible node name it was started for
MB = 1024 * 1024


@pytest.fixture(scope="module", name="ray_cluster")
def ray_cluster_fixture() -> Iterator[Cluster]:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": 80 * MB, "include_dashboard": False,
        "_system_config": {"health_check_period_ms": 1000, "health_check_timeout_ms": 1000,
                           "health_check_failure_threshold": 3},
    })
    try:
        for name in NODES:
            node = c.add_node(num_cpus=1, object_store_memory=80 * MB,
                              resources={node_resource(name): 1})
            NAMES[node.node_id] = name
        # Ray's workers import this checkout's code, on one thread each, on CPU.
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        ray.init(address=c.address, log_to_driver=False, runtime_env={"env_vars": {
            "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "CRUCIBLE_DEVICE": "cpu"}})
        c.wait_for_nodes(timeout=120)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
