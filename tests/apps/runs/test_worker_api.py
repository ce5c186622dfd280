"""The worker protocol: claim, lease, heartbeat, status, and what workers report."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from typing import get_args

import pytest
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from apps.metrics.models import MetricBatch, MetricPoint
from apps.runs.models import Checkpoint, Pool, Run, RunEvent, Sample
from tests.factories import make_run, put_run_object
from workers.protocol import PoolName

W = "/api/v1/worker"
RUNS = "/api/v1/teams/acme/runs"


@pytest.fixture
def run(project, qa):
    return make_run(project, qa)


def claim(worker, pool="cpu", worker_id="w1", run_id=None):
    body = {"pool": pool, "worker_id": worker_id}
    if run_id is not None:
        body["run_id"] = str(run_id)
    return worker.post(f"{W}/claim", body, format="json")


@pytest.fixture
def claimed(worker, run):
    """(run, lease header kwargs) for a claimed run."""
    r = claim(worker, run_id=run.pk)
    assert r.status_code == 200, r.content
    return run, {"HTTP_X_CRUCIBLE_LEASE": r.json()["lease_id"]}


@pytest.fixture
def running(worker, claimed):
    run, lease = claimed
    r = worker.post(f"{W}/runs/{run.pk}/status", {"status": "running"}, **lease)
    assert r.status_code == 200, r.content
    return run, lease


def status_trail(run: Run) -> list[tuple[str | None, str]]:
    return [(e.data.get("from"), e.data["status"])
            for e in RunEvent.objects.filter(run=run, kind="status").order_by("seq")]


# --- claim -----------------------------------------------------------------------------------


def test_claim_takes_highest_priority_then_oldest(worker, project, qa):
    low = make_run(project, qa, priority=0)
    high_new = make_run(project, qa, priority=5)
    high_old = make_run(project, qa, priority=5)
    gpu = make_run(project, qa, priority=50, pool="gpu")
    now = timezone.now()
    Run.objects.filter(pk=low.pk).update(created_at=now - timedelta(hours=3))
    Run.objects.filter(pk=high_old.pk).update(created_at=now - timedelta(hours=2))
    Run.objects.filter(pk=high_new.pk).update(created_at=now - timedelta(hours=1))

    order = []
    for i in range(3):
        r = claim(worker, worker_id=f"w{i}")
        assert r.status_code == 200, r.content
        order.append(r.json()["id"])
    assert order == [str(high_old.pk), str(high_new.pk), str(low.pk)]

    nothing = claim(worker)
    assert nothing.status_code == 204
    assert not nothing.content
    assert claim(worker, pool="gpu").json()["id"] == str(gpu.pk)
    assert claim(worker, pool="sandbox").status_code == 204


def test_claim_returns_what_a_worker_needs(worker, run, qa):
    r = claim(worker, worker_id="host:1")
    assert r.status_code == 200
    body = r.json()
    assert body["id"] == str(run.pk)
    assert body["status"] == "claimed"
    assert body["attempt"] == 1
    assert body["team"] == "acme" and body["project"] == "main"
    assert body["config"]["dataset"] == "qa"
    assert len(body["lease_id"]) >= 20
    pin = body["datasets"]["qa"]
    assert pin["digest"] == qa.current_version.digest
    assert pin["uri"] == qa.current_version.uri
    run.refresh_from_db()
    assert run.status == "claimed" and run.lease_holder == "host:1"
    assert run.lease_id == body["lease_id"]
    assert run.lease_expires_at > timezone.now() + timedelta(seconds=60)
    assert status_trail(run) == [(None, "queued"), ("queued", "claimed")]
    # The team sees who holds it.
    assert worker.get(f"{W}/runs/{run.pk}").json()["lease_id"] == body["lease_id"]


def test_claiming_a_specific_run_already_claimed_is_409(worker, claimed):
    run, _ = claimed
    r = claim(worker, worker_id="w2", run_id=run.pk)
    assert r.status_code == 409
    assert r.json()["code"] == "not_claimable"
    run.refresh_from_db()
    assert run.lease_holder == "w1" and run.attempt == 1


def test_claiming_an_unknown_run_is_204(worker, run):
    assert claim(worker, run_id=uuid.uuid4()).status_code == 204


def test_claim_needs_a_valid_pool(worker, run):
    r = worker.post(f"{W}/claim", {"pool": "tpu", "worker_id": "w"}, format="json")
    assert r.status_code == 400 and "pool" in r.json()["errors"]


def test_the_protocol_names_the_same_pools_as_the_run_model():
    """workers.protocol cannot import the model; this keeps its pool names in step."""
    assert set(get_args(PoolName)) == set(Pool.values)


def test_worker_endpoints_need_a_worker_token(member, worker, run):
    r = member.client.post(f"{W}/claim", {"pool": "cpu", "worker_id": "w"}, format="json")
    assert r.status_code == 403
    # And team endpoints refuse worker tokens.
    assert worker.get(RUNS).status_code == 403
    run.refresh_from_db()
    assert run.status == "queued"


def test_team_worker_tokens_only_see_their_team(run, team, other_team):
    from apps.core.actor import Actor
    from apps.teams.services import worker_token_create
    from tests.django_fixtures import client_for_token

    _, rival_raw = worker_token_create(actor=Actor.system(), team=other_team, name="rival")
    rival = client_for_token(rival_raw)
    assert claim(rival).status_code == 204
    assert claim(rival, run_id=run.pk).status_code == 204
    assert rival.get(f"{W}/runs/{run.pk}").status_code == 404
    run.refresh_from_db()
    assert run.status == "queued"

    _, own_raw = worker_token_create(actor=Actor.system(), team=team, name="acme")
    own = client_for_token(own_raw)
    got = claim(own)
    assert got.status_code == 200 and got.json()["id"] == str(run.pk)
    lease = {"HTTP_X_CRUCIBLE_LEASE": got.json()["lease_id"]}
    assert rival.post(f"{W}/runs/{run.pk}/heartbeat", **lease).status_code == 404
    assert own.post(f"{W}/runs/{run.pk}/heartbeat", **lease).status_code == 200
    # A metric batch finds and locks the run in one query: the same 404 for a foreign run
    # (even with its lease), a malformed id and no run; nothing stored.
    batch = {"seq": 1, "points": [{"name": "loss", "step": 0, "value": 1.0}]}
    for path in (f"{W}/runs/{run.pk}/metrics", f"{W}/runs/not-a-uuid/metrics",
                 f"{W}/runs/{uuid.uuid4()}/metrics"):
        answer = rival.post(path, batch, **lease)
        assert answer.status_code == 404, (path, answer.content)
    assert not MetricPoint.objects.filter(run=run).exists()
    assert own.post(f"{W}/runs/{run.pk}/metrics", batch, **lease).json() == \
        {"stored": 1, "duplicate": False}


# --- lease -----------------------------------------------------------------------------------


def test_heartbeat_extends_the_lease(worker, claimed):
    run, lease = claimed
    soon = timezone.now() + timedelta(seconds=5)
    Run.objects.filter(pk=run.pk).update(lease_expires_at=soon)
    r = worker.post(f"{W}/runs/{run.pk}/heartbeat", **lease)
    assert r.status_code == 200, r.content
    assert r.json()["status"] == "claimed"
    extended = parse_datetime(r.json()["lease_expires_at"])
    assert extended > soon + timedelta(seconds=60)
    run.refresh_from_db()
    assert run.lease_expires_at == extended


def test_wrong_or_missing_lease_is_409_lease_invalid(worker, claimed):
    run, _ = claimed
    for headers in ({"HTTP_X_CRUCIBLE_LEASE": "not-the-lease"}, {}):
        r = worker.post(f"{W}/runs/{run.pk}/heartbeat", **headers)
        assert r.status_code == 409
        assert r.json()["code"] == "lease_invalid"
        r = worker.post(f"{W}/runs/{run.pk}/status", {"status": "running"}, **headers)
        assert r.json()["code"] == "lease_invalid"
    run.refresh_from_db()
    assert run.status == "claimed"


def expire(run: Run) -> None:
    Run.objects.filter(pk=run.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))


def test_expired_lease_is_409_then_sweep_requeues(worker, running):
    run, lease = running
    expire(run)
    r = worker.post(f"{W}/runs/{run.pk}/heartbeat", **lease)
    assert r.status_code == 409
    assert r.json()["code"] == "lease_expired"
    r = worker.post(f"{W}/runs/{run.pk}/metrics",
                    {"seq": 1, "points": [{"name": "x", "step": 0, "value": 1}]}, **lease)
    assert r.status_code == 409 and r.json()["code"] == "lease_expired"
    assert not MetricPoint.objects.exists()

    swept = worker.post(f"{W}/sweep")
    assert swept.status_code == 200
    assert swept.json()["requeued"] == [str(run.pk)]
    run.refresh_from_db()
    assert run.status == "queued"
    assert run.lease_id == "" and run.lease_expires_at is None
    assert status_trail(run)[-2:] == [("running", "preempted"), ("preempted", "queued")]
    assert worker.post(f"{W}/sweep").json()["requeued"] == []

    # The old lease is dead; a new claim is attempt 2 with a new lease.
    assert worker.post(f"{W}/runs/{run.pk}/heartbeat", **lease).json()["code"] == \
        "run_not_active"
    again = claim(worker, worker_id="w2")
    assert again.json()["id"] == str(run.pk)
    assert again.json()["attempt"] == 2
    assert again.json()["lease_id"] != lease["HTTP_X_CRUCIBLE_LEASE"]


def test_a_new_claim_sweeps_expired_leases_first(worker, claimed):
    run, lease = claimed
    expire(run)
    r = claim(worker, worker_id="w2")
    assert r.status_code == 200
    assert r.json()["id"] == str(run.pk)
    assert r.json()["attempt"] == 2
    assert status_trail(run) == [(None, "queued"), ("queued", "claimed"),
                                 ("claimed", "preempted"), ("preempted", "queued"),
                                 ("queued", "claimed")]
    preempted = RunEvent.objects.get(run=run, kind="status", data__status="preempted")
    assert "w1" in preempted.message
    run.refresh_from_db()
    assert run.lease_holder == "w2"


def test_tiny_lease_seconds_expire_on_their_own(worker, run, settings):
    settings.CRUCIBLE = {**settings.CRUCIBLE, "LEASE_SECONDS": 0}
    body = claim(worker).json()
    r = worker.post(f"{W}/runs/{run.pk}/heartbeat", HTTP_X_CRUCIBLE_LEASE=body["lease_id"])
    assert r.status_code == 409 and r.json()["code"] == "lease_expired"
    assert worker.post(f"{W}/sweep").json()["requeued"] == [str(run.pk)]


def test_canceled_run_heartbeat_is_409_run_not_active(worker, member, running):
    run, lease = running
    assert member.client.post(f"{RUNS}/{run.pk}/cancel").status_code == 200
    r = worker.post(f"{W}/runs/{run.pk}/heartbeat", **lease)
    assert r.status_code == 409
    assert r.json()["code"] == "run_not_active"
    assert r.json()["errors"] == {"status": "canceled"}
    r = worker.post(f"{W}/runs/{run.pk}/status", {"status": "succeeded"}, **lease)
    assert r.status_code == 409 and r.json()["code"] == "run_not_active"
    run.refresh_from_db()
    assert run.status == "canceled"


# --- status ----------------------------------------------------------------------------------


def test_running_then_succeeded_then_no_way_back(worker, running):
    run, lease = running
    run.refresh_from_db()
    assert run.started_at is not None
    r = worker.post(f"{W}/runs/{run.pk}/status", {"status": "succeeded"}, **lease)
    assert r.status_code == 200 and r.json() == {"status": "succeeded"}
    run.refresh_from_db()
    assert run.finished_at is not None and run.lease_id == ""

    back = worker.post(f"{W}/runs/{run.pk}/status", {"status": "running"}, **lease)
    assert back.status_code == 409
    run.refresh_from_db()
    assert run.status == "succeeded"
    assert status_trail(run) == [(None, "queued"), ("queued", "claimed"),
                                 ("claimed", "running"), ("running", "succeeded")]


def test_running_twice_is_an_illegal_transition(worker, running):
    run, lease = running
    r = worker.post(f"{W}/runs/{run.pk}/status", {"status": "running"}, **lease)
    assert r.status_code == 409 and r.json()["code"] == "illegal_transition"


@pytest.mark.parametrize("status", ["canceled", "queued", "preempted", "claimed", "bogus"])
def test_workers_may_not_set_other_statuses(worker, running, status):
    run, lease = running
    r = worker.post(f"{W}/runs/{run.pk}/status", {"status": status}, **lease)
    assert r.status_code == 400
    assert r.json()["errors"] == {"status": [status]}
    run.refresh_from_db()
    assert run.status == "running"


def test_failed_records_the_error(worker, running, member):
    run, lease = running
    r = worker.post(f"{W}/runs/{run.pk}/status", {"status": "failed", "error": "OOM"}, **lease)
    assert r.status_code == 200
    got = member.client.get(f"{RUNS}/{run.pk}").json()
    assert got["status"] == "failed" and got["error"] == "OOM"


def test_worker_unknown_run_is_404(worker, run):
    for run_id in (uuid.uuid4(), "nope"):
        r = worker.post(f"{W}/runs/{run_id}/heartbeat", HTTP_X_CRUCIBLE_LEASE="x")
        assert r.status_code == 404 and r.json()["code"] == "not_found"


# --- metrics ---------------------------------------------------------------------------------


def post_metrics(worker, run, lease, seq, points):
    return worker.post(f"{W}/runs/{run.pk}/metrics", {"seq": seq, "points": points},
                       format="json", **lease)


def test_metric_batch_is_stored_once_per_seq(worker, running):
    run, lease = running
    points = [{"name": "loss", "step": s, "value": 2.0 - s / 10} for s in range(10)]
    r = post_metrics(worker, run, lease, 1, points)
    assert r.status_code == 200 and r.json() == {"stored": 10, "duplicate": False}
    again = post_metrics(worker, run, lease, 1, points)
    assert again.json() == {"stored": 0, "duplicate": True}
    assert MetricPoint.objects.filter(run_id=run.pk).count() == 10
    assert MetricBatch.objects.get(run=run, seq=1).point_count == 10

    more = [{"name": "acc", "step": 3, "value": 0.5, "wall_time": 1700000000.5}]
    assert post_metrics(worker, run, lease, 2, more).json() == {"stored": 1, "duplicate": False}
    assert MetricPoint.objects.filter(run_id=run.pk).count() == 11
    assert MetricPoint.objects.get(name="acc").wall_time == 1700000000.5


def test_oversized_metric_batch_is_413_and_stores_nothing(worker, running, settings):
    settings.CRUCIBLE = {**settings.CRUCIBLE, "MAX_METRIC_BATCH": 5}
    run, lease = running
    points = [{"name": "loss", "step": s, "value": 1.0} for s in range(6)]
    r = post_metrics(worker, run, lease, 1, points)
    assert r.status_code == 413
    assert r.json()["code"] == "payload_too_large"
    assert not MetricPoint.objects.exists() and not MetricBatch.objects.exists()
    assert post_metrics(worker, run, lease, 1, points[:5]).json()["stored"] == 5


@pytest.mark.parametrize(("bad", "field"), [
    ({"name": "loss", "step": 1, "value": "NaN"}, "value"),
    ({"name": "loss", "step": 1, "value": "1.5"}, "value"),
    ({"name": "loss", "step": 1, "value": True}, "value"),
    ({"name": "loss", "step": 1, "value": None}, "value"),
    ({"name": "loss", "step": 1}, "value"),
    ({"name": "loss", "step": 1, "value": 10**400}, "value"),  # too big for a float
    ({"name": "loss", "step": 2**63, "value": 1.0}, "step"),  # too big for BIGINT
    ({"name": "loss", "step": -1, "value": 1.0}, "step"),
    ({"name": "loss", "step": 1.5, "value": 1.0}, "step"),
    ({"name": "loss", "step": False, "value": 1.0}, "step"),
    ({"name": "loss", "value": 1.0}, "step"),
    ({"step": 1, "value": 1.0}, "name"),
    ({"name": "", "step": 1, "value": 1.0}, "name"),
    ({"name": 7, "step": 1, "value": 1.0}, "name"),
    ({"name": "x" * 201, "step": 1, "value": 1.0}, "name"),
])
def test_bad_metric_point_is_400_naming_it(worker, running, bad, field):
    run, lease = running
    points = [{"name": "loss", "step": 0, "value": 1.0}, {"name": "loss", "step": 2, "value": 1},
              bad]
    r = post_metrics(worker, run, lease, 1, points)
    assert r.status_code == 400
    body = r.json()
    assert body["code"] == "invalid"
    assert f"points[2].{field}" in body["message"]
    assert f"points[2].{field}" in body["errors"]
    assert not MetricPoint.objects.exists() and not MetricBatch.objects.exists()


@pytest.mark.parametrize("body", [
    {"points": [{"name": "a", "step": 0, "value": 1}]},
    {"seq": 1},
    {"seq": -1, "points": [{"name": "a", "step": 0, "value": 1}]},
    {"seq": "1", "points": [{"name": "a", "step": 0, "value": 1}]},
    {"seq": 1, "points": []},
    {"seq": 1, "points": {"name": "a"}},
    {"seq": 1, "points": [5]},
    {"seq": 1, "points": [{"name": "a", "step": 0, "value": 1, "wall_time": "now"}]},
    {"seq": 1, "points": [{"name": "a", "step": 0, "value": 1, "wall_time": 10**400}]},
    {"seq": 2**64, "points": [{"name": "a", "step": 1, "value": 1}]},
])
def test_malformed_metric_batch_is_400(worker, running, body):
    run, lease = running
    r = worker.post(f"{W}/runs/{run.pk}/metrics", body, format="json", **lease)
    assert r.status_code == 400, r.content
    assert r.json()["code"] == "invalid"
    assert not MetricPoint.objects.exists() and not MetricBatch.objects.exists()


def test_out_of_range_floats_are_400(worker, running):
    run, lease = running
    for literal in ("1e400", "-1e400"):
        raw = '{"seq": 1, "points": [{"name": "a", "step": 1, "value": ' + literal + "}]}"
        r = worker.post(f"{W}/runs/{run.pk}/metrics", data=raw,
                        content_type="application/json", **lease)
        assert r.status_code == 400, r.content
        assert "points[0].value" in r.json()["errors"]
    for literal in ("NaN", "Infinity"):
        raw = '{"seq": 1, "points": [{"name": "a", "step": 1, "value": ' + literal + "}]}"
        r = worker.post(f"{W}/runs/{run.pk}/metrics", data=raw,
                        content_type="application/json", **lease)
        assert r.status_code == 400 and r.json()["code"] == "parse_error"
    assert not MetricPoint.objects.exists()


def test_largest_step_is_accepted(worker, running, member):
    run, lease = running
    r = post_metrics(worker, run, lease, 2**63 - 1,
                     [{"name": "a", "step": 2**63 - 1, "value": 1.0}])
    assert r.json() == {"stored": 1, "duplicate": False}
    got = member.client.get(f"{RUNS}/{run.pk}/metrics").json()["series"][0]["points"]
    assert [{k: v for k, v in p.items() if k != "wall"} for p in got] == [
        {"step": 2**63 - 1, "min": 1.0, "max": 1.0, "last": 1.0, "count": 1}]


def test_downsampled_read_has_min_max_last_per_bucket(worker, running, member):
    run, lease = running
    # A zig-zag with a spike and a dip, so min, max and last differ in every bucket.
    values = [float((s * 37) % 101) - s / 10 for s in range(1000)]
    values[150] = 500.0
    values[950] = -500.0
    points = [{"name": "loss", "step": s, "value": v} for s, v in enumerate(values)]
    assert post_metrics(worker, run, lease, 1, points).json()["stored"] == 1000
    post_metrics(worker, run, lease, 2, [{"name": "lr", "step": s, "value": 0.1}
                                         for s in range(0, 1000, 250)])

    r = member.client.get(f"{RUNS}/{run.pk}/metrics", {"name": "loss", "max_points": 10})
    assert r.status_code == 200, r.content
    body = r.json()
    assert body["names"] == ["loss", "lr"]
    assert body["max_points"] == 10
    assert [s["name"] for s in body["series"]] == ["loss"]
    buckets = body["series"][0]["points"]
    assert len(buckets) == 10
    for i, bucket in enumerate(buckets):
        chunk = values[i * 100:(i + 1) * 100]
        assert bucket["count"] == 100
        assert bucket["step"] == i * 100 + 99
        assert bucket["min"] == pytest.approx(min(chunk))
        assert bucket["max"] == pytest.approx(max(chunk))
        assert bucket["last"] == pytest.approx(chunk[-1])
    # By hand for the two ends: bucket 0 is steps 0-99, bucket 9 is steps 900-999.
    # Bucket 0: max at step 30 (37*30 = 1110 = 10*101 + 100 -> 100 - 3.0), min at step 71
    # (37*71 = 2627 = 26*101 + 1 -> 1 - 7.1), last at step 99 (3663 % 101 = 27 -> 27 - 9.9).
    assert buckets[0]["max"] == pytest.approx(97.0)
    assert buckets[0]["min"] == pytest.approx(-6.1)
    assert buckets[0]["last"] == pytest.approx(17.1)
    # Bucket 1 holds the spike; bucket 9 the dip at 950, max at step 939
    # (34743 % 101 = 100 -> 100 - 93.9) and last at step 999 (36963 % 101 = 98 -> 98 - 99.9).
    assert buckets[1]["max"] == 500.0
    assert buckets[9]["min"] == -500.0
    assert buckets[9]["max"] == pytest.approx(6.1)
    assert buckets[9]["last"] == pytest.approx(-1.9)


def test_downsampling_never_exceeds_max_points(worker, running, member):
    run, lease = running
    post_metrics(worker, run, lease, 1, [{"name": "m", "step": s * 3, "value": float(s)}
                                         for s in range(997)])
    for n in (1, 7, 10, 333, 5000):
        r = member.client.get(f"{RUNS}/{run.pk}/metrics", {"max_points": n}).json()
        pts = r["series"][0]["points"]
        assert len(pts) <= n
        assert sum(p["count"] for p in pts) == 997
        assert pts[-1]["last"] == 996.0 and pts[-1]["step"] == 2988
    one = member.client.get(f"{RUNS}/{run.pk}/metrics", {"max_points": 1}).json()
    assert [{k: v for k, v in p.items() if k != "wall"}
            for p in one["series"][0]["points"]] == [
        {"step": 2988, "min": 0.0, "max": 996.0, "last": 996.0, "count": 997}]


def test_metrics_with_unknown_name_is_400(worker, running, member):
    run, lease = running
    post_metrics(worker, run, lease, 1, [{"name": "loss", "step": 0, "value": 1.0}])
    r = member.client.get(f"{RUNS}/{run.pk}/metrics", {"name": "unknown"})
    assert r.status_code == 400
    assert "unknown" in r.json()["message"] and r.json()["errors"] == {"name": ["unknown"]}
    over = member.client.get(f"{RUNS}/{run.pk}/metrics", {"max_points": 5001})
    assert over.status_code == 400


# --- events ----------------------------------------------------------------------------------


def test_event_batch_gets_contiguous_seqs(worker, claimed, member):
    run, lease = claimed
    last = Run.objects.get(pk=run.pk).event_seq
    rows = [{"message": "a"}, {"message": "b", "level": "warning", "kind": "progress"},
            {"message": "c", "data": {"x": 1}}]
    r = worker.post(f"{W}/runs/{run.pk}/events", {"events": rows}, format="json", **lease)
    assert r.status_code == 201, r.content
    assert r.json() == {"seqs": [last + 1, last + 2, last + 3]}
    r2 = worker.post(f"{W}/runs/{run.pk}/events", {"events": [{"message": "d"}]},
                     format="json", **lease)
    assert r2.json() == {"seqs": [last + 4]}
    seqs = list(RunEvent.objects.filter(run=run).order_by("seq").values_list("seq", flat=True))
    assert seqs == list(range(1, last + 5))
    listed = member.client.get(f"{RUNS}/{run.pk}/events", {"after": last}).json()["results"]
    assert [(e["message"], e["level"], e["kind"]) for e in listed] == [
        ("a", "info", "log"), ("b", "warning", "progress"), ("c", "info", "log"),
        ("d", "info", "log")]
    assert listed[2]["data"] == {"x": 1}


def test_event_batch_replay_with_idempotency_key(worker, claimed):
    run, lease = claimed
    body = {"events": [{"message": "once"}, {"message": "twice?"}]}
    url = f"{W}/runs/{run.pk}/events"
    first = worker.post(url, body, format="json", HTTP_IDEMPOTENCY_KEY="ev-1", **lease)
    count = RunEvent.objects.filter(run=run).count()
    second = worker.post(url, body, format="json", HTTP_IDEMPOTENCY_KEY="ev-1", **lease)
    assert first.status_code == second.status_code == 201
    assert second.json() == first.json()
    assert second["Idempotent-Replayed"] == "true"
    assert RunEvent.objects.filter(run=run).count() == count
    assert RunEvent.objects.filter(run=run, message="once").count() == 1
    assert Run.objects.get(pk=run.pk).event_seq == count


@pytest.mark.parametrize("body", [
    {"events": []},
    {"events": "hello"},
    {"events": [{"level": "info"}]},
    {"events": [{"message": "ok"}, {"message": "bad", "level": "loud"}]},
    {"events": [{"message": "ok", "data": [1]}]},
    {},
])
def test_bad_event_batch_is_400_and_stores_nothing(worker, claimed, body):
    run, lease = claimed
    before = RunEvent.objects.filter(run=run).count()
    r = worker.post(f"{W}/runs/{run.pk}/events", body, format="json", **lease)
    assert r.status_code == 400
    assert RunEvent.objects.filter(run=run).count() == before


def test_too_many_events_is_413(worker, claimed, settings):
    settings.CRUCIBLE = {**settings.CRUCIBLE, "MAX_EVENT_BATCH": 2}
    run, lease = claimed
    before = RunEvent.objects.count()
    r = worker.post(f"{W}/runs/{run.pk}/events",
                    {"events": [{"message": str(i)} for i in range(3)]}, format="json", **lease)
    assert r.status_code == 413
    assert RunEvent.objects.count() == before


# --- checkpoints, samples, report ------------------------------------------------------------


def test_checkpoints_dedupe_by_step_and_uri(worker, running, member, qa):
    run, lease = running
    url = f"{W}/runs/{run.pk}/checkpoints"
    uri_100 = put_run_object(run, "checkpoints/step-100.tar")
    body = {"step": 100, "uri": uri_100, "metrics": {"loss": 0.5}}
    first = worker.post(url, body, format="json", **lease)
    assert first.status_code == 201, first.content
    assert first.json()["step"] == 100 and first.json()["run"] == str(run.pk)
    same = worker.post(url, body, format="json", **lease)
    assert same.status_code == 200 and same.json()["id"] == first.json()["id"]
    other = worker.post(url, {"step": 100, "uri": put_run_object(run, "checkpoints/b.tar")},
                        format="json", **lease)
    assert other.status_code == 409 and other.json()["code"] == "conflict"
    assert Checkpoint.objects.filter(run=run).count() == 1
    assert RunEvent.objects.filter(run=run, kind="checkpoint").count() == 1
    assert worker.post(url, {"step": -1, "uri": "x"}, format="json", **lease).status_code == 400
    huge = worker.post(url, {"step": 2**64, "uri": "x"}, format="json", **lease)
    assert huge.status_code == 400 and "step" in huge.json()["errors"]

    worker.post(url, {"step": 50, "uri": put_run_object(run, "checkpoints/step-50.tar")},
                format="json", **lease)
    listed = member.client.get(f"{RUNS}/{run.pk}/checkpoints").json()["results"]
    assert [c["step"] for c in listed] == [50, 100]
    assert listed[1]["metrics"] == {"loss": 0.5}
    # A re-claimed worker learns where to resume from.
    assert [c["step"] for c in worker.get(f"{W}/runs/{run.pk}").json()["checkpoints"]] == \
        [50, 100]

    graph = member.client.get("/api/v1/teams/acme/lineage",
                              {"artifact": f"run:{run.pk}"}).json()
    edges = {(e["source"]["type"], e["source"]["id"], e["relation"], e["target"]["type"],
              e["target"]["id"]) for e in graph["edges"]}
    ckpt = Checkpoint.objects.get(run=run, step=100)
    assert ("run", str(run.pk), "produced", "checkpoint", str(ckpt.pk)) in edges
    assert ("dataset_version", qa.current_version.digest, "input", "run", str(run.pk)) in edges
    # From the checkpoint, the graph goes all the way up to the dataset version.
    up = member.client.get("/api/v1/teams/acme/lineage",
                           {"artifact": f"checkpoint:{ckpt.pk}"}).json()
    assert {"type": "dataset_version", "id": qa.current_version.digest} in up["nodes"]


def test_samples_are_stored_and_listed(worker, running, member):
    run, lease = running
    samples = [
        {"step": 1, "prompt": "2+2?", "completion": " 4", "reward": 1.0,
         "reward_components": {"correct": 1.0, "format": 0.0}},
        {"step": 2, "prompt": "3+3?", "completion": "", "reward": None},
        {"step": 2, "prompt": "p", "completion": "c"},
    ]
    r = worker.post(f"{W}/runs/{run.pk}/samples", {"samples": samples}, format="json", **lease)
    assert r.status_code == 201, r.content
    assert r.json() == {"stored": 3}
    assert Sample.objects.filter(run=run).count() == 3
    listed = member.client.get(f"{RUNS}/{run.pk}/samples").json()["results"]
    assert [(s["step"], s["prompt"]) for s in listed] == [(2, "p"), (2, "3+3?"), (1, "2+2?")]
    assert listed[2]["completion"] == " 4"
    assert listed[2]["reward_components"] == {"correct": 1.0, "format": 0.0}
    assert listed[1]["reward"] is None
    assert len(member.client.get(f"{RUNS}/{run.pk}/samples", {"limit": 1}).json()["results"]) \
        == 1

    bad = worker.post(f"{W}/runs/{run.pk}/samples",
                      {"samples": [{"step": 3, "completion": "no prompt"}]}, format="json",
                      **lease)
    assert bad.status_code == 400
    assert Sample.objects.filter(run=run).count() == 3
    for bad_row in ({"step": 2**64, "prompt": "p", "completion": "c"},
                    {"step": 1, "prompt": "p", "completion": "c", "reward": 10**400}):
        bad = worker.post(f"{W}/runs/{run.pk}/samples", {"samples": [bad_row]},
                          format="json", **lease)
        assert bad.status_code == 400, bad_row
    assert Sample.objects.filter(run=run).count() == 3


def test_report_artifact_round_trip(worker, running, member, object_store):
    run, lease = running
    report = {"records": 5, "fields": {"prompt": {"distinct": 5}}, "note": "ünïcode"}
    uri = put_run_object(run, "profile.json", json.dumps(report).encode())
    assert member.client.get(f"{RUNS}/{run.pk}/report").status_code == 404
    r = worker.post(f"{W}/runs/{run.pk}/artifacts", {"kind": "report", "uri": uri},
                    format="json", **lease)
    assert r.status_code == 200, r.content
    assert r.json() == {"report_uri": uri}
    got = member.client.get(f"{RUNS}/{run.pk}/report")
    assert got.status_code == 200 and got.json() == report
    assert RunEvent.objects.filter(run=run, kind="artifact", data__uri=uri).exists()
    # Lineage: the report hangs off its run, which hangs off its inputs.
    graph = member.client.get("/api/v1/teams/acme/lineage",
                              {"artifact": f"report:{run.pk}"}).json()
    assert {(e["source"]["type"], e["relation"], e["target"]["type"]) for e in graph["edges"]} \
        == {("dataset_version", "input", "run"), ("run", "reported", "report")}
    bad = worker.post(f"{W}/runs/{run.pk}/artifacts", {"kind": "model", "uri": uri},
                      format="json", **lease)
    assert bad.status_code == 400


def test_a_bad_worker_document_names_the_field_as_the_protocol_nests_it(worker, running):
    """Bodies are validated with workers.protocol; errors keep the one JSON shape."""
    run, lease = running
    r = worker.post(f"{W}/runs/{run.pk}/samples",
                    {"samples": [{"step": 1, "prompt": "p", "completion": "c"},
                                 {"step": 3, "completion": "no prompt"}]},
                    format="json", **lease)
    body = r.json()
    assert r.status_code == 400 and body["code"] == "invalid"
    assert list(body["errors"]) == ["samples[1].prompt"]
    assert body["message"].startswith("samples[1].prompt: ")
    r = worker.post(f"{W}/runs/{run.pk}/checkpoints", {"step": 1}, format="json", **lease)
    assert r.status_code == 400 and list(r.json()["errors"]) == ["uri"]


def test_reports_need_the_lease(worker, running):
    run, _ = running
    r = worker.post(f"{W}/runs/{run.pk}/samples",
                    {"samples": [{"step": 1, "prompt": "p", "completion": "c"}]},
                    format="json", HTTP_X_CRUCIBLE_LEASE="stolen")
    assert r.status_code == 409 and r.json()["code"] == "lease_invalid"
    r = worker.post(f"{W}/runs/{run.pk}/checkpoints", {"step": 1, "uri": "u"}, format="json",
                    HTTP_X_CRUCIBLE_LEASE="stolen")
    assert r.status_code == 409
    assert not Sample.objects.exists() and not Checkpoint.objects.exists()


def test_only_operator_tokens_may_sweep(db, team):
    from apps.core.actor import Actor
    from apps.teams.services import worker_token_create
    from tests.django_fixtures import client_for_token

    _, raw = worker_token_create(actor=Actor.system(), team=team, name="team-pool")
    r = client_for_token(raw).post("/api/v1/worker/sweep")
    assert r.status_code == 403 and "operator" in r.json()["message"]


def test_metric_names_with_copy_special_characters_round_trip(worker, running, member):
    run, lease = running
    name = "odd\tname\\with\nbreaks"
    points = [{"name": name, "step": s, "value": s * 1e-5} for s in range(3)]
    assert post_metrics(worker, run, lease, 1, points).json()["stored"] == 3
    body = member.client.get(f"{RUNS}/{run.pk}/metrics", {"name": name}).json()
    assert body["names"] == [name]
    assert [p["last"] for p in body["series"][0]["points"]] == [0.0, 1e-5, 2e-5]


def test_metrics_columns_carry_wall_times_on_both_read_paths(worker, running, member,
                                                              settings):
    """``layout=columns`` returns parallel arrays with each bucket's wall time, from raw
    points (small series) and from rollups (series larger than max_points)."""
    run, lease = running
    points = [{"name": "loss", "step": s, "value": float(s), "wall_time": 1.7e9 + s}
              for s in range(400)]
    assert post_metrics(worker, run, lease, 1, points).status_code == 200
    url = f"{RUNS}/{run.pk}/metrics?name=loss&layout=columns"
    raw = member.client.get(url + "&max_points=1000").json()["series"][0]["columns"]
    assert raw["step"] == list(range(400)) and raw["wall"][-1] == 1.7e9 + 399
    assert raw["last"][:3] == [0.0, 1.0, 2.0]
    down = member.client.get(url + "&max_points=10").json()["series"][0]["columns"]
    assert len(down["step"]) <= 10
    assert down["wall"] == [1.7e9 + s for s in down["step"]]
    bad = member.client.get(f"{RUNS}/{run.pk}/metrics?layout=rows")
    assert bad.status_code == 400 and "layout" in bad.json()["message"]


def test_checkpoint_download_goes_through_the_api(worker, running, member, make_caller):

    run, lease = running
    uri = put_run_object(run, "checkpoints/step-5.tar", b"weights")
    r = worker.post(f"{W}/runs/{run.pk}/checkpoints", {"step": 5, "uri": uri, "metrics": {}},
                    format="json", **lease)
    assert r.status_code in (200, 201), r.content
    got = member.client.get(f"{RUNS}/{run.pk}/checkpoints/5/download")
    assert got.status_code == 200
    assert b"".join(got.streaming_content) == b"weights"
    assert "attachment" in got["Content-Disposition"]
    missing = member.client.get(f"{RUNS}/{run.pk}/checkpoints/6/download")
    assert missing.status_code == 404 and "no checkpoint at step 6" in missing.json()["message"]


def test_checkpoint_download_on_s3_is_a_signed_redirect(worker, running, member, settings,
                                                        monkeypatch):
    """On S3 the API answers with a short-lived presigned URL (a real S3 server: moto)."""
    import boto3
    import httpx

    from apps.core.storage import store

    moto_server = pytest.importorskip("moto.server")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        for key, value in (("S3_ENDPOINT_URL", f"http://{host}:{port}"),
                           ("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"),
                           ("AWS_DEFAULT_REGION", "us-east-1")):
            monkeypatch.setenv(key, value)
        boto3.client("s3", endpoint_url=f"http://{host}:{port}").create_bucket(Bucket="ckpts")
        settings.OBJECT_STORE_URL = "s3://ckpts/crucible"
        store.cache_clear()
        run, lease = running
        uri = put_run_object(run, "checkpoints/final.tar", b"s3 weights")
        worker.post(f"{W}/runs/{run.pk}/checkpoints", {"step": 9, "uri": uri, "metrics": {}},
                    format="json", **lease)
        got = member.client.get(f"{RUNS}/{run.pk}/checkpoints/9/download")
        assert got.status_code == 302
        assert "Signature=" in got["Location"] and "Expires=" in got["Location"]
        assert httpx.get(got["Location"]).content == b"s3 weights"
    finally:
        store.cache_clear()
        server.stop()
