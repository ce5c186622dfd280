"""workers.client against the real app, in-process through httpx's WSGI transport."""

from __future__ import annotations

import json

import pytest

from apps.datasets.models import DatasetVersion
from apps.metrics.models import MetricPoint
from apps.runs.models import Run, RunEvent
from tests.factories import put_run_object
from workers.client import ApiError, LeaseLost, WorkerSession

RECORDS = [{"prompt": f"q{i}", "answer": str(i)} for i in range(6)]


@pytest.fixture
def qa(api, project):
    api.create_dataset("acme", "qa", "main", description="questions")
    return api.upload_version("acme", "qa", RECORDS, message="v1")


def test_me_and_dataset_upload(api, member, project):
    assert api.me()["username"] == "mia"
    created = api.create_dataset("acme", "qa", "main")
    assert created["slug"] == "qa" and created["current_version"] is None
    v1 = api.upload_version("acme", "qa", RECORDS, message="first")
    assert v1["number"] == 1 and v1["record_count"] == 6 and v1["message"] == "first"
    # Same content: the same version (the server answers 200 instead of 201).
    again = api.upload_version("acme", "qa", iter(RECORDS))
    assert again["digest"] == v1["digest"] and again["number"] == 1
    v2 = api.upload_version("acme", "qa", RECORDS[:3], parents=["qa@v1"])
    assert v2["number"] == 2 and v2["parents"] == [v1["digest"]]
    assert DatasetVersion.objects.count() == 2
    assert api.get("teams/acme/datasets/qa")["current_version"]["number"] == 2


def test_api_error_carries_code_and_message(api, project, qa):
    with pytest.raises(ApiError) as info:
        api.create_dataset("acme", "qa", "main")
    assert info.value.status == 409 and info.value.code == "conflict"

    with pytest.raises(ApiError) as info:
        api.launch_run("acme", project="main", kind="nope", datasets=["qa"], config={})
    err = info.value
    assert not isinstance(err, LeaseLost)
    assert err.status == 400
    assert err.code == "invalid"
    assert "available: eval, profile, qc, synthesize, train" in err.message
    assert err.body["errors"] == {"kind": ["unavailable kind 'nope'"]}
    assert "400 invalid" in str(err)

    # A preview answers with the validation result instead of raising on it.
    invalid = api.preview_run("acme", project="main", kind="profile", datasets=["qa"],
                              config={"progress_every": "x"})
    assert invalid["valid"] is False and "config.progress_every" in invalid["message"]

    with pytest.raises(ApiError) as info:
        api.run("acme", "00000000-0000-0000-0000-000000000000")
    assert info.value.status == 404 and info.value.code == "not_found"
    assert not Run.objects.exists()


def test_launch_run_and_read_it_back(api, qa):
    preview = api.preview_run("acme", project="main", kind="profile", datasets=["qa"],
                              config={})
    assert preview["valid"] is True
    assert preview["run"]["datasets"]["qa"]["digest"] == qa["digest"]
    assert not Run.objects.exists()

    launched = api.launch_run("acme", project="main", kind="profile", datasets=["qa"],
                              config={"top_values": 3}, priority=2)
    assert launched["status"] == "queued"
    assert launched["config"]["top_values"] == 3
    got = api.run("acme", launched["id"])
    assert got["id"] == launched["id"] and got["priority"] == 2
    assert got["datasets"][0]["digest"] == qa["digest"]
    # The client sent an Idempotency-Key: the server stored the response under it.
    from apps.core.models import IdempotencyRecord

    [record] = [r for r in IdempotencyRecord.objects.all()
                if r.response.get("id") == launched["id"]]
    assert len(record.key) == 32
    # Each logical call gets its own key: launching again is a second run.
    second = api.launch_run("acme", project="main", kind="profile", datasets=["qa"], config={})
    assert second["id"] != launched["id"]
    assert Run.objects.count() == 2

    events = api.run_events("acme", launched["id"])
    assert [e["seq"] for e in events["results"]] == [1]
    assert api.run_events("acme", launched["id"], after=1)["results"] == []


def test_paginate_follows_cursors(api, qa):
    ids = {api.launch_run("acme", project="main", kind="profile", datasets=["qa"],
                          config={})["id"] for _ in range(5)}
    first_page = api.get("teams/acme/runs", page_size=2)
    assert len(first_page["results"]) == 2 and first_page["next"]
    seen = [r["id"] for r in api.paginate("teams/acme/runs", page_size=2)]
    assert len(seen) == len(set(seen)) == 5
    assert set(seen) == ids
    queued = list(api.paginate("teams/acme/runs", page_size=2, status="queued"))
    assert len(queued) == 5
    assert list(api.paginate("teams/acme/runs", status="canceled")) == []


def test_worker_session_end_to_end(api, pool, qa, object_store):
    run = api.launch_run("acme", project="main", kind="profile", datasets=["qa"], config={})
    session = pool.claim("cpu", "w-client")
    assert isinstance(session, WorkerSession)
    assert session.run_id == run["id"]
    assert session.run.datasets["qa"].digest == qa["digest"]
    assert session.headers["X-Crucible-Lease"] == session.lease_id
    assert pool.claim("cpu", "w-other") is None

    assert session.heartbeat()["status"] == "claimed"
    assert session.set_status("running") == {"status": "running"}

    first = session.log_metrics([{"name": "loss", "step": s, "value": 1.0 / (s + 1)}
                                 for s in range(10)])
    second = session.log_metrics([{"name": "loss", "step": 10, "value": 0.05}])
    assert first == {"stored": 10, "duplicate": False}
    assert second == {"stored": 1, "duplicate": False}
    # Sequence numbers were 1 and 2: resending batch 1 is recognised as a duplicate.
    assert session.log_metrics([{"name": "loss", "step": 0, "value": 9.0}], seq=1) == \
        {"stored": 0, "duplicate": True}
    assert MetricPoint.objects.filter(run_id=run["id"]).count() == 11
    series = api.run_metrics("acme", run["id"], names=["loss"], max_points=5)
    assert series["names"] == ["loss"]
    assert len(series["series"][0]["points"]) <= 5
    assert series["series"][0]["points"][-1]["last"] == 0.05

    logged = session.log_event("halfway", level="warning", data={"seen": 3})
    assert len(logged["seqs"]) == 1
    event = RunEvent.objects.get(run_id=run["id"], seq=logged["seqs"][0])
    assert (event.message, event.level, event.data) == ("halfway", "warning", {"seen": 3})

    ckpt = session.add_checkpoint(5, put_run_object(session.run, "checkpoints/5.tar"),
                                  {"loss": 0.2})
    assert ckpt["step"] == 5
    assert session.add_samples([{"step": 5, "prompt": "p", "completion": "c"}]) == {"stored": 1}

    report = {"records": 6, "fields": {}}
    uri = put_run_object(session.run, "profile.json", json.dumps(report).encode())
    assert session.set_report(uri) == {"report_uri": uri}
    assert session.set_status("succeeded") == {"status": "succeeded"}
    assert api.run_report("acme", run["id"]) == report
    assert api.wait_for_run("acme", run["id"], timeout=1)["status"] == "succeeded"

    # Done: the lease is gone.
    with pytest.raises(LeaseLost) as info:
        session.heartbeat()
    assert info.value.code == "run_not_active"


def test_lease_lost_after_cancel(api, pool, qa):
    run = api.launch_run("acme", project="main", kind="profile", datasets=["qa"], config={})
    session = pool.claim("cpu", "w1", run_id=run["id"])
    session.set_status("running")
    canceled = api.cancel_run("acme", run["id"])
    assert canceled["status"] == "canceled"

    with pytest.raises(LeaseLost) as info:
        session.heartbeat()
    assert info.value.status == 409 and info.value.code == "run_not_active"
    for call in (lambda: session.set_status("succeeded"),
                 lambda: session.log_metrics([{"name": "x", "step": 0, "value": 1.0}]),
                 lambda: session.log_event("still here?")):
        with pytest.raises(LeaseLost):
            call()
    assert not MetricPoint.objects.exists()
    assert Run.objects.get(pk=run["id"]).status == "canceled"


def test_lease_lost_on_a_wrong_lease_and_claim_conflict(api, pool, qa):
    run = api.launch_run("acme", project="main", kind="profile", datasets=["qa"], config={})
    session = pool.claim("cpu", "w1")
    impostor = WorkerSession(pool, session.run.model_copy(update={"lease_id": "forged"}), "w2")
    with pytest.raises(LeaseLost) as info:
        impostor.heartbeat()
    assert info.value.code == "lease_invalid"
    with pytest.raises(ApiError) as conflict:
        pool.claim("cpu", "w2", run_id=run["id"])
    assert conflict.value.status == 409 and not isinstance(conflict.value, LeaseLost)
    assert session.heartbeat()["status"] == "claimed"


def test_personal_tokens_cannot_use_worker_endpoints(api, qa):
    with pytest.raises(ApiError) as info:
        api.claim("cpu", "sneaky")
    assert info.value.status == 403
