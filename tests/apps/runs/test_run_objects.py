"""Worker-reported URIs are confined to the run's own prefix (team and run), and reads go
through the run row: a team admin's worker token cannot point its run at another team's
objects, and a row that does (written before the rule) is never followed."""

from __future__ import annotations

import json

import pytest

from apps.core.actor import Actor
from apps.core.models import AuditLog
from apps.runs.models import Checkpoint, Run
from apps.teams.services import worker_token_create
from tests.django_fixtures import client_for_token
from tests.factories import DatasetFactory, ProjectFactory, make_run, put_run_object

W = "/api/v1/worker"
RUNS = "/api/v1/teams/acme/runs"


@pytest.fixture
def rival_run(other_team):
    project = ProjectFactory(team=other_team, slug="main")
    return make_run(project, DatasetFactory(project=project, team=other_team, slug="d"))


@pytest.fixture
def team_worker(team):
    """A worker token a team admin minted for acme's own pool."""
    _, raw = worker_token_create(actor=Actor.system(), team=team, name="acme-pool")
    return client_for_token(raw)


@pytest.fixture
def acme_run(team_worker, project):
    run = make_run(project, DatasetFactory(project=project, team=project.team, slug="qa"))
    claimed = team_worker.post(f"{W}/claim", {"pool": "cpu", "worker_id": "w",
                                              "run_id": str(run.pk)}, format="json").json()
    lease = {"HTTP_X_CRUCIBLE_LEASE": claimed["lease_id"]}
    assert team_worker.post(f"{W}/runs/{run.pk}/status", {"status": "running"},
                            **lease).status_code == 200
    return run, claimed, lease


def _foreign_uris(run, rival_run):
    """URIs a hostile worker might report for ``run``: all must be refused."""
    secret = put_run_object(rival_run, "report.json", b'{"secret": "rival"}')
    prefix = put_run_object(run, "report.json", b"{}").rsplit("/", 1)[0]
    return {
        "another team's object": secret,
        "dot-dot out of the prefix": f"{prefix}/../../../../teams/{rival_run.team_id}/runs/"
                                     f"{rival_run.pk}/report.json",
        "dot segment": f"{prefix}/./report.json",
        "empty segment": f"{prefix}//report.json",
        "outside the store": "file:///etc/passwd",
        "the bare prefix": f"{prefix}/",
        "another store": "s3://elsewhere/report.json",
        "missing object": f"{prefix}/never-written.json",
    }


@pytest.mark.parametrize("what", ["another team's object", "dot-dot out of the prefix",
                                  "dot segment", "empty segment", "outside the store",
                                  "the bare prefix", "another store", "missing object"])
def test_reported_uris_outside_the_runs_prefix_are_refused(what, acme_run, rival_run,
                                                           team_worker, member):
    run, _, lease = acme_run
    uri = _foreign_uris(run, rival_run)[what]
    report = team_worker.post(f"{W}/runs/{run.pk}/artifacts", {"kind": "report", "uri": uri},
                              format="json", **lease)
    assert report.status_code == 400, (what, report.content)
    assert report.json()["code"] in ("uri_outside_run", "object_missing")
    ckpt = team_worker.post(f"{W}/runs/{run.pk}/checkpoints", {"step": 1, "uri": uri},
                            format="json", **lease)
    assert ckpt.status_code == 400, (what, ckpt.content)
    run.refresh_from_db()
    assert run.report_uri == "" and not Checkpoint.objects.filter(run=run).exists()
    assert member.client.get(f"{RUNS}/{run.pk}/report").status_code == 404


def test_another_run_of_the_same_team_is_outside_the_prefix(acme_run, team_worker, project):
    run, _, lease = acme_run
    sibling = make_run(project, run.pins.first().dataset_version.dataset)
    uri = put_run_object(sibling, "report.json", b"{}")
    r = team_worker.post(f"{W}/runs/{run.pk}/artifacts", {"kind": "report", "uri": uri},
                         format="json", **lease)
    assert r.status_code == 400 and r.json()["code"] == "uri_outside_run"


def test_the_claim_names_the_prefix_and_objects_under_it_are_accepted_and_audited(
        acme_run, team_worker, member):
    run, claimed, lease = acme_run
    assert claimed["object_prefix"] == f"teams/{run.team_id}/runs/{run.pk}"
    uri = put_run_object(claimed, "nested/report.json", json.dumps({"ok": 1}).encode())
    r = team_worker.post(f"{W}/runs/{run.pk}/artifacts", {"kind": "report", "uri": uri},
                         format="json", **lease)
    assert r.status_code == 200, r.content
    assert member.client.get(f"{RUNS}/{run.pk}/report").json() == {"ok": 1}
    ckpt_uri = put_run_object(claimed, "checkpoints/step-1.tar", b"tar")
    r = team_worker.post(f"{W}/runs/{run.pk}/checkpoints", {"step": 1, "uri": ckpt_uri},
                         format="json", **lease)
    assert r.status_code == 201, r.content
    actions = set(AuditLog.objects.filter(team_id=run.team_id).values_list("action", flat=True))
    assert {"run.report", "run.checkpoint"} <= actions
    row = AuditLog.objects.get(action="run.checkpoint")
    assert row.actor_label.startswith("worker:") and row.data["uri"] == ckpt_uri


def test_stored_uri_outside_the_prefix_is_not_followed_on_read(acme_run, rival_run, member):
    """A row written before the rule (or by hand) points at another team's report: the
    read resolves through the run and refuses it instead of serving the object."""
    run, _, _ = acme_run
    secret = put_run_object(rival_run, "report.json", b'{"secret": "rival"}')
    Run.objects.filter(pk=run.pk).update(report_uri=secret)
    r = member.client.get(f"{RUNS}/{run.pk}/report")
    assert r.status_code == 409 and r.json()["code"] == "uri_outside_run"
    assert "rival" not in r.content.decode()


def test_eval_preview_cannot_pin_another_teams_checkpoint(acme_run, rival_run, member):
    """A checkpoint row of acme's own run whose URI names the rival's checkpoint (what a
    hostile worker reported before the rule) is refused at preview and at launch."""
    run, _, _ = acme_run
    rival_ckpt = put_run_object(rival_run, "checkpoints/step-9.tar", b"rival weights")
    ckpt = Checkpoint.objects.create(run=run, team_id=run.team_id, step=9, uri=rival_ckpt)
    _arith_env(member)
    for ref in (f"run:{run.pk}", f"checkpoint:{ckpt.pk}", f"run:{run.pk}@9"):
        body = {"project": "main", "kind": "eval", "environment": "arith", "base_model": ref}
        preview = member.client.post(f"{RUNS}/preview", body, format="json")
        assert preview.status_code == 400, (ref, preview.content)
        assert preview.json()["code"] == "uri_outside_run"
        assert rival_ckpt not in json.dumps(preview.json().get("errors", {}))
    # And the rival's own checkpoint row is simply not acme's.
    theirs = Checkpoint.objects.create(run=rival_run, team_id=rival_run.team_id, step=1,
                                       uri=rival_ckpt)
    body = {"project": "main", "kind": "eval", "environment": "arith",
            "base_model": f"checkpoint:{theirs.pk}"}
    r = member.client.post(f"{RUNS}/preview", body, format="json")
    assert r.status_code == 400 and "matches no checkpoint" in r.json()["message"]
    assert Run.objects.filter(team_id=run.team_id).count() == 1


def _arith_env(member) -> str:
    envs = "/api/v1/teams/acme/environments"
    assert member.client.post(envs, {"slug": "arith", "project": "main"},
                              format="json").status_code == 201
    spec = {"env": {"source": "builtin", "name": "arithmetic", "params": {"eval_size": 4}}}
    assert member.client.post(f"{envs}/arith/versions", {"spec": spec},
                              format="json").status_code == 201
    return f"{envs}/arith/versions/v1"


def test_qc_report_uri_is_confined_too(project, member, team_worker):
    run = member.client.post(f"{_arith_env(member)}/qc", {}, format="json").json()
    claimed = team_worker.post(f"{W}/claim", {"pool": "sandbox", "worker_id": "w",
                                              "run_id": run["id"]}, format="json").json()
    lease = {"HTTP_X_CRUCIBLE_LEASE": claimed["lease_id"]}
    report = {"passed": True, "blocked": False}
    bad = team_worker.post(f"{W}/runs/{run['id']}/qc",
                           {"report": report, "uri": "file:///etc/hostname"},
                           format="json", **lease)
    assert bad.status_code == 400 and bad.json()["code"] == "uri_outside_run"
    good = team_worker.post(f"{W}/runs/{run['id']}/qc",
                            {"report": report, "uri": put_run_object(claimed, "qc.json")},
                            format="json", **lease)
    assert good.status_code == 200, good.content


def test_rows_written_under_the_old_per_run_layout_stay_readable(acme_run, rival_run, member,
                                                                 object_store):
    """Before prefixes carried the team, workers wrote runs/<id>/…: a row pointing at its
    own run's old key is still served; one pointing at another run's old key is not."""
    run, _, _ = acme_run
    own = object_store.put_bytes(f"runs/{run.pk}/eval-report.json", b'{"old": true}')
    Run.objects.filter(pk=run.pk).update(report_uri=own)
    assert member.client.get(f"{RUNS}/{run.pk}/report").json() == {"old": True}
    theirs = object_store.put_bytes(f"runs/{rival_run.pk}/eval-report.json", b'{"x": 1}')
    Run.objects.filter(pk=run.pk).update(report_uri=theirs)
    assert member.client.get(f"{RUNS}/{run.pk}/report").status_code == 409
