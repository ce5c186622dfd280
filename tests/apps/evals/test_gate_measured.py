"""A suite gating a checkpoint whose regression is measured, not written by the test: a train
run on the arithmetic environment (the real train adapter and RL engine: a tiny MoE, its BPE
trained on the environment, warm-started by SFT on the reference answers) exports a model that
solves the problems; its worker then reports a later checkpoint whose ``lm_head`` is zeroed (a
real model folder, packed and uploaded the way the engine's checkpoints are). Each checkpoint
launches the suite's eval runs, which the real eval adapter executes through the worker path:
it unpacks the checkpoint, serves it, and scores its greedy answers. The suite passes the
trained checkpoint, and its report and the promote refusal for the broken one come from those
measured scores.

Why the gating entry scores the training split: a 2-layer model warm-started for 150-300 steps
answered 0.8-1.0 of the problems it was trained on with every seed tried, while its accuracy on
20 held-out problems ranged from 0.35 to 0.75 across seeds on one machine, and a CPU that
rounds differently trains another model. The held-out entry is scored and reported; only the
training split's drop is asserted. The
broken model's score is 0 by construction: with ``lm_head`` zero every logit is 0, greedy
decoding picks token 0 (``<pad>``, a special token) and every answer is empty."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from apps.core.actor import Actor
from apps.environments import services as env_services
from apps.evals.models import EntryResult, Promotion, SuiteEvaluation
from apps.runs.models import Checkpoint, Run
from tests.apps.evals.flow import eval_runs
from workers.adapters import run_claimed
from workers.adapters import train as train_adapter
from workers.adapters.common import ApiReporter
from workers.client import ApiError, CrucibleClient, WorkerSession
from workers.model_cache import fetch_tar

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.django_db

TEAM = "teams/acme"
GOOD_AT_LEAST = 0.5  # the trained model's training-split pass@1 (seen 0.8-1.0)
BROKEN_AT_MOST = 0.1  # the zeroed head's (0 by construction)
THRESHOLD = 0.2  # well inside the gap those two bounds leave (> 0.4)
SUITE = {"slug": "core", "project": "main", "entries": [
    # Greedy answers (temperature 0 by default): the training split gates, the held-out
    # problems are scored beside it.
    {"environment": "arith@v1", "split": "train", "metric": "pass@1", "threshold": THRESHOLD,
     "sampling": {"max_tokens": 4}},
    {"environment": "arith@v1", "metric": "mean_reward", "threshold": THRESHOLD,
     "sampling": {"max_tokens": 4}},
]}
TRAIN = {
    "model": {"preset": {"num_layers": 2}},
    "sft": {"steps": 300, "batch_size": 32},
    "rollout": {"group_size": 2, "max_new_tokens": 4},
    "trainer": {"steps": 1, "prompts_per_step": 2, "micro_batch_size": 4, "zero_stage": 0,
                "eval_samples": 1},
    "eval_suite": "core",
}


class Worker(WorkerSession):
    """A claimed session without the heartbeat thread: a thread would use a database
    connection outside the test's transaction. The test renews the lease where it waits."""

    def start_heartbeat(self, interval: float | None = None) -> None:
        pass


def claim(pool: CrucibleClient, run_id: Any, pool_name: str) -> Worker:
    claimed = pool.claim(pool_name, "w1", run_id=str(run_id))
    assert claimed is not None
    return Worker(client=claimed.client, run=claimed.run, worker_id=claimed.worker_id)


@pytest.fixture(autouse=True)
def worker_env(tmp_path, monkeypatch, object_store):
    """The worker's scratch and model cache, and the web's object store as the worker's."""
    monkeypatch.setenv("CRUCIBLE_VAR_DIR", str(tmp_path / "var"))
    monkeypatch.setenv("OBJECT_STORE_URL", object_store.url)


def break_head(store: Any, uri: str, scratch: Path) -> Path:
    """The checkpoint object ``uri`` unpacked, with its ``lm_head`` zeroed: a model folder
    named as the engine names a periodic checkpoint's step."""
    hf = fetch_tar(store, uri, scratch / "unpacked") / "hf"
    folder = scratch / "step-000002"
    shutil.copytree(hf, folder)
    weights = load_file(folder / "model.safetensors")
    weights["lm_head.weight"].zero_()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def promote(api: CrucibleClient, checkpoint: Checkpoint) -> tuple[int, dict[str, Any]]:
    """The promote answer's status and body (the SDK raises the API's refusals)."""
    try:
        return 201, api.request("POST", f"{TEAM}/checkpoints/{checkpoint.pk}/promote", json={})
    except ApiError as refused:
        return refused.status, refused.body


def evaluate(pool: CrucibleClient, checkpoint: Checkpoint, commit: Any,
             store: Any) -> tuple[SuiteEvaluation, list[float]]:
    """Run the eval runs ``checkpoint`` launched through the worker path: the suite's
    evaluation of it and each entry's recorded score."""
    evaluation = SuiteEvaluation.objects.get(checkpoint=checkpoint)
    for run_id in eval_runs(evaluation):
        with commit():  # the run-finished hook records the result after commit
            assert run_claimed(claim(pool, run_id, "cpu")) == "succeeded"
        report = json.loads(store.get_bytes(Run.objects.get(pk=run_id).report_uri))
        assert report["policy"]["source"]["uri"] == checkpoint.uri  # what was served
    results = EntryResult.objects.filter(evaluation=evaluation).order_by("entry__position")
    assert [r.status for r in results] == ["succeeded", "succeeded"]
    return evaluation, [r.score for r in results if r.score is not None]


def test_a_measured_regression_is_blocked_from_promote(pool, api, arith, object_store, tmp_path,
                                                       django_capture_on_commit_callbacks):
    """Every request goes through the in-process SDK clients (the member's ``api``, the
    workers' ``pool``): a Django test client's request would reconnect the signal that then
    closes the database connection the WSGI transport shares with the test."""
    def commit() -> Any:
        return django_capture_on_commit_callbacks(execute=True)

    api.request("POST", f"{TEAM}/evals/suites", json=SUITE)
    # A train run needs an environment version that passed QC.
    env_services.record_qc(actor=Actor.system(), version=arith, passed=True, report={})
    run = api.launch_run("acme", project="main", kind="train", name="sft",
                         environments=["arith@v1"], config=TRAIN)

    # The train run: the engine trains on arith@v1 and its final export is checkpoint 1. The
    # test plays the worker loop around the adapter (workers.adapters.run_claimed) because
    # this worker reports one more checkpoint before the run succeeds.
    worker = claim(pool, run["id"], "gpu")
    worker.set_status("running")
    with commit():  # the checkpoint hook launches the suite's eval runs after commit
        train_adapter.run(worker)
    good = Checkpoint.objects.get(run_id=run["id"])
    assert good.step == 1 and good.uri.endswith("/final.tar")
    _, good_scores = evaluate(pool, good, commit, object_store)
    gate = api.get(f"{TEAM}/checkpoints/{good.pk}/gate")
    assert (gate["allowed"], gate["verdict"]) == (True, "passed"), gate
    assert promote(api, good)[0] == 201

    # Its worker reports a later checkpoint: the same model with its head destroyed, packed
    # and recorded by the engine's own reporter.
    worker.heartbeat()
    broken_folder = break_head(object_store, good.uri, tmp_path / "broken")
    with commit():
        ApiReporter(worker, object_store, tmp_path / "upload").checkpoint(
            2, str(broken_folder), {})
    worker.set_status("succeeded")
    broken = Checkpoint.objects.get(run_id=run["id"], step=2)
    evaluation, broken_scores = evaluate(pool, broken, commit, object_store)
    print(f"measured: trained checkpoint {good_scores} (train pass@1, held-out mean reward), "
          f"zeroed head {broken_scores}")
    assert good_scores[0] >= GOOD_AT_LEAST, good_scores
    assert broken_scores[0] <= BROKEN_AT_MOST, broken_scores

    status, body = promote(api, broken)
    print(f"promote: {status} {body['message']}")
    assert status == 409 and body["code"] == "regression", body
    drop = good_scores[0] - broken_scores[0]
    assert (f"entry 0 pass@1 {broken_scores[0]:.3f}, previous {good_scores[0]:.3f} "
            f"(drop {drop:.3f} > {THRESHOLD:.3f})") in body["message"]
    assert 0 in [e["entry"] for e in body["errors"]["regressions"]]
    assert not Promotion.objects.filter(checkpoint=broken).exists()
    report = api.get(f"{TEAM}/evals/evaluations/{evaluation.pk}")
    assert report["verdict"] == "regressed"
    assert report["entries"][0]["previous"]["score"] == pytest.approx(good_scores[0])
    assert Run.objects.get(pk=run["id"]).status == "succeeded"
