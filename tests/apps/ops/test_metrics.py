"""/metrics: who may read it, and that what it says matches rows and requests the test made
(parsed with prometheus_client's own parser)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from apps.core.actor import Actor
from apps.metrics.services import store_batch
from apps.runs.models import Run
from apps.scheduling.models import Node
from apps.teams.services import worker_token_create
from tests.django_fixtures import client_for_token
from tests.factories import TeamFactory, UserFactory, make_run

URL = "/metrics"


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(text: str, name: str, **labels: str) -> float | None:
    return samples(text).get((name, frozenset(labels.items())))


@pytest.fixture
def metrics_token(settings: Any) -> str:
    settings.CRUCIBLE = {**settings.CRUCIBLE, "METRICS_TOKEN": "scrape-secret-123"}
    return "scrape-secret-123"


def scrape(token: str) -> str:
    response = Client().get(URL, HTTP_AUTHORIZATION=f"Bearer {token}")
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain")
    return response.content.decode()


def test_anonymous_and_non_operators_are_refused(member, worker, metrics_token, db):
    anonymous = Client().get(URL)
    assert anonymous.status_code == 401
    assert anonymous["WWW-Authenticate"] == 'Bearer realm="metrics"'
    assert "CRUCIBLE_METRICS_TOKEN" in anonymous.json()["message"]
    assert Client().get(URL, HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    # Signed in, but not an operator: a team member's token, a team's worker token.
    assert member.client.get(URL).status_code == 403
    _, team_worker = worker_token_create(actor=Actor.system(), team=TeamFactory(), name="w")
    assert client_for_token(team_worker).get(URL).status_code == 403
    # Operators: the configured token, an operator worker token, a staff user's session.
    assert Client().get(URL, HTTP_AUTHORIZATION=f"Bearer {metrics_token}").status_code == 200
    assert worker.get(URL).status_code == 200
    staff = Client()
    staff.force_login(UserFactory(is_staff=True))
    assert staff.get(URL).status_code == 200


def test_without_a_configured_token_the_token_is_not_a_way_in(worker, db):
    assert Client().get(URL, HTTP_AUTHORIZATION="Bearer ").status_code == 401
    assert worker.get(URL).status_code == 200


def test_queue_depth_wait_and_runs_by_state(project, metrics_token):
    runs = [make_run(project) for _ in range(4)]
    pool = runs[0].pool
    long_ago = timezone.now() - timedelta(hours=2)
    Run.objects.filter(pk=runs[0].pk).update(queued_at=long_ago)
    Run.objects.filter(pk=runs[3].pk).update(status="running")
    text = scrape(metrics_token)
    assert value(text, "crucible_queue_depth", pool=pool) == 3
    assert value(text, "crucible_team_queue_depth", pool=pool, team="acme") == 3
    assert value(text, "crucible_queue_oldest_wait_seconds", pool=pool) >= 7200
    assert value(text, "crucible_team_queue_oldest_wait_seconds", pool=pool,
                 team="acme") >= 7200
    assert value(text, "crucible_runs", status="queued", pool=pool) == 3
    assert value(text, "crucible_runs", status="running", pool=pool) == 1
    assert value(text, "crucible_runs", status="failed", pool=pool) == 0
    # Every pool has a series, so an empty queue reads 0 rather than no data.
    other = next(p for p in ("gpu", "sandbox", "cpu") if p != pool)
    assert value(text, "crucible_queue_depth", pool=other) == 0


def test_heartbeat_ages_of_nodes_and_running_workers(project, metrics_token, settings):
    settings.CRUCIBLE = {**settings.CRUCIBLE, "LEASE_SECONDS": 120}
    Node.objects.create(name="gpu-1", pool="gpu", gpu_count=8, gpu_type="H100",
                        last_heartbeat_at=timezone.now() - timedelta(seconds=600))
    run = make_run(project)
    # A worker that last renewed 100 s ago: 20 s of its 120 s lease left.
    Run.objects.filter(pk=run.pk).update(
        status="running", lease_expires_at=timezone.now() + timedelta(seconds=20))
    text = scrape(metrics_token)
    age = value(text, "crucible_node_heartbeat_age_seconds", node="gpu-1", pool="gpu",
                state="ready")
    assert age is not None and age >= 600
    assert value(text, "crucible_nodes", pool="gpu", state="ready") == 1
    beat = value(text, "crucible_run_heartbeat_age_max_seconds", pool=run.pool)
    assert beat is not None and 100 <= beat <= 120


def test_request_latency_histogram_counts_requests_by_view(metrics_token, db):
    labels = {"view": "healthz", "method": "GET", "status": "2xx"}
    before = value(scrape(metrics_token), "crucible_http_request_duration_seconds_count",
                   **labels) or 0
    for _ in range(3):
        assert Client().get("/healthz").status_code == 200
    Client().get("/no/such/page")
    text = scrape(metrics_token)
    assert value(text, "crucible_http_request_duration_seconds_count", **labels) == before + 3
    assert value(text, "crucible_http_request_duration_seconds_count", view="unresolved",
                 method="GET", status="4xx") >= 1
    assert value(text, "crucible_http_request_duration_seconds_bucket", le="+Inf",
                 **labels) == before + 3


def test_ingested_points_are_counted_once(project, metrics_token,
                                          django_capture_on_commit_callbacks):
    run = make_run(project)
    before = value(scrape(metrics_token), "crucible_metric_points_ingested_total") or 0
    dup_before = value(scrape(metrics_token), "crucible_metric_batches_ingested_total",
                       outcome="duplicate") or 0
    rows = [("loss", step, 1.0 / (step + 1), 0.0) for step in range(5)]
    with django_capture_on_commit_callbacks(execute=True):
        assert store_batch(run=run, seq=1, rows=rows) == (5, False)
        assert store_batch(run=run, seq=1, rows=rows) == (0, True)  # a retried batch
    text = scrape(metrics_token)
    assert value(text, "crucible_metric_points_ingested_total") == before + 5
    assert value(text, "crucible_metric_batches_ingested_total",
                 outcome="duplicate") == dup_before + 1


def test_sandbox_executions_and_verdicts(member, worker, metrics_token,
                                         django_capture_on_commit_callbacks):
    url = "/api/v1/teams/acme/executions"
    ids = [member.client.post(url, {"language": "python", "code": f"print({i})"}).json()["id"]
           for i in range(3)]
    text = scrape(metrics_token)
    assert value(text, "crucible_sandbox_executions_active", status="queued") == 3
    before = {v: value(text, "crucible_sandbox_executions_finished_total", status="done",
                       verdict=v) or 0 for v in ("OK", "TLE", "other")}
    results = [{"status": "OK", "stdout": "0\n", "exit_code": 0},
               {"status": "TLE", "stdout": "", "exit_code": None},
               {"status": "NOT-A-VERDICT", "stdout": "", "exit_code": 1}]
    for execution_id, result in zip(ids, results, strict=True):
        lease = worker.post(f"/api/v1/worker/executions/{execution_id}/start").json()
        with django_capture_on_commit_callbacks(execute=True):
            r = worker.post(f"/api/v1/worker/executions/{execution_id}/result",
                            {"result": result}, HTTP_IDEMPOTENCY_KEY=execution_id,
                            HTTP_X_CRUCIBLE_LEASE=lease["lease_id"])
        assert r.status_code == 200, r.content
    text = scrape(metrics_token)
    for verdict in ("OK", "TLE", "other"):
        assert value(text, "crucible_sandbox_executions_finished_total", status="done",
                     verdict=verdict) == before[verdict] + 1
    assert value(text, "crucible_sandbox_executions_active", status="queued") == 0
