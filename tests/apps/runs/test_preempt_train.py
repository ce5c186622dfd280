"""Preemption by checkpoint through the worker path: the real API in-process, the real train
adapter and engine. The scheduler's request reaches the worker as the heartbeat's ``stop:
preempt``; the engine checkpoints its last completed step, the checkpoint is recorded, and only
then does the run report ``preempted``; the next attempt resumes after that step. A cancel
stops the engine without a checkpoint. (tests/workers/rl/test_preempt_checkpoint.py covers
the engine alone, on one and two ranks.)"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from apps.core.actor import Actor
from apps.metrics.models import MetricPoint
from apps.runs import services
from apps.runs.models import Checkpoint, Run, RunEvent, RunStatus
from workers import drain
from workers.adapters import run_claimed
from workers.client import CrucibleClient, LeaseLost, WorkerSession

pytest.importorskip("deepspeed")

STEPS = 4
CONFIG = {
    "model": {"preset": {"num_layers": 1}},
    "sft": {"steps": 2, "batch_size": 4},
    "rollout": {"group_size": 2, "max_new_tokens": 2},
    "trainer": {"steps": STEPS, "prompts_per_step": 2, "micro_batch_size": 4,
                "zero_stage": 0, "eval_samples": 1},
    # Longer than the run: only the preemption writes a checkpoint before the final export.
    "checkpoint": {"every": 100, "keep": 2},
}


@pytest.fixture(autouse=True)
def worker_env(tmp_path, monkeypatch, object_store):
    """The worker's scratch folder, and the web's object store as the worker's."""
    monkeypatch.setenv("CRUCIBLE_VAR_DIR", str(tmp_path / "var"))
    monkeypatch.setenv("OBJECT_STORE_URL", object_store.url)


@pytest.fixture(autouse=True)
def no_drain():
    drain.reset()
    yield
    drain.reset()


class StoppedAfter(WorkerSession):
    """A claimed session whose run is preempted (or canceled) once RL step ``at``'s loss is
    stored. The request goes through the real service and the worker learns of it from a real
    heartbeat answer, called here rather than from the heartbeat thread so that the step it
    lands after is fixed."""

    at: int | None = None
    how: str = "preempt"

    def start_heartbeat(self, interval: float | None = None) -> None:
        pass  # the test beats, in log_metrics

    def log_metrics(self, points: list[dict[str, Any]], seq: int | None = None) -> Any:
        out = super().log_metrics(points, seq)
        if any(p["name"] == "loss" and p["step"] == self.at for p in points):
            run = Run.objects.get(pk=self.run_id)
            if self.how == "drain":  # the worker process got SIGTERM
                drain.request("SIGTERM in the test", exit_after=3600)
                return out
            if self.how == "preempt":
                services.request_preemption(actor=Actor.system(), run=run,
                                            deadline=timezone.now() + timedelta(hours=1),
                                            reason="room for a production run")
            else:
                services.cancel(actor=Actor.system(), run=run)
            try:
                self.heartbeat()
            except LeaseLost:  # what the heartbeat thread does with a cancel's 409
                self._lost.set()
        return out


def claim(pool: CrucibleClient, run_id: str, worker: str, at: int | None = None,
          how: str = "preempt") -> StoppedAfter:
    claimed = pool.claim("gpu", worker, run_id=run_id)
    assert claimed is not None
    session = StoppedAfter(client=claimed.client, run=claimed.run, worker_id=claimed.worker_id)
    session.at, session.how = at, how
    return session


def loss_steps(run_id: str) -> list[int]:
    return list(MetricPoint.objects.filter(run_id=run_id, name="loss")
                .order_by("step").values_list("step", flat=True))


def test_a_preempted_train_run_checkpoints_then_reports_and_resumes_after_it(
        pool, api, project, object_store):
    run_id = api.launch_run("acme", project="main", kind="train", config=CONFIG)["id"]
    first = claim(pool, run_id, "w1", at=2)
    assert run_claimed(first) == "preempted"

    run = Run.objects.get(pk=run_id)
    assert run.status == RunStatus.QUEUED and run.preemptions == 1
    prefix = f"{object_store.url}/{first.run.object_prefix}/checkpoints"
    ckpt = Checkpoint.objects.get(run_id=run_id)
    assert (ckpt.step, ckpt.uri, ckpt.resumable) == (
        2, f"{prefix}/epoch-1/step-000002.tar", True)
    assert loss_steps(run_id) == [1, 2]
    # The checkpoint was recorded before the run said it was preempted.
    recorded = RunEvent.objects.get(run_id=run_id, kind="checkpoint").seq
    preempted = RunEvent.objects.get(run_id=run_id, kind="status",
                                     data__status="preempted").seq
    assert recorded < preempted

    second = claim(pool, run_id, "w2")
    assert second.run.lease_epoch == 2
    assert run_claimed(second) == "succeeded"
    assert RunEvent.objects.filter(
        run_id=run_id, message__startswith="attempt 2: resuming from the checkpoint at step 2"
    ).exists()
    # Contiguous: steps 3 and 4 trained by the second attempt, none stored twice.
    assert loss_steps(run_id) == [1, 2, 3, 4]
    assert list(Checkpoint.objects.filter(run_id=run_id).order_by("step")
                .values_list("step", "uri")) == [
        (2, f"{prefix}/epoch-1/step-000002.tar"), (4, f"{prefix}/epoch-2/final.tar")]


def test_a_canceled_train_run_stops_without_a_checkpoint(pool, api, project, object_store):
    run_id = api.launch_run("acme", project="main", kind="train", config=CONFIG)["id"]
    assert run_claimed(claim(pool, run_id, "w1", at=2, how="cancel")) == "stopped"
    assert Run.objects.get(pk=run_id).status == RunStatus.CANCELED
    assert not Checkpoint.objects.filter(run_id=run_id).exists()
    run = Run.objects.get(pk=run_id)
    assert not object_store.exists(f"{object_store.url}/teams/{run.team_id}/runs/{run_id}/"
                                   "checkpoints/epoch-1/step-000002.tar")


def test_a_drained_train_run_checkpoints_hands_its_attempt_back_and_resumes(
        pool, api, project, object_store):
    """SIGTERM to the worker (drain): the preemption's checkpoint path, but the attempt ends
    ``drained``, is given back, and is no scheduler preemption; the run is queued at once."""
    run_id = api.launch_run("acme", project="main", kind="train", config=CONFIG)["id"]
    first = claim(pool, run_id, "w1", at=2, how="drain")
    assert run_claimed(first) == "drained"
    run = Run.objects.get(pk=run_id)
    assert (run.status, run.preemptions, run.retry_base, run.lease_id) == (
        RunStatus.QUEUED, 0, 1, "")
    attempt = run.attempts.get()
    assert (attempt.outcome, attempt.resume_step) == ("drained", 0)
    assert attempt.claimed_at <= attempt.started_at <= attempt.ended_at
    ckpt = Checkpoint.objects.get(run_id=run_id)
    assert (ckpt.step, ckpt.resumable) == (2, True)
    assert loss_steps(run_id) == [1, 2]

    drain.reset()  # the next worker is not shutting down
    assert run_claimed(claim(pool, run_id, "w2")) == "succeeded"
    assert loss_steps(run_id) == [1, 2, 3, 4]
    first_attempt, second_attempt = Run.objects.get(pk=run_id).attempts.all()
    assert (second_attempt.outcome, second_attempt.resume_step) == ("succeeded", 2)
    shown = api.run("acme", run_id)["goodput"]
    # Attempt 1 keeps its work up to checkpoint 2; what followed it counts as preemption.
    assert shown["lost_preemption_s"] == \
        first_attempt.ended_at.timestamp() - ckpt.created_at.timestamp()
    assert shown["lost_failure_s"] == 0 and 0 < shown["goodput"] < 1


def test_a_draining_worker_hands_back_a_profile_run_at_its_next_report(pool, api, project, qa):
    from tests.factories import make_run

    run = make_run(project, qa)
    drain.request("SIGTERM in the test", exit_after=3600)
    claimed = pool.claim(run.pool, "w1", run_id=str(run.pk))
    assert claimed is not None
    assert run_claimed(claimed) == "drained"
    run.refresh_from_db()
    assert (run.status, run.retry_base) == (RunStatus.QUEUED, 1)
    assert run.attempts.get().outcome == "drained"
