"""Attempts: retries of failed or lost attempts up to ``max_attempts`` with each error kept,
cancel (the worker's next call is refused, checkpoints stay), and what a retried attempt
needs to resume without storing a metric point twice."""

from __future__ import annotations

from datetime import timedelta

import httpx
import pytest
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from django.utils import timezone

from apps.metrics.models import MetricBatch, MetricPoint
from apps.runs.models import Checkpoint, Run, RunEvent
from tests.factories import make_run, put_run_object
from workers.client import CrucibleClient

W = "/api/v1/worker"
RUNS = "/api/v1/teams/acme/runs"


def claim(worker, run, worker_id="w1"):
    r = worker.post(f"{W}/claim", {"pool": run.pool, "worker_id": worker_id,
                                   "run_id": str(run.pk)}, format="json")
    assert r.status_code == 200, r.content
    return r.json(), {"HTTP_X_CRUCIBLE_LEASE": r.json()["lease_id"]}


def fail(worker, run, lease, error, retry=True):
    body = {"status": "failed", "error": error, "retry": retry}
    r = worker.post(f"{W}/runs/{run.pk}/status", body, format="json", **lease)
    assert r.status_code == 200, r.content
    return r


def expire(run: Run) -> None:
    Run.objects.filter(pk=run.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))


def test_retryable_failures_are_retried_up_to_max_attempts_keeping_each_error(
        worker, member, project, qa):
    run = make_run(project, qa, max_attempts=3)
    for n in (1, 2, 3):
        body, lease = claim(worker, run, worker_id=f"w{n}")
        assert body["attempt"] == n and body["max_attempts"] == 3
        worker.post(f"{W}/runs/{run.pk}/status", {"status": "running"}, format="json", **lease)
        fail(worker, run, lease, f"CUDA error on node {n}")
        run.refresh_from_db()
        assert run.status == ("queued" if n < 3 else "failed"), n
    assert run.error == "CUDA error on node 3"
    shown = member.client.get(f"{RUNS}/{run.pk}").json()
    assert [(a["number"], a["worker"], a["outcome"], a["error"]) for a in shown["attempts"]] == [
        (1, "w1", "failed", "CUDA error on node 1"),
        (2, "w2", "failed", "CUDA error on node 2"),
        (3, "w3", "failed", "CUDA error on node 3"),
    ]
    assert all(a["ended_at"] for a in shown["attempts"])
    messages = list(RunEvent.objects.filter(run=run).order_by("seq")
                    .values_list("message", flat=True))
    assert "queued: attempt 1 failed; retrying (attempt 2 of 3)" in messages
    assert "failed: CUDA error on node 2" in messages
    assert messages[-1] == "gave up after 3 of 3 attempts"

    # A person resuming it grants a fresh allowance.
    assert member.client.post(f"{RUNS}/{run.pk}/resume").json()["status"] == "queued"
    body, lease = claim(worker, run, worker_id="w4")
    assert body["attempt"] == 4
    fail(worker, run, lease, "flaky again")
    run.refresh_from_db()
    assert run.status == "queued"


def test_a_failure_without_retry_is_final_at_once(worker, project, qa):
    run = make_run(project, qa, max_attempts=3)
    _, lease = claim(worker, run)
    fail(worker, run, lease, "config.trainer.steps: bad", retry=False)
    run.refresh_from_db()
    assert run.status == "failed" and run.attempt == 1
    assert run.attempts.get().outcome == "failed"


def test_lost_leases_are_requeued_until_max_attempts_then_fail(worker, project, qa):
    run = make_run(project, qa, max_attempts=2)
    claim(worker, run, worker_id="dead-1")
    expire(run)
    assert worker.post(f"{W}/sweep").json()["requeued"] == [str(run.pk)]
    claim(worker, run, worker_id="dead-2")
    expire(run)
    swept = worker.post(f"{W}/sweep").json()
    assert swept["requeued"] == [] and swept["failed"] == [str(run.pk)]
    run.refresh_from_db()
    assert run.status == "failed"
    assert run.error == "worker dead-2 lost on attempt 2; gave up after 2 of 2 attempts"
    attempts = list(run.attempts.values_list("number", "outcome", "error"))
    assert attempts == [
        (1, "lost", "lease held by dead-1 expired"),
        (2, "lost", "lease held by dead-2 expired"),
    ]
    trail = [(e.data.get("from"), e.data["status"])
             for e in RunEvent.objects.filter(run=run, kind="status").order_by("seq")]
    assert trail[-2:] == [("claimed", "preempted"), ("preempted", "failed")]


def test_cancel_refuses_the_worker_and_keeps_checkpoints(worker, member, project, qa):
    run = make_run(project, qa)
    _, lease = claim(worker, run)
    worker.post(f"{W}/runs/{run.pk}/status", {"status": "running"}, format="json", **lease)
    uri_3 = put_run_object(run, "checkpoints/step-3.tar")
    ckpt = worker.post(f"{W}/runs/{run.pk}/checkpoints", {"step": 3, "uri": uri_3},
                       format="json", **lease)
    assert ckpt.status_code == 201

    assert member.client.post(f"{RUNS}/{run.pk}/cancel").json()["status"] == "canceled"
    for path, body in (("metrics", {"seq": 1, "points": [{"name": "x", "step": 4,
                                                          "value": 1}]}),
                       ("checkpoints", {"step": 4, "uri": put_run_object(run, "c/4.tar")}),
                       ("heartbeat", None)):
        r = worker.post(f"{W}/runs/{run.pk}/{path}", body, format="json", **lease)
        assert r.status_code == 409 and r.json()["code"] == "run_not_active", path
    assert list(Checkpoint.objects.filter(run=run).values_list("step", flat=True)) == [3]
    listed = member.client.get(f"{RUNS}/{run.pk}/checkpoints").json()["results"]
    assert [c["step"] for c in listed] == [3]
    shown = member.client.get(f"{RUNS}/{run.pk}").json()
    assert shown["attempts"][0]["outcome"] == "canceled"

    # Resumed, the next worker is told where to continue from.
    member.client.post(f"{RUNS}/{run.pk}/resume")
    body, _ = claim(worker, run, worker_id="w2")
    assert body["checkpoints"] == [{"step": 3, "uri": uri_3}]


def test_claim_of_a_retry_carries_metric_watermarks(worker, project, qa):
    run = make_run(project, qa)
    body, lease = claim(worker, run)
    assert (body["metric_seq"], body["metric_steps"]) == (0, {})
    for seq, steps in ((1, range(0, 5)), (2, range(5, 7))):
        worker.post(f"{W}/runs/{run.pk}/metrics", {"seq": seq, "points": [
            {"name": name, "step": s, "value": float(s)} for s in steps
            for name in ("loss", "reward")]}, format="json", **lease)
    worker.post(f"{W}/runs/{run.pk}/metrics", {"seq": 3, "points": [
        {"name": "eval", "step": 0, "value": 0.5}]}, format="json", **lease)
    expire(run)
    worker.post(f"{W}/sweep")
    again, _ = claim(worker, run, worker_id="w2")
    assert again["metric_seq"] == 3
    assert again["metric_steps"] == {"loss": 6, "reward": 6, "eval": 0}


@pytest.fixture
def pool(db, worker_token):
    """The real client, in-process (WSGI), sharing the test's transaction."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        transport = httpx.WSGITransport(app=get_wsgi_application())
        with CrucibleClient("http://testserver", worker_token, transport=transport,
                            retries=0) as client:
            yield client
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


def test_a_replaying_session_continues_seqs_and_stores_no_point_twice(pool, project, qa):
    """Attempt 1 stores steps 0-6 and dies; attempt 2 resumes from a checkpoint at step 4
    and replays 5-6 before going on: each (name, step) ends up stored once."""
    run = make_run(project, qa)
    first = pool.claim("cpu", "w1", run_id=str(run.pk))
    for step in range(7):
        first.log_metrics([{"name": "loss", "step": step, "value": 1.0 / (step + 1)}])
    first.log_metrics([{"name": "eval", "step": 0, "value": 0.1}])
    expire(run)
    second = pool.claim("cpu", "w2", run_id=str(run.pk))
    assert second.run.attempt == 2
    replay = second.log_metrics([{"name": "loss", "step": 5, "value": 9.0},
                                 {"name": "eval", "step": 5, "value": 0.2}])
    assert replay == {"stored": 1, "duplicate": False}  # eval@5 is new, loss@5 is not
    assert second.log_metrics([{"name": "loss", "step": 6, "value": 9.0}]) == \
        {"stored": 0, "duplicate": False, "dropped": 1}
    for step in (7, 8):
        assert second.log_metrics([{"name": "loss", "step": step, "value": 0.1}])["stored"] == 1
    assert second.dropped_points == 2
    loss = list(MetricPoint.objects.filter(run=run, name="loss").order_by("step")
                .values_list("step", "value"))
    assert [s for s, _ in loss] == list(range(9))
    assert dict(loss)[5] == pytest.approx(1 / 6)  # the first attempt's value stands
    # Batch numbers continued after attempt 1's eight batches instead of colliding.
    assert list(MetricBatch.objects.filter(run=run).order_by("seq")
                .values_list("seq", flat=True)) == list(range(1, 12))
