"""Faults of the control plane under real processes (issue 21, item 8): a uvicorn web on the
test database, Celery workers, a node agent and, for the broker test, a private redis-server.

- The web is stopped for longer than the client's old retry budget (~15 s) in the middle of a
  train run: the worker queues its reports, trains on, and delivers them when the web is back;
  the run succeeds with one attempt, every step once, no gap in the stream.
- A worker is killed with SIGKILL mid-run: its node agent reports the dead lease at once and
  another worker claims the run within seconds (not when the 120 s lease expires); the time
  from kill to claim is printed (``kill_to_claim_s``), not asserted.
- Redis is restarted under a busy worker that the node agent supervises: the run it was
  training finishes, and a run launched afterwards is done too (kombu's restore_unacked bug
  makes a busy Celery 5.7 worker exit after such an outage; the agent starts it again).
- PostgreSQL is stopped for 20 s in the middle of a train run (a private cluster holding a
  copy of the test database, which the web uses; the system server is never stopped): the
  web answers 5xx meanwhile, the worker's outbox holds its reports, and once the database is
  back the web's connections recover and the run succeeds with one attempt.

Runs on both configurations (the broker test brings its own Redis in either); the PostgreSQL
stop runs in the PostgreSQL pass (RabbitMQ: tests/e2e/test_rabbitmq.py)."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import time
from collections import Counter
from collections.abc import Iterator

import pytest
from django.db import connection
from django.utils import timezone

from apps.metrics.models import MetricBatch, MetricPoint
from apps.runs.models import Run, RunAttempt, RunEvent
from tests.e2e.conftest import purge_queues, tenant, wait_for
from tests.e2e.faults import (  # noqa: F401 - the fixtures, found by name
    PostgresCluster,
    Processes,
    RedisServer,
    database_url,
    postgres_cluster_fixture,
    processes_fixture,
    redis_server_fixture,
    tail,
    worker_command,
)
from workers.client import CrucibleClient

# Worker processes import torch and DeepSpeed: minutes on a loaded machine.
pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True),
              pytest.mark.timeout(900)]

STEPS = 150
CONFIG = {
    "model": {"preset": {"num_layers": 1}},
    "rollout": {"group_size": 2, "max_new_tokens": 2},
    "trainer": {"steps": STEPS, "prompts_per_step": 2, "micro_batch_size": 4,
                "zero_stage": 0, "eval_samples": 1},
    "checkpoint": {"every": 25, "keep": 1},
}
OUTAGE_S = 25  # longer than the old retry budget (5 tries, ~15.5 s)
REDIS_OUTAGE_S = 15
POSTGRES_OUTAGE_S = 20
FINAL = ("succeeded", "failed", "canceled")


def _rewards(run_id: str) -> int:
    return MetricPoint.objects.filter(run_id=run_id, name="reward_mean").count()


def _finished(run_id: str) -> Run | None:
    run = Run.objects.get(pk=run_id)
    return run if run.status in FINAL else None


def _assert_clean_history(run_id: str, steps: int = STEPS) -> None:
    """Every step once per series, no point stored twice, no gap in the stream."""
    points = list(MetricPoint.objects.filter(run_id=run_id).values_list("name", "step"))
    assert [k for k, n in Counter(points).items() if n > 1] == []
    assert sorted(s for n, s in points if n == "reward_mean") == list(range(1, steps + 1))
    events = RunEvent.objects.filter(run_id=run_id).values_list("seq", flat=True)
    batches = MetricBatch.objects.filter(run_id=run_id).values_list("stream_seq", flat=True)
    seqs = sorted([*events, *batches])
    assert seqs == list(range(1, len(seqs) + 1))


def test_a_web_outage_longer_than_the_old_retries_costs_a_train_run_nothing(
        processes: Processes, tmp_path):
    pytest.importorskip("deepspeed")
    purge_queues()
    token, worker_token = tenant("outage")
    processes.start_web(CRUCIBLE_LEASE_SECONDS="120")
    log = tmp_path / "worker.log"
    worker = processes.start_worker(worker_token, log, queues="gpu")
    with CrucibleClient(processes.url, token) as client:
        rid = client.launch_run("outage", project="demo", kind="train", name="outage",
                                config=CONFIG)["id"]

    def training() -> bool:
        assert worker.poll() is None, tail(log)
        return _rewards(rid) >= 3

    wait_for(training, timeout=600, what="the first steps")
    processes.stop_web()
    before = _rewards(rid)
    assert Run.objects.get(pk=rid).status == "running" and before < STEPS
    time.sleep(OUTAGE_S)
    assert worker.poll() is None, tail(log)
    assert _rewards(rid) == before  # nothing reached the stopped web
    processes.start_web()

    done = wait_for(lambda: _finished(rid), timeout=600, what="the run to finish")
    assert done.status == "succeeded", (done.error, tail(log))
    outcomes = list(RunAttempt.objects.filter(run_id=rid).values_list("outcome", flat=True))
    assert done.attempt == 1 and outcomes == ["succeeded"], outcomes
    _assert_clean_history(rid)
    text = log.read_text(errors="replace")
    assert "queueing reports and training on" in text, tail(log)
    delivered = [int(n) for n in re.findall(r"(\d+) queued reports delivered", text)]
    print(f"web outage: {OUTAGE_S} s; reports queued meanwhile and delivered after: "
          f"{delivered}")


def test_a_killed_worker_is_reported_by_its_agent_and_its_run_claimed_within_seconds(
        processes: Processes, tmp_path):
    pytest.importorskip("deepspeed")
    purge_queues()
    token, worker_token = tenant("killed")
    processes.start_web(CRUCIBLE_LEASE_SECONDS="120")
    agent_log = tmp_path / "agent.log"
    processes.start_agent(worker_token, agent_log, CRUCIBLE_NODE_WATCH_S="0.5")
    logs = {name: tmp_path / f"worker-{name}.log" for name in ("a", "b")}
    workers = {name: processes.start_worker(worker_token, path, queues="gpu")
               for name, path in logs.items()}
    with CrucibleClient(processes.url, token) as client:
        rid = client.launch_run("killed", project="demo", kind="train", name="killed",
                                config=CONFIG)["id"]
    wait_for(lambda: _rewards(rid) >= 2, timeout=600, what="the first steps")
    holder = Run.objects.get(pk=rid).lease_holder
    pid = int(holder.rsplit(":", 1)[1])
    [victim] = [name for name, proc in workers.items() if proc.pid == pid]
    workers[victim].send_signal(signal.SIGKILL)
    killed_at = timezone.now()
    workers[victim].wait(timeout=30)

    second = wait_for(lambda: RunAttempt.objects.filter(run_id=rid, number=2).first(),
                      timeout=120, what="another worker to claim the run")
    kill_to_claim = (second.claimed_at - killed_at).total_seconds()
    print(f"kill_to_claim_s: crucible={kill_to_claim:.1f} target=<=15 (lease 120 s)")
    done = wait_for(lambda: _finished(rid), timeout=600, what="the run to finish")
    survivor = next(p for n, p in workers.items() if n != victim)
    assert done.status == "succeeded", (done.error, tail(logs["a"]), tail(logs["b"]))
    first = RunAttempt.objects.get(run_id=rid, number=1)
    assert (first.outcome, second.worker.endswith(f":{survivor.pid}")) == ("lost", True)
    assert "died" in first.error and "expired" not in first.error, first.error
    assert "reporting it" in agent_log.read_text(errors="replace")
    _assert_clean_history(rid)


def test_a_redis_restart_under_a_busy_supervised_worker_then_a_new_run_is_done(
        processes: Processes, redis_server: RedisServer, tmp_path):
    pytest.importorskip("deepspeed")
    token, worker_token = tenant("broker")
    broker = {"REDIS_URL": redis_server.url, "CELERY_BROKER_URL": redis_server.url}
    processes.start_web(CRUCIBLE_LEASE_SECONDS="120", **broker)
    agent_log = tmp_path / "agent.log"
    # The node agent runs the host's worker and starts it again whenever it exits.
    processes.start_agent(worker_token, agent_log, CRUCIBLE_AGENT_WORKER=shlex.join(
        worker_command("gpu,cpu", like_up=True)), **broker)
    with CrucibleClient(processes.url, token) as client:
        rid = client.launch_run("broker", project="demo", kind="train", name="busy",
                                config=CONFIG)["id"]
        wait_for(lambda: _rewards(rid) >= 3, timeout=600, what="the busy worker's first steps")
        # The run is held by the prefork pool's process; its parent is the Celery worker
        # the agent started.
        pool_pid = int(Run.objects.get(pk=rid).lease_holder.rsplit(":", 1)[1])
        worker_pid = _parent(pool_pid)
        redis_server.stop()
        time.sleep(REDIS_OUTAGE_S)  # past several of the consumer's reconnect tries
        redis_server.start()  # same port, empty: the broker lost its state too
        done = wait_for(lambda: _finished(rid), timeout=600, what="the busy run to finish")
        assert done.status == "succeeded", (done.error, tail(agent_log))
        assert done.attempt == 1
        _assert_clean_history(rid)

        # The kombu bug makes the worker exit about here (seen on a shared Redis; not every
        # outage triggers it). Whether or not it did, make it exit now: the agent must bring
        # it back for the next run.
        exited_by_itself = not _alive(worker_pid)
        if not exited_by_itself:
            os.kill(worker_pid, signal.SIGKILL)
        client.create_dataset("broker", "after", "demo")
        client.upload_version("broker", "after", [{"q": i} for i in range(20)])
        later = client.launch_run("broker", project="demo", kind="profile",
                                  datasets=["after"])["id"]
        after = wait_for(lambda: _finished(later), timeout=300,
                         what=f"the run launched after the outage:\n{tail(agent_log)}")
        assert after.status == "succeeded", after.error
    text = agent_log.read_text(errors="replace")
    assert f"worker (pid {worker_pid}) exited" in text, tail(agent_log)
    print(f"redis restart ({REDIS_OUTAGE_S} s) under a busy worker: the worker exited by "
          f"itself: {exited_by_itself}; restarted by the agent, the next run was done")


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as handle:
        return int(handle.read().rsplit(b")", 1)[1].split()[1])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat", "rb") as handle:
        return handle.read().rsplit(b")", 1)[1].split()[0] != b"Z"


@contextlib.contextmanager
def _reading(cluster: PostgresCluster) -> Iterator[None]:
    """This test's ORM reads the private cluster (where the web writes) instead of the test
    database, until the block ends (before pytest-django flushes the test database)."""
    saved = dict(connection.settings_dict)
    connection.close()
    connection.settings_dict.update(HOST="127.0.0.1", PORT=str(cluster.port),
                                    NAME=cluster.database, USER="postgres", PASSWORD="")
    try:
        yield
    finally:
        connection.close()
        connection.settings_dict.clear()
        connection.settings_dict.update(saved)


def test_a_postgresql_stop_mid_training_costs_the_run_nothing(
        processes: Processes, postgres_cluster: PostgresCluster, tmp_path):
    pytest.importorskip("deepspeed")
    purge_queues()
    token, worker_token = tenant("pgstop")
    postgres_cluster.load(database_url())  # the tenant and its tokens come along
    processes.start_web(CRUCIBLE_LEASE_SECONDS="120", DATABASE_URL=postgres_cluster.url)
    log = tmp_path / "worker.log"
    worker = processes.start_worker(worker_token, log, queues="gpu")
    with CrucibleClient(processes.url, token) as client:
        rid = client.launch_run("pgstop", project="demo", kind="train", name="pgstop",
                                config=CONFIG)["id"]

    with _reading(postgres_cluster):
        def training() -> bool:
            assert worker.poll() is None, tail(log)
            return _rewards(rid) >= 3

        wait_for(training, timeout=600, what="the first steps")
        connection.close()  # the test's own session must not hold the cluster up
        postgres_cluster.stop()
        time.sleep(POSTGRES_OUTAGE_S)
        assert worker.poll() is None, tail(log)
        assert processes.web is not None and processes.web.poll() is None
        postgres_cluster.start()

        done = wait_for(lambda: _finished(rid), timeout=600, what="the run to finish")
        assert done.status == "succeeded", (done.error, tail(log))
        outcomes = list(RunAttempt.objects.filter(run_id=rid).values_list("outcome",
                                                                          flat=True))
        assert done.attempt == 1 and outcomes == ["succeeded"], outcomes
        _assert_clean_history(rid)
    text = log.read_text(errors="replace")
    assert "queueing reports and training on" in text, tail(log)
    delivered = [int(n) for n in re.findall(r"(\d+) queued reports delivered", text)]
    web_log = tail(tmp_path / f"web-{processes.port}.log", 100_000)
    print(f"postgresql stop: {POSTGRES_OUTAGE_S} s; reports queued meanwhile and delivered "
          f"after: {delivered}; web 5xx logged: {web_log.count('Internal Server Error')}")
