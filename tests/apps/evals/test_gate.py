"""A suite gating a run's checkpoints, end to end through the real APIs: each checkpoint the
worker reports launches one eval run per entry (real queued runs, pinned to the checkpoint);
the worker API's reports of those runs fill the results; the report compares each with the
previous checkpoint and the baseline; promote answers 409 until the suite passed the
checkpoint, and for a regression names the entry and the drop."""

from __future__ import annotations

import pytest

from apps.core.actor import Actor
from apps.core.models import AuditLog
from apps.evals import services
from apps.evals.models import EntryResult, EvalSuite, Promotion, SuiteEvaluation
from apps.lineage.models import LineageEdge
from apps.runs.models import Checkpoint, Run
from tests.apps.evals.flow import checkpoint, eval_runs, finish_eval, start
from tests.factories import make_train_run, put_run_object

pytestmark = pytest.mark.django_db
API = "/api/v1/teams/acme"
SUITES = f"{API}/evals/suites"


@pytest.fixture
def suite(member, arith):
    r = member.client.post(SUITES, {"slug": "core", "project": "main", "entries": [
        {"environment": "arith@v1", "samples_per_task": 2, "k": [1, 2], "metric": "pass@2",
         "threshold": 0.1},
        {"environment": "arith@v1", "metric": "mean_reward", "threshold": 0.2},
    ]}, format="json")
    assert r.status_code == 201, r.content
    return r.json()


@pytest.fixture
def train(member, suite, worker):
    r = member.client.post(f"{API}/runs", {
        "project": "main", "kind": "train", "name": "grpo", "base_model": "preset",
        "config": {"eval_suite": "core", "trainer": {"steps": 30}}}, format="json")
    assert r.status_code == 201, r.content
    run = Run.objects.get(pk=r.json()["id"])
    return run, start(worker, run, "gpu")


def promote(client, ckpt):
    return client.post(f"{API}/checkpoints/{ckpt}/promote", {"note": "ship"}, format="json")


def test_a_regressed_checkpoint_is_blocked_from_promote(member, viewer, worker, train,
                                                        django_capture_on_commit_callbacks):
    run, lease = train

    def commit():
        return django_capture_on_commit_callbacks(execute=True)

    # Step 10: the checkpoint launches the suite's two eval runs, pinned to it.
    ckpt10, ev10 = checkpoint(worker, run, lease, 10, commit)
    runs10 = eval_runs(ev10)
    launched = list(Run.objects.filter(pk__in=runs10))
    assert len(launched) == 2
    stored = Checkpoint.objects.get(pk=ckpt10)
    for r in launched:
        assert (r.kind, r.status, r.pool, r.base_checkpoint_id) == ("eval", "queued", "cpu",
                                                                     ckpt10)
        assert r.config["model"]["path"] == stored.uri  # the checkpoint is what is evaluated
        assert r.environment_version is not None and r.project.slug == "main"
    assert LineageEdge.objects.filter(relation="base_model", source_id=str(ckpt10)).count() == 2
    assert (ev10.subject_kind, ev10.trigger, ev10.label) == ("checkpoint", "checkpoint",
                                                             "grpo @ step 10")

    # Not finished: promote refuses, saying so.
    r = promote(member.client, ckpt10)
    assert r.status_code == 409
    assert r.json()["code"] == "evaluation_pending"
    assert "2 of 2 eval runs have not finished" in r.json()["message"]
    finish_eval(worker, runs10[0], pass_at={"1": 0.5, "2": 0.75}, mean_reward=0.6,
                latency_s=0.2, commit=commit)
    assert promote(member.client, ckpt10).json()["code"] == "evaluation_pending"
    finish_eval(worker, runs10[1], pass_at={"1": 0.5}, mean_reward=0.6, latency_s=0.1,
                commit=commit)
    results = EntryResult.objects.filter(evaluation=ev10).order_by("entry__position")
    assert [(x.status, x.score) for x in results] == [("succeeded", 0.75), ("succeeded", 0.6)]
    assert all(x.cpu_seconds is not None and x.cpu_seconds >= 0 for x in results)

    gate = viewer.client.get(f"{API}/checkpoints/{ckpt10}/gate").json()
    assert (gate["allowed"], gate["code"], gate["verdict"]) == (True, "passed", "passed")
    r = promote(member.client, ckpt10)
    assert r.status_code == 201, r.content
    assert r.json()["evaluation"] == ev10.pk and r.json()["note"] == "ship"
    assert AuditLog.objects.filter(action="checkpoint.promote", target_id=str(ckpt10)).exists()
    assert promote(member.client, ckpt10).json()["code"] == "already_promoted"
    # Step 10 becomes the suite's baseline.
    r = member.client.patch(f"{SUITES}/core", {"baseline": ev10.pk}, format="json")
    assert r.status_code == 200 and r.json()["baseline"] == ev10.pk

    # Step 20: pass@2 drops 0.75 -> 0.55 (0.2 > 0.1): a regression against both.
    ckpt20, ev20 = checkpoint(worker, run, lease, 20, commit)
    runs20 = eval_runs(ev20)
    finish_eval(worker, runs20[0], pass_at={"1": 0.4, "2": 0.55}, mean_reward=0.5,
                latency_s=0.2, commit=commit)
    finish_eval(worker, runs20[1], pass_at={"1": 0.5}, mean_reward=0.5, latency_s=0.1,
                commit=commit)
    r = promote(member.client, ckpt20)
    assert r.status_code == 409, r.content
    body = r.json()
    assert body["code"] == "regression"
    assert "entry 0 pass@2 0.550, previous 0.750 (drop 0.200 > 0.100), baseline 0.750" in \
        body["message"]
    assert [e["entry"] for e in body["errors"]["regressions"]] == [0]  # mean_reward: 0.1 < 0.2
    assert not Promotion.objects.filter(checkpoint_id=ckpt20).exists()
    report = member.client.get(f"{API}/evals/evaluations/{ev20.pk}").json()
    assert (report["verdict"], report["previous"], report["baseline"]) == ("regressed", ev10.pk,
                                                                           ev10.pk)
    e0, e1 = report["entries"]
    assert e0["previous"]["delta"] == pytest.approx(-0.2) and e0["regressed"]
    assert e1["baseline"]["delta"] == pytest.approx(-0.1) and not e1["regressed"]
    assert report["capability"] == pytest.approx((0.55 + 0.5) / 2)

    # Step 30: one eval run fails; nothing to judge: refused until it is evaluated again.
    ckpt30, ev30 = checkpoint(worker, run, lease, 30, commit)
    runs30 = eval_runs(ev30)
    finish_eval(worker, runs30[0], pass_at={}, mean_reward=0, latency_s=0, error="OOM",
                commit=commit)
    finish_eval(worker, runs30[1], pass_at={"1": 0.9}, mean_reward=0.9, latency_s=0.1,
                commit=commit)
    body = promote(member.client, ckpt30).json()
    assert body["code"] == "evaluation_failed" and "evaluate it again" in body["message"]
    # ... and evaluating it again launches a fresh evaluation, which is what gates now.
    r = member.client.post(f"{SUITES}/core/evaluate", {"base_model": f"checkpoint:{ckpt30}"},
                           format="json")
    assert r.status_code == 201, r.content
    assert r.json()["verdict"] == "pending" and r.json()["subject"]["checkpoint"] == ckpt30
    assert promote(member.client, ckpt30).json()["code"] == "evaluation_pending"

    # The leaderboard holds the two complete evaluations, best capability first.
    board = viewer.client.get(f"{SUITES}/core/leaderboard").json()["results"]
    assert [(b["subject"]["step"], b["rank"]) for b in board] == [(10, 1), (20, 2)]
    assert board[0]["baseline"] and board[0]["pareto"]


def test_a_result_whose_hook_was_missed_is_recorded_by_promote(member, worker, train,
                                                              django_capture_on_commit_callbacks):
    """The run-finished hook runs after commit; if it never ran (here: callbacks not
    executed), promote records the finished runs itself before judging."""
    run, lease = train
    ckpt, evaluation = checkpoint(worker, run, lease, 5,
                                  lambda: django_capture_on_commit_callbacks(execute=True))
    for run_id in eval_runs(evaluation):
        finish_eval(worker, run_id, pass_at={"1": 0.5, "2": 0.5}, mean_reward=0.5,
                    latency_s=0.1)  # no commit callbacks: the hook does not run
    assert set(EntryResult.objects.filter(evaluation=evaluation)
               .values_list("status", flat=True)) == {"pending"}
    assert promote(member.client, ckpt).status_code == 201
    assert set(EntryResult.objects.filter(evaluation=evaluation)
               .values_list("status", flat=True)) == {"succeeded"}


def test_ungated_runs_promote_and_suites_that_refuse_launch(member, worker, arith, suite,
                                                            project):
    plain = make_train_run(project)
    lease = start(worker, plain, "gpu")
    uri = put_run_object(plain, "checkpoints/final.tar", b"w")
    r = worker.post(f"/api/v1/worker/runs/{plain.pk}/checkpoints",
                    {"step": 1, "uri": uri}, format="json", **lease)
    ckpt = r.json()["id"]
    assert not SuiteEvaluation.objects.exists()  # names no suite: nothing launched
    r = promote(member.client, ckpt)
    assert r.status_code == 201 and r.json()["evaluation"] is None
    # A suite evaluation whose launch is refused is all or nothing (here: a bad base model).
    before = Run.objects.count()
    r = member.client.post(f"{SUITES}/core/evaluate", {"base_model": "checkpoint:999999"},
                           format="json")
    assert r.status_code == 400 and "matches no checkpoint" in r.json()["message"]
    r = member.client.post(f"{SUITES}/core/evaluate", {"base_model": "preset",
                                                       "policy": {"base_url": "http://x"}},
                           format="json")
    assert r.status_code == 400 and "once" in r.json()["message"]
    assert Run.objects.count() == before and not SuiteEvaluation.objects.exists()
    # A served variant is evaluated by its endpoint (the hook a variant object will call).
    variant = services.evaluate_variant(
        actor=Actor.system(), suite=EvalSuite.objects.get(), label="int8",
        policy={"base_url": "http://127.0.0.1:9/v1", "model": "int8"})
    assert variant.subject_kind == "variant" and variant.trigger == "variant"
    configs = [Run.objects.get(pk=r).config for r in eval_runs(variant)]
    assert [c["policy"]["base_url"] for c in configs] == ["http://127.0.0.1:9/v1"] * 2


def test_a_deleted_gating_suite_blocks_promote_and_keeps_past_promotions(
        member, viewer, worker, train, django_capture_on_commit_callbacks):
    run, lease = train

    def commit():
        return django_capture_on_commit_callbacks(execute=True)

    ckpt1, ev1 = checkpoint(worker, run, lease, 1, commit)
    for run_id in eval_runs(ev1):
        finish_eval(worker, run_id, pass_at={"1": 0.5, "2": 0.5}, mean_reward=0.5,
                    latency_s=0.1, commit=commit)
    assert viewer.client.post(f"{API}/checkpoints/{ckpt1}/promote", {},
                              format="json").status_code == 403  # viewers read only
    assert promote(member.client, ckpt1).status_code == 201
    assert member.client.delete(f"{SUITES}/core").status_code == 204
    assert Promotion.objects.get(checkpoint_id=ckpt1).evaluation_id is None  # kept

    # The run still names the deleted suite: its next checkpoint is recorded (the hook only
    # logs), nothing is launched, and promote refuses until the suite exists again.
    before = Run.objects.count()
    uri = put_run_object(run, "checkpoints/step-2.tar", b"w")
    with commit():
        r = worker.post(f"/api/v1/worker/runs/{run.pk}/checkpoints",
                        {"step": 2, "uri": uri, "resumable": True}, format="json", **lease)
    assert r.status_code == 201 and Run.objects.count() == before
    body = promote(member.client, r.json()["id"]).json()
    assert body["code"] == "suite_missing" and "no longer exists" in body["message"]
