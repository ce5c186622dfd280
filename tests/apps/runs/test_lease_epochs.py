"""Lease epochs fence a late writer. Attempt 1 of a run is preempted and misses its deadline,
so its lease is revoked; attempt 2 claims the run and checkpoints; attempt 1, still alive,
then writes checkpoints and reports them. Its files land in its own epoch's folder (nothing of
attempt 2's is overwritten), its reports are refused, a live lease cannot register them
either, and the next attempt resumes from attempt 2's checkpoint."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from apps.core.actor import Actor
from apps.runs import services
from apps.runs.models import Checkpoint, Run, RunStatus
from workers.adapters.common import ApiReporter
from workers.adapters.train import prepare_train
from workers.client import ApiError, CrucibleClient, LeaseLost, WorkerSession

SYSTEM = Actor.system()


@pytest.fixture(autouse=True)
def var_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CRUCIBLE_VAR_DIR", str(tmp_path / "var"))


def written(root: Path, step: int, by: str) -> str:
    """A checkpoint folder laid out as the engine saves it, its state saying who wrote it;
    returns the ``hf`` folder the engine reports."""
    folder = root / f"step-{step:06d}"
    (folder / "hf").mkdir(parents=True)
    (folder / "hf" / "config.json").write_text("{}")
    (folder / "ds").mkdir()
    (folder / "ds" / "model_states.pt").write_bytes(by.encode())
    (folder / "state.json").write_text(json.dumps({"step": step, "by": by}))
    return str(folder / "hf")


def claim(pool: CrucibleClient, run_id: str, worker: str) -> WorkerSession:
    session = pool.claim("gpu", worker, run_id=run_id)
    assert session is not None
    return session


def resumed_state(session: WorkerSession, store, work: Path) -> dict:
    spec, resume = prepare_train(session, store, work)
    assert resume is True
    restored = sorted((work / "checkpoints").glob("step-*"))
    assert len(restored) == 1
    return json.loads((restored[0] / "state.json").read_text())


def test_a_revoked_attempt_writing_late_never_becomes_the_resume_point(
        pool, api, project, object_store, tmp_path):
    run_id = api.launch_run("acme", project="main", kind="train",
                            config={"checkpoint": {"every": 2}})["id"]
    one = claim(pool, run_id, "w1")
    assert one.run.lease_epoch == 1
    late = ApiReporter(one, object_store, tmp_path / "up1")
    late.checkpoint(2, written(tmp_path / "one", 2, "attempt 1"), {})

    # The scheduler preempts attempt 1, which does not stop by the deadline: lease revoked.
    services.request_preemption(actor=SYSTEM, run=Run.objects.get(pk=run_id),
                                deadline=timezone.now() - timedelta(seconds=1),
                                reason="room for a production run")
    assert [r.pk for r in services.enforce_preemption_deadlines(actor=SYSTEM)] == [
        Run.objects.get(pk=run_id).pk]

    two = claim(pool, run_id, "w2")
    assert two.run.lease_epoch == 2
    assert resumed_state(two, object_store, tmp_path / "w2") == {"step": 2, "by": "attempt 1"}
    ApiReporter(two, object_store, tmp_path / "up2").checkpoint(
        4, written(tmp_path / "two", 4, "attempt 2"), {})
    prefix = f"{object_store.url}/{two.run.object_prefix}/checkpoints"
    theirs = object_store.get_bytes(f"{prefix}/epoch-2/step-000004.tar")

    # Attempt 1 wakes up: it writes checkpoints at the same step and a later one, and reports
    # them. Each upload lands under epoch-1/; each report is refused.
    for step in (4, 6):
        with pytest.raises(LeaseLost):
            late.checkpoint(step, written(tmp_path / "one", step, "attempt 1, late"), {})
        assert object_store.exists(f"{prefix}/epoch-1/step-{step:06d}.tar")
    assert object_store.get_bytes(f"{prefix}/epoch-2/step-000004.tar") == theirs

    # Nor can the live lease register the late file, or report under an older epoch.
    with pytest.raises(ApiError) as refused:
        two.add_checkpoint(6, f"{prefix}/epoch-1/step-000006.tar", resumable=True)
    assert (refused.value.status, refused.value.code) == (409, "stale_epoch")
    flat = object_store.put_bytes(f"{two.run.object_prefix}/checkpoints/step-000008.tar", b"x")
    with pytest.raises(ApiError) as stale:
        two._post("checkpoints", {"step": 8, "uri": flat, "resumable": True, "lease_epoch": 1})
    assert (stale.value.status, stale.value.code) == (409, "stale_epoch")
    assert list(Checkpoint.objects.filter(run_id=run_id).order_by("step")
                .values_list("step", "uri")) == [
        (2, f"{prefix}/epoch-1/step-000002.tar"), (4, f"{prefix}/epoch-2/step-000004.tar")]

    # Attempt 2's worker is lost; attempt 3 resumes from attempt 2's checkpoint.
    Run.objects.filter(pk=run_id).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    services.sweep_expired(actor=SYSTEM)
    assert Run.objects.get(pk=run_id).status == RunStatus.QUEUED
    three = claim(pool, run_id, "w3")
    assert three.run.lease_epoch == 3
    assert resumed_state(three, object_store, tmp_path / "w3") == {"step": 4, "by": "attempt 2"}


def test_a_worker_from_before_epochs_is_checked_by_its_lease_only(pool, api, project,
                                                                  object_store):
    """A report without ``lease_epoch`` and with a flat URI (an older worker) is recorded."""
    run_id = api.launch_run("acme", project="main", kind="train")["id"]
    session = claim(pool, run_id, "w1")
    uri = object_store.put_bytes(f"{session.run.object_prefix}/checkpoints/step-000001.tar",
                                 b"x")
    session._post("checkpoints", {"step": 1, "uri": uri, "resumable": True})
    assert Checkpoint.objects.get(run_id=run_id).uri == uri
