"""Rules evaluated where the data arrives: metric batches and run events through the
worker API (the hooks run after commit), lost workers through the lease sweep, queue wait
and lost nodes through the beat's evaluate call. Each condition fires once per cooldown,
not once per batch, and only for the team (and project) the rule belongs to."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from apps.alerts.models import Alert
from apps.core.actor import Actor
from apps.runs.models import Run
from apps.scheduling import services as scheduling_services
from apps.scheduling.models import Allocation, Node
from tests.factories import DatasetFactory, ProjectFactory, make_run

RULES = "/api/v1/teams/acme/alert-rules"


@pytest.fixture
def hooks(django_capture_on_commit_callbacks: Any) -> Any:
    """Run on-commit hooks (where the rules are evaluated) as a real commit would."""
    return lambda: django_capture_on_commit_callbacks(execute=True)


def _rule(caller: Any, kind: str, team: str = "acme", **fields: Any) -> int:
    r = caller.client.post(f"/api/v1/teams/{team}/alert-rules", {"name": kind, "kind": kind,
                                                                 **fields}, format="json")
    assert r.status_code == 201, r.content
    return int(r.json()["id"])


class Claimed:
    """A claimed run whose worker reports; each report commits (its hooks run) on its own,
    as separate requests do."""

    def __init__(self, worker: Any, project: Any, hooks: Any, slug: str = "d") -> None:
        self.worker, self.hooks = worker, hooks
        self.run = make_run(project, DatasetFactory(project=project, team=project.team,
                                                    slug=slug))
        claim = worker.post("/api/v1/worker/claim", {"pool": "cpu", "worker_id": "w1",
                                                     "run_id": str(self.run.pk)}).json()
        self.lease = {"HTTP_X_CRUCIBLE_LEASE": claim["lease_id"]}
        self.seq = 0
        self.step = 0

    def metrics(self, name: str, *values: float) -> None:
        self.seq += 1
        points = []
        for value in values:
            self.step += 1
            points.append({"name": name, "step": self.step, "value": value})
        with self.hooks():
            r = self.worker.post(f"/api/v1/worker/runs/{self.run.pk}/metrics",
                                 {"seq": self.seq, "points": points}, format="json",
                                 **self.lease)
        assert r.status_code == 200, r.content

    def event(self, message: str, level: str = "warning", **data: Any) -> None:
        with self.hooks():
            r = self.worker.post(f"/api/v1/worker/runs/{self.run.pk}/events",
                                 {"events": [{"message": message, "level": level,
                                              "data": data}]}, format="json", **self.lease)
        assert r.status_code in (200, 201), r.content


def test_reward_collapse_fires_once_when_the_smoothed_reward_drops(worker, project, member,
                                                                   hooks):
    _rule(member, "reward_collapse", params={"alpha": 0.5, "drop": 0.7, "min_points": 5})
    run = Claimed(worker, project, hooks)
    run.metrics("reward_mean", 1, 1, 1)
    run.metrics("reward_mean", 0)  # smoothed 0.5: a 50% drop, under the bound
    assert not Alert.objects.exists()
    run.metrics("reward_mean", 0)  # smoothed 0.25: 75% below the peak
    run.metrics("reward_mean", 0)  # still collapsed: the cooldown holds it back
    run.metrics("loss", 3.0)  # another series: not read at all
    alert = Alert.objects.get()
    assert alert.kind == "reward_collapse" and alert.run_id == run.run.pk
    assert alert.value == pytest.approx(0.75) and "75% below its peak 1" in alert.message
    listed = member.client.get("/api/v1/teams/acme/alerts", {"run": str(run.run.pk)}).json()
    assert [a["id"] for a in listed["results"]] == [alert.pk]


def test_mismatch_kl_and_forgery_suspect_metrics(worker, project, member, hooks):
    _rule(member, "mismatch_kl", params={"bound": 0.05})
    _rule(member, "forgery_suspect", params={"threshold": 0.1})
    _rule(member, "sandbox_error_rate", params={"threshold": 0.2, "for_points": 2})
    run = Claimed(worker, project, hooks)
    run.metrics("mismatch/kl", 0.01)
    run.metrics("reward/verdict_exited_early", 0.05)
    run.metrics("reward/verdict_sandbox_error", 0.5)  # one point above: needs two
    assert not Alert.objects.exists()
    run.metrics("mismatch/kl", 0.2)
    run.metrics("reward/verdict_exited_early", 0.4)
    run.metrics("reward/verdict_sandbox_error", 0.3)
    fired = {a.kind: a for a in Alert.objects.all()}
    assert set(fired) == {"mismatch_kl", "forgery_suspect", "sandbox_error_rate"}
    assert fired["mismatch_kl"].value == 0.2 and "mismatch/kl" in fired["mismatch_kl"].message
    assert "exited early" in fired["forgery_suspect"].message


def test_nan_streak_fires_once_not_per_event(worker, project, member, hooks):
    _rule(member, "nan_streak", params={"streak": 2})
    run = Claimed(worker, project, hooks)
    run.event("step 4: non-finite loss, step skipped", step=4, nan_streak=1)
    assert not Alert.objects.exists()
    run.event("step 5: non-finite loss, step skipped", step=5, nan_streak=2)
    run.event("step 6: non-finite loss, step skipped", step=6, nan_streak=3)
    alert = Alert.objects.get()
    assert alert.kind == "nan_streak" and alert.value == 2.0
    assert "2 consecutive non-finite" in alert.message


def test_rules_fire_only_for_their_own_team_and_project(worker, project, member, outsider,
                                                        hooks):
    _rule(outsider, "nan_streak", team="rival")
    other_project = ProjectFactory(team=project.team, slug="other")
    _rule(member, "nan_streak", project="other")
    run = Claimed(worker, project, hooks)
    run.event("non-finite", nan_streak=5)
    assert not Alert.objects.exists()
    run2 = Claimed(worker, other_project, hooks, slug="d2")
    run2.event("non-finite", nan_streak=5)
    assert Alert.objects.get().run_id == run2.run.pk
    assert outsider.client.get("/api/v1/teams/rival/alerts").json()["results"] == []
    assert outsider.client.get(f"/api/v1/teams/acme/alerts/{Alert.objects.get().pk}"
                               ).status_code == 404


def test_a_lost_worker_fires_once_per_lost_attempt(worker, project, member, hooks):
    _rule(member, "worker_lost")
    run = Claimed(worker, project, hooks)
    Run.objects.filter(pk=run.run.pk).update(lease_expires_at=timezone.now()
                                             - timedelta(seconds=5))
    with hooks():
        assert worker.post("/api/v1/worker/sweep").status_code == 200
        worker.post("/api/v1/worker/sweep")
    alert = Alert.objects.get()
    assert alert.kind == "worker_lost" and alert.key == f"run:{run.run.pk}:attempt:1"
    assert "worker w1 lost on attempt 1" in alert.message


def test_queue_wait_and_lost_nodes_fire_from_the_periodic_pass(worker, project, member,
                                                               outsider, hooks):
    _rule(member, "queue_wait", params={"seconds": 60})
    _rule(member, "node_lost")
    _rule(outsider, "node_lost", team="rival")  # holds nothing on the node: not its alert
    _rule(outsider, "node_lost", team="rival", params={"scope": "cluster"})
    waiting = make_run(project, DatasetFactory(project=project, team=project.team, slug="q"))
    held = make_run(project, DatasetFactory(project=project, team=project.team, slug="h"))
    node = Node.objects.create(name="gpu-7", pool="gpu", gpu_count=8,
                               last_heartbeat_at=timezone.now() - timedelta(hours=1))
    Allocation.objects.create(run=held, node=node, gpu_ids=[0], flavor="a100")
    assert scheduling_services.sweep_lost_nodes() == ["gpu-7"]
    with hooks():
        first = worker.post("/api/v1/worker/alerts/evaluate").json()
    assert len(first["fired"]) == 2  # the lost node, for acme and rival's cluster rule
    Run.objects.filter(pk=waiting.pk).update(queued_at=timezone.now() - timedelta(minutes=5))
    with hooks():
        second = worker.post("/api/v1/worker/alerts/evaluate").json()
        third = worker.post("/api/v1/worker/alerts/evaluate").json()
    assert len(second["fired"]) == 1 and third["fired"] == []
    acme = {a.kind: a for a in Alert.objects.filter(team__slug="acme")}
    assert set(acme) == {"queue_wait", "node_lost"}
    assert "gpu-7" in acme["node_lost"].message and str(held.pk) in acme["node_lost"].message
    assert acme["queue_wait"].value >= 300
    rival = Alert.objects.filter(team__slug="rival").get()
    assert rival.rule.params["scope"] == "cluster"
    # A team's worker token may not run the cluster-wide pass.
    from apps.teams.services import worker_token_create
    from tests.django_fixtures import client_for_token
    _, raw = worker_token_create(actor=Actor.system(), team=project.team, name="team-pool")
    assert client_for_token(raw).post("/api/v1/worker/alerts/evaluate").status_code == 403


def test_the_alerts_page_lists_alerts_rules_and_deliveries(worker, project, member, viewer,
                                                           outsider, hooks, client):
    _rule(member, "nan_streak")
    run = Claimed(worker, project, hooks)
    run.event("non-finite", nan_streak=4)
    client.force_login(viewer.user)
    page = client.get("/t/acme/alerts/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "4 consecutive non-finite" in html and 'id="rules"' in html
    filtered = client.get("/t/acme/alerts/", {"run": "00000000-0000-0000-0000-000000000000"})
    assert "4 consecutive" not in filtered.content.decode()
    run_page = client.get(f"/t/acme/runs/{run.run.pk}/").content.decode()
    assert f"/t/acme/alerts/?run={run.run.pk}" in run_page
    client.force_login(outsider.user)
    assert client.get("/t/acme/alerts/").status_code == 404


def test_ingest_pays_no_query_for_rules_that_do_not_read_the_batch(
        worker, project, member, hooks, django_assert_num_queries):
    from apps.alerts import services

    run = Claimed(worker, project, hooks)
    services.enabled_rules(project.team_id)  # the per-process cache, warm
    with django_assert_num_queries(0):  # a team without rules
        services.on_metrics(run_id=run.run.pk, team_id=project.team_id, names={"loss"})
    _rule(member, "mismatch_kl")  # a rule write clears the cache
    services.enabled_rules(project.team_id)
    with django_assert_num_queries(0):  # a rule, but of a series this batch lacks
        services.on_metrics(run_id=run.run.pk, team_id=project.team_id, names={"loss"})
