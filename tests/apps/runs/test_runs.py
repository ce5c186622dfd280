"""Launching runs (with preview and validation), their lifecycle, listing and events."""

from __future__ import annotations

import uuid

import pytest

from apps.core.actor import Actor
from apps.environments import services as env_services
from apps.environments.models import Environment
from apps.lineage.models import LineageEdge
from apps.runs.models import Run, RunEvent
from tests.factories import DatasetFactory, make_run, make_version

RUNS = "/api/v1/teams/acme/runs"


@pytest.fixture
def qa(project):
    dataset = DatasetFactory(project=project, team=project.team, slug="qa")
    make_version(dataset, [{"prompt": f"q{i}", "answer": str(i)} for i in range(4)])
    dataset.refresh_from_db()
    return dataset


def doc(**overrides):
    return {"project": "main", "kind": "profile", "datasets": ["qa"], "config": {}, **overrides}


def launch(client, **overrides):
    return client.post(RUNS, doc(**overrides), format="json")


def status_events(run_id: object) -> list[dict]:
    return [
        {"status": e.data["status"], "from": e.data.get("from"), "message": e.message}
        for e in RunEvent.objects.filter(run_id=run_id, kind="status").order_by("seq")
    ]


# --- launch ----------------------------------------------------------------------------------


def test_launch_profile_run_freezes_config_and_pins_version(member, qa):
    v1 = qa.current_version
    r = launch(member.client, name="first profile")
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["status"] == "queued"
    assert body["kind"] == "profile"
    assert body["pool"] == "cpu"
    assert body["priority"] == 0
    assert body["attempt"] == 0
    assert body["name"] == "first profile"
    assert body["config"] == {"dataset": "qa", "max_records": None, "progress_every": 1000,
                              "top_values": 5}
    assert body["datasets"] == [{"alias": "qa", "dataset": "qa", "digest": v1.digest,
                                 "number": 1, "record_count": 4}]
    run = Run.objects.get(pk=body["id"])
    assert run.created_by == member.user and run.queued_at is not None

    # A new upload moves the dataset's current pointer, not the run's pin.
    v2 = make_version(qa, [{"prompt": "new"}])
    qa.refresh_from_db()
    assert qa.current_version == v2
    again = member.client.get(f"{RUNS}/{body['id']}").json()
    assert again["datasets"][0]["digest"] == v1.digest
    assert again["datasets"][0]["number"] == 1
    assert again["config"] == body["config"]
    assert list(run.dataset_versions.all()) == [v1]

    # Lineage: the pinned version is the run's input.
    edge = LineageEdge.objects.get(target_type="run", target_id=body["id"])
    assert (edge.source_type, edge.source_id, edge.relation) == (
        "dataset_version", v1.digest, "input")


def test_launch_with_explicit_version_and_config(member, qa):
    make_version(qa, [{"x": 1}, {"x": 2}])
    r = launch(member.client, datasets=["qa@v1"], priority=7, pool="gpu",
               config={"max_records": 10, "progress_every": 2, "top_values": 0,
                       "dataset": "qa"})
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["datasets"][0]["number"] == 1
    assert body["priority"] == 7 and body["pool"] == "gpu"
    assert body["config"] == {"dataset": "qa", "max_records": 10, "progress_every": 2,
                              "top_values": 0}


def test_launch_with_environment_reference(member, qa, project):
    env = env_services.environment_create(actor=Actor.system(), team=project.team,
                                          project=project, slug="gsm")
    v1, _ = env_services.version_create(actor=Actor.system(), environment=env,
                                        spec={"task": "a"})
    v2, _ = env_services.version_create(actor=Actor.system(), environment=env,
                                        spec={"task": "b"})
    r = launch(member.client, environment="gsm@v1")
    assert r.status_code == 201, r.content
    assert r.json()["environment"] == {"environment": "gsm", "digest": v1.digest, "number": 1}
    latest = launch(member.client, environment="gsm")
    assert latest.json()["environment"]["number"] == 2
    by_digest = launch(member.client, environment=f"gsm@{v2.digest[:10]}")
    assert by_digest.json()["environment"]["digest"] == v2.digest
    assert LineageEdge.objects.filter(source_type="environment_version", source_id=v1.digest,
                                      relation="environment").count() == 1

    count = Run.objects.count()
    for ref in ("gsm@v3", "nope"):
        bad = launch(member.client, environment=ref)
        assert bad.status_code == 400, ref
        assert "environment" in bad.json()["errors"]
    assert Run.objects.count() == count
    assert Environment.objects.count() == 1


def test_preview_validates_resolves_and_creates_nothing(member, qa):
    runs, events = Run.objects.count(), RunEvent.objects.count()
    r = member.client.post(f"{RUNS}/preview", doc(priority=3), format="json")
    assert r.status_code == 200, r.content
    body = r.json()
    assert body["valid"] is True
    assert body["run"]["kind"] == "profile"
    assert body["run"]["pool"] == "cpu"
    assert body["run"]["priority"] == 3
    assert body["run"]["config"]["dataset"] == "qa"
    assert body["run"]["datasets"] == {
        "qa": {"dataset": "qa", "digest": qa.current_version.digest, "number": 1,
               "record_count": 4}
    }
    assert body["run"]["environment"] is None
    bad = member.client.post(f"{RUNS}/preview", doc(config={"nope": 1}), format="json")
    assert bad.status_code == 400
    assert (Run.objects.count(), RunEvent.objects.count()) == (runs, events)


def test_the_launch_document_is_recorded_in_the_first_status_event(member, qa):
    body = launch(member.client).json()
    first = RunEvent.objects.get(run_id=body["id"], seq=1)
    assert first.kind == "status" and first.data["status"] == "queued"
    assert first.data["document"]["datasets"]["qa"]["digest"] == qa.current_version.digest


# --- bad launches: 400 naming the problem, no run --------------------------------------------


@pytest.mark.parametrize(("overrides", "needle", "error_key"), [
    ({"config": {"bogus": 1}}, "config.bogus", "config.bogus"),
    ({"config": {"progress_every": "often"}}, "config.progress_every",
     "config.progress_every"),
    ({"config": {"max_records": 0}}, "config.max_records", "config.max_records"),
    ({"config": {"top_values": 1000}}, "config.top_values", "config.top_values"),
    ({"config": {"dataset": "other"}}, "config.dataset", "config.dataset"),
    ({"config": [1, 2]}, "config", "config"),
    ({"kind": "EVAL"}, "available: eval, profile, qc, synthesize, train", "kind"),
    ({"kind": "nope"}, "available: eval, profile, qc, synthesize, train", "kind"),
    ({"datasets": ["missing"]}, "missing", "datasets"),
    ({"datasets": ["qa@v9"]}, "v9", "datasets"),
    ({"datasets": ["qa@not-a-ref!"]}, "qa@not-a-ref!", "datasets"),
    ({"datasets": []}, "exactly 1", "datasets"),
    ({"datasets": ["qa", "qb"]}, "exactly 1", "datasets"),
    ({"datasets": ["qa", "qa@v1"]}, "pinned twice", "datasets"),
    ({"pool": "tpu"}, "pool", "pool"),
    ({"project": "elsewhere"}, "elsewhere", "project"),
    ({"priority": 1000}, "priority", "priority"),
])
def test_bad_launch_is_400_naming_the_field(member, qa, project, overrides, needle, error_key):
    qb = DatasetFactory(project=project, team=project.team, slug="qb")
    make_version(qb, [{"b": 1}])
    before = Run.objects.count()
    for url in (RUNS, f"{RUNS}/preview"):
        r = member.client.post(url, doc(**overrides), format="json")
        assert r.status_code == 400, (url, r.content)
        body = r.json()
        assert body["code"] == "invalid"
        assert needle in body["message"], body
        assert error_key in body["errors"], body
    assert Run.objects.count() == before
    assert not RunEvent.objects.exists()


def test_dataset_without_versions_is_400(member, project):
    DatasetFactory(project=project, team=project.team, slug="empty")
    r = launch(member.client, datasets=["empty"])
    assert r.status_code == 400 and "no versions" in r.json()["message"]


def test_viewer_cannot_launch(viewer, qa):
    r = launch(viewer.client)
    assert r.status_code == 403
    assert not Run.objects.exists()


def test_dataset_of_another_team_is_unknown(member, qa, other_team):
    from tests.factories import ProjectFactory

    theirs = DatasetFactory(project=ProjectFactory(team=other_team), team=other_team,
                            slug="secret")
    make_version(theirs)
    r = launch(member.client, datasets=["secret"])
    assert r.status_code == 400 and "secret" in r.json()["message"]


# --- idempotency -----------------------------------------------------------------------------


def test_idempotency_key_replays_the_same_run(member, qa):
    key = {"HTTP_IDEMPOTENCY_KEY": "launch-123"}
    first = member.client.post(RUNS, doc(), format="json", **key)
    second = member.client.post(RUNS, doc(), format="json", **key)
    assert first.status_code == second.status_code == 201
    assert first.json()["id"] == second.json()["id"]
    assert second["Idempotent-Replayed"] == "true"
    assert not first.has_header("Idempotent-Replayed")
    assert Run.objects.count() == 1
    assert RunEvent.objects.count() == 1

    # Same key, different body: refused, nothing created.
    reused = member.client.post(RUNS, doc(priority=5), format="json", **key)
    assert reused.status_code in (400, 422)
    assert reused.json()["code"] == "idempotency_key_reused"
    assert Run.objects.count() == 1

    # A new key is a new run.
    other = member.client.post(RUNS, doc(), format="json", HTTP_IDEMPOTENCY_KEY="launch-124")
    assert other.status_code == 201 and other.json()["id"] != first.json()["id"]
    assert Run.objects.count() == 2


def test_failed_launch_with_key_is_not_stored(member, qa):
    key = {"HTTP_IDEMPOTENCY_KEY": "retry-me"}
    bad = member.client.post(RUNS, doc(datasets=["later"]), format="json", **key)
    assert bad.status_code == 400
    later = DatasetFactory(project=qa.project, team=qa.team, slug="later")
    make_version(later)
    good = member.client.post(RUNS, doc(datasets=["later"]), format="json", **key)
    assert good.status_code == 201, good.content


def test_idempotency_keys_are_per_caller(member, admin, qa):
    key = {"HTTP_IDEMPOTENCY_KEY": "shared-key"}
    a = member.client.post(RUNS, doc(), format="json", **key)
    b = admin.client.post(RUNS, doc(), format="json", **key)
    assert a.status_code == b.status_code == 201
    assert a.json()["id"] != b.json()["id"]


# --- lifecycle -------------------------------------------------------------------------------


def test_cancel_then_cancel_again_then_resume(member, qa):
    run_id = launch(member.client).json()["id"]
    r = member.client.post(f"{RUNS}/{run_id}/cancel")
    assert r.status_code == 200, r.content
    assert r.json()["status"] == "canceled"
    assert r.json()["finished_at"] is not None

    again = member.client.post(f"{RUNS}/{run_id}/cancel")
    assert again.status_code == 409
    assert again.json()["code"] == "illegal_transition"
    assert again.json()["errors"] == {"status": "canceled", "requested": "canceled"}

    resumed = member.client.post(f"{RUNS}/{run_id}/resume")
    assert resumed.status_code == 200
    assert resumed.json()["status"] == "queued"
    assert resumed.json()["finished_at"] is None

    # A queued run cannot be resumed.
    assert member.client.post(f"{RUNS}/{run_id}/resume").json()["code"] == "illegal_transition"

    assert status_events(run_id) == [
        {"status": "queued", "from": None, "message": "queued"},
        {"status": "canceled", "from": "queued", "message": "canceled: by mia"},
        {"status": "queued", "from": "canceled", "message": "queued: resumed by mia"},
    ]


def test_every_transition_writes_a_status_event(member, qa, worker):
    run_id = launch(member.client).json()["id"]
    claim = worker.post("/api/v1/worker/claim", {"pool": "cpu", "worker_id": "w1"}).json()
    lease = {"HTTP_X_CRUCIBLE_LEASE": claim["lease_id"]}
    assert worker.post(f"/api/v1/worker/runs/{run_id}/status", {"status": "running"},
                       **lease).status_code == 200
    assert worker.post(f"/api/v1/worker/runs/{run_id}/status",
                       {"status": "failed", "error": "boom"}, **lease).status_code == 200
    assert member.client.post(f"{RUNS}/{run_id}/resume").status_code == 200
    assert member.client.post(f"{RUNS}/{run_id}/cancel").status_code == 200

    got = [(e["from"], e["status"]) for e in status_events(run_id)]
    assert got == [(None, "queued"), ("queued", "claimed"), ("claimed", "running"),
                   ("running", "failed"), ("failed", "queued"), ("queued", "canceled")]
    failed = RunEvent.objects.get(run_id=run_id, kind="status", data__status="failed")
    assert failed.level == "error" and "boom" in failed.message
    run = Run.objects.get(pk=run_id)
    assert run.status == "canceled" and run.error == ""  # resume clears the error
    assert run.event_seq == RunEvent.objects.filter(run=run).count() == 6


def test_viewer_cannot_cancel(viewer, member, qa):
    run_id = launch(member.client).json()["id"]
    assert viewer.client.post(f"{RUNS}/{run_id}/cancel").status_code == 403
    assert viewer.client.get(f"{RUNS}/{run_id}").json()["status"] == "queued"


# --- reading ---------------------------------------------------------------------------------


def test_list_filter_by_status_and_order_by_priority(member, qa):
    ids = [launch(member.client, priority=p).json()["id"] for p in (5, -3, 9, 0)]
    member.client.post(f"{RUNS}/{ids[2]}/cancel")

    queued = member.client.get(RUNS, {"status": "queued"}).json()["results"]
    assert {r["id"] for r in queued} == {ids[0], ids[1], ids[3]}
    canceled = member.client.get(RUNS, {"status": "canceled"}).json()["results"]
    assert [r["id"] for r in canceled] == [ids[2]]
    both = member.client.get(RUNS, {"status__in": "canceled,queued"}).json()["results"]
    assert len(both) == 4

    by_priority = member.client.get(RUNS, {"ordering": "priority"}).json()["results"]
    assert [r["priority"] for r in by_priority] == [-3, 0, 5, 9]
    by_priority_desc = member.client.get(RUNS, {"ordering": "-priority"}).json()["results"]
    assert [r["priority"] for r in by_priority_desc] == [9, 5, 0, -3]

    newest_first = member.client.get(RUNS).json()["results"]
    assert [r["id"] for r in newest_first] == ids[::-1]


def test_list_other_filters(member, qa):
    launch(member.client, pool="gpu")
    launch(member.client)
    assert len(member.client.get(RUNS, {"pool": "gpu"}).json()["results"]) == 1
    assert len(member.client.get(RUNS, {"kind": "profile"}).json()["results"]) == 2
    assert len(member.client.get(RUNS, {"project__slug": "main"}).json()["results"]) == 2
    assert member.client.get(RUNS, {"project__slug": "zzz"}).json()["results"] == []


def test_cursor_pagination_follows_next_without_duplicates(member, qa):
    ids = {launch(member.client).json()["id"] for _ in range(5)}
    seen: list[str] = []
    pages = 0
    page = member.client.get(RUNS, {"page_size": 2}).json()
    while True:
        pages += 1
        assert len(page["results"]) <= 2
        seen += [r["id"] for r in page["results"]]
        if not page["next"]:
            break
        assert page["next"].startswith("http://testserver/api/v1/teams/acme/runs")
        page = member.client.get(page["next"]).json()
    assert pages == 3
    assert len(seen) == len(set(seen)) == 5
    assert set(seen) == ids


def test_cursor_pagination_with_priority_ordering(member, qa):
    for p in (1, 1, 2, 2, 3):
        launch(member.client, priority=p)
    seen, priorities = [], []
    page = member.client.get(RUNS, {"page_size": 2, "ordering": "priority"}).json()
    while True:
        seen += [r["id"] for r in page["results"]]
        priorities += [r["priority"] for r in page["results"]]
        if not page["next"]:
            break
        page = member.client.get(page["next"]).json()
    assert len(seen) == len(set(seen)) == 5
    assert priorities == [1, 1, 2, 2, 3]


def test_runs_of_other_teams_are_invisible(member, outsider, qa):
    run_id = launch(member.client).json()["id"]
    assert outsider.client.get(f"{RUNS}/{run_id}").status_code == 404
    assert outsider.client.get("/api/v1/teams/rival/runs").json()["results"] == []
    r = outsider.client.get(f"/api/v1/teams/rival/runs/{run_id}")
    assert r.status_code == 404 and r.json()["code"] == "not_found"


def test_events_are_gap_free_and_resumable(member, qa):
    run_id = launch(member.client).json()["id"]
    for action in ("cancel", "resume", "cancel", "resume"):
        assert member.client.post(f"{RUNS}/{run_id}/{action}").status_code == 200
    url = f"{RUNS}/{run_id}/events"
    everything = member.client.get(url).json()
    seqs = [e["seq"] for e in everything["results"]]
    assert seqs == [1, 2, 3, 4, 5]
    assert everything["last_seq"] == 5 and everything["more"] is False
    assert all(e["kind"] == "status" for e in everything["results"])

    after = member.client.get(url, {"after": 2}).json()
    assert [e["seq"] for e in after["results"]] == [3, 4, 5]
    first_page = member.client.get(url, {"after": 2, "limit": 2}).json()
    assert [e["seq"] for e in first_page["results"]] == [3, 4]
    assert first_page["more"] is True and first_page["last_seq"] == 4
    rest = member.client.get(url, {"after": first_page["last_seq"], "limit": 2}).json()
    assert [e["seq"] for e in rest["results"]] == [5]
    assert rest["more"] is False
    nothing = member.client.get(url, {"after": 5}).json()
    assert nothing == {"results": [], "last_seq": 5, "more": False}

    assert member.client.get(url, {"after": "x"}).status_code == 400
    assert member.client.get(url, {"limit": 0}).status_code == 400
    assert member.client.get(url, {"after": -1}).status_code == 400


@pytest.mark.parametrize("suffix", ["", "/events", "/metrics", "/checkpoints", "/report"])
def test_unknown_or_malformed_run_id_is_404_json(member, qa, suffix):
    for run_id in (uuid.uuid4(), "not-a-uuid", "12345"):
        r = member.client.get(f"{RUNS}/{run_id}{suffix}")
        assert r.status_code == 404, (run_id, suffix)
        assert r["Content-Type"].startswith("application/json")
        assert r.json()["code"] == "not_found"
    r = member.client.post(f"{RUNS}/{uuid.uuid4()}/cancel")
    assert r.status_code == 404 and r.json()["code"] == "not_found"


def test_report_of_a_run_without_one_is_404(member, qa):
    run_id = launch(member.client).json()["id"]
    r = member.client.get(f"{RUNS}/{run_id}/report")
    assert r.status_code == 404 and "no report" in r.json()["message"]


def test_metrics_of_a_new_run_are_empty(member, qa):
    run_id = launch(member.client).json()["id"]
    r = member.client.get(f"{RUNS}/{run_id}/metrics").json()
    assert r == {"names": [], "max_points": 1000, "layout": "points", "series": []}
    assert member.client.get(f"{RUNS}/{run_id}/metrics",
                             {"max_points": 0}).status_code == 400


def test_make_run_factory_matches_the_api(project, member):
    run = make_run(project)
    got = member.client.get(f"{RUNS}/{run.pk}").json()
    assert got["status"] == "queued" and len(got["datasets"]) == 1
