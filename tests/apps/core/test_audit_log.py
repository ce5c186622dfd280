"""Every write leaves an audit row (sandbox executions, worker checkpoints, reports and
samples included), and a team's admins read the team's log through the API and on a page:
filtered by actor, action, object and time, in cursor pages."""

from __future__ import annotations

import hashlib
from datetime import timedelta

from django.test import Client
from django.utils import timezone

from apps.core.models import AuditLog
from apps.sandbox.models import Execution
from tests.factories import DatasetFactory, make_run, put_run_object

LOG = "/api/v1/teams/acme/audit-log"
W = "/api/v1/worker"


def _actions(team) -> list[str]:
    return list(AuditLog.objects.filter(team=team).order_by("id").values_list("action",
                                                                              flat=True))


def test_code_submission_and_its_execution_are_audited(team, member, worker):
    code = "print(input()[::-1])"
    created = member.client.post("/api/v1/teams/acme/executions",
                                 {"language": "python", "code": code}).json()
    submit = AuditLog.objects.get(action="sandbox.execution.submit")
    assert submit.team == team and submit.actor == member.user
    assert submit.target_type == "execution" and submit.target_id == created["id"]
    assert submit.data["code_sha256"] == hashlib.sha256(code.encode()).hexdigest()
    batch = member.client.post("/api/v1/teams/acme/executions/batch", {"requests": [
        {"language": "python", "code": "print(1)"}, {"language": "bash", "code": "echo"}]})
    assert batch.status_code == 202
    assert AuditLog.objects.filter(action="sandbox.execution.submit").count() == 3
    lease = worker.post(f"{W}/executions/{created['id']}/start",
                        HTTP_X_CRUCIBLE_WORKER="box-1").json()["lease_id"]
    worker.post(f"{W}/executions/{created['id']}/result",
                {"result": {"status": "OK", "stdout": "x\n", "exit_code": 0}},
                HTTP_X_CRUCIBLE_LEASE=lease)
    done = AuditLog.objects.get(action="sandbox.execution.finish")
    assert done.actor_label.startswith("worker:")
    assert done.data["status"] == "done" and done.data["result"] == "OK"
    start = AuditLog.objects.get(action="sandbox.execution.start", target_id=created["id"])
    assert start.actor_label.endswith("/box-1") and start.data == {"worker": "box-1"}


def test_lost_executions_are_audited(team, member, worker):
    created = member.client.post("/api/v1/teams/acme/executions",
                                 {"language": "python", "code": "1"}).json()
    worker.post(f"{W}/executions/{created['id']}/start")
    Execution.objects.filter(pk=created["id"]).update(
        lease_expires_at=timezone.now() - timedelta(seconds=1))
    assert worker.post(f"{W}/sweep").json()["executions_lost"] == 1
    lost = AuditLog.objects.get(action="sandbox.execution.lost")
    assert lost.team == team and lost.actor_label == "system"


def test_worker_sample_writes_are_audited(team, project, worker):
    run = make_run(project, DatasetFactory(project=project, team=team, slug="qa"))
    claimed = worker.post(f"{W}/claim", {"pool": "cpu", "worker_id": "w",
                                         "run_id": str(run.pk)}, format="json").json()
    lease = {"HTTP_X_CRUCIBLE_LEASE": claimed["lease_id"]}
    rows = [{"step": s, "prompt": "p", "completion": "c", "reward": 1.0} for s in (3, 5)]
    assert worker.post(f"{W}/runs/{run.pk}/samples", {"samples": rows}, format="json",
                       **lease).status_code == 201
    row = AuditLog.objects.get(action="run.samples")
    assert row.target_id == str(run.pk)
    assert row.data == {"count": 2, "first_step": 3, "last_step": 5}


def _seed(team, admin, member, project, worker):
    """A run with a checkpoint and a report, a project, a cancel: rows by three actors."""
    run = make_run(project, DatasetFactory(project=project, team=team, slug="qa"))
    claimed = worker.post(f"{W}/claim", {"pool": "cpu", "worker_id": "w",
                                         "run_id": str(run.pk)}, format="json").json()
    lease = {"HTTP_X_CRUCIBLE_LEASE": claimed["lease_id"]}
    worker.post(f"{W}/runs/{run.pk}/checkpoints",
                {"step": 1, "uri": put_run_object(claimed, "c/1.tar")}, format="json", **lease)
    worker.post(f"{W}/runs/{run.pk}/artifacts",
                {"kind": "report", "uri": put_run_object(claimed, "r.json", b"{}")},
                format="json", **lease)
    member.client.post("/api/v1/teams/acme/projects", {"slug": "side"}, format="json")
    admin.client.post(f"/api/v1/teams/acme/runs/{run.pk}/cancel")
    return run


def test_admins_read_and_filter_the_teams_log(team, admin, member, project, worker, outsider):
    run = _seed(team, admin, member, project, worker)
    everything = admin.client.get(LOG)
    assert everything.status_code == 200, everything.content
    listed = everything.json()["results"]
    assert [r["id"] for r in listed] == sorted((r["id"] for r in listed), reverse=True)
    assert {r["action"] for r in listed} >= {"run.create", "run.checkpoint", "run.report",
                                             "project.create", "run.canceled"}
    by_member = admin.client.get(LOG, {"actor": member.user.username}).json()["results"]
    assert {r["action"] for r in by_member} == {"project.create"}
    assert by_member[0]["actor_username"] == member.user.username
    workers = admin.client.get(LOG, {"action": "run.checkpoint"}).json()["results"]
    assert len(workers) == 1 and workers[0]["actor"].startswith("worker:")
    by_prefix = admin.client.get(LOG, {"actor": workers[0]["actor"].split("/")[0]}).json()
    assert {"run.checkpoint", "run.report"} <= {r["action"] for r in by_prefix["results"]}
    run_rows = admin.client.get(LOG, {"object": f"run:{run.pk}", "action": "run."}).json()
    assert {r["action"] for r in run_rows["results"]} >= {"run.create", "run.report",
                                                          "run.canceled", "run.claimed"}
    assert all(r["target_id"] == str(run.pk) for r in run_rows["results"])
    later = (timezone.now() + timedelta(minutes=1)).isoformat()
    assert admin.client.get(LOG, {"since": later}).json()["results"] == []
    assert len(admin.client.get(LOG, {"until": later}).json()["results"]) == len(listed)
    bad = admin.client.get(LOG, {"since": "yesterday"})
    assert bad.status_code == 400 and "since" in bad.json()["errors"]
    assert admin.client.get(LOG, {"object": "run"}).status_code == 400
    # Members and viewers may not read it; other teams do not see it exists.
    assert member.client.get(LOG).status_code == 403
    assert outsider.client.get(LOG).status_code == 404


def test_the_log_pages_by_cursor_without_gaps_or_repeats(team, admin, member, project, worker):
    _seed(team, admin, member, project, worker)
    total = AuditLog.objects.filter(team=team).count()
    seen, url, params = [], LOG, {"page_size": 3}
    while url:
        body = admin.client.get(url, params).json()
        seen += [r["id"] for r in body["results"]]
        url, params = body["next"], None
    assert len(seen) == total == len(set(seen))
    assert seen == sorted(seen, reverse=True)


def test_other_teams_rows_never_appear(team, admin, outsider, project):
    outsider.client.post("/api/v1/teams/rival/projects", {"slug": "theirs"}, format="json")
    mine = {r["action"] for r in admin.client.get(LOG).json()["results"]}
    assert "project.create" not in mine
    theirs = outsider.client.get("/api/v1/teams/rival/audit-log").json()["results"]
    assert [r["target_id"] for r in theirs if r["action"] == "project.create"] == ["theirs"]


def test_admins_read_the_log_on_a_page(team, admin, member, project, worker):
    run = _seed(team, admin, member, project, worker)
    browser = Client()
    browser.force_login(admin.user)
    page = browser.get("/t/acme/audit/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "run.checkpoint" in html and "project.create" in html and member.user.username in html
    filtered = browser.get("/t/acme/audit/", {"object": f"run:{run.pk}"}).content.decode()
    assert "project.create" not in filtered and "run.report" in filtered
    assert browser.get("/t/acme/audit/", {"since": "nope"}).status_code == 400
    team_page = browser.get("/t/acme/team/").content.decode()
    assert 'href="/t/acme/audit/"' in team_page
    # 50 a page, with a link to older entries.
    for n in range(60):
        member.client.post("/api/v1/teams/acme/projects", {"slug": f"p{n}"}, format="json")
    first = browser.get("/t/acme/audit/").content.decode()
    assert first.count("<tr data-id=") == 50 and "Older entries" in first
    member_browser = Client()
    member_browser.force_login(member.user)
    assert member_browser.get("/t/acme/audit/").status_code == 404
