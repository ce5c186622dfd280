"""A train run whose request spans two nodes, through the worker path: the real API in-process,
the real train adapter as the Ray job's driver, ranks as Ray actors on a local multi-node
cluster (CPU, ``tests/ray_fixtures.py``). Killing the node of rank 1 after the step-2
checkpoint is recorded fails the attempt naming rank 1 (a retryable failure: the run is
queued again), and the next claim resumes from the recorded checkpoint on the nodes left:
attempts [lost, succeeded], contiguous steps, the single-host 2-rank run's losses.
(tests/workers/cluster/test_ray_job.py covers the launcher alone.)"""

from __future__ import annotations

import time
import tomllib
from collections.abc import Callable
from typing import Any

import pytest

from apps.metrics.models import MetricPoint
from apps.runs.models import Checkpoint, Run, RunEvent, RunStatus
from tests.ray_fixtures import ray_cluster_fixture  # noqa: F401 - ray_cluster
from tests.workers.cluster.test_ray_job import TOLERANCE, ZERO2, lose_node
from tests.workers.rl.test_rl_distributed import finish, launch, losses
from workers.adapters import run_claimed
from workers.client import CrucibleClient, WorkerSession

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# Without the frozen KL / DPO reference: a resume through the platform rebuilds the warm start
# from the checkpoint's weights (workers.rl.resume.restore_phases), so a resumed run's
# reference is the step-N policy, not the post-SFT one, and its losses drift from the
# uninterrupted run's from the first resumed step on (seen here: 3.8e-5 at step 3 with
# kl_coef = 0.02). That is the single-host path's behaviour too, and not this test's subject.
CONFIG = ZERO2.replace("kl_coef = 0.02", "kl_coef = 0.0").replace("dpo_coef = 0.1",
                                                                   "dpo_coef = 0.0")
assert "kl_coef = 0.0" in CONFIG and "dpo_coef = 0.0" in CONFIG


def platform_config() -> dict[str, Any]:
    """The torchrun test's run as a launch document: the worker picks the checkpoint folder,
    and reports go to the API."""
    config = tomllib.loads(CONFIG.format(dir="unused"))
    del config["output"], config["checkpoint"]["dir"]
    return config


@pytest.fixture(autouse=True)
def worker_env(tmp_path, monkeypatch, object_store):
    """The worker's scratch folder (every node of the local cluster sees it: one host), and
    the web's object store as the worker's."""
    monkeypatch.setenv("CRUCIBLE_VAR_DIR", str(tmp_path / "var"))
    monkeypatch.setenv("OBJECT_STORE_URL", object_store.url)


class Watched(WorkerSession):
    """A claimed session that keeps the placement it reports and, when step 2's checkpoint is
    recorded, calls ``at_step2`` before answering: rank 0 waits for that answer (the driver
    acknowledges a checkpoint once it is recorded), so the run is provably at step 2 when the
    node goes. The heartbeat is not started: the in-process API's database belongs to the
    test's thread (the attempt is shorter than the lease)."""

    placement: list[dict[str, Any]]
    at_step2: Callable[[Watched], None] | None

    def start_heartbeat(self, interval: float | None = None) -> None:
        pass

    def log_event(self, message: str, **kwargs: Any) -> Any:
        data = kwargs.get("data") or {}
        if "placement" in data:
            self.placement = data["placement"]
        return super().log_event(message, **kwargs)

    def add_checkpoint(self, step: int, *args: Any, **kwargs: Any) -> Any:
        out = super().add_checkpoint(step, *args, **kwargs)
        if step == 2 and self.at_step2 is not None:
            self.at_step2(self)
        return out


def claim(pool: CrucibleClient, run_id: str, worker: str) -> Watched:
    claimed = pool.claim("cpu", worker, run_id=run_id)
    assert claimed is not None
    session = Watched(client=claimed.client, run=claimed.run, worker_id=claimed.worker_id)
    session.placement, session.at_step2 = [], None
    return session


def test_a_two_node_train_run_loses_a_node_and_resumes_on_the_rest(
        ray_cluster, pool, api, project, tmp_path):
    ref_dir = tmp_path / "torchrun"
    finish(launch(ref_dir, config=CONFIG), ref_dir)
    reference = losses(ref_dir)

    run_id = api.launch_run("acme", project="main", kind="train", pool="cpu",
                            config=platform_config(), max_attempts=3,
                            resources={"nodes": 2, "gpus_per_node": 0, "cpus": 1})["id"]
    first = claim(pool, run_id, "w1")
    assert (first.run.resources["nodes"], first.run.nodes) == (2, [])
    killed: dict[str, Any] = {}

    def kill_rank1_node(session: Watched) -> None:
        killed["node_id"] = session.placement[1]["node_id"]
        lose_node(ray_cluster, session.placement[1])

    first.at_step2 = kill_rank1_node
    t0 = time.monotonic()
    outcome = run_claimed(first)
    assert killed.get("node_id"), "the node was never killed"
    assert outcome == "failed", outcome
    run = Run.objects.get(pk=run_id)
    assert run.status == RunStatus.QUEUED, (run.status, run.error)
    failure = [m for m in RunEvent.objects.filter(run_id=run_id, kind="status")
               .values_list("message", flat=True) if "rank 1 (node" in m]
    assert failure and "died" in failure[0], list(
        RunEvent.objects.filter(run_id=run_id, kind="status").values_list("message", flat=True))
    assert time.monotonic() - t0 < 400

    second = claim(pool, run_id, "w2")
    recorded = [c.step for c in second.run.checkpoints]
    assert second.run.attempt == 2 and recorded == [2], recorded
    assert run_claimed(second) == "succeeded"
    assert killed["node_id"] not in {p["node_id"] for p in second.placement}
    assert RunEvent.objects.filter(
        run_id=run_id,
        message__startswith=f"attempt 2: resuming from the checkpoint at step {recorded[-1]}"
    ).exists()
    assert RunEvent.objects.filter(run_id=run_id, message__startswith="rank 1: ").exists(), \
        "rank output is streamed as run events"
    points = dict(MetricPoint.objects.filter(run_id=run_id, name="loss")
                  .values_list("step", "value"))
    assert sorted(points) == [1, 2, 3, 4, 5, 6]  # contiguous, each stored once
    for step in range(1, 7):
        assert abs(points[step] - reference[step]) <= TOLERANCE, (step, points[step])
    assert Checkpoint.objects.filter(run_id=run_id, step=6).exists()
    assert Run.objects.get(pk=run_id).status == RunStatus.SUCCEEDED
