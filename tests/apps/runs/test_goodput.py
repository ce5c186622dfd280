"""Goodput arithmetic (apps.runs.goodput) against hand-computed timelines, and the run
detail API and page that show it."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest
from django.test import Client

from apps.runs.goodput import Attempt, CheckpointMark, compute
from apps.runs.models import Checkpoint, Run, RunAttempt

# Attempt 1: claimed 100, began 110, checkpoints at steps 5 (150) and 10 (190), lost at 230.
# Attempt 2: claimed 260, resumed from 10 at 275, checkpoint 15 (320), preempted at 325.
# Attempt 3: claimed 340, resumed from 15 at 350, succeeded at 400 (the run's finish).
THREE = [
    Attempt(1, "lost", claimed_at=100, ended_at=230, started_at=110, resume_step=0),
    Attempt(2, "preempted", claimed_at=260, ended_at=325, started_at=275, resume_step=10),
    Attempt(3, "succeeded", claimed_at=340, ended_at=400, started_at=350, resume_step=15),
]
MARKS = [CheckpointMark(5, 150), CheckpointMark(10, 190), CheckpointMark(15, 320)]


def test_a_lost_then_preempted_then_finished_run_by_hand():
    g = compute(THREE, MARKS, now=1000, finished_at=400)
    # wall 400-100 = 300; useful (190-110) + (320-275) + (400-350) = 80 + 45 + 50 = 175;
    # startup 10 + 15 + 10 = 35; queued (260-230) + (340-325) = 45; lost: 230-190 = 40 to the
    # lost worker, 325-320 = 5 to the preemption.
    assert (g.wall, g.useful, g.startup, g.queued, g.failure, g.preemption) == (
        300, 175, 35, 45, 40, 5)
    assert g.useful + g.startup + g.queued + g.failure + g.preemption == g.wall
    assert g.goodput == 175 / 300
    assert [(a.number, a.startup, a.useful, a.lost) for a in g.attempts] == [
        (1, 10, 80, 40), (2, 15, 45, 5), (3, 10, 50, 0)]


def test_only_checkpoints_the_next_attempt_resumed_from_keep_work():
    # Attempt 2 resumed from step 5 (the step-10 object was unusable): attempt 1 keeps its
    # work up to the step-5 checkpoint only, and its steps 6-10 are redone.
    attempts = [THREE[0], Attempt(2, "succeeded", claimed_at=260, ended_at=330,
                                  started_at=270, resume_step=5)]
    g = compute(attempts, MARKS[:2], now=1000, finished_at=330)
    assert (g.attempts[0].useful, g.attempts[0].lost) == (150 - 110, 230 - 150)
    assert (g.useful, g.failure, g.queued, g.wall) == (40 + 60, 80, 30, 230)


def test_an_attempt_with_no_checkpoint_loses_all_its_work_and_a_drain_is_a_preemption():
    attempts = [Attempt(1, "drained", claimed_at=0, ended_at=50, started_at=20, resume_step=0),
                Attempt(2, "active", claimed_at=52, started_at=60, resume_step=0)]
    g = compute(attempts, [CheckpointMark(5, 70)], now=100)
    # Checkpoint 5 was registered by attempt 2 (after attempt 1 ended): it keeps nothing of
    # attempt 1. The active attempt's work up to now counts.
    assert (g.attempts[0].startup, g.attempts[0].useful, g.attempts[0].lost) == (20, 0, 30)
    assert (g.preemption, g.failure, g.queued, g.useful, g.startup, g.wall) == (
        30, 0, 2, 40, 28, 100)


def test_an_attempt_that_never_began_is_all_startup_and_a_queued_run_counts_its_wait():
    attempts = [Attempt(1, "lost", claimed_at=10, ended_at=40)]
    g = compute(attempts, [], now=100)
    assert (g.startup, g.useful, g.failure, g.queued, g.wall) == (30, 0, 0, 60, 90)
    assert g.goodput == 0


def test_no_attempt_no_goodput():
    g = compute([], [], now=5)
    assert g.goodput is None and g.wall == 0 and g.as_dict()["goodput"] is None


def browser_for(caller) -> Client:
    client = Client()
    client.force_login(caller.user)
    return client


def _at(seconds: float) -> datetime:
    return datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=seconds)


@pytest.fixture
def timed_run(project, qa):
    """THREE and MARKS as database rows (times in seconds after 2026-01-01)."""
    from tests.factories import make_run

    run = make_run(project, qa)
    Run.objects.filter(pk=run.pk).update(status="succeeded", attempt=3, finished_at=_at(400))
    for a in THREE:
        assert a.ended_at is not None and a.started_at is not None
        RunAttempt.objects.create(run=run, number=a.number, outcome=a.outcome,
                                  claimed_at=_at(a.claimed_at), ended_at=_at(a.ended_at),
                                  started_at=_at(a.started_at), resume_step=a.resume_step)
    for m in MARKS:
        Checkpoint.objects.create(run=run, team=run.team, step=m.step, resumable=True,
                                  uri=f"file:///x/step-{m.step}.tar",
                                  created_at=_at(m.created_at))
    # The final export is not resumable: it marks no kept work of a failed attempt.
    Checkpoint.objects.create(run=run, team=run.team, step=20, uri="file:///x/final.tar",
                              created_at=_at(399))
    return run


def test_the_run_detail_api_reports_goodput_and_its_breakdown(member, timed_run):
    body = member.client.get(f"/api/v1/teams/acme/runs/{timed_run.pk}").json()
    assert body["goodput"]["goodput"] == pytest.approx(175 / 300, abs=1e-12)
    assert {k: body["goodput"][k] for k in ("wall_s", "useful_s", "queued_s", "startup_s",
                                             "lost_preemption_s", "lost_failure_s")} == {
        "wall_s": 300, "useful_s": 175, "queued_s": 45, "startup_s": 35,
        "lost_preemption_s": 5, "lost_failure_s": 40}
    assert [a["useful_s"] for a in body["goodput"]["attempts"]] == [80, 45, 50]
    assert [a["resume_step"] for a in body["attempts"]] == [0, 10, 15]
    # Lists leave it out (it is computed per run).
    listed = member.client.get("/api/v1/teams/acme/runs").json()["results"]
    assert "goodput" not in listed[0]


def test_the_run_page_shows_the_goodput_figure(member, timed_run):
    html = browser_for(member).get(f"/t/acme/runs/{timed_run.pk}/").content.decode()
    figure = re.search(r'id="goodput-value"[^>]*>([^<]*)<', html)
    assert figure is not None and figure.group(1) == "58.3%"
    assert dict(re.findall(r'<dd data-part="(\w+)">([^<]*)</dd>', html)) == {
        "useful": "175.0 s", "queued": "45.0 s", "startup": "35.0 s",
        "preemption": "5.0 s", "failure": "40.0 s"}
    table = html[html.index('id="attempts"'):]
    table = table[:table.index("</table>")]
    assert re.findall(r'<td class="num">([^<]*)</td>', table) == [
        "10.0 s", "80.0 s", "40.0 s", "15.0 s", "45.0 s", "5.0 s", "10.0 s", "50.0 s", "0.0 s"]


def test_the_openapi_schema_documents_the_run_detail_goodput(member):
    import json

    schema = json.loads(member.client.get("/api/v1/schema?format=json").content)
    schemas = schema["components"]["schemas"]
    ok = schema["paths"]["/api/v1/teams/{team}/runs/{run}/"]["get"]["responses"]["200"]
    detail = schemas[ok["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]]
    ref = detail["properties"]["goodput"]
    name = (ref.get("$ref") or ref["allOf"][0]["$ref"]).rsplit("/", 1)[-1]
    assert set(schemas[name]["properties"]) == {
        "goodput", "wall_s", "useful_s", "queued_s", "startup_s", "lost_preemption_s",
        "lost_failure_s", "attempts"}
    assert schemas[name]["properties"]["goodput"].get("nullable") is True
    assert "/api/v1/worker/runs/{run}/started" in schema["paths"]


W = "/api/v1/worker"


def _claim(worker, run, worker_id):
    r = worker.post(f"{W}/claim", {"pool": run.pool, "worker_id": worker_id,
                                   "run_id": str(run.pk)}, format="json")
    assert r.status_code == 200, r.content
    return {"HTTP_X_CRUCIBLE_LEASE": r.json()["lease_id"]}


def test_a_drained_attempt_is_given_back_and_requeued_and_success_records_goodput(
        worker, member, project, django_capture_on_commit_callbacks):
    from apps.core import telemetry
    from tests.factories import make_train_run

    run = make_train_run(project, max_attempts=1)
    lease = _claim(worker, run, "w1")
    assert worker.post(f"{W}/runs/{run.pk}/started", {"resume_step": -1}, format="json",
                       **lease).status_code == 400
    started = worker.post(f"{W}/runs/{run.pk}/started", {"resume_step": 0}, format="json",
                          **lease).json()
    assert (started["attempt"], started["resume_step"]) == (1, 0)
    # A second report keeps the first stamp.
    again = worker.post(f"{W}/runs/{run.pk}/started", {"resume_step": 7}, format="json",
                        **lease).json()
    assert (again["started_at"], again["resume_step"]) == (started["started_at"], 0)
    r = worker.post(f"{W}/runs/{run.pk}/status", {"status": "preempted", "drained": True},
                    format="json", **lease)
    assert r.json() == {"status": "queued"}, r.content
    run.refresh_from_db()
    # One attempt allowed, one used by the drain, and still it may run again: given back.
    assert (run.status, run.retry_base, run.preemptions, run.lease_id) == ("queued", 1, 0, "")
    assert run.attempts.get().outcome == "drained"
    # The old lease is dead.
    assert worker.post(f"{W}/runs/{run.pk}/started", {"resume_step": 0}, format="json",
                       **lease).status_code == 409

    lease = _claim(worker, run, "w2")
    worker.post(f"{W}/runs/{run.pk}/started", {"resume_step": 0}, format="json", **lease)
    before = telemetry.REGISTRY.get_sample_value("crucible_run_goodput_count") or 0
    with django_capture_on_commit_callbacks(execute=True):
        assert worker.post(f"{W}/runs/{run.pk}/status", {"status": "succeeded"}, format="json",
                           **lease).json() == {"status": "succeeded"}
    assert telemetry.REGISTRY.get_sample_value("crucible_run_goodput_count") == before + 1
    body = member.client.get(f"/api/v1/teams/acme/runs/{run.pk}").json()
    assert [a["outcome"] for a in body["attempts"]] == ["drained", "succeeded"]
    assert 0 < body["goodput"]["goodput"] < 1
