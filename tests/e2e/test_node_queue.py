"""With the scheduler on, an admitted run's Celery message goes to the queue of the node its
allocation names (``node.<name>``): a real worker that consumes only that queue (no pool
queue at all) gets it, claims it as that node and runs it to the end."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from apps.runs.models import RunAttempt
from apps.scheduling.models import Allocation, Node
from tests.e2e.conftest import tenant
from workers.client import CrucibleClient
from workers.protocol import node_queue

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

DEMO = "deploy/demo/arithmetic.jsonl"


def test_a_worker_on_the_allocated_node_gets_the_message_from_its_node_queue(
        live_server, start_worker, settings, tmp_path: Path) -> None:
    settings.CRUCIBLE = {**settings.CRUCIBLE, "SCHEDULER": True}
    token, worker_token = tenant()
    # A name of its own per test run: the broker keeps queues between runs.
    name = f"host-{uuid.uuid4().hex[:8]}.rack_1"
    Node.objects.create(name=name, pool="cpu", cpus=4, memory_mb=8192)
    log = tmp_path / "worker.log"
    start_worker(worker_token, queues=node_queue(name), log=log,
                 extra_env={"CRUCIBLE_NODE_NAME": name})
    records = [json.loads(line) for line in Path(DEMO).read_text().splitlines()][:20]
    with CrucibleClient(live_server.url, token) as client:
        client.create_dataset("e2e", "arith", "demo")
        client.upload_version("e2e", "arith", records)
        run = client.launch_run("e2e", project="demo", kind="profile", datasets=["arith"])
        try:
            done = client.wait_for_run("e2e", run["id"], timeout=120)
        except TimeoutError:
            raise AssertionError(log.read_text()[-4000:]) from None
        assert done["status"] == "succeeded", done["error"]
    allocation = Allocation.objects.get(run_id=run["id"])
    assert allocation.node.name == name and allocation.dispatched_at is not None
    assert RunAttempt.objects.get(run_id=run["id"]).outcome == "succeeded"
    assert "workers.tasks.execute_run" in log.read_text()
