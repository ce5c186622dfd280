"""A worker's side of a suite-gated run, through the real worker API: train run claimed, its
checkpoints reported (each launches the suite's eval runs), eval runs claimed, their
reports stored and their status reported. Shared by the gate test and the browser test."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from apps.evals.models import EntryResult, SuiteEvaluation
from apps.runs.models import Run, RunAttempt
from tests.factories import put_run_object

W = "/api/v1/worker"
Commit = Callable[[], contextlib.AbstractContextManager[Any]]


def start(worker: Any, run: Run | str, pool: str) -> dict[str, str]:
    """Claim and start ``run``; its lease as request headers."""
    run_id = str(run.pk if isinstance(run, Run) else run)
    r = worker.post(f"{W}/claim", {"pool": pool, "worker_id": "w1", "run_id": run_id},
                    format="json")
    assert r.status_code == 200, r.content
    lease = {"HTTP_X_CRUCIBLE_LEASE": r.json()["lease_id"]}
    r = worker.post(f"{W}/runs/{run_id}/status", {"status": "running"}, **lease)
    assert r.status_code == 200, r.content
    return lease


def checkpoint(worker: Any, run: Run, lease: dict[str, str], step: int,
               commit: Commit = contextlib.nullcontext) -> tuple[int, SuiteEvaluation]:
    """Report a checkpoint of ``run``; its id and the suite evaluation it launched."""
    uri = put_run_object(run, f"checkpoints/step-{step:06d}.tar", b"weights %d" % step)
    with commit():
        r = worker.post(f"{W}/runs/{run.pk}/checkpoints",
                        {"step": step, "uri": uri, "resumable": True}, format="json", **lease)
    assert r.status_code == 201, r.content
    ckpt = r.json()["id"]
    return ckpt, SuiteEvaluation.objects.get(checkpoint_id=ckpt)


def finish_eval(worker: Any, run_id: Any, *, pass_at: dict[str, float], mean_reward: float,
                latency_s: float, tasks: int = 4, held_s: float | None = None,
                error: str | None = None, commit: Commit = contextlib.nullcontext) -> None:
    """Do what the eval adapter does at its end: store its report under the run's prefix,
    point the run at it, and report succeeded (or report ``error`` as a failure). With
    ``held_s`` the attempt's claim is moved that far back, so the cost it holds is known."""
    run = Run.objects.get(pk=run_id)
    lease = start(worker, run, run.pool)
    if held_s is not None:
        run.refresh_from_db()
        attempt = RunAttempt.objects.get(run=run, number=run.attempt)
        RunAttempt.objects.filter(pk=attempt.pk).update(
            claimed_at=attempt.claimed_at - timedelta(seconds=held_s))
    if error is None:
        report = {"schema": "crucible.eval/1", "split": "eval", "k": [int(k) for k in pass_at],
                  "summary": {"tasks": tasks, "samples": tasks * 2, "errors": 0,
                              "mean_reward": mean_reward, "pass_at": pass_at,
                              "latency_s": {"mean": latency_s, "p50": latency_s,
                                            "p95": latency_s}}}
        uri = put_run_object(run, "eval-report.json", json.dumps(report).encode())
        r = worker.post(f"{W}/runs/{run.pk}/artifacts", {"kind": "report", "uri": uri},
                        format="json", **lease)
        assert r.status_code == 200, r.content
        body: dict[str, Any] = {"status": "succeeded"}
    else:
        body = {"status": "failed", "error": error}
    with commit():
        r = worker.post(f"{W}/runs/{run.pk}/status", body, format="json", **lease)
    assert r.status_code == 200, r.content


def eval_runs(evaluation: SuiteEvaluation) -> list[str]:
    """The evaluation's eval runs in entry order."""
    return [str(r.run_id) for r in EntryResult.objects.filter(evaluation=evaluation)
            .order_by("entry__position")]
