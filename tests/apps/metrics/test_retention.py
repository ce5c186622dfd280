"""Per-team retention of raw metric points: the prune drops points ingested before the
team's window and keeps the series and rollups, so reads served from rollups are the same
before and after; a team without retention keeps everything; retried batches stay no-ops."""

from __future__ import annotations

import math
from datetime import timedelta

from django.utils import timezone

from apps.core.actor import Actor
from apps.metrics.models import MetricBatch, MetricPoint
from apps.metrics.selectors import series, series_many
from apps.metrics.services import prune_raw_points
from apps.teams.services import team_update, worker_token_create
from tests.factories import DatasetFactory, make_run

STEPS = 60_000  # past RAW_SCAN_LIMIT: reads at 1000 buckets come from rollups too


def _ingest(worker, run, lease, names, steps, batch=5000):
    for seq, start in enumerate(range(0, steps, batch), start=1):
        columns = {"name": [], "step": [], "value": [], "wall_time": []}
        for s in range(start, min(start + batch, steps)):
            for k, name in enumerate(names):
                columns["name"].append(name)
                columns["step"].append(s)
                columns["value"].append(math.sin(s / 700 + k) + (s % 89) / 1000)
                columns["wall_time"].append(1.7e9 + s)
        r = worker.post(f"/api/v1/worker/runs/{run.pk}/metrics",
                        {"seq": seq, "columns": columns}, format="json", **lease)
        assert r.status_code == 200, r.content


def _claim(worker, project, slug):
    run = make_run(project, DatasetFactory(project=project, team=project.team, slug=slug))
    claim = worker.post("/api/v1/worker/claim", {"pool": "cpu", "worker_id": "w",
                                                 "run_id": str(run.pk)}).json()
    return run, {"HTTP_X_CRUCIBLE_LEASE": claim["lease_id"]}


def test_reads_above_rollup_resolution_survive_dropping_raw_points(member, worker, project):
    run, lease = _claim(worker, project, "d")
    names = ["loss", "reward"]
    _ingest(worker, run, lease, names, STEPS)
    # Buckets of ≥ 8 rollup rows (fan-in 8), and of ≥ 1 (a series past RAW_SCAN_LIMIT):
    # every read at or above the rollup resolution (64 steps a bucket).
    sizes = (5, 50, 100, 500)
    before = {n: series_many(run.pk, names, max_points=n) for n in sizes}
    assert all(len(before[n]["loss"]) == n for n in sizes)
    # The run page's read, over HTTP in both layouts.
    url = f"/api/v1/teams/{project.team.slug}/runs/{run.pk}/metrics?max_points=500"
    http_before = [member.client.get(url + layout).json() for layout in ("", "&layout=columns")]
    assert len(http_before[1]["series"][0]["columns"]["step"]) == 500

    team_update(actor=Actor.system(), team=project.team, metric_retention_days=30)
    # Nothing is old enough yet: nothing dropped.
    assert prune_raw_points() == {}
    assert MetricPoint.objects.filter(run=run).count() == STEPS * 2
    dropped = prune_raw_points(now=timezone.now() + timedelta(days=31))
    assert dropped == {project.team.slug: STEPS * 2}
    assert not MetricPoint.objects.filter(run=run).exists()

    after = {n: series_many(run.pk, names, max_points=n) for n in sizes}
    assert after == before
    assert [member.client.get(url + layout).json()
            for layout in ("", "&layout=columns")] == http_before
    # A retried batch is still a no-op: its batch row outlives its points.
    r = worker.post(f"/api/v1/worker/runs/{run.pk}/metrics",
                    {"seq": 1, "columns": {"name": ["loss"], "step": [0], "value": [9.0]}},
                    format="json", **lease)
    assert r.json() == {"stored": 0, "duplicate": True}
    # A second prune finds nothing left to drop.
    assert prune_raw_points(now=timezone.now() + timedelta(days=31)) == {}


def test_only_old_batches_of_teams_with_retention_are_dropped(worker, project, other_team):
    run, lease = _claim(worker, project, "d")
    _ingest(worker, run, lease, ["loss"], 2000, batch=1000)
    old = MetricBatch.objects.get(run=run, seq=1)
    MetricBatch.objects.filter(pk=old.pk).update(
        received_at=timezone.now() - timedelta(days=10))
    # other_team's retention setting does not touch this team's points.
    team_update(actor=Actor.system(), team=other_team, metric_retention_days=1)
    assert prune_raw_points() == {}
    assert MetricPoint.objects.filter(run=run).count() == 2000
    team_update(actor=Actor.system(), team=project.team, metric_retention_days=7)
    assert prune_raw_points() == {project.team.slug: 1000}
    assert sorted(MetricPoint.objects.filter(run=run).values_list("step", flat=True)) == \
        list(range(1000, 2000))
    # A short series whose raw points went reads from rollups: totals still add up.
    got = series(run.pk, "loss", max_points=10)
    assert sum(b["count"] for b in got) == 2000 and got[-1]["step"] == 1999


def test_team_api_sets_retention(owner, team):
    r = owner.client.patch(f"/api/v1/teams/{team.slug}", {"metric_retention_days": 14},
                           format="json")
    assert r.status_code == 200, r.content
    assert r.json()["metric_retention_days"] == 14
    r = owner.client.patch(f"/api/v1/teams/{team.slug}", {"metric_retention_days": 0},
                           format="json")
    assert r.status_code == 400 and "metric_retention_days" in r.content.decode()


def test_the_prune_endpoint_is_for_operator_tokens(worker, team):
    from tests.django_fixtures import client_for_token

    r = worker.post("/api/v1/worker/metrics/prune")  # the operator's pool token
    assert r.status_code == 200 and r.json() == {"dropped": {}}
    _, raw = worker_token_create(actor=Actor.system(), team=team, name="team-pool")
    r = client_for_token(raw).post("/api/v1/worker/metrics/prune")
    assert r.status_code == 403 and "operator" in r.json()["message"]
