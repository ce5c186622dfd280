"""Query budgets: the leaderboard reads every evaluation at once (no query per row); the
evaluations list adds one indexed look-up per evaluation (its previous version), nothing
more (the results, the suites and all compared scores are read in batches)."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from apps.core.actor import Actor
from apps.evals import services
from apps.evals.models import EvalSuite
from tests.apps.evals.flow import eval_runs, finish_eval

pytestmark = pytest.mark.django_db
SUITE = "/api/v1/teams/acme/evals/suites/core"


@pytest.fixture
def suite(member, arith):
    r = member.client.post("/api/v1/teams/acme/evals/suites", {
        "slug": "core", "project": "main", "entries": [
            {"environment": "arith@v1", "metric": "mean_reward"},
            {"environment": "arith@v1", "k": [1], "metric": "pass@1"}]}, format="json")
    assert r.status_code == 201, r.content
    return EvalSuite.objects.get()


def _evaluate(worker, suite, n: int, start: int, capture) -> None:
    for i in range(start, start + n):
        evaluation = services.evaluate_variant(
            actor=Actor.system(), suite=suite, label=f"m{i}",
            policy={"base_url": f"http://127.0.0.1:{9000 + i}/v1", "model": f"m{i}"})
        for run_id in eval_runs(evaluation):
            finish_eval(worker, run_id, pass_at={"1": 0.5}, mean_reward=0.1 * i,
                        latency_s=0.1, commit=lambda: capture(execute=True))


def _count(client, url: str) -> tuple[int, int]:
    assert client.get(url).status_code == 200
    with CaptureQueriesContext(connection) as queries:
        response = client.get(url)
    assert response.status_code == 200, response.content
    return len(queries), len(response.json()["results"])


def test_query_budgets(member, worker, suite, django_capture_on_commit_callbacks):
    _evaluate(worker, suite, 2, 0, django_capture_on_commit_callbacks)
    board2, rows = _count(member.client, f"{SUITE}/leaderboard")
    assert rows == 2
    list2, rows = _count(member.client, f"{SUITE}/evaluations")
    assert rows == 2
    _evaluate(worker, suite, 3, 2, django_capture_on_commit_callbacks)
    board5, rows = _count(member.client, f"{SUITE}/leaderboard")
    assert rows == 5 and board5 <= board2
    list5, rows = _count(member.client, f"{SUITE}/evaluations")
    assert rows == 5 and list5 <= list2 + 3
    # and the report says the previous version of each (the evaluation before it)
    reports = member.client.get(f"{SUITE}/evaluations").json()["results"]
    ids = [r["id"] for r in reports]
    assert [r["previous"] for r in reports] == [*ids[1:], None]
