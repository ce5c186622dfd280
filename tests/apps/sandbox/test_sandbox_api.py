"""The executions API: validation, quota, the worker hand-off (engine-free here; the
real sandbox runs in tests/e2e/test_sandbox_job.py)."""

from __future__ import annotations

from apps.sandbox.models import Execution

URL = "/api/v1/teams/acme/executions"


def test_submit_validates_with_the_engine_schema(member):
    r = member.client.post(URL, {"language": "cobol", "code": "x"})
    assert r.status_code == 400
    assert r.json()["message"].startswith("language: ")
    assert "unknown language" in r.json()["message"]
    r = member.client.post(URL, {"language": "python", "code": "1", "colour": "red"})
    assert r.status_code == 400 and "colour" in r.json()["message"]
    r = member.client.post(URL, {"language": "python", "code": "1", "wait": 999})
    assert r.status_code == 400 and "wait" in r.json()["message"]
    assert Execution.objects.count() == 0


def test_viewer_cannot_submit(viewer):
    r = viewer.client.post(URL, {"language": "python", "code": "print(1)"})
    assert r.status_code == 403


def test_quota_refuses_work_beyond_the_team_limit(member, settings):
    settings.CRUCIBLE = {**settings.CRUCIBLE, "SANDBOX_QUOTA": 3}
    ok = member.client.post(f"{URL}/batch", {"requests": [
        {"language": "python", "code": "print(1)"}] * 2})
    assert ok.status_code == 202 and len(ok.json()["results"]) == 2
    too_many = member.client.post(f"{URL}/batch", {"requests": [
        {"language": "python", "code": "print(1)"}] * 2})
    assert too_many.status_code == 429
    assert "quota of 3" in too_many.json()["message"]
    assert Execution.objects.count() == 2


def test_worker_starts_once_and_reports_result(member, worker):
    created = member.client.post(URL, {"language": "python", "code": "print(1)"}).json()
    assert created["status"] == "queued"
    start = worker.post(f"/api/v1/worker/executions/{created['id']}/start")
    assert start.status_code == 200 and start.json()["request"]["code"] == "print(1)"
    again = worker.post(f"/api/v1/worker/executions/{created['id']}/start")
    assert again.status_code == 409
    lease = start.json()["lease_id"]
    result = {"status": "OK", "stdout": "1\n", "exit_code": 0}
    r = worker.post(f"/api/v1/worker/executions/{created['id']}/result", {"result": result},
                    HTTP_IDEMPOTENCY_KEY="k1", HTTP_X_CRUCIBLE_LEASE=lease)
    assert r.json() == {"status": "done"}
    replay = worker.post(f"/api/v1/worker/executions/{created['id']}/result",
                         {"result": result}, HTTP_IDEMPOTENCY_KEY="k1",
                         HTTP_X_CRUCIBLE_LEASE=lease)
    assert replay.status_code == 200  # a retried report is answered, not refused
    got = member.client.get(f"{URL}/{created['id']}").json()
    assert got["status"] == "done" and got["result"]["stdout"] == "1\n"


def test_other_teams_cannot_see_executions(member, outsider):
    created = member.client.post(URL, {"language": "python", "code": "print(1)"}).json()
    assert outsider.client.get(f"{URL}/{created['id']}").status_code == 404


def test_a_result_comes_back_only_under_its_executions_lease(member, worker, db):
    """A start hands out a lease; a result from another worker token, under another lease
    id, or after the lease expired is refused with the runs API's 409s and stores nothing."""
    from datetime import timedelta

    from django.utils import timezone

    from apps.core.actor import Actor
    from apps.teams.services import worker_token_create
    from tests.django_fixtures import client_for_token

    created = member.client.post(URL, {"language": "python", "code": "print(1)"}).json()
    url = f"/api/v1/worker/executions/{created['id']}"
    start = worker.post(f"{url}/start").json()
    assert start["lease_id"] and start["lease_expires_at"]
    body = {"result": {"status": "OK", "stdout": "1\n", "exit_code": 0}}
    _, raw = worker_token_create(actor=Actor.system(), team=None, name="other pool")
    other = client_for_token(raw).post(f"{url}/result", body, format="json",
                                       HTTP_X_CRUCIBLE_LEASE=start["lease_id"])
    assert other.status_code == 409 and other.json()["code"] == "lease_invalid"
    wrong = worker.post(f"{url}/result", body, format="json", HTTP_X_CRUCIBLE_LEASE="nope")
    assert wrong.status_code == 409 and wrong.json()["code"] == "lease_invalid"
    missing = worker.post(f"{url}/result", body, format="json")
    assert missing.status_code == 409 and missing.json()["code"] == "lease_invalid"
    Execution.objects.filter(pk=created["id"]).update(
        lease_expires_at=timezone.now() - timedelta(seconds=1))
    late = worker.post(f"{url}/result", body, format="json",
                       HTTP_X_CRUCIBLE_LEASE=start["lease_id"])
    assert late.status_code == 409 and late.json()["code"] == "lease_expired"
    assert Execution.objects.get(pk=created["id"]).status == "running"
    Execution.objects.filter(pk=created["id"]).update(
        lease_expires_at=timezone.now() + timedelta(seconds=60))
    ok = worker.post(f"{url}/result", body, format="json",
                     HTTP_X_CRUCIBLE_LEASE=start["lease_id"])
    assert ok.status_code == 200 and ok.json() == {"status": "done"}
    done = worker.post(f"{url}/result", body, format="json",
                       HTTP_X_CRUCIBLE_LEASE=start["lease_id"])
    assert done.status_code == 409 and done.json()["code"] == "not_running"
