"""RabbitMQ as the Celery broker (``CELERY_BROKER_URL=amqp://…``), on private RabbitMQ nodes
(their own node name, ports and database: the system node on 5672 is never touched):

- a train run end to end on a node whose consumer (acknowledgement) timeout is 3 s instead of
  30 min, so the run outlasts it as a run of hours outlasts the default: RabbitMQ closes the
  worker's channel and requeues the message, and the run still succeeds with one attempt,
  every step once, no gap in the stream; the web's ``/readyz`` checks the broker and
  ``/metrics`` reports the broker's queues;
- a run sent to a node queue (``node.<name>``, declared on the fly) reaches the worker that
  consumes only that queue;
- the node is restarted under a busy worker: the run it was training finishes, and a run
  launched after the restart is done too, by the same worker process.

Runs on both configurations (each test brings its own RabbitMQ node)."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import httpx
import pytest

from apps.runs.models import Run, RunAttempt
from apps.scheduling.models import Allocation, Node
from tests.e2e.conftest import tenant, wait_for
from tests.e2e.faults import (  # noqa: F401 - the fixtures, found by name
    Processes,
    RabbitServer,
    processes_fixture,
    rabbit_server_fixture,
    require_rabbitmq,
    tail,
    worker_command,
)
from tests.e2e.test_control_plane_faults import (
    CONFIG,
    _assert_clean_history,
    _finished,
    _rewards,
)
from workers.client import CrucibleClient
from workers.protocol import node_queue

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True),
              pytest.mark.timeout(900)]

RESTART_OUTAGE_S = 15
# Long enough to outlast a 3 s consumer timeout several times, short enough for a quick test.
SHORT_STEPS = 40
SHORT = json.loads(json.dumps(CONFIG))
SHORT["trainer"]["steps"] = SHORT_STEPS
DEMO = "deploy/demo/arithmetic.jsonl"


def _broker(server: RabbitServer) -> dict[str, str]:
    return {"CELERY_BROKER_URL": server.url}


def _worker(processes: Processes, token: str, log: Path, queues: str,
            server: RabbitServer, **extra: str):
    """A prefork worker, as ``manage.py up`` and the deploy images run it: its main process
    keeps answering the broker's heartbeats while the pool process trains (a ``-P solo``
    worker cannot while a task runs, and RabbitMQ drops its connection after two missed
    heartbeats)."""
    return processes.spawn(worker_command(queues, like_up=True),
                           processes.worker_env(token, **_broker(server), **extra), log)


def test_a_train_run_outlasting_the_consumer_timeout_succeeds_on_rabbitmq(
        processes: Processes, tmp_path: Path):
    pytest.importorskip("deepspeed")
    require_rabbitmq()
    folder = tmp_path / "rabbitmq"
    folder.mkdir()
    server = RabbitServer(folder, consumer_timeout_ms=3000)
    server.start()
    try:
        token, worker_token = tenant("rabbit")
        processes.start_web(CRUCIBLE_LEASE_SECONDS="120", **_broker(server))
        ready = httpx.get(f"{processes.url}/readyz", timeout=30).json()
        assert ready["checks"]["broker"]["ok"], ready
        log = tmp_path / "worker.log"
        worker = _worker(processes, worker_token, log, "gpu", server)
        with CrucibleClient(processes.url, token) as client:
            rid = client.launch_run("rabbit", project="demo", kind="train", name="amqp",
                                    config=SHORT)["id"]

        def finished() -> Run | None:
            assert worker.poll() is None, tail(log)
            return _finished(rid)

        done = wait_for(finished, timeout=600, what="the run to finish")
        assert done.status == "succeeded", (done.error, tail(log))
        outcomes = list(RunAttempt.objects.filter(run_id=rid).values_list("outcome",
                                                                          flat=True))
        assert done.attempt == 1 and outcomes == ["succeeded"], outcomes
        _assert_clean_history(rid, SHORT_STEPS)
        # The server did close the channel under the running task, and the worker took it
        # as a lost connection (not "Unrecoverable error": broker_channel_error_retry).
        timeouts = server.log().count("has timed out waiting for delivery acknowledgement")
        assert timeouts >= 1, server.log()[-4000:]
        text = log.read_text(errors="replace")
        assert "Connection to broker lost" in text and "Unrecoverable" not in text, tail(log)

        # Each channel close put the task's message back in the queue; the worker takes the
        # redelivered copy as a no-op (the run is done). That copy may still be waiting at
        # the moment the run finishes (CI saw 1 message there once): nothing may stay queued.
        def drained() -> bool:
            metrics = httpx.get(f"{processes.url}/metrics", timeout=30,
                                headers={"Authorization": f"Bearer {worker_token}"}).text
            return 'crucible_broker_queue_messages{queue="gpu"} 0.0' in metrics

        wait_for(drained, timeout=120, what="the gpu queue to be empty (redelivered copies "
                                           "consumed as no-ops)")
        assert _finished(rid).status == "succeeded" and RunAttempt.objects.filter(
            run_id=rid).count() == 1  # the redelivery changed nothing
    finally:
        server.stop()
    print(f"rabbitmq consumer timeout 3 s: channel closed under the run {timeouts} time(s); "
          "the run succeeded with one attempt")


def test_a_run_sent_to_a_node_queue_reaches_its_worker_on_rabbitmq(
        processes: Processes, rabbit_server: RabbitServer, tmp_path: Path):
    token, worker_token = tenant("rabbitnode")
    name = f"host-{uuid.uuid4().hex[:8]}"
    Node.objects.create(name=name, pool="cpu", cpus=4, memory_mb=8192)
    processes.start_web(CRUCIBLE_SCHEDULER="true", **_broker(rabbit_server))
    log = tmp_path / "worker.log"
    _worker(processes, worker_token, log, node_queue(name), rabbit_server,
            CRUCIBLE_NODE_NAME=name)
    records = [json.loads(line) for line in Path(DEMO).read_text().splitlines()][:20]
    with CrucibleClient(processes.url, token) as client:
        client.create_dataset("rabbitnode", "arith", "demo")
        client.upload_version("rabbitnode", "arith", records)
        rid = client.launch_run("rabbitnode", project="demo", kind="profile",
                                datasets=["arith"])["id"]
        done = wait_for(lambda: _finished(rid), timeout=300, what=f"the run:\n{tail(log)}")
    assert done.status == "succeeded", done.error
    allocation = Allocation.objects.get(run_id=rid)
    assert allocation.node.name == name and allocation.dispatched_at is not None
    # The only worker consumes the node queue alone: the message came through it.
    assert "workers.tasks.execute_run" in log.read_text(errors="replace")


def test_a_rabbitmq_restart_under_a_busy_worker_then_a_new_run_is_done(
        processes: Processes, rabbit_server: RabbitServer, tmp_path: Path):
    pytest.importorskip("deepspeed")
    token, worker_token = tenant("rabbitrestart")
    processes.start_web(CRUCIBLE_LEASE_SECONDS="120", **_broker(rabbit_server))
    log = tmp_path / "worker.log"
    worker = _worker(processes, worker_token, log, "gpu,cpu", rabbit_server)
    with CrucibleClient(processes.url, token) as client:
        rid = client.launch_run("rabbitrestart", project="demo", kind="train", name="busy",
                                config=CONFIG)["id"]
        wait_for(lambda: _rewards(rid) >= 3, timeout=600, what="the busy worker's first steps")
        rabbit_server.stop()
        time.sleep(RESTART_OUTAGE_S)
        rabbit_server.start()  # the same node, ports and database
        done = wait_for(lambda: _finished(rid), timeout=600, what="the busy run to finish")
        assert done.status == "succeeded", (done.error, tail(log))
        assert done.attempt == 1
        _assert_clean_history(rid)

        client.create_dataset("rabbitrestart", "after", "demo")
        client.upload_version("rabbitrestart", "after", [{"q": i} for i in range(20)])
        later = client.launch_run("rabbitrestart", project="demo", kind="profile",
                                  datasets=["after"])["id"]
        after = wait_for(lambda: _finished(later), timeout=300,
                         what=f"the run launched after the restart:\n{tail(log)}")
        assert after.status == "succeeded", after.error
    # Unlike the Redis transport's (tests/e2e/test_control_plane_faults.py), the AMQP
    # consumer reconnects: the same worker process did both runs.
    assert worker.poll() is None, tail(log)
    text = log.read_text(errors="replace")
    assert "Unrecoverable error" not in text, tail(log)
    print(f"rabbitmq restart ({RESTART_OUTAGE_S} s down) under a busy worker: the worker "
          "reconnected by itself; both runs done")
