"""Spot-check review through the API: batches from engine results, the seeded sample,
locks, verdicts, and the batch decision that accepts (becoming a dataset version with its
manifest and lineage), rejects or resamples."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import DatabaseError, transaction
from django.test import Client
from django.utils import timezone

from apps.core.models import AuditLog
from apps.datasets.models import DatasetVersion
from apps.lineage.models import LineageEdge
from apps.review.models import Batch, BatchTransition, ReviewItem
from apps.review.sampling import sample_indices
from tests.factories import DatasetFactory, make_run, make_version

BATCHES = "/api/v1/teams/acme/batches"
ITEMS = "/api/v1/teams/acme/review-items"


def records(n: int, tag: str = "q") -> list[dict]:
    return [{"id": i, "question": f"{tag} {i} + {i}?", "answer": str(2 * i),
             "verification": [{"stage": "syntax", "ok": True, "check": "parses", "detail": ""},
                              {"stage": "logic", "ok": True, "check": "rederive",
                               "detail": f"{2 * i} == {2 * i}"}]}
            for i in range(n)]


@pytest.fixture
def target(project):
    return DatasetFactory(project=project, team=project.team, slug="synth-math")


@pytest.fixture
def seed_version(project):
    seeds = DatasetFactory(project=project, team=project.team, slug="seeds")
    return make_version(seeds, [{"id": 1, "question": "seed"}])


def manifest(parents: list[str] | None = None) -> dict:
    return {
        "config": {"name": "math-mix", "seed": 11, "generators": [{"kind": "math", "count": 10}]},
        "seed": 11,
        "parents": parents or [],
        "stages": {"generated": {"in": 12, "out": 12}, "syntax": {"in": 12, "out": 11},
                   "logic": {"in": 11, "out": 10}},
        "rejections": {"logic.answer_mismatch": 1, "syntax.unparsable": 1},
        "distinct_n": {"1": 0.41, "2": 0.77},
    }


def create(client, n=10, **extra):
    body = {"dataset": "synth-math", "records": records(n), "manifest": manifest(),
            "target_error_rate": 0.5, "confidence": 0.9, "sample_seed": 5, **extra}
    return client.post(BATCHES, body, format="json")


def open_items(client, batch_id: str) -> list[dict]:
    rows = client.get(f"{ITEMS}?batch={batch_id}&status=open").json()["results"]
    return rows


def judge(client, item_id: int, verdict: str, reason: str = ""):
    return client.post(f"{ITEMS}/{item_id}/verdict", {"verdict": verdict, "reason": reason},
                       format="json")


# --- creating a batch --------------------------------------------------------------------


def test_create_batch_draws_the_seeded_sample(member, target, seed_version):
    r = create(member.client, n=100, target_error_rate=0.05, confidence=0.95,
               manifest=manifest([f"seeds@v{seed_version.number}"]), name="math-1")
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["status"] == "pending_review" and body["name"] == "math-1"
    assert body["record_count"] == 100 and body["sample_size"] == 59
    assert body["decision"]["outcome"] == "pending"
    assert body["items"] == {"open": 59, "accepted": 0, "rejected": 0}
    assert body["manifest"]["stages"]["logic"]["out"] == 10
    assert [t["to_status"] for t in body["transitions"]] == ["pending_review"]

    batch = Batch.objects.get(pk=body["id"])
    assert list(batch.parents.all()) == [seed_version]
    indices = sorted(ReviewItem.objects.filter(batch=batch).values_list("index", flat=True))
    assert indices == sorted(sample_indices(seed=5, population=100, size=59))
    item = ReviewItem.objects.filter(batch=batch).order_by("id").first()
    assert item.record["id"] == item.index  # the record at that position
    assert item.trail[1]["stage"] == "logic"  # the engine's verification trail
    assert AuditLog.objects.filter(action="review.batch.create").count() == 1


def test_batch_create_is_idempotent_with_a_key(member, target):
    headers = {"HTTP_IDEMPOTENCY_KEY": "synth-run-7"}
    body = {"dataset": "synth-math", "records": records(10), "target_error_rate": 0.5,
            "confidence": 0.9}
    first = member.client.post(BATCHES, body, format="json", **headers)
    again = member.client.post(BATCHES, body, format="json", **headers)
    assert first.status_code == again.status_code == 201
    assert again["Idempotent-Replayed"] == "true"
    assert first.json()["id"] == again.json()["id"] and Batch.objects.count() == 1


@pytest.mark.parametrize(("change", "field"), [
    ({"dataset": "nope"}, "dataset"),
    ({"records": []}, "records"),
    ({"records": [{"id": 1}, "text"]}, "records"),
    ({"trails": [[]]}, "trails"),
    ({"target_error_rate": 1.5}, "target_error_rate"),
    ({"confidence": 1.0}, "confidence"),
    ({"manifest": {"parents": ["seeds@v9"]}}, "manifest"),
    ({"manifest": {"seed": "eleven"}}, "manifest"),
    ({"run": "00000000-0000-4000-8000-000000000000"}, "run"),
])
def test_bad_batch_is_400_naming_the_field_and_writes_nothing(member, target, seed_version,
                                                              change, field):
    r = create(member.client, **change)
    assert r.status_code == 400, r.content
    assert field in r.json()["errors"], r.json()
    assert not Batch.objects.exists() and not ReviewItem.objects.exists()


def test_viewer_reads_but_cannot_create_or_judge(member, viewer, target):
    batch = create(member.client).json()
    assert create(viewer.client).status_code == 403
    item = open_items(viewer.client, batch["id"])[0]
    assert viewer.client.get(f"{BATCHES}/{batch['id']}").status_code == 200
    assert judge(viewer.client, item["id"], "accept").status_code == 403
    assert viewer.client.post(f"{ITEMS}/{item['id']}/claim").status_code == 403


# --- locks -------------------------------------------------------------------------------


def test_a_claimed_item_is_held_for_one_reviewer_until_the_lock_expires(member, make_caller,
                                                                          team, target):
    other = make_caller(team, "member", "rita")
    batch = create(member.client).json()
    item = open_items(member.client, batch["id"])[0]
    claimed = member.client.post(f"{ITEMS}/{item['id']}/claim").json()
    assert claimed["locked_by"] == "mia" and claimed["lock_expires_at"]

    taken = other.client.post(f"{ITEMS}/{item['id']}/claim")
    assert taken.status_code == 409 and taken.json()["code"] == "locked"
    assert "mia" in taken.json()["message"]
    assert judge(other.client, item["id"], "accept").status_code == 409
    assert other.client.post(f"{ITEMS}/{item['id']}/release").status_code == 409

    ReviewItem.objects.filter(pk=item["id"]).update(
        lock_expires_at=timezone.now() - timedelta(seconds=1))
    assert other.client.get(f"{ITEMS}/{item['id']}").json()["locked_by"] is None
    assert other.client.post(f"{ITEMS}/{item['id']}/claim").json()["locked_by"] == "rita"
    released = other.client.post(f"{ITEMS}/{item['id']}/release").json()
    assert released["locked_by"] is None
    assert judge(member.client, item["id"], "accept").status_code == 200


# --- verdicts and the batch decision -------------------------------------------------------


def test_accepted_batch_becomes_a_dataset_version_with_manifest_and_lineage(
    member, project, target, seed_version
):
    run = make_run(project, name="synthesize-math")
    r = create(member.client, manifest=manifest([seed_version.digest]), run=str(run.pk))
    batch = r.json()
    assert batch["sample_size"] == 4  # target 50 % at 90 %: 4 records
    reviewed = []
    for item in open_items(member.client, batch["id"]):
        result = judge(member.client, item["id"], "accept").json()
        reviewed.append(result["batch"]["decision"]["reviewed"])
    assert reviewed == [1, 2, 3, 4]  # the decision updates as verdicts arrive
    assert result["batch"]["status"] == "accepted"
    assert result["batch"]["decision"]["outcome"] == "accept"

    stored = Batch.objects.get(pk=batch["id"])
    version = stored.version
    assert version is not None and version.record_count == 10
    assert version.digest == stored.digest  # the batch's records, content-addressed
    target.refresh_from_db()
    assert target.current_version_id == version.pk
    assert version.manifest["config"]["name"] == "math-mix" and version.manifest["seed"] == 11
    assert version.manifest["stages"]["syntax"]["out"] == 11
    assert version.manifest["parents"] == [
        {"dataset": "seeds", "number": 1, "digest": seed_version.digest}]
    assert version.manifest["review"]["reviewed"] == 4
    assert version.manifest["review"]["rejected"] == 0
    assert list(version.parents.all()) == [seed_version]
    edges = {(e.source_type, e.source_id, e.relation) for e in
             LineageEdge.objects.filter(target_type="dataset_version", target_id=version.digest)}
    assert ("run", str(run.pk), "produced") in edges
    assert ("dataset_version", seed_version.digest, "derived") in edges
    assert [t.to_status for t in stored.transitions.all()] == ["pending_review", "accepted"]
    api_version = member.client.get(
        f"/api/v1/teams/acme/datasets/synth-math/versions/{version.digest}").json()
    assert api_version["manifest"]["distinct_n"] == {"1": 0.41, "2": 0.77}


def test_batch_rejected_by_spot_check_keeps_rejected_items_visible(member, target):
    batch = create(member.client).json()
    for n, item in enumerate(open_items(member.client, batch["id"])):
        r = judge(member.client, item["id"], "reject", f"wrong answer {n}")
        assert r.status_code == 200, r.content
    detail = member.client.get(f"{BATCHES}/{batch['id']}").json()
    assert detail["status"] == "rejected"
    assert "above 50.0%" in detail["decision"]["reason"]
    assert detail["decision"]["lower"] == pytest.approx(0.1 ** 0.25)
    assert detail["version"] is None and not DatasetVersion.objects.filter(
        dataset=target).exists()
    rejected = member.client.get(
        f"{ITEMS}?batch={batch['id']}&status=rejected&dataset=synth-math&batch_status=rejected"
    ).json()
    assert sorted(i["reason"] for i in rejected["results"]) == [
        f"wrong answer {n}" for n in range(4)]
    assert all(i["reviewed_by"] == "mia" for i in rejected["results"])


def test_rejecting_needs_a_reason_and_closed_items_refuse_verdicts(member, target):
    batch = create(member.client).json()
    item = open_items(member.client, batch["id"])[0]
    r = judge(member.client, item["id"], "reject", "   ")
    assert r.status_code == 400 and "reason" in r.json()["errors"]
    assert judge(member.client, item["id"], "maybe").status_code == 400
    assert judge(member.client, item["id"], "accept").status_code == 200
    again = judge(member.client, item["id"], "reject", "changed my mind")
    assert again.status_code == 409 and again.json()["code"] == "already_reviewed"


def test_inconclusive_sample_resamples_then_decides(member, target):
    batch = create(member.client).json()
    first = open_items(member.client, batch["id"])
    for item, verdict in zip(first, ["reject", "reject", "reject", "accept"], strict=True):
        result = judge(member.client, item["id"], verdict, "bad" if verdict == "reject" else "")
    state = result.json()["batch"]
    assert state["status"] == "resampling"
    assert state["sample_size"] == 10  # grown to the c=3 plan (12), capped at the batch
    assert state["decision"]["outcome"] == "pending"
    second = open_items(member.client, batch["id"])
    assert len(second) == 6 and {i["round"] for i in second} == {2}
    stored = Batch.objects.get(pk=batch["id"])
    assert sorted(stored.items.values_list("index", flat=True)) == list(range(10))
    for item in second:
        result = judge(member.client, item["id"], "accept")
    final = result.json()["batch"]
    assert final["status"] == "accepted"  # census: 3 of 10 bad, within 50 %
    assert "Every record reviewed" in final["decision"]["reason"]
    assert [t.to_status for t in stored.transitions.all()] == [
        "pending_review", "resampling", "accepted"]
    assert judge(member.client, first[0]["id"], "accept").json()["code"] == "batch_closed"


def test_transition_rows_are_insert_only(member, target):
    create(member.client)
    with pytest.raises(DatabaseError), transaction.atomic():
        BatchTransition.objects.update(reason="rewritten")


# --- the worker hand-over ------------------------------------------------------------------


def test_worker_submits_its_runs_batch_under_the_lease(worker, project, target):
    run = make_run(project, name="synthesize")
    claim = worker.post("/api/v1/worker/claim",
                        {"pool": run.pool, "worker_id": "w1", "run_id": str(run.pk)},
                        format="json").json()
    url = f"/api/v1/worker/runs/{run.pk}/batches"
    body = {"dataset": "synth-math", "records": records(10), "manifest": manifest()}
    assert worker.post(url, body, format="json").status_code == 409  # no lease
    r = worker.post(url, body, format="json", HTTP_X_CRUCIBLE_LEASE=claim["lease_id"])
    assert r.status_code == 201, r.content
    assert r.json()["run"] == str(run.pk)
    assert r.json()["sample_size"] == 10  # default plan (5 % at 95 %) on 10 records: all
    assert Batch.objects.get().run_id == run.pk


def test_a_batch_is_refused_under_a_wrong_or_expired_lease(worker, project, target):
    from datetime import timedelta

    from django.utils import timezone

    from apps.runs.models import Run

    run = make_run(project, name="synthesize")
    claim = worker.post("/api/v1/worker/claim",
                        {"pool": run.pool, "worker_id": "w1", "run_id": str(run.pk)},
                        format="json").json()
    url = f"/api/v1/worker/runs/{run.pk}/batches"
    body = {"dataset": "synth-math", "records": records(10), "manifest": manifest()}
    wrong = worker.post(url, body, format="json", HTTP_X_CRUCIBLE_LEASE="not-the-lease")
    assert wrong.status_code == 409 and wrong.json()["code"] == "lease_invalid"
    Run.objects.filter(pk=run.pk).update(lease_expires_at=timezone.now()
                                         - timedelta(seconds=1))
    late = worker.post(url, body, format="json", HTTP_X_CRUCIBLE_LEASE=claim["lease_id"])
    assert late.status_code == 409 and late.json()["code"] == "lease_expired"
    assert not Batch.objects.exists()


# --- isolation and admin -----------------------------------------------------------------


def test_other_team_sees_none_of_acmes_items(member, outsider, target):
    batch = create(member.client).json()
    assert outsider.client.get("/api/v1/teams/rival/review-items").json()["results"] == []
    # acme's batch id through rival's own queue: nothing, and no hint that it exists
    theirs = outsider.client.get(f"/api/v1/teams/rival/review-items?batch={batch['id']}")
    assert theirs.status_code == 200 and theirs.json()["results"] == []
    assert outsider.client.get(f"{ITEMS}?batch={batch['id']}").status_code == 404


def test_staff_judges_in_django_admin_through_the_service(member, target, django_user_model):
    batch = create(member.client).json()
    item = open_items(member.client, batch["id"])[0]
    staff = django_user_model.objects.create_superuser("root", "root@example.com", "pw")
    client = Client()
    client.force_login(staff)
    assert client.get("/admin/review/reviewitem/").status_code == 200
    assert client.get(f"/admin/review/batch/{batch['id']}/change/").status_code == 200
    url = f"/admin/review/reviewitem/{item['id']}/change/"
    assert client.get(url).status_code == 200
    inline = {"transitions-TOTAL_FORMS": "0", "transitions-INITIAL_FORMS": "0"}
    refused = client.post(url, {"verdict": "reject", "verdict_reason": "", **inline})
    assert refused.status_code == 200 and b"Say why" in refused.content
    done = client.post(url, {"verdict": "reject", "verdict_reason": "admin: ambiguous", **inline})
    assert done.status_code == 302
    stored = ReviewItem.objects.get(pk=item["id"])
    assert stored.status == "rejected" and stored.reason == "admin: ambiguous"
    assert stored.transitions.get().actor == staff


def test_undo_verdict_rules(member, make_caller, team, project):
    """Only the reviewer who judged an item may undo it, and only while its batch is open."""
    from apps.core.actor import Actor
    from apps.review import services as review_services
    from apps.teams.models import Role

    dataset = DatasetFactory(project=project, team=team, slug="undo-ds")
    batch = review_services.batch_create(
        actor=Actor.system(), dataset=dataset, name="b", sample_seed=1,
        records=[{"id": i, "question": str(i), "answer": str(i)} for i in range(10)],
        target_error_rate=0.5, confidence=0.9)
    other = make_caller(team, Role.MEMBER, "olga")
    items = list(batch.items.order_by("id"))
    url = f"/api/v1/teams/{team.slug}/review-items"
    open_one = member.client.post(f"{url}/{items[0].pk}/undo")
    assert open_one.status_code == 409 and open_one.json()["code"] == "no_verdict"
    assert member.client.post(f"{url}/{items[0].pk}/verdict", {"verdict": "accept"},
                              format="json").status_code == 200
    theirs = other.client.post(f"{url}/{items[0].pk}/undo")
    assert theirs.status_code == 409 and theirs.json()["code"] == "not_yours"
    undone = member.client.post(f"{url}/{items[0].pk}/undo")
    assert undone.status_code == 200 and undone.json()["item"]["status"] == "open"
    for it in items:  # accept them all: the batch is decided, its verdicts final
        member.client.post(f"{url}/{it.pk}/verdict", {"verdict": "accept"}, format="json")
    batch.refresh_from_db()
    assert batch.status == "accepted"
    final = member.client.post(f"{url}/{items[0].pk}/undo")
    assert final.status_code == 409 and final.json()["code"] == "batch_closed"
    assert ReviewItem.objects.get(pk=items[0].pk).status == "accepted"
