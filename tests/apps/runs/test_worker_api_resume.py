"""The train task's plumbing around the RL engine, against the real API in-process:
checkpoints packed into the object store, a retried attempt unpacking the last one, a base
model fetched from an earlier run's checkpoint, stopping on cancel, and which failures are
worth another attempt. (tests/e2e runs the real engine through real worker processes.)"""

from __future__ import annotations

import json
import math
import tarfile
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from django.utils import timezone

from apps.metrics.models import MetricPoint
from apps.runs.models import Checkpoint, Run, RunEvent
from workers import adapters
from workers.adapters import execute, retryable
from workers.adapters.common import ApiReporter
from workers.adapters.train import environment_objective, prepare_train
from workers.client import LeaseLost
from workers.reporting import Stopped


@pytest.fixture(autouse=True)
def var_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CRUCIBLE_VAR_DIR", str(tmp_path / "var"))
    return tmp_path / "var"


def engine_checkpoint(root: Path, step: int) -> Path:
    """Files laid out as workers/rl/checkpoint.py saves them; returns the ``hf`` folder the
    engine reports."""
    folder = root / f"step-{step:06d}"
    (folder / "hf").mkdir(parents=True)
    (folder / "hf" / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    (folder / "hf" / "model.safetensors").write_bytes(b"w" * 64)
    (folder / "ds").mkdir()
    (folder / "ds" / "mp_rank_00_model_states.pt").write_bytes(b"s" * 32)
    (folder / "rng-rank0.pt").write_bytes(b"r")
    (folder / "state.json").write_text(json.dumps({"step": step, "cursor": 2 * step}))
    return folder / "hf"


def launch(api, **document):
    return api.launch_run("acme", project="main", kind="train", **document)


def expire(run_id: str) -> None:
    Run.objects.filter(pk=run_id).update(lease_expires_at=timezone.now() - timedelta(seconds=1))


def test_checkpoints_go_to_the_store_and_a_retry_resumes_from_the_last(
        pool, api, project, object_store, tmp_path):
    run = launch(api, config={"sft": {"steps": 2}, "checkpoint": {"every": 2}})
    session = pool.claim("gpu", "w1", run_id=run["id"])
    local = tmp_path / "engine"
    sink = ApiReporter(session, object_store, tmp_path / "upload")
    sink.log(1, {"loss": 0.5, "skipped": math.nan})
    sink.checkpoint(2, str(engine_checkpoint(local, 2)), {"loss": 0.5, "nan": math.nan})
    sink.checkpoint(4, str(engine_checkpoint(local, 4)), {"loss": 0.25})
    final = local / "final"
    final.mkdir()
    (final / "config.json").write_text("{}")
    (final / "model.safetensors").write_bytes(b"f")
    sink.checkpoint(4, str(final), {})  # the final export on a checkpointed step
    assert list(MetricPoint.objects.filter(run_id=run["id"]).values_list("name", "step")) == [
        ("loss", 1)]

    rows = list(Checkpoint.objects.filter(run_id=run["id"]).order_by("step"))
    # Under the claim's lease epoch: no other attempt ever writes these keys.
    assert session.run.lease_epoch == 1
    prefix = f"{object_store.url}/{session.run.object_prefix}/checkpoints/epoch-1"
    assert [(c.step, c.uri, c.metrics) for c in rows] == [
        (2, f"{prefix}/step-000002.tar", {"loss": 0.5}),
        (4, f"{prefix}/step-000004.tar", {"loss": 0.25}),
    ]
    assert RunEvent.objects.filter(run_id=run["id"],
                                   message="final model at step 4 is checkpoint 4").exists()
    archive = tmp_path / "x.tar"
    archive.write_bytes(object_store.get_bytes(rows[1].uri))
    with tarfile.open(archive) as tar:
        assert sorted(tar.getnames()) == [
            "ds", "ds/mp_rank_00_model_states.pt", "hf", "hf/config.json",
            "hf/model.safetensors", "rng-rank0.pt", "state.json"]

    # A final export on a new step is recorded as the run's last checkpoint, model only.
    sink.checkpoint(5, str(final), {"eval/reward_mean": 0.75})
    assert Checkpoint.objects.get(run_id=run["id"], step=5).uri == f"{prefix}/final.tar"

    # The worker dies; the next attempt, elsewhere, unpacks the last training state.
    expire(run["id"])
    again = pool.claim("gpu", "w2", run_id=run["id"])
    work = tmp_path / "attempt-2"
    spec, resume = prepare_train(again, object_store, work)
    assert resume is True
    assert spec.checkpoint.dir == str(work / "checkpoints")
    restored = work / "checkpoints" / "step-000004"
    assert json.loads((restored / "state.json").read_text()) == {"step": 4, "cursor": 8}
    assert (restored / "ds" / "mp_rank_00_model_states.pt").read_bytes() == b"s" * 32
    # SFT is inside those weights: the engine gets a finished warm-start folder.
    assert (work / "checkpoints" / "sft" / "config.json").is_file()
    assert RunEvent.objects.filter(
        run_id=run["id"], message__startswith="attempt 2: resuming from the checkpoint at "
                                              "step 4").exists()
    # The new session knows every recorded step: the final export at 5 will not collide.
    assert ApiReporter(again, object_store).checkpoint_steps == {2, 4, 5}


def test_a_checkpoint_base_model_is_fetched_into_the_host_cache(
        pool, api, project, object_store, tmp_path, var_dir):
    parent = launch(api)
    session = pool.claim("gpu", "w1", run_id=parent["id"])
    ApiReporter(session, object_store, tmp_path / "up").checkpoint(
        3, str(engine_checkpoint(tmp_path / "engine", 3)), {})
    child = launch(api, base_model=f"run:{parent['id']}")
    claimed = pool.claim("gpu", "w2", run_id=child["id"])
    spec, resume = prepare_train(claimed, object_store, tmp_path / "child")
    assert resume is False
    local = Path(spec.model.path)
    assert spec.model.source == "path" and local.name == "hf"
    assert local.parent.parent == var_dir / "models"
    assert json.loads((local / "config.json").read_text()) == {"model_type": "qwen3_moe"}
    assert spec.tokenizer.source == "model"
    # A second run from the same checkpoint reuses the unpacked copy.
    sibling = launch(api, base_model=f"run:{parent['id']}")
    spec2, _ = prepare_train(pool.claim("gpu", "w3", run_id=sibling["id"]), object_store,
                             tmp_path / "sibling")
    assert spec2.model.path == spec.model.path


def test_the_sink_stops_the_engine_once_the_run_is_canceled(pool, api, project,
                                                           object_store):
    run = launch(api)
    session = pool.claim("gpu", "w1", run_id=run["id"])
    sink = ApiReporter(session, object_store)
    sink.log(1, {"loss": 1.0})
    api.cancel_run("acme", run["id"])
    with pytest.raises(LeaseLost):  # the next report is refused...
        sink.log(2, {"loss": 0.9})
    session._lost.set()  # ...and once a heartbeat has seen it, no call is even made
    with pytest.raises(Stopped):
        sink.event("info", "step 3")


def test_execute_asks_for_a_retry_only_when_another_attempt_may_help(
        pool, api, project, monkeypatch):
    def run_with(error: Exception) -> Run:
        def engine(session) -> None:
            raise error

        monkeypatch.setitem(adapters.ADAPTERS, "train", engine)
        run = launch(api)
        assert execute(pool, run["id"], "gpu", "w") == "failed"
        return Run.objects.get(pk=run["id"])

    transient = run_with(OSError("No space left on device"))
    assert transient.status == "queued" and transient.attempt == 1
    assert transient.attempts.get().error == "OSError: No space left on device"
    final = run_with(KeyError("oops"))
    assert final.status == "failed" and final.error == "KeyError: 'oops'"


class TrainingFailed(RuntimeError):
    """Named like the engine's: a diverged run would diverge again."""


class Flagged(Exception):
    retryable = True


@pytest.mark.parametrize("exc, expected", [
    (OSError("disk"), True),
    (MemoryError(), True),
    (RuntimeError("CUDA error: an illegal memory access"), True),
    (TimeoutError(), True),
    (httpx.ConnectError("refused"), True),
    (TrainingFailed("3 consecutive non-finite losses"), False),
    (FileNotFoundError("gone"), False),
    (ValueError("micro_batch_size must divide"), False),
    (KeyError("x"), False),
    (Flagged(), True),
])
def test_retryable(exc, expected):
    assert retryable(exc) is expected


def test_pinned_environments_become_the_training_task_without_quarantined_tasks(
        pool, api, project, object_store):
    from apps.core.actor import Actor
    from apps.environments import services as env_services

    system = Actor.system()
    versions = []
    for slug, params in (("add", {"ops": ["+"], "max_operand": 4}),
                         ("mul", {"ops": ["*"], "max_operand": 3, "eval_size": 3})):
        env = env_services.environment_create(actor=system, team=project.team,
                                              project=project, slug=slug)
        version, _ = env_services.version_create(actor=system, environment=env, spec={
            "env": {"source": "builtin", "name": "arithmetic", "params": params}})
        versions.append(version)
    env_services.record_qc(actor=system, version=versions[0], passed=True,
                           report={"passed": True, "quarantined_ids": ["1+1", "2+2"]})
    env_services.record_qc(actor=system, version=versions[1], passed=True, report={})
    run = launch(api, environments=["add", "mul"])
    session = pool.claim("gpu", "w1", run_id=run["id"])
    assert session.run.environments[0].quarantined_ids == ["1+1", "2+2"]

    objective = environment_objective(session, object_store)
    ids = {e.meta["task_id"] for e in objective.train + objective.eval}
    assert not {"0:1+1", "0:2+2"} & ids and "0:1+2" in ids
    assert {e.meta["env"] for e in objective.eval} == {"0", "1"}
    assert len([e for e in objective.eval if e.meta["env"] == "1"]) == 3
    # Each completion is scored by its own environment; right answers get full reward.
    sample = [e for e in objective.train if e.meta["env"] == "0"][:2] + \
        [e for e in objective.train if e.meta["env"] == "1"][:2]
    totals, parts = objective.reward(sample, [e.reference for e in sample[:3]] + ["wrong"])
    assert totals == [1.0, 1.0, 1.0, 0.0]
    assert parts["add@v1/exact_match"] == [1.0, 1.0, 0.0, 0.0]
    assert parts["mul@v1/exact_match"] == [0.0, 0.0, 1.0, 0.0]
    assert set(parts) == set(objective.components)
    assert objective.corpus()
    assert RunEvent.objects.filter(run_id=run["id"],
                                   message__contains="2 quarantined by QC").exists()
