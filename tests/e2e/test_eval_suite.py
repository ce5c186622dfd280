"""An eval suite on a real run: API → broker → a Celery worker process → engines → API.

A tiny train run names suite ``core``; every checkpoint it records launches the suite's eval
run of that checkpoint (the worker serves the checkpoint with the inference engine and
scores it on the arithmetic environment); each finished eval run's report lands in the
suite's results through the run-finished hook of the live server; the gate then passes the
first checkpoint (no previous version, no baseline) and promote succeeds, while the suite's
leaderboard ranks every evaluated checkpoint with its cost and latency.

(The regressed-checkpoint refusal is in tests/apps/evals/test_gate.py: a tiny random model's
scores cannot be steered into a regression, so there the eval runs' reports come through
the real worker API with chosen scores.)
"""

from __future__ import annotations

import pytest

from apps.core.actor import Actor
from apps.environments import services as env_services
from apps.projects.models import Project
from tests.e2e.conftest import tenant, wait_for
from workers.client import CrucibleClient

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True),
              pytest.mark.timeout(600)]

TINY = {
    "model": {"preset": {"num_layers": 1}},
    "rollout": {"group_size": 2, "max_new_tokens": 2},
    "trainer": {"steps": 2, "prompts_per_step": 2, "micro_batch_size": 4, "zero_stage": 0,
                "eval_samples": 1},
    "checkpoint": {"every": 2},
    "eval_suite": "core",
}


def test_each_checkpoint_is_evaluated_by_the_suite_and_gates_promote(live_server,
                                                                      start_worker):
    token, worker_token = tenant()
    project = Project.objects.get(team__slug="e2e", slug="demo")
    env = env_services.environment_create(actor=Actor.system(), team=project.team,
                                          project=project, slug="arith")
    env_services.version_create(actor=Actor.system(), environment=env, spec={
        "env": {"source": "builtin", "name": "arithmetic",
                "params": {"max_operand": 4, "eval_size": 3}}})
    worker = start_worker(worker_token, queues="gpu,cpu")
    with CrucibleClient(live_server.url, token) as client:
        client.request("POST", "teams/e2e/evals/suites", json={
            "slug": "core", "project": "demo", "entries": [
                {"environment": "arith@v1", "samples_per_task": 2, "k": [1, 2],
                 "concurrency": 2, "metric": "pass@2", "threshold": 0.5,
                 "sampling": {"max_tokens": 4, "temperature": 1.0, "seed": 3}}]})
        run = client.launch_run("e2e", project="demo", kind="train", name="tiny",
                                base_model="preset", config=TINY)
        try:
            done = client.wait_for_run("e2e", run["id"], timeout=400)
        except TimeoutError:
            worker.terminate()
            raise AssertionError(worker.communicate(timeout=10)[0][-4000:]) from None
        assert done["status"] == "succeeded", done["error"]
        checkpoints = client.run_checkpoints("e2e", run["id"])
        assert checkpoints, "the run recorded no checkpoint"

        def evaluated():
            rows = client.get("teams/e2e/evals/suites/core/evaluations")["results"]
            finished = [r for r in rows if r["verdict"] != "pending"]
            return rows if len(finished) == len(checkpoints) else None

        try:
            rows = wait_for(evaluated, timeout=400, what="the suite's eval runs")
        except AssertionError:
            worker.terminate()
            raise AssertionError(worker.communicate(timeout=10)[0][-4000:]) from None
        assert sorted(r["subject"]["checkpoint"] for r in rows) == \
            sorted(c["id"] for c in checkpoints)
        for row in rows:
            (entry,) = row["entries"]
            assert entry["status"] == "succeeded", entry["error"]
            assert entry["run_status"] == "succeeded"
            assert entry["tasks"] == 3 and 0.0 <= entry["score"] <= 1.0
            assert entry["score"] == entry["pass_at"]["2"]
            assert entry["latency_s"] > 0 and entry["cpu_seconds"] > 0
            assert row["verdict"] in ("passed", "regressed")
        first = min(checkpoints, key=lambda c: (c["step"], c["id"]))
        gate = client.get(f"teams/e2e/checkpoints/{first['id']}/gate")
        assert (gate["allowed"], gate["verdict"]) == (True, "passed")  # nothing before it
        promoted = client.request("POST", f"teams/e2e/checkpoints/{first['id']}/promote",
                                  json={"note": "first"})
        assert promoted["checkpoint"] == first["id"]
        board = client.get("teams/e2e/evals/suites/core/leaderboard")["results"]
        assert len(board) == len(checkpoints)
        assert any(b["pareto"] for b in board)
        assert all(b["cpu_seconds_per_task"] > 0 and b["latency_s"] > 0 for b in board)
