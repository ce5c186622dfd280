"""Sizes and counts are bounded: free-text fields have maximum lengths, free-form JSON
documents maximum sizes, and one person a quota of teams."""

from __future__ import annotations

from apps.core import limits
from apps.datasets.models import Dataset
from apps.projects.models import Project
from apps.runs.models import RunEvent, Sample
from apps.teams.models import Team
from tests.factories import DatasetFactory, make_run, make_version

TEAM = "/api/v1/teams/acme"
W = "/api/v1/worker"


def _refused(response, field: str) -> None:
    assert response.status_code == 400, response.content[:300]
    body = response.json()
    assert field in body["errors"], body
    assert field in body["message"]


def test_ten_megabyte_project_description_is_refused(member, project):
    r = member.client.post(f"{TEAM}/projects", {"slug": "big", "description": "d" * 10_000_000},
                           format="json")
    _refused(r, "description")
    assert not Project.objects.filter(slug="big").exists()
    at_limit = member.client.post(f"{TEAM}/projects",
                                  {"slug": "ok", "description": "d" * limits.DESCRIPTION},
                                  format="json")
    assert at_limit.status_code == 201, at_limit.content[:200]
    r = member.client.patch(f"{TEAM}/projects/ok", {"description": "d" * (limits.DESCRIPTION + 1)},
                            format="json")
    _refused(r, "description")


def test_dataset_and_environment_descriptions_are_bounded(member, project):
    long = "x" * (limits.DESCRIPTION + 1)
    _refused(member.client.post(f"{TEAM}/datasets", {"slug": "d", "project": "main",
                                                     "description": long}, format="json"),
             "description")
    _refused(member.client.post(f"{TEAM}/environments", {"slug": "e", "project": "main",
                                                         "description": long}, format="json"),
             "description")
    assert not Dataset.objects.exists()


def test_team_name_is_bounded(owner):
    r = owner.client.patch(TEAM, {"name": "n" * (limits.NAME + 1)}, format="json")
    _refused(r, "name")


def test_run_config_is_bounded(member, project):
    dataset = DatasetFactory(project=project, team=project.team, slug="qa")
    make_version(dataset)
    body = {"project": "main", "kind": "profile", "datasets": ["qa"],
            "config": {"pad": "p" * (limits.CONFIG_BYTES + 10)}}
    _refused(member.client.post(f"{TEAM}/runs/preview", body, format="json"), "config")


def test_worker_reports_are_bounded(worker, project):
    run = make_run(project, DatasetFactory(project=project, team=project.team, slug="qa"))
    claimed = worker.post(f"{W}/claim", {"pool": "cpu", "worker_id": "w",
                                         "run_id": str(run.pk)}, format="json").json()
    lease = {"HTTP_X_CRUCIBLE_LEASE": claimed["lease_id"]}
    events = RunEvent.objects.filter(run=run).count()
    big_data = {"events": [{"message": "m", "data": {"blob": "b" * limits.SMALL_JSON_BYTES}}]}
    r = worker.post(f"{W}/runs/{run.pk}/events", big_data, format="json", **lease)
    assert r.status_code == 400 and "events[0].data" in r.json()["message"]
    long_sample = {"samples": [{"step": 1, "prompt": "p" * (limits.SAMPLE_TEXT + 1),
                                "completion": "c"}]}
    r = worker.post(f"{W}/runs/{run.pk}/samples", long_sample, format="json", **lease)
    assert r.status_code == 400 and "prompt" in r.content.decode()
    error = {"status": "failed", "error": "e" * (limits.MESSAGE + 1)}
    assert worker.post(f"{W}/runs/{run.pk}/status", error, format="json",
                       **lease).status_code == 400
    assert RunEvent.objects.filter(run=run).count() == events
    assert not Sample.objects.exists()


def test_a_person_may_create_only_so_many_teams(make_caller, settings):
    settings.CRUCIBLE = {**settings.CRUCIBLE, "TEAMS_PER_USER": 3}
    caller = make_caller()
    for n in range(3):
        r = caller.client.post("/api/v1/teams", {"slug": f"mine-{n}"}, format="json")
        assert r.status_code == 201, r.content
    refused = caller.client.post("/api/v1/teams", {"slug": "mine-3"}, format="json")
    assert refused.status_code == 403 and refused.json()["code"] == "quota_exceeded"
    assert "CRUCIBLE_TEAMS_PER_USER=3" in refused.json()["message"]
    assert not Team.objects.filter(slug="mine-3").exists()
    # Another person has their own quota; a superuser has none.
    assert make_caller().client.post("/api/v1/teams", {"slug": "theirs"},
                                     format="json").status_code == 201
    boss = make_caller()
    boss.user.is_superuser = True
    boss.user.save()
    for n in range(4):
        assert boss.client.post("/api/v1/teams", {"slug": f"ops-{n}"},
                                format="json").status_code == 201
