"""``checkpoint.keep`` in the object store: a worker that records a resumable checkpoint with
``keep`` makes the API delete the objects of older ones (rows stay, marked pruned), never one
that lineage points to (a run started from it), never the final export, never an object
outside the run's own keys; a pruned checkpoint cannot be started from."""

from __future__ import annotations

import pytest

from apps.core.actor import Actor
from apps.environments import services as env_services
from apps.runs.models import Checkpoint, RunEvent
from tests.apps.runs.test_worker_api import RUNS, W, claim
from tests.factories import DatasetFactory, make_run, make_version, put_run_object


@pytest.fixture
def running(worker, project):
    dataset = DatasetFactory(project=project, team=project.team, slug="qa")
    make_version(dataset)
    run = make_run(project, dataset)
    lease = {"HTTP_X_CRUCIBLE_LEASE": claim(worker, run_id=run.pk).json()["lease_id"]}
    assert worker.post(f"{W}/runs/{run.pk}/status", {"status": "running"},
                       **lease).status_code == 200
    return run, lease


@pytest.fixture
def arith(project):
    env = env_services.environment_create(actor=Actor.system(), team=project.team,
                                          project=project, slug="arith")
    version, _ = env_services.version_create(actor=Actor.system(), environment=env, spec={
        "env": {"source": "builtin", "name": "arithmetic", "params": {"eval_size": 4}}})
    return version


@pytest.fixture
def post(worker, running, object_store, django_capture_on_commit_callbacks):
    """Record a checkpoint of the running run (its object written first), running the
    transaction's on-commit work (the deletes) as a real commit would."""
    run, lease = running

    def record(step: int, *, keep: int | None = 2, resumable: bool = True,
               key: str | None = None) -> str:
        uri = put_run_object(run, key or f"checkpoints/step-{step:06d}.tar", b"state %d" % step)
        body = {"step": step, "uri": uri, "resumable": resumable}
        if keep is not None:
            body["keep"] = keep
        with django_capture_on_commit_callbacks(execute=True):
            r = worker.post(f"{W}/runs/{run.pk}/checkpoints", body, format="json", **lease)
        assert r.status_code == 201, r.content
        return uri

    return record


def _live(run) -> list[int]:
    return sorted(Checkpoint.objects.filter(run=run, pruned_at__isnull=True)
                  .values_list("step", flat=True))


def test_keep_prunes_older_checkpoint_objects_but_keeps_their_rows(worker, running, member,
                                                                   object_store, post):
    run, _ = running
    uris = {step: post(step) for step in (1, 2, 3, 4)}
    assert _live(run) == [3, 4]
    assert [object_store.exists(uris[s]) for s in (1, 2, 3, 4)] == [False, False, True, True]
    listed = member.client.get(f"{RUNS}/{run.pk}/checkpoints").json()["results"]
    assert [(c["step"], c["resumable"], c["pruned_at"] is not None) for c in listed] == \
        [(1, True, True), (2, True, True), (3, True, False), (4, True, False)]
    pruned = RunEvent.objects.filter(run=run, kind="checkpoint", message__contains="pruned")
    assert sorted(e.data["step"] for e in pruned) == [1, 2]
    # A resuming worker is only offered what is still in the store.
    offered = worker.get(f"{W}/runs/{run.pk}").json()["checkpoints"]
    assert [c["step"] for c in offered] == [3, 4]
    # The final export (not resumable) is never pruned, even past keep.
    final = post(5, resumable=False, key="checkpoints/final.tar")
    post(6)
    assert _live(run) == [4, 5, 6] and object_store.exists(final)
    # Without keep nothing is pruned (other run kinds, older workers).
    post(7, keep=None)
    assert _live(run) == [4, 5, 6, 7]


def test_a_checkpoint_a_run_started_from_is_never_pruned(running, member, arith,
                                                        object_store, post):
    run, _ = running
    uris = {step: post(step) for step in (1, 2, 3)}
    assert _live(run) == [2, 3]
    # An eval starts from step 2 (kept now); later checkpoints would push it out.
    launched = member.client.post(f"{RUNS}", {
        "project": "main", "kind": "eval", "environment": f"arith@v{arith.number}",
        "base_model": f"run:{run.pk}@2", "config": {}}, format="json")
    assert launched.status_code == 201, launched.content
    for step in (4, 5):
        uris[step] = post(step)
    assert _live(run) == [2, 4, 5]
    assert object_store.exists(uris[2]) and not object_store.exists(uris[3])
    event = RunEvent.objects.get(run=run, kind="checkpoint", data__step=3,
                                 message__contains="pruned")
    assert event.data["kept_for_lineage"] == [2]


def test_a_pruned_checkpoint_cannot_be_started_from(running, member, arith, post):
    run, _ = running
    for step in (1, 2, 3):
        post(step, keep=1)
    refused = member.client.post(f"{RUNS}", {
        "project": "main", "kind": "eval", "environment": f"arith@v{arith.number}",
        "base_model": f"run:{run.pk}@1", "config": {}}, format="json")
    assert refused.status_code == 400, refused.content
    assert "was pruned by its run's checkpoint.keep" in refused.json()["message"]
    # "run:<id>" means its latest kept checkpoint.
    latest = member.client.post(f"{RUNS}/preview", {
        "project": "main", "kind": "eval", "environment": f"arith@v{arith.number}",
        "base_model": f"run:{run.pk}", "config": {}}, format="json")
    assert latest.status_code == 200 and latest.json()["run"]["base_model"]["step"] == 3


def test_pruning_never_deletes_objects_outside_the_runs_own_keys(worker, running, project,
                                                                 object_store, post):
    run, lease = running
    other = make_run(project)
    foreign = put_run_object(other, "checkpoints/step-000001.tar", b"theirs")
    r = worker.post(f"{W}/runs/{run.pk}/checkpoints",
                    {"step": 1, "uri": foreign, "resumable": True}, format="json", **lease)
    assert r.status_code == 400 and r.json()["code"] == "uri_outside_run"
    # A row from before URIs were confined may still point there: pruning leaves it alone.
    Checkpoint.objects.create(run=run, team_id=run.team_id, step=1, uri=foreign,
                              resumable=True)
    for step in (2, 3):
        post(step, keep=1)
    # Marked pruned (nothing may start from it through this run), but the object stays.
    assert _live(run) == [3]
    assert object_store.exists(foreign)


def test_keep_must_be_positive(worker, running, object_store):
    run, lease = running
    r = worker.post(f"{W}/runs/{run.pk}/checkpoints",
                    {"step": 1, "uri": "s3://x/1", "keep": 0}, format="json", **lease)
    assert r.status_code == 400 and "keep" in r.json()["errors"]
    assert not Checkpoint.objects.exists()
