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
    result = {"status": "OK", "stdout": "1\n", "exit_code": 0}
    r = worker.post(f"/api/v1/worker/executions/{created['id']}/result", {"result": result},
                    HTTP_IDEMPOTENCY_KEY="k1")
    assert r.json() == {"status": "done"}
    replay = worker.post(f"/api/v1/worker/executions/{created['id']}/result",
                         {"result": result}, HTTP_IDEMPOTENCY_KEY="k1")
    assert replay.status_code == 200  # a retried report is answered, not refused
    got = member.client.get(f"{URL}/{created['id']}").json()
    assert got["status"] == "done" and got["result"]["stdout"] == "1\n"


def test_other_teams_cannot_see_executions(member, outsider):
    created = member.client.post(URL, {"language": "python", "code": "print(1)"}).json()
    assert outsider.client.get(f"{URL}/{created['id']}").status_code == 404
